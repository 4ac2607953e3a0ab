"""``pd-transfer bench proxy``, small: the proxy and its HTTP stand-ins as real processes; each concurrency's
latencies with and without the proxy, the stand-ins' delay under both (no timing thresholds beyond that delay)."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("aiohttp", reason="the proxy needs the 'proxy' extra (aiohttp)")
pytestmark = pytest.mark.timeout(60)


def test_bench_runs_the_proxy_and_stand_ins_as_processes() -> None:
    from pd_transfer.bench.proxy.latency import run_bench

    result = run_bench(
        requests=40, concurrencies=(1, 8), rounds=2, warmup=4, requests_at_1=10, token_delay_s=0.001, saturation=False
    )
    for key, count in (("concurrency_1", 10), ("concurrency_8", 40)):
        r = result[key]
        assert r["requests_each"] == count and r["concurrency"] == int(key.split("_")[1])
        assert r["direct_ms_p50"] > 8 and r["proxy_ms_p50"] > 8  # the backend delay: 20 ms prefill + 8 x 1 ms
        assert r["added_ms_p50"] == pytest.approx(r["proxy_ms_p50"] - r["direct_ms_p50"], abs=1e-3)
    assert "saturation" not in result
    assert result["backend_delay"]["prefill_ms"] == 20.0 and result["backend_delay"]["decode_ms_per_token"] == 1.0
    if len(os.sched_getaffinity(0)) >= 2:
        assert result["pinning"]["proxy"] and result["pinning"]["client_and_stand_ins"]
