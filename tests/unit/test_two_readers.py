"""A disk load read by two threads (pd_transfer/offload/two_readers.py): every block read once, a file's blocks in
order on one thread, a helper that never starts leaves the work to the caller, failures come back; the directory
tier's loads give the same blocks and the same misses with the helper and without."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from pd_transfer.offload import DirectoryTier, PageFormat, TierBlocks, chain_block_keys, file_keys
from pd_transfer.offload.file_format import group_header_bytes
from pd_transfer.offload.helpers import helper
from pd_transfer.offload.two_readers import by_file, read_groups
from pd_transfer.spec import ModelFingerprint

MODEL = ModelFingerprint(model="m", dtype="bfloat16", num_layers=2, total_num_kv_heads=2, head_size=8)
FORMAT = PageFormat(fingerprint=MODEL, page_bytes=(65536, 65536), block_size=16)  # 128 KiB blocks
GROUP = 4


def test_indices_are_grouped_by_file_in_order_of_first_appearance() -> None:
    assert by_file(["a", "a", "b", "c", "c", "a"]) == [[0, 1, 5], [2], [3, 4]]
    assert by_file([]) == []


def test_every_index_is_read_once_and_each_group_in_order_on_one_thread() -> None:
    groups = by_file([i // 3 for i in range(30)])
    seen: list[tuple[int, int]] = []  # (index, thread), appended under the GIL

    def read(index: int) -> bool:
        seen.append((index, threading.get_ident()))
        return index % 7 != 0

    missed = read_groups(groups, read, two=True)
    assert missed == {0, 7, 14, 21, 28}
    assert sorted(index for index, _ in seen) == list(range(30))
    for group in groups:
        order = [(index, thread) for index, thread in seen if index in group]
        assert [index for index, _ in order] == group and len({thread for _, thread in order}) == 1


def test_a_helper_busy_elsewhere_leaves_every_group_to_the_caller() -> None:
    release = threading.Event()
    busy = helper("read").submit(release.wait, 60)
    try:
        threads: set[int] = set()
        assert read_groups([[0], [1], [2]], lambda i: threads.add(threading.get_ident()) is None, two=True) == set()
        assert threads == {threading.get_ident()}
    finally:
        release.set()
        busy.result(60)


def test_a_failing_read_is_raised_after_both_threads_stopped() -> None:
    reads: list[int] = []

    def read(index: int) -> bool:
        reads.append(index)
        if index == 40:
            raise OSError("disk gone")
        return True

    with pytest.raises(OSError, match="disk gone"):
        read_groups([[i] for i in range(200)], read, two=True)
    count = len(reads)
    helper("read").submit(lambda: None).result(60)  # the helper is idle: its task of this call has ended
    assert len(reads) == count < 200  # nothing read after the call returned, and the rest was given up


def _job(keys: list[bytes]) -> TierBlocks:
    return TierBlocks("disk", tuple(keys), files=file_keys(keys, GROUP))


@pytest.mark.parametrize("two", [False, True], ids=["one thread", "two threads"])
def test_the_tier_loads_the_same_blocks_and_misses_with_a_helper_and_without(tmp_path: Path, two: bool) -> None:
    """Eleven blocks: groups 0-3 and 4-7, block files 8-10; block 5's payload damaged, block 9's file gone."""
    keys = chain_block_keys(MODEL, list(range(16 * 11)), 16)
    rng = np.random.default_rng(1)
    cache = [rng.integers(0, 256, (11, size), dtype=np.uint8) for size in FORMAT.page_bytes]
    tier = DirectoryTier(tmp_path, FORMAT, max_bytes=1 << 30, group_blocks=GROUP, read_thread=two)
    tier.store_blocks(_job(keys), range(11), cache)
    with tier.group_path_of(keys[7]).open("r+b") as file:
        file.seek(group_header_bytes(GROUP) + FORMAT.block_bytes + 100)
        file.write(b"\xff\x00\xff")
    tier.path_of(keys[9]).unlink()
    out = [np.zeros_like(page) for page in cache]
    targets = list(range(10, -1, -1))  # scattered: reversed
    loaded, missed = tier.load_blocks(_job(keys), targets, out)
    assert missed == [keys[5], keys[6], keys[7], keys[9]] and loaded == 7 * FORMAT.block_bytes
    for index in (0, 1, 2, 3, 4, 8, 10):
        assert all(np.array_equal(o[targets[index]], c[index]) for o, c in zip(out, cache, strict=True))
