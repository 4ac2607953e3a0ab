"""The host tier and the transfer worker: byte-exact store and load through the pool, rows that do not hold
their block are misses, a bounded queue, typed bad input. Then the same for the device path (a GPU engine's:
``BlockCopier``, ``HostPool.store_device`` / ``load_device``, ``TransferWorker(device_copies=...)``) run on CPU
tensors, where its copies are plain ones, and what it refuses; tests/gpu/test_gpu_offload.py runs that path on a CUDA
device with a pinned pool. The pool shared with a real second process: tests/process/test_offload_host_processes.py."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pd_transfer.offload import (
    DirectoryTier,
    HostPool,
    OffloadInputError,
    OffloadManager,
    OffloadMetrics,
    PageFormat,
    TierBlocks,
    TransferJob,
    TransferWorker,
    canonical_views,
    chain_block_keys,
)
from pd_transfer.offload.device_copy import BlockCopier
from pd_transfer.spec import ModelFingerprint

MODEL = ModelFingerprint(model="m", dtype="bfloat16", num_layers=3, total_num_kv_heads=2, head_size=8)
FORMAT = PageFormat(fingerprint=MODEL, page_bytes=(96, 160, 64), block_size=16)
ENGINE_BLOCKS = 40
KEYS = chain_block_keys(MODEL, list(range(16 * 32)), 16)


def engine_cache(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, 256, (ENGINE_BLOCKS, size), dtype=torch.uint8, generator=generator)
        for size in FORMAT.page_bytes
    ]


def strided_cache(seed: int) -> list[torch.Tensor]:
    """:func:`engine_cache`'s bytes in rows further apart than their length (as vLLM's layer views are when the
    layers share a block)."""
    out = []
    for tensor in engine_cache(seed):
        wide = torch.zeros(tensor.shape[0], 2 * tensor.shape[1], dtype=torch.uint8)
        wide[:, : tensor.shape[1]] = tensor
        out.append(wide[:, : tensor.shape[1]])
    return out


def block_bytes(cache: Sequence[torch.Tensor], block: int) -> bytes:
    return b"".join(t[block].numpy().tobytes() for t in cache)


@pytest.fixture
def pool() -> Iterator[HostPool]:
    pool = HostPool.create(FORMAT, 24 * FORMAT.block_bytes)
    yield pool
    pool.close()


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_blocks_come_back_byte_exact_whatever_the_rows_and_blocks(data: st.DataObject) -> None:
    """Through the host path or the device path (its staging buffer any number of blocks, rows strided)."""
    pool = HostPool.create(FORMAT, 24 * FORMAT.block_bytes)
    try:
        count = data.draw(st.integers(1, 12))
        rows = data.draw(st.one_of(st.just(list(range(3, 3 + count))), st.permutations(range(24))))[:count]
        sources = data.draw(st.lists(st.integers(0, ENGINE_BLOCKS - 1), min_size=count, max_size=count, unique=True))
        targets = data.draw(st.permutations(range(ENGINE_BLOCKS)))[:count]
        staging = data.draw(st.one_of(st.none(), st.integers(1, 13)))  # None: the host path
        source, target = (engine_cache(1), engine_cache(2)) if staging is None else (strided_cache(1), strided_cache(2))
        blocks = TierBlocks("host", tuple(KEYS[:count]), tuple(rows))
        untouched = {b: block_bytes(target, b) for b in range(ENGINE_BLOCKS) if b not in targets}
        if staging is None:
            stored = pool.store_blocks(blocks, sources, canonical_views(source, FORMAT))
            moved, missed = pool.load_blocks(blocks, targets, canonical_views(target, FORMAT))
        else:
            copier = BlockCopier(source, staging_bytes=staging * FORMAT.block_bytes)
            stored = pool.store_device(blocks, sources, copier, None)
            moved, missed = pool.load_device(blocks, targets, BlockCopier(target, staging_bytes=1), None)
        assert missed == [] and moved == stored == count * FORMAT.block_bytes
        for s, t in zip(sources, targets, strict=True):
            assert block_bytes(target, t) == block_bytes(source, s)
        assert all(block_bytes(target, b) == data for b, data in untouched.items())
    finally:
        pool.close()


@pytest.mark.parametrize("device_copies", [False, True], ids=["host-path", "device-path"])
def test_worker_stores_and_loads_through_the_manager(pool: HostPool, device_copies: bool) -> None:
    metrics = OffloadMetrics()
    manager = OffloadManager("host", pool.capacity_bytes, FORMAT.block_bytes, metrics=metrics)
    cache = strided_cache(3) if device_copies else engine_cache(3)
    worker = TransferWorker(
        cache, pool, metrics=metrics, device_copies=device_copies, staging_bytes=2 * FORMAT.block_bytes
    )
    try:
        plan = manager.prepare_store(KEYS[:6])
        assert plan is not None and worker.submit(TransferJob(1, "store", (5, 6, 7, 30, 2, 3), plan.blocks))
        (result,) = worker.poll(timeout=30)
        assert result.ok and result.num_bytes == 6 * FORMAT.block_bytes
        manager.complete_store(plan.blocks.keys)
        expected = [block_bytes(cache, b) for b in (5, 6, 7, 30, 2, 3)]
        for t in cache:
            t.zero_()
        assert manager.lookup(KEYS[:8]) == 6
        load = manager.prepare_load(KEYS[:6])
        assert worker.submit(TransferJob(2, "load", (10, 11, 12, 13, 14, 15), load))
        (result,) = worker.poll(timeout=30)
        manager.complete_load(KEYS[:6])
        assert result.ok and [block_bytes(cache, b) for b in range(10, 16)] == expected
    finally:
        worker.close()
    value = metrics.registry.get_sample_value
    assert value("pd_transfer_offload_stored_bytes_total", {"tier": "host"}) == 6 * FORMAT.block_bytes
    assert value("pd_transfer_offload_loaded_bytes_total", {"tier": "host"}) == 6 * FORMAT.block_bytes
    assert value("pd_transfer_offload_transfer_bytes_count", {"tier": "host", "direction": "load"}) == 1


@pytest.mark.parametrize("device_copies", [False, True], ids=["host-path", "device-path"])
def test_a_row_that_does_not_hold_its_block_is_a_miss(pool: HostPool, device_copies: bool) -> None:
    cache = engine_cache(4)
    views = canonical_views(cache, FORMAT)
    pool.store_blocks(TierBlocks("host", (KEYS[0], KEYS[1]), (0, 1)), [0, 1], views)
    target = strided_cache(5) if device_copies else engine_cache(5)
    before = block_bytes(target, 9)
    asked = TierBlocks("host", (KEYS[0], KEYS[2], KEYS[1]), (0, 1, 2))  # row 1 holds KEYS[1]; row 2 nothing
    worker = TransferWorker(target, pool, device_copies=device_copies)
    try:
        assert worker.submit(TransferJob(7, "load", (8, 9, 10), asked))
        (result,) = worker.poll(timeout=30)
    finally:
        worker.close()
    assert not result.ok and result.failed_keys == (KEYS[2], KEYS[1])
    assert block_bytes(target, 8) == block_bytes(cache, 0) and block_bytes(target, 9) == before


class GatedTier:
    """A tier whose stores wait for a gate: holds the worker's thread so the queue can fill."""

    name = "host"
    page_format = FORMAT

    def __init__(self) -> None:
        self.started, self.gate = threading.Event(), threading.Event()

    def store_blocks(self, blocks: TierBlocks, block_ids: Sequence[int], caches: Sequence[np.ndarray]) -> int:
        self.started.set()
        assert self.gate.wait(30)
        return 0

    def load_blocks(
        self, blocks: TierBlocks, block_ids: Sequence[int], caches: Sequence[np.ndarray]
    ) -> tuple[int, list[bytes]]:
        raise OSError("this tier cannot load")


def test_the_queue_is_bounded_and_submit_never_blocks() -> None:
    tier = GatedTier()
    worker = TransferWorker(engine_cache(7), tier, max_queued_jobs=1)
    job = TransferJob(0, "store", (1,), TierBlocks("host", (KEYS[0],), (0,)))
    try:
        assert worker.submit(job)
        assert tier.started.wait(30)  # the thread holds job 0; the queue is empty
        assert worker.submit(TransferJob(1, "store", job.block_ids, job.tier_blocks))
        assert not worker.submit(TransferJob(2, "store", job.block_ids, job.tier_blocks))  # full: refused
        assert worker.in_flight == 2
        assert worker.submit(TransferJob(3, "load", job.block_ids, job.tier_blocks)) is False
        tier.gate.set()
        results: list = []
        while len(results) < 2:
            batch = worker.poll(timeout=30)
            assert batch, "the worker did not finish in 30 s"
            results += batch
        assert [r.job_id for r in results] == [0, 1] and all(r.ok for r in results)
        assert worker.submit(TransferJob(4, "load", job.block_ids, job.tier_blocks))
        (failed,) = worker.poll(timeout=30)
        assert not failed.ok and failed.error.startswith("OSError") and failed.failed_keys == (KEYS[0],)
    finally:
        tier.gate.set()
        worker.close()


def test_bad_input_is_a_typed_error(pool: HostPool) -> None:
    with pytest.raises(OffloadInputError):
        TransferWorker([torch.zeros(4, 96, dtype=torch.float32)] * 3, pool)
    with pytest.raises(OffloadInputError):
        TransferWorker(engine_cache(8)[:2], pool)
    worker = TransferWorker(engine_cache(8), pool)
    try:
        for job in (
            TransferJob(1, "store", (ENGINE_BLOCKS,), TierBlocks("host", (KEYS[0],), (0,))),
            TransferJob(2, "store", (1, 2), TierBlocks("host", (KEYS[0],), (0,))),
            TransferJob(3, "store", (1,), TierBlocks("disk", (KEYS[0],), ())),
        ):
            with pytest.raises(OffloadInputError):
                worker.submit(job)
    finally:
        worker.close()
    with pytest.raises(OffloadInputError):
        pool.store_blocks(
            TierBlocks("host", (KEYS[0],), (pool.num_rows,)), [0], canonical_views(engine_cache(8), FORMAT)
        )
    with pytest.raises(OffloadInputError):
        HostPool.create(FORMAT, FORMAT.block_bytes - 1)
    with pytest.raises(OffloadInputError):
        HostPool.attach("pd-offload-no-such-pool", FORMAT, 4)


def test_rows_stored_by_either_path_load_by_the_other(pool: HostPool) -> None:
    source, by_host, by_device = strided_cache(3), strided_cache(4), strided_cache(5)
    first, second = TierBlocks("host", tuple(KEYS[:3]), (0, 1, 2)), TierBlocks("host", tuple(KEYS[3:5]), (7, 9))
    pool.store_device(first, [4, 8, 15], BlockCopier(source), None)
    pool.store_blocks(second, [20, 21], canonical_views(source, FORMAT))
    pool.load_blocks(first, [0, 1, 2], canonical_views(by_host, FORMAT))
    pool.load_device(second, [30, 31], BlockCopier(by_device), None)
    assert [block_bytes(by_host, b) for b in (0, 1, 2)] == [block_bytes(source, b) for b in (4, 8, 15)]
    assert [block_bytes(by_device, b) for b in (30, 31)] == [block_bytes(source, b) for b in (20, 21)]


def test_what_the_device_path_refuses(tmp_path, pool: HostPool) -> None:
    cache = strided_cache(9)
    disk = DirectoryTier(tmp_path, FORMAT, max_bytes=1 << 20)
    with pytest.raises(OffloadInputError, match="the disk tier takes blocks from host memory only"):
        TransferWorker(cache, disk, device_copies=True)
    with pytest.raises(OffloadInputError, match="need 2-D uint8/int8 rows"):
        BlockCopier([torch.zeros(4, 8)])
    with pytest.raises(OffloadInputError, match="differs from the first in device or block count"):
        BlockCopier([torch.zeros(4, 8, dtype=torch.uint8), torch.zeros(5, 8, dtype=torch.uint8)])
    with pytest.raises(OffloadInputError, match="a pinned host pool is private to its process"):
        HostPool.create(FORMAT, 4 * FORMAT.block_bytes, name="pd-offload-pinned", pinned=True)
    assert not pool.pinned and pool.row_tensor().data_ptr() == pool.rows.ctypes.data


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here: host memory can be pinned")
def test_a_pinned_pool_without_cuda_is_refused_clearly() -> None:
    with pytest.raises(OffloadInputError, match=r"cannot pin \d+ bytes of host memory"):
        HostPool.create(FORMAT, 4 * FORMAT.block_bytes, pinned=True)
