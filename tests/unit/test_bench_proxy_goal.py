"""``bench proxy``'s verdict beside vLLM's router: CPU ratios need enough clock ticks, and a run without them says so
instead of failing (a Rust router can spend under one 10 ms tick over a short run)."""

from __future__ import annotations

import os

from pd_transfer.bench.proxy import latency


def test_a_cpu_ratio_needs_enough_clock_ticks_on_both_sides() -> None:
    tick = 1 / os.sysconf("SC_CLK_TCK")
    enough = latency.MIN_CPU_TICKS * tick
    assert latency.cpu_per_request_ratio(2 * enough, 40, enough, 40) == 2.0
    assert latency.cpu_per_request_ratio(2 * enough, 20, enough, 40) == 4.0  # per request
    assert latency.cpu_per_request_ratio(enough, 40, 0.0, 40) is None  # the router's CPU rounded to nothing
    assert latency.cpu_per_request_ratio(enough, 40, enough - tick, 40) is None
    assert latency.cpu_per_request_ratio(enough, 0, enough, 40) is None


def test_the_goal_is_undecided_without_a_cpu_ratio_and_judged_with_one() -> None:
    def summary(cpu: float | None, p50: float, p99: float) -> dict[str, object]:
        return {"concurrency": 8, "vs_vllm_router": {"cpu_per_request": cpu, "p50": p50, "p99": p99}}

    undecided = latency.goal_verdict(summary(None, 0.9, 0.9))
    assert undecided["met"] is None and "clock ticks" in undecided["why"]
    assert latency.goal_verdict(summary(1.2, 0.9, 1.0))["met"] is True
    assert latency.goal_verdict(summary(1.6, 0.9, 1.0))["met"] is False
    assert latency.goal_verdict(summary(1.2, 0.9, 1.1))["met"] is False
    assert latency.goal_verdict({"concurrency": 8})["met"] is None
