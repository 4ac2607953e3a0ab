"""Offload from a GPU engine: a CUDA cache's blocks go to a pinned host pool and come back, byte for byte, through
the worker's copy stream; a store copies what the engine's kernels queued before it wrote (it waits for them on the
device, not on the engine's thread), and a load reported done has its bytes in the cache.
tests/test_offload_host.py runs the same path on CPU tensors."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from vllm_gpu_caches import LAYERS, geometry, layer_caches

from pd_transfer.integrations.vllm_cache_layouts import block_rows
from pd_transfer.offload import HostPool, PageFormat, TierBlocks, TransferJob, TransferWorker, chain_block_keys
from pd_transfer.spec import ModelFingerprint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: torch sees no GPU here"),
]

BLOCKS = 48
KERNEL_CYCLES = 2_000_000_000  # torch.cuda._sleep: about a second of device time, queued before the job


def paged_rows(device: str = "cuda") -> list[torch.Tensor]:
    """The block rows of vLLM's paged views, layers interleaved in a block (rows further apart than their length)."""
    tensors = layer_caches("paged", "NHD", BLOCKS, geometry(), torch.bfloat16, "BL", device)
    return [block_rows(t) for _, t in sorted(tensors.items())]


def page_format(rows: list[torch.Tensor]) -> PageFormat:
    model = ModelFingerprint("gpu-offload", "bfloat16", LAYERS, 4, 16)
    return PageFormat(fingerprint=model, page_bytes=tuple(int(r.shape[1]) for r in rows), block_size=16)


@pytest.fixture
def rows() -> list[torch.Tensor]:
    rows = paged_rows()
    for r in rows:
        r.copy_(torch.randint(0, 256, r.shape, dtype=torch.uint8, device=r.device))
    return rows


@pytest.fixture
def pool(rows: list[torch.Tensor]) -> Iterator[HostPool]:
    pool = HostPool.create(page_format(rows), 32 * page_format(rows).block_bytes, pinned=True)
    yield pool
    pool.close()


def job(job_id: int, direction: str, block_ids: list[int], fmt: PageFormat, rows: list[int]) -> TransferJob:
    keys = chain_block_keys(fmt.fingerprint, list(range(16 * len(block_ids))), 16)
    return TransferJob(job_id, direction, tuple(block_ids), TierBlocks("host", tuple(keys), tuple(rows)))  # type: ignore[arg-type]


def done(worker: TransferWorker) -> None:
    (result,) = worker.poll(timeout=60)
    assert result.ok, result.error


def test_the_pool_is_pinned_and_blocks_come_back_byte_exact(rows: list[torch.Tensor], pool: HostPool) -> None:
    assert pool.pinned and pool.row_tensor().is_pinned()
    fmt = pool.page_format
    sources, targets = [5, 40, 3, 4, 17, 30, 31, 0], [1, 2, 47, 9, 10, 11, 20, 6]
    expected = [r[sources].cpu() for r in rows]
    worker = TransferWorker(rows, pool, staging_bytes=3 * fmt.block_bytes)  # by device: the copy path
    try:
        assert worker.submit(job(1, "store", sources, fmt, [8, 9, 10, 2, 3, 20, 21, 22]))
        done(worker)
        for r in rows:
            r.zero_()
        assert worker.submit(job(2, "load", targets, fmt, [8, 9, 10, 2, 3, 20, 21, 22]))
        done(worker)
        assert all(torch.equal(r[targets].cpu(), e) for r, e in zip(rows, expected, strict=True))
    finally:
        worker.close()


def test_a_store_copies_what_the_kernels_queued_before_it_wrote(rows: list[torch.Tensor], pool: HostPool) -> None:
    fmt = pool.page_format
    worker = TransferWorker(rows, pool)
    blocks = [12, 13, 14]
    index = torch.tensor(blocks, device="cuda")  # made now: a host copy later would wait for the kernels
    try:
        torch.cuda._sleep(KERNEL_CYCLES)  # the engine's step, still running when the store is submitted
        for r in rows:
            r.index_fill_(0, index, 0x5A)
        assert worker.submit(job(3, "store", blocks, fmt, [0, 1, 2]))
        assert not torch.cuda.current_stream().query()  # submitting did not wait for the engine's kernels
        done(worker)
        stored = pool.row_tensor()[:3]
        assert bool((stored == 0x5A).all())
        for r in rows:
            r.index_fill_(0, index, 0)
        torch.cuda._sleep(KERNEL_CYCLES // 4)
        result = worker.run_now(job(4, "load", blocks, fmt, [0, 1, 2]))  # a load the next forward needs
        assert result.ok and all(bool((r[blocks] == 0x5A).all()) for r in rows)
    finally:
        worker.close()
