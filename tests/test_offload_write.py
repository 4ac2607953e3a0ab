"""How the directory tier writes a file: payload first, header (with the payload checksums) last, the checksums
computed on a helper thread while the store writes (pd_transfer/offload/hash_ahead.py, files.py). Files come out
byte-identical either way; a writer killed before its header leaves nothing readable, in a new file or in an
evicted file it was rewriting; a failed job leaves no checksum running; a forked child hashes on its own thread."""

from __future__ import annotations

import multiprocessing
import os
import select
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from msgspec import msgpack

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


WRITER = """
import sys
import numpy as np
from msgspec import msgpack
from pd_transfer.offload import DirectoryTier, PageFormat, TierBlocks, chain_block_keys, file_keys
from pd_transfer.offload import files
root, fmt, seeds, bound = msgpack.decode(bytes.fromhex(sys.stdin.readline().strip()))
page_format = msgpack.decode(fmt, type=PageFormat)
tier = DirectoryTier(root, page_format, max_bytes=bound, group_blocks=4, checksum_thread=True)
import threading
files.MIN_AHEAD_BYTES = 0  # these 768 KiB groups too: the checksums on the helper thread (with 2+ CPUs)
encode = files.encode_group_header


def stop_before_header(*args):
    helper = any(t.name.startswith("pd-offload-checksum") for t in threading.enumerate())
    print("payload written", helper, flush=True)
    sys.stdin.readline()  # killed here
    return encode(*args)


for index, seed in enumerate(seeds):
    keys = chain_block_keys(page_format.fingerprint, [seed, *range(1, 16 * 4)], 16)
    cache = [np.full((4, size), seed, np.uint8) for size in page_format.page_bytes]
    if index == len(seeds) - 1:
        files.encode_group_header = stop_before_header
    tier.store_blocks(TierBlocks("disk", tuple(keys), files=file_keys(keys, 4)), range(4), cache)
"""


def read_line(process: subprocess.Popen[bytes], timeout: float = 60.0) -> str:
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], timeout)
    assert ready, f"no line from pid {process.pid} within {timeout} s"
    return process.stdout.readline().decode().strip()


@pytest.mark.parametrize("into", ["a new file", "an evicted file"])
def test_a_writer_killed_before_the_header_leaves_nothing_readable(tmp_path: Path, into: str) -> None:
    probe = DirectoryTier(tmp_path, FORMAT, max_bytes=BIG, group_blocks=GROUP)
    seeds = [11] if into == "a new file" else [11, 12, 13]  # a bound of two groups: the third reuses the first's
    process = subprocess.Popen([sys.executable, "-c", WRITER], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert process.stdin is not None
        bound = 2 * probe.group_file_bytes
        process.stdin.write(msgpack.encode([str(tmp_path), msgpack.encode(FORMAT), seeds, bound]).hex().encode())
        process.stdin.write(b"\n")
        process.stdin.flush()
        # the last group's payload is written (the groups before it are stored), its header not
        assert read_line(process) == f"payload written {helper_useful()}"
        os.kill(process.pid, signal.SIGKILL)
        assert process.wait(30) == -signal.SIGKILL
    finally:
        process.kill()
        process.wait(30)
    last = chain(seeds[-1], GROUP)
    (temp,) = tmp_path.rglob("*.tmp")  # the killed writer's file: whole payload, no header of its own
    assert temp.stat().st_size == probe.group_file_bytes
    assert not probe.exists(last[-1], last[-1]) and probe.load_blocks(job(last), range(GROUP), zeros(GROUP))[1] == last
    if into == "an evicted file":
        first = chain(seeds[0], GROUP)
        assert probe.load_blocks(job(first), range(GROUP), zeros(GROUP))[1] == first  # its name is gone
    for keys in [last] + ([chain(seeds[0], GROUP)] if into == "an evicted file" else []):
        probe.group_path_of(keys[-1]).parent.mkdir(exist_ok=True)
        os.link(temp, probe.group_path_of(keys[-1]))  # even published by mistake, no block of it is KV
        assert probe.load_blocks(job(keys), range(GROUP), zeros(GROUP))[1] == keys
        assert not probe.group_path_of(keys[-1]).exists()  # rejected and deleted
    swept = DirectoryTier(tmp_path, FORMAT, max_bytes=BIG, group_blocks=GROUP, stale_temp_seconds=0)
    assert swept.sweep() == 0 and list(tmp_path.rglob("*.tmp")) == []


def store_in_child(root: str, seed: int) -> None:
    """In a forked child (the parent's helper thread does not exist there): a store that needs the helper."""
    tier = DirectoryTier(root, FORMAT, max_bytes=BIG, group_blocks=GROUP, checksum_thread=True)
    tier.store_blocks(job(chain(seed)), range(BLOCKS), engine(seed))
    os._exit(0 if helper_threads() == 1 else 3)


@needs_two_cpus
def test_a_forked_child_hashes_on_its_own_helper(tmp_path: Path) -> None:
    parent = DirectoryTier(tmp_path, FORMAT, max_bytes=BIG, group_blocks=GROUP, checksum_thread=True)
    parent.store_blocks(job(chain(21)), range(BLOCKS), engine(21))
    assert helper_threads() >= 1
    child = multiprocessing.get_context("fork").Process(target=store_in_child, args=(str(tmp_path), 22))
    child.start()
    child.join(120)
    if child.exitcode is None:
        child.kill()
    assert child.exitcode == 0
    out = zeros()
    assert parent.load_blocks(job(chain(22)), range(BLOCKS), out)[1] == []
    assert all(np.array_equal(a, b) for a, b in zip(out, engine(22), strict=True))


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
