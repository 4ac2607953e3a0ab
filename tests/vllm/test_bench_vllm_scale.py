"""``pd-transfer bench vllm --scale`` on real vLLM servers at Llama-3-8B's KV geometry (five servers one phase after
another: about half an hour on 2 cores, so marked ``slow``: scripts/test-vllm leaves it out; run it with
``pytest -m slow tests/vllm/test_bench_vllm_scale.py`` in .venv-vllm)."""

from __future__ import annotations

import json

import pytest
from vllm_servers import logs_dir

from pd_transfer.affinity import allowed_cpu
from pd_transfer.bench.vllm.run import BenchSettings
from pd_transfer.bench.vllm.scale import run_scale
from pd_transfer.bench.vllm.scale_report import render_scale_table

pytestmark = pytest.mark.slow


SCALE_TEST_TIMEOUT_S = 1800  # five vLLM servers started one phase after another on a shared 2-core machine


@pytest.mark.timeout(SCALE_TEST_TIMEOUT_S)
def test_scale_run_at_8b_kv_geometry_against_a_plain_server(tmp_path_factory: pytest.TempPathFactory) -> None:
    """``bench vllm --scale``'s run on real vLLM servers at Llama-3-8B's KV geometry, one short prompt: the plain
    server, then NixlConnector's pair, then ours; the JSON's shape, every KV byte moved, tokens equal the plain
    server's. A small KV cache and context (the test's prompt is short) keep the servers' memory low, and
    ``--enforce-eager`` skips the minutes of graph compilation a 32-layer model costs each server at startup."""
    from pd_transfer.bench.vllm.model import build_kv8b_model, kv_bytes_per_token

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
