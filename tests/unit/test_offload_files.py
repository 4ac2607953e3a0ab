"""The disk tier on real files: byte-exact round trips; corrupt, truncated, foreign and zero-length files are misses
(and deleted); the size bound deletes the oldest files; the payload checksum sees small changes. Across real
processes (two writers of the same keys, a writer killed between write and rename):
tests/process/test_offload_files_processes.py."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pd_transfer.offload import DirectoryTier, OffloadInputError, OffloadManager, PageFormat, chain_block_keys
from pd_transfer.offload.checksum import payload_checksum
from pd_transfer.offload.files import HEADER_BYTES
from pd_transfer.spec import ModelFingerprint

MODEL = ModelFingerprint(model="m", dtype="bfloat16", num_layers=2, total_num_kv_heads=2, head_size=8)
OTHER = ModelFingerprint(model="m-other", dtype="bfloat16", num_layers=2, total_num_kv_heads=2, head_size=8)
FORMAT = PageFormat(fingerprint=MODEL, page_bytes=(4096, 2048), block_size=16)
KEYS = chain_block_keys(MODEL, list(range(16 * 16)), 16)
BIG = 1 << 30


def pages(seed: int, page_format: PageFormat = FORMAT) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8) for size in page_format.page_bytes]


def empty(page_format: PageFormat = FORMAT) -> list[np.ndarray]:
    return [np.zeros(size, np.uint8) for size in page_format.page_bytes]


def same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def test_a_block_comes_back_byte_exact_and_another_instance_finds_it(tmp_path: Path) -> None:
    writer = DirectoryTier(tmp_path, FORMAT, max_bytes=BIG, fsync=True)
    stored = pages(1)
    assert writer.store(KEYS[0], stored) == HEADER_BYTES + FORMAT.block_bytes
    reader = DirectoryTier(tmp_path, FORMAT, max_bytes=BIG)  # another engine on the same directory
    out = empty()
    assert reader.load(KEYS[0], out) == "ok" and same(out, stored)
    assert reader.load(KEYS[1], empty()) == "missing"
    manager = OffloadManager("disk", 4 * FORMAT.block_bytes, FORMAT.block_bytes, probe=reader.exists)
    assert manager.lookup(KEYS[:3]) == 1


def damage(path: Path, how: str) -> None:
    raw = bytearray(path.read_bytes())
    if how == "payload bit":
        raw[HEADER_BYTES + 1234] ^= 0x10
    elif how == "header bit":
        raw[41] ^= 0x01  # payload length field: the header checksum no longer matches
    elif how == "truncated":
        del raw[-100:]
    elif how == "zero length":
        raw = bytearray()
    elif how == "short header":
        del raw[20:]
    elif how == "extra bytes":
        raw += b"x"
    elif how == "garbage":
        raw = bytearray(os.urandom(len(raw)))
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize(
    ("how", "outcome"),
    [
        ("payload bit", "corrupt"),
        ("header bit", "corrupt"),
        ("truncated", "truncated"),
        ("zero length", "truncated"),
        ("short header", "truncated"),
        ("extra bytes", "corrupt"),
        ("garbage", "corrupt"),
    ],
)
def test_a_damaged_file_is_a_miss_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, how: str, outcome: str
) -> None:
    tier = DirectoryTier(tmp_path, FORMAT, max_bytes=BIG)
    tier.store(KEYS[0], pages(2))
    damage(tier.path_of(KEYS[0]), how)
    with caplog.at_level(logging.WARNING, logger="pd_transfer.offload.files"):
        assert tier.load(KEYS[0], empty()) == outcome
    assert f"is {outcome}; deleted, treated as a miss" in caplog.text and KEYS[0][:6].hex() in caplog.text
    assert not tier.exists(KEYS[0])  # deleted, so the next store writes the block again
    stored = pages(3)
    assert tier.store(KEYS[0], stored) > 0
    out = empty()
    assert tier.load(KEYS[0], out) == "ok" and same(out, stored)


def test_foreign_files_are_misses(tmp_path: Path) -> None:
    ours = DirectoryTier(tmp_path, FORMAT, max_bytes=BIG)
    other_format = PageFormat(fingerprint=OTHER, page_bytes=FORMAT.page_bytes, block_size=16)
    theirs = DirectoryTier(tmp_path, other_format, max_bytes=BIG)
    theirs.store(KEYS[0], pages(3))
    assert ours.load(KEYS[0], empty()) == "missing"  # another model's blocks live in another directory
    ours.path_of(KEYS[0]).parent.mkdir(exist_ok=True)
    os.replace(theirs.path_of(KEYS[0]), ours.path_of(KEYS[0]))  # ... even moved under our name
    assert ours.load(KEYS[0], empty()) == "foreign"
    ours.store(KEYS[1], pages(4))
    ours.path_of(KEYS[2]).parent.mkdir(exist_ok=True)
    os.replace(ours.path_of(KEYS[1]), ours.path_of(KEYS[2]))  # a block filed under another key
    assert ours.load(KEYS[2], empty()) == "foreign"
    rank1 = PageFormat(fingerprint=MODEL, page_bytes=FORMAT.page_bytes, block_size=16, tp_size=2, tp_rank=1)
    assert rank1.tag != FORMAT.tag


def test_bad_pages_are_a_typed_error(tmp_path: Path) -> None:
    tier = DirectoryTier(tmp_path, FORMAT, max_bytes=BIG)
    with pytest.raises(OffloadInputError):
        tier.store(KEYS[0], pages(5)[:1])
    with pytest.raises(OffloadInputError):
        tier.load(b"short", empty())
    with pytest.raises(OffloadInputError):
        DirectoryTier(tmp_path, FORMAT, max_bytes=100)


def test_the_size_bound_deletes_the_oldest_files_across_instances(tmp_path: Path) -> None:
    writer = DirectoryTier(tmp_path, FORMAT, max_bytes=BIG)
    for index in range(8):
        writer.store(KEYS[index], pages(index))
        os.utime(writer.path_of(KEYS[index]), (1000 + index, 1000 + index))
    stale, fresh = writer.path_of(KEYS[0]).parent / ".stale.tmp", writer.path_of(KEYS[1]).parent / ".fresh.tmp"
    stale.write_bytes(b"left by a dead writer")
    fresh.write_bytes(b"being written")
    os.utime(stale, (900, 900))
    bounded = DirectoryTier(tmp_path, FORMAT, max_bytes=5 * writer.file_bytes, stale_temp_seconds=60)
    assert bounded.sweep() == 4  # over the bound: down to 90% of it, 4 files
    assert [bounded.exists(key) for key in KEYS[:8]] == [False] * 4 + [True] * 4
    assert list(tmp_path.rglob("*.tmp")) == [fresh]  # a writer may still be busy with the fresh one
    bounded.store(KEYS[8], pages(8))
    bounded.store(KEYS[9], pages(9))  # 6 files > 5: the sweep deletes the oldest two
    assert sum(bounded.exists(key) for key in KEYS[:10]) == 4 and bounded.exists(KEYS[9])


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.sampled_from([4096, 8192, 65536, 4000, 24]), min_size=1, max_size=3),
    flips=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 2**20), st.integers(0, 7)), min_size=1, max_size=3),
)
def test_the_payload_checksum_sees_any_change_of_up_to_three_bits(
    sizes: list[int], flips: list[tuple[int, int, int]]
) -> None:
    rng = np.random.default_rng(len(sizes))
    original = [rng.integers(0, 256, size, dtype=np.uint8) for size in sizes]
    damaged = [page.copy() for page in original]
    for page, offset, bit in {(p % len(sizes), o % sizes[p % len(sizes)], b) for p, o, b in flips}:
        damaged[page][offset] ^= 1 << bit
    assert payload_checksum(damaged) != payload_checksum(original)
    if len(sizes) > 1 and sizes[0] == sizes[1]:
        swapped = [original[1], original[0], *original[2:]]
        assert payload_checksum(swapped) != payload_checksum(original)
