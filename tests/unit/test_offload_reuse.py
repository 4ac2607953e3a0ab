"""The disk tier at its bound: one sweep per batch makes room, the files it evicts are rewritten with the new
blocks (no file created or deleted), and that never lets a reader take one block's bytes for another's; files of
format version 1 (the old checksum) are foreign; the payload checksum is XXH3-64 of the pages in order. Two
processes doing this at once on one directory: tests/process/test_offload_reuse_processes.py."""

from __future__ import annotations

import os
import struct
import zlib
from collections import Counter
from pathlib import Path

import numpy as np
import xxhash

from pd_transfer.offload import DirectoryTier, OffloadMetrics, PageFormat, TierBlocks, chain_block_keys
from pd_transfer.offload.checksum import payload_checksum
from pd_transfer.offload.files import HEADER_BYTES, _NewFile, check_header
from pd_transfer.offload.hash_ahead import ChecksumsAhead
from pd_transfer.spec import ModelFingerprint

MODEL = ModelFingerprint(model="m", dtype="bfloat16", num_layers=2, total_num_kv_heads=2, head_size=8)
FORMAT = PageFormat(fingerprint=MODEL, page_bytes=(4096, 2048), block_size=16)
KEYS = chain_block_keys(MODEL, list(range(16 * 32)), 16)
FILE_BYTES = HEADER_BYTES + FORMAT.block_bytes


def engine(seed: int, blocks: int = 8) -> list[np.ndarray]:
    """An engine cache: one (blocks, page bytes) uint8 array per page of the format, random bytes."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (blocks, size), dtype=np.uint8) for size in FORMAT.page_bytes]


def block(cache: list[np.ndarray], index: int) -> list[np.ndarray]:
    return [tensor[index] for tensor in cache]


def empty() -> list[np.ndarray]:
    return [np.zeros(size, np.uint8) for size in FORMAT.page_bytes]


def same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def temporary_files(root: Path) -> list[Path]:
    return [path for path in root.rglob("*") if path.is_file() and not path.name.endswith(".kvblock")]


def test_a_full_tier_rewrites_the_files_it_evicts(tmp_path: Path) -> None:
    metrics = OffloadMetrics()
    tier = DirectoryTier(tmp_path, FORMAT, max_bytes=6 * FILE_BYTES, metrics=metrics)
    old = engine(1)
    for index in range(6):
        assert tier.store(KEYS[index], block(old, index)) == FILE_BYTES
        os.utime(tier.path_of(KEYS[index]), (1000 + index, 1000 + index))  # KEYS[0] the oldest
    inodes = {index: tier.path_of(KEYS[index]).stat().st_ino for index in range(6)}
    new = engine(2)
    moved = tier.store_blocks(TierBlocks("disk", tuple(KEYS[6:9]), (0, 1, 2)), [5, 6, 7], new)
    assert moved == 3 * FORMAT.block_bytes
    # 6 files + 3 coming > 6: evict the oldest until 3 more fit under 90% (4 evicted, 3 of them rewritten)
    assert [tier.exists(key) for key in KEYS[:9]] == [False] * 4 + [True] * 5
    rewritten = {tier.path_of(key).stat().st_ino for key in KEYS[6:9]}
    assert rewritten <= {inodes[index] for index in range(4)}, "the new blocks went to new files"
    for key, source in zip(KEYS[6:9], (5, 6, 7), strict=True):
        out = empty()
        assert tier.load(key, out) == "ok" and same(out, block(new, source))
    assert temporary_files(tmp_path) == []
    assert metrics.registry.get_sample_value("pd_transfer_offload_evictions_total", {"tier": "disk"}) == 4


def test_a_reader_of_a_rewritten_file_gets_a_miss_never_the_new_block(tmp_path: Path) -> None:
    tier = DirectoryTier(tmp_path, FORMAT, max_bytes=FILE_BYTES)  # room for one block
    cache = engine(3)
    tier.store(KEYS[0], block(cache, 0))
    fd = os.open(tier.path_of(KEYS[0]), os.O_RDONLY)  # a reader opened KEYS[0] before it was evicted
    try:
        header_before = os.pread(fd, HEADER_BYTES, 0)
        tier.store(KEYS[1], block(cache, 1))  # evicts KEYS[0] and writes KEYS[1] into its file
        assert not tier.exists(KEYS[0]) and os.fstat(fd).st_ino == tier.path_of(KEYS[1]).stat().st_ino
        out = empty()
        assert tier._read_payload(fd, KEYS[0], out) == ("foreign", 0)  # the header names another block now
        outcome, checksum = check_header(header_before, KEYS[0], FORMAT.tag, FORMAT.block_bytes)
        os.preadv(fd, [page.data for page in out], HEADER_BYTES)  # header read before, payload after
        assert outcome == "ok" and payload_checksum(out) != checksum  # the load calls it corrupt
    finally:
        os.close(fd)


def test_a_reused_file_another_process_swept_meanwhile_is_replaced_by_a_new_one(tmp_path: Path) -> None:
    tier = DirectoryTier(tmp_path, FORMAT, max_bytes=2 * FILE_BYTES)
    cache = engine(4)
    tier.store(KEYS[0], block(cache, 0))
    tier.store(KEYS[1], block(cache, 1))
    evicted, kept = tier._sweep(Counter({FILE_BYTES: 1}))
    spares = kept[FILE_BYTES]
    assert evicted >= 1 and len(spares) == 1 and not tier.exists(KEYS[0])
    spares[0].unlink()  # what a sweep of another process does to a temporary file it finds stale
    with ChecksumsAhead([[block(cache, 2)]], ahead=False) as hashes:
        tier._write_new(_NewFile(tier.path_of(KEYS[2]), KEYS[2], [(KEYS[2], block(cache, 2))]), spares[0], hashes, 0)
    out = empty()
    assert tier.load(KEYS[2], out) == "ok" and same(out, block(cache, 2))
    assert temporary_files(tmp_path) == []


def test_a_version_1_file_is_foreign_and_deleted(tmp_path: Path) -> None:
    tier = DirectoryTier(tmp_path, FORMAT, max_bytes=1 << 30)
    tier.store(KEYS[0], block(engine(5), 0))
    path = tier.path_of(KEYS[0])
    raw = bytearray(path.read_bytes())
    raw[8:10] = struct.pack("<H", 1)  # written before the checksum became XXH3: a valid version 1 header
    raw[56:60] = struct.pack("<I", zlib.crc32(bytes(raw[:56])))
    path.write_bytes(bytes(raw))
    assert tier.load(KEYS[0], empty()) == "foreign" and not path.exists()


def test_the_payload_checksum_is_xxh3_64_of_the_pages_in_order() -> None:
    pages = block(engine(6), 0)
    assert payload_checksum(pages) == xxhash.xxh3_64_intdigest(b"".join(page.tobytes() for page in pages))
    assert payload_checksum(pages[::-1]) != payload_checksum(pages)
