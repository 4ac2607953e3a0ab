"""``bench topology``'s CMA ceiling (:mod:`pd_transfer.bench.topology.cma_ceiling`) with real child processes: every
case's rows land where the case puts them, the check fails for any other placement, the children are gone after the
block, and a process that cannot be read ends the measure with the reason. What ``bench topology`` reports of it:
tests/process/test_bench_device.py."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from contextlib import ExitStack

import numpy as np
import pytest
import torch

from pd_transfer.bench.topology.cma_ceiling import (
    Geometry,
    Reader,
    SourceRead,
    cases,
    held_memory,
    verified,
)
from pd_transfer.bench.transfer.reads import QUICK_SHAPE
from pd_transfer.connector.cache import zeroed_host_tensor
from pd_transfer.sim.shape import Shape
from pd_transfer.transfer.errors import PeerDisconnected

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process_vm_readv is Linux's")


def request_ids(shape: Shape, seed: int = 3) -> tuple[list[int], list[int], list[int]]:
    """(remote ids, local ids at the shape's block size, local ids at four times it), as bench topology draws them."""
    rng = np.random.default_rng(seed)
    blocks = shape.request_blocks
    remote = rng.choice(shape.cache_blocks, blocks, replace=False).tolist()
    local = rng.choice(shape.cache_blocks, blocks, replace=False).tolist()
    big = rng.choice(shape.cache_blocks // 4, -(-blocks // 4), replace=False).tolist()
    return remote, local, big


def test_every_case_lands_in_place_and_another_placement_fails_the_check() -> None:
    geometry = Geometry.of(QUICK_SHAPE)
    pids = []
    with ExitStack() as stack:
        reader = Reader(2)
        stack.callback(reader.close)
        sources = (
            stack.enter_context(held_memory(geometry.nbytes, 1 << 48, huge_pages=True)),
            stack.enter_context(held_memory(geometry.nbytes // 2, 2 << 48, huge_pages=False)),
        )
        pids = [source.pid for source in sources]
        local = zeroed_host_tensor((geometry.nbytes,), torch.uint8, huge_pages=False).numpy().view(np.uint64)
        base = local.ctypes.data
        reads = cases(geometry, sources, base, request_ids(QUICK_SHAPE))
        assert [len(reads[case]) for case in ("homogeneous", "tp_2_to_1", "block_16_to_64")] == [1, 2, 1]
        for case, case_reads in reads.items():
            local.fill(0)
            assert reader.seconds(case_reads) > 0
            assert verified(case_reads, sources, local, base), case
            moved = [dataclasses.replace(read, local=np.roll(read.local, 1)) for read in case_reads]
            assert not verified(moved, sources, local, base), case
    for pid in pids:  # each child exited, and was waited for, with the block
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_process_that_is_gone_ends_the_read_with_the_reason() -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(30)
    target = np.zeros(1024, dtype=np.uint8)
    read = SourceRead(
        gone.pid, np.array([4096], dtype=np.uint64), 1024, np.array([target.ctypes.data], np.uint64), 1024
    )
    reader = Reader(1)
    try:
        with pytest.raises(PeerDisconnected, match=f"process {gone.pid} is gone .*No such process"):
            reader.seconds([read])
    finally:
        reader.close()
    with pytest.raises(ValueError, match="threads must be at least 1"):
        Reader(0)
    with pytest.raises(ValueError, match="not NHD"):
        Geometry.of(dataclasses.replace(QUICK_SHAPE, layout="NHD"))
