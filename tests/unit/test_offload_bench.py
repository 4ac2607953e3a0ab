"""``pd-transfer bench offload`` (the tiers, no vLLM) on a small shape: it runs, verifies every block it moved and
reports every case, with its helper threads and without side by side, and the disk tier's
loads with the page cache warm and cold, saying what was resident."""

from __future__ import annotations

from pathlib import Path

from pd_transfer.bench.offload import tiers
from pd_transfer.offload.helpers import helper_useful

#: 2 MiB jobs: enough for the checksum helper (1 MiB and up), a quarter of the time of ``--quick``'s 32 MiB
SMALL = tiers.Shape(num_tensors=4, page_bytes=16384, blocks=32, engine_blocks=40)


def test_a_small_run_verifies_every_case_and_names_its_baselines(tmp_path: Path) -> None:
    result = tiers.run(SMALL, repeats=1, directory=str(tmp_path))
    assert result["verified"] is True and isinstance(result["goals_met"], bool)
    disk = result["disk"]
    assert disk["checksum_thread"] == disk["read_thread"] == helper_useful() and disk["group_blocks"] == 8
    cases = [disk["contiguous"], disk["scattered"], disk["full_tier"], disk["one_thread"]["scattered"]]
    cases += list(disk["per_block"].values())
    for case in cases:
        assert case["verified"] is True
        assert case["store_ratio_vs_file_write"] > 0 and case["load_ratio_vs_file_read"] > 0
        warm, cold = case["page_cache"]["warm"], case["page_cache"]["cold"]
        assert warm["resident_fraction_min"] == 1.0 and warm["achieved"] is True
        assert cold["achieved"] == (cold["resident_fraction_max"] <= 0.01)  # tmpfs keeps its pages: not cold
        assert (case["cold_load_ratio_vs_file_read"] is not None) == cold["achieved"]
    assert set(result["goals"]) >= {"disk_load_warm", "disk_load_cold", "disk_full_tier_load_cold"}
    assert result["host"]["scattered"]["verified"] is True and result["end_to_end"] is None
    assert list(tmp_path.iterdir()) == []  # the tier's files are gone
