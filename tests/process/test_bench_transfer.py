"""``pd-transfer bench transfer --quick --json`` on the default transport (CMA on one host): a real prefill process,
real NIXL reads; the JSON names the host's copy rate on both page kinds and how much of the decode's cache is in
huge pages, and every read was verified (no timing checks); with ``--verify-cost``, read checks' cost beside it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pd_transfer.transfer.huge_pages import thp_mode

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def result() -> dict:
    env = {**os.environ, "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo")}
    env.pop("UCX_TLS", None)
    argv = [sys.executable, "-m", "pd_transfer.cli", "bench", "transfer", "--quick", "--verify-cost", "--json"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def test_reads_are_verified_beside_both_yardsticks(result: dict) -> None:
    for case in ("contiguous", "scattered"):
        measured = result[case]
        assert measured["verified"] is True, case
        for key in (
            "gbps",
            "raw_nixl_gbps",
            "raw_nixl_write_gbps",
            "memcpy_gbps",
            "ratio_vs_memcpy",
            "cpu_seconds_per_gib",
        ):
            assert measured[key] > 0, (case, key)
    assert result["prefill_saw_notification"] is True


def test_the_host_copy_rate_is_the_faster_page_kind(result: dict) -> None:
    kinds = (result["host_copy_gbps_4k_pages"], result["host_copy_gbps_huge_pages"])
    assert min(kinds) > 0
    assert result["host_copy_gbps"] == max(kinds)


def test_the_decode_cache_is_in_huge_pages(result: dict) -> None:
    settings = result["settings"]
    assert settings["transparent_hugepages"] == thp_mode()
    assert settings["huge_pages"] == "own"  # the default: pd-transfer's own caches, which the bench allocates
    if thp_mode() in {"never", "unknown"}:
        pytest.skip("the kernel gives no transparent huge pages")
    assert settings["decode_cache_huge_page_fraction"] >= 0.9


def test_read_checks_cost_is_measured_per_mode_against_off(result: dict) -> None:
    """``--verify-cost``: in-place reads by CMA and NIXL, by a decode of each ``verify`` mode, each verified, each
    ratio against ``off``'s time, beside the host's copy rate and the digests at the hold."""
    section = result["verify_cost"]
    for transport in ("host_cma", "nixl"):
        cases = section[transport]
        assert set(cases) == {"all", "sample", "off"}, transport
        assert all(case["verified"] is True and case["cost_vs_off"] > 0 for case in cases.values()), cases
        assert cases["off"]["cost_vs_off"] == 1.0
    assert section["copy_gbps"] > 0 and section["hold_digest_seconds"] > 0
