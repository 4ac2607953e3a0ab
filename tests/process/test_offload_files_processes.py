"""The disk tier across real processes: two processes storing the same keys leave one valid file per key; a
writer killed with SIGKILL between write and rename leaves nothing readable. The rest:
tests/unit/test_offload_files.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
from child_io import read_line
from msgspec import msgpack
from test_offload_files import BIG, FORMAT, KEYS, MODEL, empty

from pd_transfer.offload import DirectoryTier, chain_block_keys
from pd_transfer.offload.files import HEADER_BYTES

WRITER = """
import sys
import numpy as np
from msgspec import msgpack
from pd_transfer.offload import DirectoryTier, PageFormat
root, fmt, keys, fill, mode = msgpack.decode(bytes.fromhex(sys.stdin.readline().strip()))
tier = DirectoryTier(root, msgpack.decode(fmt, type=PageFormat), max_bytes=1 << 30)
pages = [np.full(size, fill, np.uint8) for size in tier.page_format.page_bytes]
if mode == "race":
    print("ready", flush=True)
    sys.stdin.readline()
    written = sum(1 for key in keys if tier.store(key, pages))
    print("done", written, flush=True)
else:
    temp = tier.write_temp(keys[0], pages)
    print(temp, flush=True)
    sys.stdin.readline()
    tier.publish(temp, keys[0])
"""


def writer(root: Path, fill: int, mode: str, keys: list[bytes]) -> subprocess.Popen[bytes]:
    process = subprocess.Popen(
        [sys.executable, "-c", WRITER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=os.environ.copy()
    )
    assert process.stdin is not None
    args = msgpack.encode([str(root), msgpack.encode(FORMAT), keys, fill, mode])
    process.stdin.write(args.hex().encode() + b"\n")
    process.stdin.flush()
    return process


def test_two_processes_storing_the_same_keys_leave_one_valid_file_each(tmp_path: Path) -> None:
    keys = chain_block_keys(MODEL, list(range(16 * 300)), 16)  # both store these, in the same order
    writers = [writer(tmp_path, fill, "race", keys) for fill in (0x11, 0xEE)]
    try:
        assert [read_line(w) for w in writers] == ["ready", "ready"]
        for w in writers:
            assert w.stdin is not None
            w.stdin.write(b"go\n")
            w.stdin.flush()
        done = [read_line(w).split() for w in writers]
    finally:
        for w in writers:
            w.kill()
            w.wait(30)
    assert [d[0] for d in done] == ["done", "done"]
    assert sum(int(d[1]) for d in done) >= len(keys)  # every key written by one writer at least
    tier = DirectoryTier(tmp_path, FORMAT, max_bytes=BIG)
    for key in keys:
        out = empty()
        assert tier.load(key, out) == "ok"
        fill = int(out[0][0])
        assert fill in (0x11, 0xEE) and all(np.all(page == fill) for page in out)  # one writer's block, whole
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert sorted(p.name for p in files) == sorted(tier.path_of(key).name for key in keys)  # no temp files


def test_a_writer_killed_between_write_and_rename_leaves_nothing_readable(tmp_path: Path) -> None:
    process = writer(tmp_path, 0x5A, "kill", KEYS[:1])
    try:
        temp = Path(read_line(process))  # the block is written, not yet renamed
        assert temp.stat().st_size == HEADER_BYTES + FORMAT.block_bytes
        os.kill(process.pid, signal.SIGKILL)
        assert process.wait(30) == -signal.SIGKILL
    finally:
        process.kill()
    tier = DirectoryTier(tmp_path, FORMAT, max_bytes=BIG, stale_temp_seconds=0)
    assert not tier.exists(KEYS[0]) and tier.load(KEYS[0], empty()) == "missing"
    assert tier.sweep() == 0 and not temp.exists()  # the sweep removed the dead writer's file
