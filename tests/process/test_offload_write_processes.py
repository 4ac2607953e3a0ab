"""How the directory tier writes a file, across real processes: a writer killed before its header leaves nothing
readable, in a new file or in an evicted file it was rewriting; a forked child hashes on its own helper thread. The
rest: tests/unit/test_offload_write.py."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from child_io import read_line
from msgspec import msgpack
from test_offload_write import BIG, BLOCKS, FORMAT, GROUP, chain, engine, helper_threads, job, needs_two_cpus, zeros

from pd_transfer.offload import DirectoryTier
from pd_transfer.offload.hash_ahead import helper_useful

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
