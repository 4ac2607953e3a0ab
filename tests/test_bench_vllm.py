"""``pd-transfer bench vllm`` without servers: its arguments, the commands it would run, and the shape of its result
built from a tiny fake run (no timings are asserted)."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_servers import logs_dir, vllm_missing

from pd_transfer.affinity import allowed_cpu
from pd_transfer.bench import vllm_connectors
from pd_transfer.bench.vllm_pairs import bench_server
from pd_transfer.bench.vllm_report import build_result, percentile, render_table
from pd_transfer.bench.vllm_requests import EXTERNAL
from pd_transfer.bench.vllm_run import BenchSettings, portable_path
from pd_transfer.bench.vllm_scale import run_scale
from pd_transfer.bench.vllm_scale_affinity import affinity_census, pinned_command, restore_strays, thread_affinities
from pd_transfer.bench.vllm_scale_report import render_scale_table
from pd_transfer.cli import build_parser
from pd_transfer.cluster.http_client import metric_sum

SCALE_TEST_TIMEOUT_S = 1800  # five vLLM servers started one phase after another on a shared 2-core machine


def _record(length: int, decode_s: float, tokens: list[str], nbytes: int) -> dict:
    return {
        "length": length,
        "prefill_s": 0.1,
        "decode_s": decode_s,
        "load_s": decode_s / 10,
        "loads": 1,
        "bytes": nbytes,
        "external_tokens": length,
        "freed_s": 0.02,
        "tokens": tokens,
    }


def _fake_result() -> dict:
    robust = {"malformed": "no answer in 60 s", "next_request": "HTTP 500", "still_serving": False}
    runs = {
        "nixl": {
            "requests": [_record(50, 0.4, ["a", "b"], 1 << 19), _record(677, 0.6, ["c"], 6 << 19)],
            "first_request": _record(50, 1.5, ["z"], 1 << 19),
            "startup_s": {"nixl-prefill": 200.0, "nixl-decode": 210.0},
            "robustness": robust,
        },
        "ours": {
            "requests": [_record(50, 0.3, ["a", "b"], 1 << 19), _record(677, 0.5, ["d"], 6 << 19)],
            "first_request": _record(50, 1.0, ["z"], 1 << 19),
            "startup_s": {"ours-prefill": 190.0, "ours-decode": 200.0},
            "robustness": {**robust, "malformed": "answered, tokens equal the reference", "still_serving": True},
        },
    }
    return build_result({"model": "m", "requests": 2}, runs, [["a", "b"], ["c"]])


def test_arguments_and_defaults() -> None:
    args = build_parser().parse_args(["bench", "vllm"])
    assert args.func is vllm_connectors.run
    settings = vllm_connectors._settings(args)
    assert (settings.requests, list(settings.lengths), settings.max_tokens, args.json) == (
        30,
        [50, 677, 1500],
        16,
        False,
    )
    args = build_parser().parse_args(["bench", "vllm", "--json", "--requests", "6", "--lengths", "10,20"])
    settings = vllm_connectors._settings(args)
    assert (settings.requests, list(settings.lengths), args.json) == (6, [10, 20], True)
    scale = vllm_connectors._settings(build_parser().parse_args(["bench", "vllm", "--scale"]))
    assert (scale.requests, list(scale.lengths), Path(scale.model).name) == (3, [256, 1024, 4096], "llama8b-kv-f32")
    for bad in (["--requests", "0"], ["--lengths", "x"], ["--lengths", "5000"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["bench", "vllm", *bad])


def test_servers_differ_only_in_the_connector(tmp_path: Path) -> None:
    nixl = bench_server("nixl", "decode", "/m", "py", tmp_path)
    ours = bench_server("ours", "decode", "/m", "py", tmp_path)

    def flags(command: list[str]) -> list[str]:
        skip = {"--port", "--kv-transfer-config"}
        return [a for i, a in enumerate(command) if a not in skip and command[i - 1] not in skip]

    assert flags(nixl.command) == flags(ours.command)
    assert "--block-size" in nixl.command and nixl.command[nixl.command.index("--block-size") + 1] == "128"
    configs = [json.loads(p.command[p.command.index("--kv-transfer-config") + 1]) for p in (nixl, ours)]
    assert [c["kv_connector"] for c in configs] == ["NixlConnector", "PdTransferConnector"]
    assert nixl.env["VLLM_CPU_OMP_THREADS_BIND"] == ours.env["VLLM_CPU_OMP_THREADS_BIND"] == allowed_cpu(1)
    assert "VLLM_NIXL_SIDE_CHANNEL_PORT" in nixl.env
    plain = bench_server(None, "reference", "/m", "py", tmp_path)
    assert "--kv-transfer-config" not in plain.command


def test_result_shape_and_table() -> None:
    result = json.loads(json.dumps(_fake_result()))  # JSON-serializable as is
    assert set(result) == {"setup", "connectors", "greedy_tokens_equal", "ours_over_nixl"}
    assert result["greedy_tokens_equal"] == {
        "ours_vs_nixl": "1/2",
        "nixl_vs_reference": "2/2",
        "ours_vs_reference": "1/2",
    }
    for name in ("nixl", "ours"):
        entry = result["connectors"][name]
        summary = entry["summary"]
        for key in ("decode_p50_s", "decode_p95_s", "load_p50_s", "load_p95_s", "bytes_total", "freed_p50_s"):
            assert key in summary
        assert summary["every_prompt_token_external"] is True
        assert set(summary["by_length"]) == {"50", "677"}
        assert all("tokens" not in r for r in entry["requests"])
        assert entry["robustness"]["still_serving"] in (True, False)
    assert set(result["ours_over_nixl"]) >= {"decode_p50_s", "load_p50_s", "bytes_total"}
    table = render_table(result)
    assert "NixlConnector" in table and "PdTransferConnector" in table and "ours_vs_nixl 1/2" in table


def test_percentile_and_metric_parsing() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([float(i) for i in range(1, 21)], 95) == 19.0
    text = "\n".join(
        [
            "# HELP vllm:nixl_xfer_time_seconds x",
            'vllm:nixl_xfer_time_seconds_sum{engine="0",model_name="m"} 0.5',
            'vllm:nixl_xfer_time_seconds_count{engine="0",model_name="m"} 2.0',
            'vllm:prompt_tokens_by_source_total{engine="0",source="external_kv_transfer"} 727.0',
            'vllm:prompt_tokens_by_source_total{engine="0",source="local_compute"} 3.0',
        ]
    )
    assert metric_sum(text, "vllm:nixl_xfer_time_seconds_sum") == 0.5
    assert metric_sum(text, "vllm:nixl_xfer_time_seconds") == 0.0  # exact names only
    assert metric_sum(text, EXTERNAL, source="external_kv_transfer") == 727.0


def test_recorded_paths_are_not_machine_specific(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert portable_path(tmp_path / "runs" / "bench") == "runs/bench"  # under the working directory: relative
    assert portable_path("runs/bench") == "runs/bench"
    assert portable_path("/elsewhere/models/tiny-llama-f32") == "tiny-llama-f32"  # elsewhere: its name only


#: a child that reports its process's CPUs, starts one thread that moves itself to CPU argv[1] only and one that
#: widens itself to argv[1] and argv[2], says where both are, then waits for its stdin to close
_STRAY_CHILD = """
import os, sys, threading
first, second = int(sys.argv[2]), int(sys.argv[1])
ready = threading.Barrier(3)
def run(cpus):
    os.sched_setaffinity(0, cpus)
    ready.wait()
    sys.stdin.read()
threads = [threading.Thread(target=run, args=(c,), daemon=True) for c in ({second}, {first, second})]
for t in threads:
    t.start()
ready.wait()
print(sorted(os.sched_getaffinity(0)), threads[0].native_id, threads[1].native_id, flush=True)
sys.stdin.read()
"""


def test_pinned_server_and_its_stray_threads_put_back() -> None:
    """``bench vllm --scale``'s placement on a real process: bound to one CPU from its start (every thread
    inherits it); a thread that moved itself to another CPU only is put back, one that widened to more CPUs
    including its own keeps that."""
    if not hasattr(os, "sched_setaffinity") or len(cpus := sorted(os.sched_getaffinity(0))) < 2:
        pytest.skip("needs Linux sched_setaffinity and two allowed CPUs")
    first, second = cpus[0], cpus[1]
    command = pinned_command({first}, [sys.executable, "-c", _STRAY_CHILD, str(second), str(first)])
    child = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert child.stdout is not None and child.stdin is not None
        readable, _, _ = select.select([child.stdout], [], [], 30.0)
        assert readable, "the child did not report within 30 s"
        own, stray, widened = child.stdout.readline().decode().strip().rsplit(" ", 2)
        assert own == f"[{first}]"  # the process was bound before its program ran
        before = thread_affinities(child.pid)
        assert before[int(stray)][1] == {second} and before[int(widened)][1] == {first, second}
        assert len(restore_strays(child.pid, {first})) == 1
        after = thread_affinities(child.pid)
        assert after[int(stray)][1] == {first} and after[int(widened)][1] == {first, second}
        census = affinity_census(child.pid)
        assert census == {str(first): len(after) - 1, f"{first},{second}": 1}, census
        child.stdin.close()
        assert child.wait(timeout=30) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)


@pytest.mark.timeout(SCALE_TEST_TIMEOUT_S)
def test_scale_run_at_8b_kv_geometry_against_a_plain_server(tmp_path_factory: pytest.TempPathFactory) -> None:
    """``bench vllm --scale``'s run on real vLLM servers at Llama-3-8B's KV geometry, one short prompt: the plain
    server, then NixlConnector's pair, then ours; the JSON's shape, every KV byte moved, tokens equal the plain
    server's. A small KV cache and context (the test's prompt is short) keep the servers' memory low, and
    ``--enforce-eager`` skips the minutes of graph compilation a 32-layer model costs each server at startup."""
    reason = vllm_missing()
    if reason:
        pytest.skip(reason)
    from pd_transfer.bench.vllm_model import build_kv8b_model, kv_bytes_per_token

    model = build_kv8b_model(tmp_path_factory.mktemp("models") / "llama8b-kv-f32")
    logs = logs_dir("pd-transfer-bench-scale")
    settings = BenchSettings(model=str(model), log_dir=logs, lengths=[256], requests=1, max_tokens=4)
    scale = run_scale(settings, max_model_len=512, kvcache_gib=0.25, extra_args=["--enforce-eager"])
    result = json.loads(json.dumps(scale))
    errors = {name: entry["error"] for name, entry in result["setups"].items() if entry["error"]}
    assert not errors, f"{errors} (logs in {logs})"
    assert result["tokens_equal"] is True, result["by_length"]
    assert set(result["setups"]) == {"plain", "nixl", "ours"}
    assert result["longest_prompt_tokens"] == 256 and set(result["by_length"]) == {"256"}
    for key in ("decode_ttft_ratio", "ttft_overhead_ratio", "ttft_over_plain", "kv_gbps", "host_copy_gbps"):
        assert key in result
    assert set(result["kv_gbps"]) == {"ours", "nixl"} and all(v and v > 0 for v in result["kv_gbps"].values())
    assert result["setups"]["plain"]["by_length"]["256"]["ttft_p50_s"] > 0
    for name in ("nixl", "ours"):
        at = result["setups"][name]["by_length"]["256"]
        assert at["bytes"] == 256 * kv_bytes_per_token(), (name, at["bytes"])  # two full 128-token blocks
        assert at["every_prompt_token_external"] is True and at["tokens_equal_plain"] == "1/1"
        assert at["pd_ttft_p50_s"] >= at["decode_ttft_p50_s"] > 0
        for server, placed in result["setups"][name]["threads"].items():  # every thread allowed on its own core
            core = str(allowed_cpu(0 if server.endswith("prefill") else 1))
            assert all(core in cpus.split(",") for cpus in placed["threads_by_cpus"]), (server, placed)
    assert result["setup"]["model"] == "llama8b-kv-f32"  # no machine path
    assert str(tmp_path_factory.getbasetemp()) not in json.dumps(result)
    assert "| 256 |" in render_scale_table(result)
