"""The host tier's pool shared with a real second process, which attaches it and reads the blocks byte-exact. The
rest: tests/unit/test_offload_host.py."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest
from test_offload_host import FORMAT, KEYS, block_bytes, engine_cache

from pd_transfer.offload import (
    HostPool,
    TierBlocks,
    canonical_views,
)

CHILD = """
import hashlib, sys
import numpy as np
import pytest
from msgspec import msgpack
from pd_transfer.offload import HostPool, PageFormat, TierBlocks
name, fmt, rows, keys = msgpack.decode(sys.stdin.buffer.read())
fmt = msgpack.decode(fmt, type=PageFormat)
pool = HostPool.attach(name, fmt, rows)
cache = [np.zeros((len(keys), size), np.uint8) for size in fmt.page_bytes]
moved, missed = pool.load_blocks(TierBlocks("host", tuple(keys), tuple(range(len(keys)))), range(len(keys)), cache)
print(len(missed), *[hashlib.sha256(b"".join(c[i].tobytes() for c in cache)).hexdigest() for i in range(len(keys))])
pool.close()
"""


@pytest.fixture
def pool() -> Iterator[HostPool]:
    made = HostPool.create(FORMAT, 24 * FORMAT.block_bytes)
    yield made
    made.close()


def test_another_process_attaches_the_pool_and_reads_the_blocks(pool: HostPool) -> None:
    from msgspec import msgpack

    cache = engine_cache(6)
    pool.store_blocks(TierBlocks("host", tuple(KEYS[:3]), (0, 1, 2)), [4, 5, 6], canonical_views(cache, FORMAT))
    request = msgpack.encode([pool.shared_name, msgpack.encode(FORMAT), pool.num_rows, KEYS[:3]])
    child = subprocess.run([sys.executable, "-c", CHILD], input=request, capture_output=True, timeout=60, check=True)
    missed, *digests = child.stdout.decode().split()
    assert missed == "0"
    assert digests == [hashlib.sha256(block_bytes(cache, b)).hexdigest() for b in (4, 5, 6)]
    assert np.any(pool.rows[0])  # the child's exit left the segment mapped and named here
