"""The host tier's device path (a GPU engine's: ``BlockCopier``, ``HostPool.store_device`` / ``load_device``,
``TransferWorker(device_copies=...)``) run on CPU tensors, where its copies are plain ones: byte-exact whatever the
rows, blocks and staging size, interchangeable with the host path's rows, misses kept as misses, and what it
refuses. tests/gpu/test_gpu_offload.py runs the same path on a CUDA device with a pinned pool."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pd_transfer.offload import (
    DirectoryTier,
    HostPool,
    OffloadInputError,
    OffloadManager,
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
    """Rows further apart than their length (as vLLM's layer views are when layers share a block)."""
    generator = torch.Generator().manual_seed(seed)
    wide = [torch.randint(0, 256, (ENGINE_BLOCKS, 2 * size), dtype=torch.uint8, generator=generator)
            for size in FORMAT.page_bytes]  # fmt: skip
    return [tensor[:, :size] for tensor, size in zip(wide, FORMAT.page_bytes, strict=True)]


def block_bytes(cache: Sequence[torch.Tensor], block: int) -> bytes:
    return b"".join(t[block].numpy().tobytes() for t in cache)


@pytest.fixture
def pool() -> Iterator[HostPool]:
    pool = HostPool.create(FORMAT, 24 * FORMAT.block_bytes)
    yield pool
    pool.close()


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_blocks_come_back_byte_exact_whatever_the_rows_blocks_and_staging(data: st.DataObject) -> None:
    pool = HostPool.create(FORMAT, 24 * FORMAT.block_bytes)
    try:
        count = data.draw(st.integers(1, 12))
        rows = data.draw(st.one_of(st.just(list(range(3, 3 + count))), st.permutations(range(24))))[:count]
        sources = data.draw(st.lists(st.integers(0, ENGINE_BLOCKS - 1), min_size=count, max_size=count, unique=True))
        targets = data.draw(st.permutations(range(ENGINE_BLOCKS)))[:count]
        staging_blocks = data.draw(st.integers(1, 13))
        source, target = engine_cache(1), engine_cache(2)
        copier = BlockCopier(source, staging_bytes=staging_blocks * FORMAT.block_bytes)
        blocks = TierBlocks("host", tuple(KEYS[:count]), tuple(rows))
        assert pool.store_device(blocks, sources, copier, None) == count * FORMAT.block_bytes
        untouched = {b: block_bytes(target, b) for b in range(ENGINE_BLOCKS) if b not in targets}
        moved, missed = pool.load_device(blocks, targets, BlockCopier(target, staging_bytes=1), None)
        assert missed == [] and moved == count * FORMAT.block_bytes
        for s, t in zip(sources, targets, strict=True):
            assert block_bytes(target, t) == block_bytes(source, s)
        assert all(block_bytes(target, b) == data for b, data in untouched.items())
    finally:
        pool.close()


def test_rows_stored_by_either_path_load_by_the_other(pool: HostPool) -> None:
    source, by_host, by_device = engine_cache(3), engine_cache(4), engine_cache(5)
    first, second = TierBlocks("host", tuple(KEYS[:3]), (0, 1, 2)), TierBlocks("host", tuple(KEYS[3:5]), (7, 9))
    pool.store_device(first, [4, 8, 15], BlockCopier(source), None)
    pool.store_blocks(second, [20, 21], canonical_views(source, FORMAT))
    pool.load_blocks(first, [0, 1, 2], canonical_views(by_host, FORMAT))
    pool.load_device(second, [30, 31], BlockCopier(by_device), None)
    assert [block_bytes(by_host, b) for b in (0, 1, 2)] == [block_bytes(source, b) for b in (4, 8, 15)]
    assert [block_bytes(by_device, b) for b in (30, 31)] == [block_bytes(source, b) for b in (20, 21)]


def test_worker_with_device_copies_stores_and_loads_through_the_manager(pool: HostPool) -> None:
    manager = OffloadManager("host", pool.capacity_bytes, FORMAT.block_bytes)
    cache = engine_cache(6)
    worker = TransferWorker(cache, pool, device_copies=True, staging_bytes=2 * FORMAT.block_bytes)
    try:
        plan = manager.prepare_store(KEYS[:6])
        assert plan is not None and worker.submit(TransferJob(1, "store", (5, 6, 7, 30, 2, 3), plan.blocks))
        (result,) = worker.poll(timeout=30)
        assert result.ok and result.num_bytes == 6 * FORMAT.block_bytes
        manager.complete_store(plan.blocks.keys)
        expected = [block_bytes(cache, b) for b in (5, 6, 7, 30, 2, 3)]
        for t in cache:
            t.zero_()
        load = manager.prepare_load(KEYS[:6])
        result = worker.run_now(TransferJob(2, "load", (10, 11, 12, 13, 14, 15), load))
        manager.complete_load(KEYS[:6])
        assert result.ok and [block_bytes(cache, b) for b in range(10, 16)] == expected
    finally:
        worker.close()


def test_a_row_that_does_not_hold_its_block_is_a_miss_on_the_device_path(pool: HostPool) -> None:
    cache = engine_cache(7)
    pool.store_device(TierBlocks("host", (KEYS[0], KEYS[1]), (0, 1)), [0, 1], BlockCopier(cache), None)
    target = engine_cache(8)
    before = block_bytes(target, 9)
    asked = TierBlocks("host", (KEYS[0], KEYS[2], KEYS[1]), (0, 1, 2))  # row 1 holds KEYS[1]; row 2 nothing
    worker = TransferWorker(target, pool, device_copies=True)
    try:
        assert worker.submit(TransferJob(7, "load", (8, 9, 10), asked))
        (result,) = worker.poll(timeout=30)
    finally:
        worker.close()
    assert not result.ok and result.failed_keys == (KEYS[2], KEYS[1])
    assert block_bytes(target, 8) == block_bytes(cache, 0) and block_bytes(target, 9) == before


def test_what_the_device_path_refuses(tmp_path, pool: HostPool) -> None:
    cache = engine_cache(9)
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
