"""Reference check of the transfer plan: encoded prefill caches, simulated NIXL reads, postprocess, and an
element-by-element comparison of every decode rank's cache (see ``topology_sim``)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st
from topology_sim import Scenario, fingerprint, run_scenario

from pd_transfer.spec import KVCacheLayout
from pd_transfer.topology import expected_readers

POW2 = [1, 2, 4, 8]
BLOCKS = [4, 8, 16, 32, 64]
LAYOUTS = ["HND", "NHD"]
PLANS = ["auto", "direct", "staged", "min0", "huge"]


def check_readers(scenario: Scenario, outcome) -> None:
    """Each prefill rank is told the number of decode ranks that really read it."""
    layout = KVCacheLayout(
        fingerprint(scenario.heads, scenario.head_size, dtype=scenario.dtype, mla=scenario.mla),
        scenario.remote_tp,
        0,
        scenario.remote_block,
        scenario.remote_layout,  # type: ignore[arg-type]
    )
    for rank in range(scenario.remote_tp):
        readers = sum(any(s.remote_rank == rank for s in plan.sources) for plan in outcome.plans)
        assert expected_readers(rank, layout, scenario.local_tp) == readers
        for plan in outcome.plans:
            if rank in plan.readers_hint:
                assert plan.readers_hint[rank] == readers


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    mla = draw(st.integers(0, 7)) == 0
    return Scenario(
        heads=1 if mla else draw(st.sampled_from([*POW2, 4, 8])),
        mla=mla,
        remote_tp=draw(st.sampled_from(POW2)),
        local_tp=draw(st.sampled_from(POW2)),
        remote_block=draw(st.sampled_from(BLOCKS)),
        local_block=draw(st.sampled_from(BLOCKS)),
        remote_layout=draw(st.sampled_from(LAYOUTS)),
        local_layout=draw(st.sampled_from(LAYOUTS)),
        remote_together=draw(st.booleans()),
        local_together=draw(st.booleans()),
        num_tokens=draw(st.integers(1, 200)),
        head_size=draw(st.sampled_from([4, 8])),
        dtype=draw(st.sampled_from(["float32", "float32", "bfloat16", "uint8"])),
        plan=draw(st.sampled_from([*PLANS, "staged", "huge"])),  # staging needs the most care: weight it
        pad=draw(st.sampled_from([0, 0, 1, 8])),
        extra_blocks=draw(st.sampled_from([0, 1, 5])),
        only_needed_ranks=draw(st.booleans()),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_every_combination_lands_every_token(scenario: Scenario) -> None:
    outcome = run_scenario(scenario)
    check_readers(scenario, outcome)
    plan = outcome.plans[0]
    event(f"{plan.strategy}{' + postprocess' if plan.postprocess else ''}, {len(plan.sources)} source(s)")
    if scenario.plan in ("direct", "min0"):
        assert all(plan.strategy == "direct" and plan.postprocess is None for plan in outcome.plans)
    if scenario.plan == "staged":
        assert all(plan.strategy == "staged" for plan in outcome.plans)


@st.composite
def restaging_scenarios(draw: st.DrawFn) -> Scenario:
    """Scenarios whose staged plan mostly needs a postprocess: several heads on both sides and a block-size
    regrouping or a layout change."""
    heads = draw(st.sampled_from([2, 4, 8]))
    local_block, remote_block = draw(st.sampled_from(BLOCKS)), draw(st.sampled_from(BLOCKS))
    local_layout, remote_layout = draw(st.sampled_from(LAYOUTS)), draw(st.sampled_from(LAYOUTS))
    assume(remote_block < local_block or local_layout != remote_layout)
    return Scenario(
        heads=heads,
        remote_tp=draw(st.sampled_from([tp for tp in POW2 if tp < heads])),
        local_tp=draw(st.sampled_from([tp for tp in POW2 if tp < heads])),
        remote_block=remote_block,
        local_block=local_block,
        remote_layout=remote_layout,
        local_layout=local_layout,
        remote_together=draw(st.booleans()),
        local_together=draw(st.booleans()),
        num_tokens=draw(st.integers(1, 200)),
        head_size=draw(st.sampled_from([4, 8])),
        dtype=draw(st.sampled_from(["float32", "bfloat16"])),
        plan=draw(st.sampled_from(["staged", "huge"])),
        pad=draw(st.sampled_from([0, 1, 8])),
        extra_blocks=draw(st.sampled_from([0, 3])),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(restaging_scenarios())
def test_staged_blocks_are_restaged(scenario: Scenario) -> None:
    outcome = run_scenario(scenario)
    check_readers(scenario, outcome)
    plan = outcome.plans[0]
    event(f"{plan.strategy}{' + postprocess' if plan.postprocess else ''}, {len(plan.sources)} source(s)")
    if scenario.plan == "staged":
        assert all(plan.strategy == "staged" for plan in outcome.plans)


EXPLICIT = {
    "tp2_to_1": Scenario(remote_tp=2, local_tp=1),
    "tp1_to_2": Scenario(remote_tp=1, local_tp=2),
    "tp4_2heads_to_1": Scenario(heads=2, remote_tp=4, local_tp=1),
    "tp1_to_4_2heads": Scenario(heads=2, remote_tp=1, local_tp=4),
    "tp8_2heads_to_2": Scenario(heads=2, remote_tp=8, local_tp=2),
    "tp8_2heads_to_8": Scenario(heads=2, remote_tp=8, local_tp=8),
    "block16_to_64": Scenario(remote_block=16, local_block=64, num_tokens=150),
    "block64_to_16": Scenario(remote_block=64, local_block=16, num_tokens=150),
    "hnd_to_nhd": Scenario(local_layout="NHD"),
    "nhd_to_hnd_tp2_to_1_block8_to_32": Scenario(
        remote_layout="NHD", remote_tp=2, remote_block=8, local_block=32, num_tokens=77
    ),
    "mla_tp2_to_4": Scenario(mla=True, remote_tp=2, local_tp=4),
    "mla_tp4_to_1_block64_to_16": Scenario(mla=True, remote_tp=4, local_tp=1, remote_block=64, local_block=16),
    # Head counts and TP sizes that are not powers of two or do not divide each other.
    "12heads_tp6_to_4": Scenario(heads=12, remote_tp=6, local_tp=4),
    "12heads_tp4_to_6": Scenario(heads=12, remote_tp=4, local_tp=6, local_layout="NHD"),
    "6heads_tp3_to_2_nhd": Scenario(heads=6, remote_tp=3, local_tp=2, remote_layout="NHD", local_layout="NHD"),
    "3heads_tp6_to_1": Scenario(heads=3, remote_tp=6, local_tp=1, remote_block=8, local_block=32),
    "kv_together_both": Scenario(remote_together=True, local_together=True, remote_tp=2, local_block=32),
    "one_token": Scenario(num_tokens=1, remote_block=64, local_block=4),
    "exact_blocks": Scenario(num_tokens=128, remote_block=32, local_block=64),
    "bf16_padded": Scenario(dtype="bfloat16", pad=3, local_layout="NHD", remote_block=4, local_block=16),
}


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("name", sorted(EXPLICIT))
def test_explicit_case(name: str, plan: str) -> None:
    scenario = dataclasses.replace(EXPLICIT[name], plan=plan)
    outcome = run_scenario(scenario)
    check_readers(scenario, outcome)
