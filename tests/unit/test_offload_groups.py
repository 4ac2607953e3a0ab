"""The directory tier's group files: a whole aligned group of a prompt's blocks in one file named by its last
block's key, checked block by block (pd_transfer/offload/file_format.py, files.py, groups.py). Two writer processes
of the same groups: tests/process/test_offload_groups_processes.py."""

from __future__ import annotations

import itertools
import logging
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pd_transfer.offload import (
    DirectoryTier,
    OffloadManager,
    OffloadMetrics,
    PageFormat,
    TierBlocks,
    chain_block_keys,
    file_keys,
)
from pd_transfer.offload.file_format import check_group_header, encode_group_header, group_header_bytes
from pd_transfer.spec import ModelFingerprint

MODEL = ModelFingerprint(model="m", dtype="bfloat16", num_layers=2, total_num_kv_heads=2, head_size=8)
FORMAT = PageFormat(fingerprint=MODEL, page_bytes=(4096, 2048), block_size=16)
BIG = 1 << 30
GROUP = 4


def chain(blocks: int, seed: int = 0) -> list[bytes]:
    return chain_block_keys(MODEL, [seed, *range(1, 16 * blocks)], 16)


def engine(blocks: int, seed: int) -> list[np.ndarray]:
    """An engine cache of ``blocks`` blocks in FORMAT: one (blocks, page bytes) array per page."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (blocks, size), dtype=np.uint8) for size in FORMAT.page_bytes]


def zeros(blocks: int) -> list[np.ndarray]:
    return [np.zeros((blocks, size), np.uint8) for size in FORMAT.page_bytes]


def job(keys: list[bytes], group: int = GROUP, start: int = 0, count: int | None = None) -> TierBlocks:
    """Disk-tier blocks ``keys[start:start+count]`` of one prompt, with their files as the connector names them."""
    end = len(keys) if count is None else start + count
    files = file_keys(keys, group)
    return TierBlocks("disk", tuple(keys[start:end]), files=tuple(files[start:end]))


def block_equal(a: list[np.ndarray], i: int, b: list[np.ndarray], j: int) -> bool:
    return all(np.array_equal(x[i], y[j]) for x, y in zip(a, b, strict=True))


def kinds(root: Path) -> tuple[int, int]:
    """(group files, block files) under ``root``."""
    return len(list(root.rglob("*.kvgroup"))), len(list(root.rglob("*.kvblock")))


def test_file_keys_name_each_whole_group_by_its_last_key_and_leave_the_tail_alone() -> None:
    keys = chain(11)
    assert file_keys(keys, 4) == (keys[3],) * 4 + (keys[7],) * 4 + tuple(keys[8:])
    assert file_keys(keys, 1) == tuple(keys)
    with pytest.raises(ValueError, match="group_blocks"):
        file_keys(keys, 0)


def test_whole_groups_go_to_one_file_each_and_come_back_byte_exact(tmp_path: Path) -> None:
    keys, cache = chain(11), engine(11, 1)
    tier = DirectoryTier(tmp_path, FORMAT, max_bytes=BIG, group_blocks=GROUP)
    assert tier.store_blocks(job(keys), range(11), cache) == 11 * FORMAT.block_bytes
    assert kinds(tmp_path) == (2, 3)  # blocks 0-3 and 4-7 grouped, the tail 8-10 a file each
    assert tier.group_path_of(keys[3]).stat().st_size == group_header_bytes(4) + 4 * FORMAT.block_bytes
    assert tier.store_blocks(job(keys), range(11), cache) == 0  # held already: nothing written
    reader = DirectoryTier(tmp_path, FORMAT, max_bytes=BIG, group_blocks=GROUP)  # another engine
    files = file_keys(keys, GROUP)
    manager = OffloadManager("disk", BIG, FORMAT.block_bytes, probe=reader.exists)
    assert manager.lookup(keys, files) == 11
    out = zeros(11)
    loaded, missed = reader.load_blocks(job(keys, start=5, count=6), range(6), out)  # from inside a group
    assert (loaded, missed) == (6 * FORMAT.block_bytes, [])
    assert all(block_equal(out, i, cache, 5 + i) for i in range(6))


def test_a_group_split_across_store_jobs_is_stored_as_block_files_and_still_found(tmp_path: Path) -> None:
    keys, cache = chain(8), engine(8, 2)
    tier = DirectoryTier(tmp_path, FORMAT, max_bytes=BIG, group_blocks=GROUP)
    tier.store_blocks(job(keys, start=0, count=6), range(6), cache)  # a chunked prefill: blocks 0-5 ...
    tier.store_blocks(job(keys, start=6, count=2), range(6, 8), cache)  # ... then 6-7
    assert kinds(tmp_path) == (1, 4)
    assert all(tier.exists(k, f) for k, f in zip(keys, file_keys(keys, GROUP), strict=True))
    out = zeros(8)
    assert tier.load_blocks(job(keys), range(8), out)[1] == []
    assert all(block_equal(out, i, cache, i) for i in range(8))


def test_per_block_files_of_the_old_layout_are_read_and_other_group_sizes_are_not_mistaken(tmp_path: Path) -> None:
    keys, cache = chain(8), engine(8, 3)
    DirectoryTier(tmp_path, FORMAT, max_bytes=BIG, group_blocks=1).store_blocks(job(keys, 1), range(8), cache)
    DirectoryTier(tmp_path, FORMAT, max_bytes=BIG, group_blocks=8).store_blocks(job(keys, 8), range(8), cache)
    assert kinds(tmp_path) == (1, 8)
    tier = DirectoryTier(tmp_path, FORMAT, max_bytes=BIG, group_blocks=GROUP)
    out = zeros(8)
    assert tier.load_blocks(job(keys), range(8), out)[1] == []  # no .g4 group: the block files serve
    assert all(block_equal(out, i, cache, i) for i in range(8))


def damage(path: Path, offset: int, data: bytes | None = None) -> None:
    """Overwrite bytes at ``offset`` (None: cut the file there)."""
    with path.open("r+b") as file:
        if data is None:
            file.truncate(offset)
        else:
            file.seek(offset)
            file.write(data)


@pytest.mark.parametrize(
    ("how", "missed", "reason"),
    [
        ("block 2's payload", [2, 3], "corrupt"),  # blocks 0-1 right; the file is gone after block 2
        ("header entry", [0, 1, 2, 3], "corrupt"),
        ("torn: cut inside block 1", [0, 1, 2, 3], "truncated"),
        ("zero length", [0, 1, 2, 3], "truncated"),
        ("another format tag", [0, 1, 2, 3], "foreign"),
    ],
)
def test_a_damaged_group_is_a_miss_for_what_it_cannot_vouch_for_and_is_deleted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, how: str, missed: list[int], reason: str
) -> None:
    keys, cache = chain(4), engine(4, 4)
    metrics = OffloadMetrics()
    tier = DirectoryTier(tmp_path, FORMAT, max_bytes=BIG, group_blocks=GROUP, metrics=metrics)
    tier.store_blocks(job(keys), range(4), cache)
    path, header = tier.group_path_of(keys[3]), group_header_bytes(GROUP)
    if how == "block 2's payload":
        damage(path, header + 2 * FORMAT.block_bytes + 100, b"\xff\x00\xff")
    elif how == "header entry":
        damage(path, 64 + 24 + 3, b"\x01")  # block 1's key: the header CRC no longer matches
    elif how == "torn: cut inside block 1":
        damage(path, header + FORMAT.block_bytes + 10)
    elif how == "zero length":
        damage(path, 0)
    else:  # a valid header of another page format (a CRC that matches)
        _, entries = check_group_header(path.read_bytes(), keys[3], FORMAT.tag, FORMAT.block_bytes, GROUP)
        listed = [(key, entries[key][1]) for key in keys]
        damage(path, 0, encode_group_header(keys[3], b"\x00" * 8, FORMAT.block_bytes, listed))
    out = zeros(4)
    with caplog.at_level(logging.WARNING, logger="pd_transfer.offload.files"):
        loaded, failed = tier.load_blocks(job(keys), range(4), out)
    assert failed == [keys[i] for i in missed] and loaded == (4 - len(missed)) * FORMAT.block_bytes
    assert all(block_equal(out, i, cache, i) for i in range(4) if i not in missed)  # what loaded is right
    assert not path.exists() and reason in caplog.text and keys[0].hex() not in caplog.text
    rejected = metrics.registry.get_sample_value(
        "pd_transfer_offload_rejected_blocks_total", {"tier": "disk", "reason": reason}
    )
    assert rejected == len(missed)
    assert tier.store_blocks(job(keys), range(4), cache) == 4 * FORMAT.block_bytes  # a later store rewrites it
    assert tier.load_blocks(job(keys), range(4), zeros(4))[1] == []


@settings(max_examples=40, deadline=None)
@given(
    blocks=st.integers(1, 23),
    group=st.integers(1, 6),
    cuts=st.lists(st.integers(1, 22), max_size=4),
    shift=st.integers(0, 3),
)
def test_any_prompt_split_into_any_store_jobs_loads_back_from_any_offset(
    tmp_path_factory: pytest.TempPathFactory, blocks: int, group: int, cuts: list[int], shift: int
) -> None:
    root = tmp_path_factory.mktemp("groups")
    keys, cache = chain(blocks, blocks), engine(blocks, blocks)
    tier = DirectoryTier(root, FORMAT, max_bytes=BIG, group_blocks=group)
    bounds = sorted({0, blocks, *(c for c in cuts if c < blocks)})
    for start, end in itertools.pairwise(bounds):
        tier.store_blocks(job(keys, group, start, end - start), range(start, end), cache)
    start = min(shift, blocks - 1)
    out = zeros(blocks)
    loaded, missed = tier.load_blocks(job(keys, group, start), range(blocks - start), out)
    assert missed == [] and loaded == (blocks - start) * FORMAT.block_bytes
    assert all(block_equal(out, i, cache, start + i) for i in range(blocks - start))
    groups, singles = kinds(root)
    assert groups * max(group, 1) + singles == blocks if group > 1 else (groups, singles) == (0, blocks)


def test_a_full_tier_evicts_whole_group_files_and_rewrites_them(tmp_path: Path) -> None:
    probe = DirectoryTier(tmp_path, FORMAT, max_bytes=BIG, group_blocks=GROUP)
    tier = DirectoryTier(tmp_path, FORMAT, max_bytes=4 * probe.group_file_bytes, group_blocks=GROUP)
    prompts = [(chain(8, seed), engine(8, seed)) for seed in range(6)]
    inodes: set[int] = set()
    for keys, cache in prompts:
        tier.store_blocks(job(keys), range(8), cache)
        inodes |= {path.stat().st_ino for path in tmp_path.rglob("*.kvgroup")}
    assert kinds(tmp_path)[1] == 0 and sum(p.stat().st_size for p in tmp_path.rglob("*.kv*")) <= tier.max_bytes
    assert len(inodes) <= 4  # evicted group files were rewritten, never new ones created once full
    for index, (keys, cache) in enumerate(prompts):
        out = zeros(8)
        missed = tier.load_blocks(job(keys), range(8), out)[1]
        assert all(block_equal(out, i, cache, i) for i, key in enumerate(keys) if key not in missed)
        assert len(missed) % GROUP == 0 and (missed == [] or index < len(prompts) - 1)  # groups leave whole
    assert list(tmp_path.rglob("*.tmp")) == []
