"""The directory tier's group files across real processes: two writers of the same groups leave whole groups of
one writer. The rest: tests/unit/test_offload_groups.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from child_io import read_line
from msgspec import msgpack
from test_offload_groups import BIG, FORMAT, GROUP, chain, job, kinds, zeros

from pd_transfer.offload import (
    DirectoryTier,
)

WRITER = """
import sys
import numpy as np
from msgspec import msgpack
from pd_transfer.offload import DirectoryTier, PageFormat, TierBlocks, chain_block_keys, file_keys
root, fmt, prompts, fill = msgpack.decode(bytes.fromhex(sys.stdin.readline().strip()))
page_format = msgpack.decode(fmt, type=PageFormat)
tier = DirectoryTier(root, page_format, max_bytes=1 << 30, group_blocks=4)
cache = [np.full((8, size), fill, np.uint8) for size in page_format.page_bytes]
jobs = []
for seed in prompts:
    keys = chain_block_keys(page_format.fingerprint, [seed, *range(1, 16 * 8)], 16)
    jobs.append(TierBlocks("disk", tuple(keys), files=file_keys(keys, 4)))
print("ready", flush=True)
sys.stdin.readline()
written = sum(tier.store_blocks(blocks, range(8), cache) for blocks in jobs)
print("done", written, flush=True)
"""


def test_two_processes_writing_the_same_groups_leave_whole_groups_of_one_writer(tmp_path: Path) -> None:
    prompts = list(range(100, 160))  # 60 prompts of 8 blocks: 120 group files, both writers, same order
    writers = [
        subprocess.Popen([sys.executable, "-c", WRITER], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        for _ in range(2)
    ]
    try:
        for fill, process in zip((0x11, 0xEE), writers, strict=True):
            assert process.stdin is not None
            process.stdin.write(msgpack.encode([str(tmp_path), msgpack.encode(FORMAT), prompts, fill]).hex().encode())
            process.stdin.write(b"\n")
            process.stdin.flush()
        assert [read_line(w) for w in writers] == ["ready", "ready"]
        for process in writers:
            assert process.stdin is not None
            process.stdin.write(b"go\n")
            process.stdin.flush()
        done = [read_line(w).split() for w in writers]
    finally:
        for process in writers:
            process.kill()
            process.wait(30)
    assert [d[0] for d in done] == ["done", "done"]
    tier = DirectoryTier(tmp_path, FORMAT, max_bytes=BIG, group_blocks=GROUP)
    for seed in prompts:
        keys = chain(8, seed)
        out = zeros(8)
        assert tier.load_blocks(job(keys), range(8), out)[1] == []
        for first in (0, 4):  # each group whole from one writer
            fills = {int(page[i].max()) for page in out for i in range(first, first + 4)}
            fills |= {int(page[i].min()) for page in out for i in range(first, first + 4)}
            assert len(fills) == 1 and fills <= {0x11, 0xEE}
    assert kinds(tmp_path) == (120, 0) and list(tmp_path.rglob("*.tmp")) == []
