"""How the directory tier writes a file: payload first, header (with the payload checksums) last, the checksums
computed on a helper thread while the store writes (pd_transfer/offload/hash_ahead.py, files.py). Files come out
byte-identical either way; a failed job leaves no checksum running; a file the helper has not started is hashed by
the store itself. A writer killed before its header, a forked child: tests/process/test_offload_write_processes.py."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from pd_transfer.offload import DirectoryTier, PageFormat, TierBlocks, chain_block_keys, file_keys, hash_ahead
from pd_transfer.offload.hash_ahead import MIN_AHEAD_BYTES, ChecksumsAhead, file_checksums, helper_useful
from pd_transfer.spec import ModelFingerprint

MODEL = ModelFingerprint(model="m", dtype="bfloat16", num_layers=2, total_num_kv_heads=2, head_size=8)
FORMAT = PageFormat(fingerprint=MODEL, page_bytes=(131072, 65536), block_size=16)  # 192 KiB blocks
GROUP = 4
BLOCKS = 8  # a job: 1.5 MiB, enough for the helper thread
BIG = 1 << 30
HELPER = "pd-offload-checksum"
needs_two_cpus = pytest.mark.skipif(not helper_useful(), reason="this process may use only one CPU")


def chain(seed: int, blocks: int = BLOCKS) -> list[bytes]:
    return chain_block_keys(MODEL, [seed, *range(1, 16 * blocks)], 16)


def job(keys: list[bytes]) -> TierBlocks:
    return TierBlocks("disk", tuple(keys), files=file_keys(keys, GROUP))


def engine(seed: int, blocks: int = BLOCKS) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (blocks, size), dtype=np.uint8) for size in FORMAT.page_bytes]


def zeros(blocks: int = BLOCKS) -> list[np.ndarray]:
    return [np.zeros((blocks, size), np.uint8) for size in FORMAT.page_bytes]


def contents(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` by its path below the tier's format directory."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def helper_threads() -> int:
    return sum(t.name.startswith(HELPER) for t in threading.enumerate())


def test_a_job_is_big_enough_for_the_helper() -> None:
    assert BLOCKS * FORMAT.block_bytes >= MIN_AHEAD_BYTES


@needs_two_cpus
def test_files_written_with_the_helper_thread_equal_those_written_without(tmp_path: Path) -> None:
    blocks = BLOCKS + 2  # two whole groups and two blocks past them (block files)
    prompts = [(chain(seed, blocks), engine(seed, blocks)) for seed in (1, 2, 3)]
    for name, thread in (("ahead", True), ("serial", False)):
        tier = DirectoryTier(tmp_path / name, FORMAT, max_bytes=BIG, group_blocks=GROUP, checksum_thread=thread)
        for keys, cache in prompts:
            assert tier.store_blocks(job(keys), range(blocks), cache) == blocks * FORMAT.block_bytes
        if thread:
            assert helper_threads() >= 1  # the checksums were computed on the helper
    written = contents(tmp_path / "ahead")
    assert written == contents(tmp_path / "serial")
    assert sum(name.endswith(".kvgroup") for name in written) == 6 and len(written) == 12
    reader = DirectoryTier(tmp_path / "ahead", FORMAT, max_bytes=BIG, group_blocks=GROUP)
    for keys, cache in prompts:
        out = zeros(blocks)
        assert reader.load_blocks(job(keys), range(blocks), out)[1] == []
        assert all(np.array_equal(a, b) for a, b in zip(out, cache, strict=True))


def test_the_helper_computes_what_the_store_thread_would_and_a_failed_job_leaves_none_running() -> None:
    cache = engine(4, 64)
    files = [[[page[b] for page in cache] for b in range(first, first + 4)] for first in range(0, 64, 4)]
    with ChecksumsAhead(files, ahead=True) as hashes:
        assert hashes.ahead and all(hashes.start(i) for i in range(len(files)))
        assert [hashes.result(i) for i in range(len(files))] == [file_checksums(f) for f in files]
    assert hashes.pending == 0
    with pytest.raises(OSError, match="disk full"), ChecksumsAhead(files * 8, ahead=True) as hashes:
        for i in range(len(files) * 8):
            hashes.start(i)
        raise OSError("disk full")  # what a failed write does: the job ends before its other files
    assert hashes.pending == 0  # cancelled or finished: nothing reads the engine's blocks after the job
    with ChecksumsAhead(files, ahead=False) as hashes:
        assert not hashes.ahead and not hashes.start(3) and hashes.result(3) == file_checksums(files[3])


def test_a_file_the_helper_has_not_started_is_hashed_by_the_store_itself() -> None:
    cache = engine(5, 16)
    files = [[[page[b] for page in cache] for b in range(first, first + 4)] for first in range(0, 16, 4)]
    release = threading.Event()
    busy = hash_ahead._pool().submit(release.wait, 60)  # the helper busy elsewhere (no CPU for it, say)
    try:
        with ChecksumsAhead(files, ahead=True) as hashes:
            assert all(hashes.start(i) for i in range(len(files)))
            assert hashes.result(2) == file_checksums(files[2])  # not started: computed here, no wait
            assert hashes.pending == len(files) - 1
            release.set()
            assert [hashes.result(i) for i in (0, 1, 3)] == [file_checksums(files[i]) for i in (0, 1, 3)]
        assert hashes.pending == 0
    finally:
        release.set()
        busy.result(60)
