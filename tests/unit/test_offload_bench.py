"""``pd-transfer bench offload`` (the tiers, no vLLM) on a small shape: it runs, verifies every block it moved and
reports every case, the checksum on a helper thread and on the store's own thread side by side."""

from __future__ import annotations

from pathlib import Path

from pd_transfer.bench import offload
from pd_transfer.offload.hash_ahead import helper_useful


def test_a_quick_run_verifies_every_case_and_names_its_baselines(tmp_path: Path) -> None:
    result = offload.run(offload.QUICK_SHAPE, repeats=1, directory=str(tmp_path))
    assert result["verified"] is True and isinstance(result["goals_met"], bool)
    disk = result["disk"]
    assert disk["checksum_thread"] == helper_useful() and disk["group_blocks"] == 8
    cases = [disk["contiguous"], disk["scattered"], disk["full_tier"], disk["checksum_serial"]["scattered"]]
    cases += list(disk["per_block"].values())
    for case in cases:
        assert case["verified"] is True
        assert case["store_ratio_vs_file_write"] > 0 and case["load_ratio_vs_file_read"] > 0
    assert result["host"]["scattered"]["verified"] is True and result["end_to_end"] is None
    assert list(tmp_path.iterdir()) == []  # the tier's files are gone
