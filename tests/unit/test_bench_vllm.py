"""``pd-transfer bench vllm`` without servers: its arguments, the commands it would run, and the shape of its result
built from a tiny fake run (no timings are asserted). ``--scale``'s CPU placement on a real process:
tests/process/test_bench_vllm_pinning.py; its run on real vLLM: tests/vllm/test_bench_vllm_scale.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pd_transfer.affinity import allowed_cpu
from pd_transfer.bench.vllm import connectors
from pd_transfer.bench.vllm.pairs import bench_server
from pd_transfer.bench.vllm.report import build_result, percentile, render_table
from pd_transfer.bench.vllm.requests import EXTERNAL
from pd_transfer.bench.vllm.run import portable_path
from pd_transfer.cli import build_parser
from pd_transfer.cluster.http_client import metric_sum


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
    assert args.func is connectors.run
    settings = connectors._settings(args)
    assert (settings.requests, list(settings.lengths), settings.max_tokens, args.json) == (
        30,
        [50, 677, 1500],
        16,
        False,
    )
    args = build_parser().parse_args(["bench", "vllm", "--json", "--requests", "6", "--lengths", "10,20"])
    settings = connectors._settings(args)
    assert (settings.requests, list(settings.lengths), args.json) == (6, [10, 20], True)
    scale = connectors._settings(build_parser().parse_args(["bench", "vllm", "--scale"]))
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
