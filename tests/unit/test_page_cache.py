"""Page cache state of the disk tier's files: ``page_cache`` tells how much of a file the kernel caches and drops
it, and ``DirectoryTier.cached`` says whether a load would read only cached files (what lets the vLLM connector
load a directory hit in the step)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from pd_transfer.offload import DirectoryTier, PageFormat, TierBlocks, chain_block_keys, file_keys, page_cache
from pd_transfer.spec import ModelFingerprint

MODEL = ModelFingerprint(model="m", dtype="bfloat16", num_layers=2, total_num_kv_heads=2, head_size=8)
FORMAT = PageFormat(fingerprint=MODEL, page_bytes=(8192, 4096), block_size=16)


def _cold(path: Path) -> None:
    """Drop ``path`` from the page cache, or skip where the filesystem keeps it (tmpfs keeps every page)."""
    page_cache.drop_from_cache(path)
    if page_cache.resident_fraction(path) != 0.0:
        pytest.skip(f"the filesystem of {path.parent} keeps dropped pages in memory")


@pytest.mark.parametrize("cachestat", [True, False], ids=["cachestat", "mincore"])
def test_a_file_is_resident_after_writing_cold_after_dropping_and_warm_again_after_reading(
    tmp_path: Path, cachestat: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = page_cache.library_calls()
    if calls is None:
        pytest.skip("no C library with mincore here")
    monkeypatch.setattr(calls, "cachestat", cachestat and calls.cachestat)
    path = tmp_path / "f"
    path.write_bytes(os.urandom(64 * 4096))
    assert page_cache.resident_fraction(path) == 1.0
    _cold(path)
    with path.open("rb") as file:  # the first 16 pages, without readahead beyond them
        os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
        file.read(16 * 4096)
    assert page_cache.resident_fraction(path) == pytest.approx(0.25)


def test_a_missing_file_cannot_be_told_or_dropped() -> None:
    assert page_cache.resident_fraction("/nonexistent/file") is None
    with pytest.raises(FileNotFoundError):
        page_cache.drop_from_cache("/nonexistent/file")


def test_an_empty_file_is_wholly_resident(tmp_path: Path) -> None:
    (tmp_path / "empty").touch()
    assert page_cache.resident_fraction(tmp_path / "empty") == 1.0


def test_the_tier_names_the_files_a_load_reads_and_whether_the_page_cache_holds_them(tmp_path: Path) -> None:
    """Ten blocks of one prompt in groups of 4: two group files and two block files. ``cached`` is True while
    they are all in the page cache, False once one of them is dropped or gone."""
    tier = DirectoryTier(tmp_path, FORMAT, max_bytes=1 << 30, group_blocks=4)
    keys = chain_block_keys(MODEL, list(range(16 * 10)), 16)
    files = file_keys(keys, 4)
    rng = np.random.default_rng(0)
    for key, file in zip(keys, files, strict=True):
        assert not tier.cached([key], [file]) and tier.files_holding([key], [file]) is None
    caches = [rng.integers(0, 256, (10, size), dtype=np.uint8) for size in FORMAT.page_bytes]
    tier.store_blocks(TierBlocks("disk", tuple(keys), tuple(range(10)), files), list(range(10)), caches)
    held = tier.files_holding(keys, files)
    assert held == [tier.group_path_of(keys[3]), tier.group_path_of(keys[7]), tier.path_of(keys[8]),
                    tier.path_of(keys[9])]  # fmt: skip
    assert tier.cached(keys, files) and tier.cached(keys[:4], files[:4])
    _cold(held[1])
    assert tier.cached(keys[:4], files[:4]) and not tier.cached(keys, files) and not tier.cached(keys[4:6], files[4:6])
    held[3].unlink()
    assert tier.files_holding(keys, files) is None and not tier.cached(keys[8:], files[8:])
