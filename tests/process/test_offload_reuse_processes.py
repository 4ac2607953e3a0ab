"""The disk tier at its bound across real processes: two processes evicting and rewriting in one bounded directory
leave only whole, right blocks. The rest: tests/unit/test_offload_reuse.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
from child_io import read_line
from msgspec import msgpack
from test_offload_reuse import FILE_BYTES, FORMAT, MODEL, empty, temporary_files

from pd_transfer.offload import DirectoryTier, chain_block_keys

WRITER = """
import sys
import numpy as np
from msgspec import msgpack
from pd_transfer.offload import DirectoryTier, PageFormat, TierBlocks
root, fmt, keys, fill, max_bytes = msgpack.decode(bytes.fromhex(sys.stdin.readline().strip()))
tier = DirectoryTier(root, msgpack.decode(fmt, type=PageFormat), max_bytes=max_bytes)
cache = [np.full((6, size), fill, np.uint8) for size in tier.page_format.page_bytes]
print("ready", flush=True)
sys.stdin.readline()
for start in range(0, len(keys), 6):
    batch = tuple(keys[start : start + 6])
    tier.store_blocks(TierBlocks("disk", batch, tuple(range(len(batch)))), list(range(len(batch))), cache)
tier.close()
print("done", flush=True)
"""


def start_writer(root: Path, keys: list[bytes], fill: int, max_bytes: int) -> subprocess.Popen[bytes]:
    process = subprocess.Popen([sys.executable, "-c", WRITER], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert process.stdin is not None
    process.stdin.write(msgpack.encode([str(root), msgpack.encode(FORMAT), keys, fill, max_bytes]).hex().encode())
    process.stdin.write(b"\n")
    process.stdin.flush()
    return process


def test_two_processes_evicting_and_rewriting_in_one_bounded_directory_leave_only_right_blocks(
    tmp_path: Path,
) -> None:
    chains = [chain_block_keys(MODEL, [fill, *range(16 * 120 - 1)], 16) for fill in (0x11, 0xEE)]
    bound = 20 * FILE_BYTES
    writers = [start_writer(tmp_path, keys, fill, bound) for keys, fill in zip(chains, (0x11, 0xEE), strict=True)]
    try:
        assert [read_line(w) for w in writers] == ["ready", "ready"]
        for w in writers:
            assert w.stdin is not None
            w.stdin.write(b"go\n")
            w.stdin.flush()
        assert [read_line(w) for w in writers] == ["done", "done"]
    finally:
        for w in writers:
            w.kill()
            w.wait(30)
    tier = DirectoryTier(tmp_path, FORMAT, max_bytes=bound)
    files = list(tmp_path.rglob("*.kvblock"))
    assert 0 < len(files) <= 24  # the bound plus each writer's 10% share
    owner = {key: fill for keys, fill in zip(chains, (0x11, 0xEE), strict=True) for key in keys}
    found = [key for key in owner if tier.exists(key)]
    assert len(found) == len(files)
    for key in found:
        out = empty()
        assert tier.load(key, out) == "ok", key.hex()
        assert all(np.all(page == owner[key]) for page in out)  # the block of that key, whole
    assert temporary_files(tmp_path) == []
