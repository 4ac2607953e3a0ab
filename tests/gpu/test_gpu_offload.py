"""Offload from a GPU engine: a CUDA cache's blocks go to a pinned host pool and come back, byte for byte, through
the worker's copier; a store copies what the engine's kernels queued before it wrote (it waits for them on the
device, not on the engine's thread), and a load reported done has its bytes in the cache. Then the copier's pipeline
itself (issue 34 item 5): chunks through staging buffers taken in turn, gathered and scattered by the row kernel
(where Triton imports) or by torch, host copies on a second stream, jobs queued back to back over the same buffers:
every byte where it belongs. tests/unit/test_offload_host.py and tests/unit/test_offload_device_copy.py run the same
logic on CPU tensors; the rate against a pinned copy is ``pd-transfer bench offload --device cuda``'s
(scripts/test-gpu)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from vllm_gpu_caches import LAYERS, geometry, layer_caches

from pd_transfer.integrations.vllm_cache_layouts import block_rows
from pd_transfer.offload import HostPool, PageFormat, TierBlocks, TransferJob, TransferWorker, chain_block_keys
from pd_transfer.offload.device_copy import BlockCopier
from pd_transfer.rows import kernel_available
from pd_transfer.rows.by_torch import FEW_RUNS
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


WIDTHS = (4096, 8192, 4096, 1040)  # three page widths; 1040 bytes: rows aligned to 16 bytes, not 4 KiB
PATHS = [
    pytest.param(
        True,
        id="row-kernel",
        marks=pytest.mark.skipif(not kernel_available(torch.device("cuda")), reason="needs Triton"),
    ),
    pytest.param(False, id="torch"),
]


def strided_caches(seed: int) -> list[torch.Tensor]:
    """Random pages on the GPU, each tensor's rows 512 bytes further apart than their length."""
    generator = torch.Generator().manual_seed(seed)
    wide = [torch.randint(0, 256, (BLOCKS, w + 512), dtype=torch.uint8, generator=generator) for w in WIDTHS]
    return [t.to("cuda")[:, :w] for t, w in zip(wide, WIDTHS, strict=True)]


def host_block(caches: list[torch.Tensor], block: int) -> torch.Tensor:
    return torch.cat([t[block].cpu() for t in caches])


@pytest.mark.parametrize("one_kernel", PATHS)
@pytest.mark.parametrize(("staging_blocks", "buffers"), [(2, 2), (7, 2), (9, 3)])
def test_the_pipeline_stores_and_loads_every_byte(one_kernel: bool, staging_blocks: int, buffers: int) -> None:
    source, target = strided_caches(1), strided_caches(2)
    before = [t.clone() for t in target]
    block_bytes = sum(WIDTHS)
    host = torch.full((40, block_bytes), 0xA5, dtype=torch.uint8, pin_memory=True)
    staging = staging_blocks * block_bytes
    storing = BlockCopier(source, staging_bytes=staging, buffers=buffers, one_kernel=one_kernel)
    loading = BlockCopier(target, staging_bytes=staging, buffers=buffers, one_kernel=one_kernel)
    sources = [5, 40, 3, 4, 17, 30, 31, 0, 12, 13, 14, 15, 16, 44, 2, 1, 47]
    rows = [0, 1, 2, 3, 9, 10, 11, 30, 20, 21, 22, 23, 24, 39, 5, 6, 38]  # runs of consecutive rows and single ones
    targets = [1, 2, 47, 9, 10, 11, 20, 6, 30, 31, 32, 33, 34, 35, 0, 3, 4]
    stored = storing.to_host(sources, rows, host, storing.mark_ready())
    assert stored is not None
    loaded = loading.from_host(rows, targets, host, stored)  # queued behind the store on the device, not the host
    assert loaded is not None
    loaded.synchronize()
    for s, r in zip(sources, rows, strict=True):
        assert torch.equal(host[r], host_block(source, s)), f"host row {r}"
    assert bool((host[[r for r in range(40) if r not in rows]] == 0xA5).all())
    for t, s in zip(targets, sources, strict=True):
        assert torch.equal(host_block(target, t), host_block(source, s)), f"block {t}"
    others = [b for b in range(BLOCKS) if b not in targets]
    assert all(torch.equal(a[others], b[others]) for a, b in zip(target, before, strict=True))
    calls = len(storing.chunks(rows)) * (len(set(WIDTHS)) if one_kernel else len(WIDTHS))
    if one_kernel:  # one launch per page width and chunk
        assert storing.gather_calls == calls
    else:  # per tensor and chunk, a gather, or a slice copy per run where the chunk's blocks make few runs
        assert calls <= storing.gather_calls <= calls * FEW_RUNS


@pytest.mark.parametrize("one_kernel", PATHS)
def test_jobs_queued_back_to_back_share_the_buffers_safely(one_kernel: bool) -> None:
    """Stores and a load through one copier (one-block chunks, two buffers) queued without waiting in between: each
    job's staging writes wait for the buffer's last reader, the load's scatter for its rows' copy in."""
    cache = strided_caches(3)
    expected = {b: host_block(cache, b) for b in range(BLOCKS)}
    host = torch.zeros((16, sum(WIDTHS)), dtype=torch.uint8, pin_memory=True)
    copier = BlockCopier(cache, staging_bytes=1, one_kernel=one_kernel)
    events = [
        copier.to_host([1, 2, 3, 4, 5], [0, 1, 2, 3, 4], host, copier.mark_ready()),
        copier.to_host([6, 7, 8], [10, 12, 14], host),
        copier.from_host([0, 1, 2, 12], [20, 21, 22, 23], host),  # blocks 1, 2, 3 and 7 again, as 20 to 23
        copier.to_host([20, 21, 22, 23], [5, 6, 7, 8], host),
    ]
    last = events[-1]
    assert last is not None
    last.synchronize()
    assert all(event is not None and event.query() for event in events)
    for block, row in [(1, 0), (5, 4), (6, 10), (8, 14), (1, 5), (2, 6), (3, 7), (7, 8)]:
        assert torch.equal(host[row], expected[block]), f"host row {row}"
    for block, was in [(20, 1), (21, 2), (22, 3), (23, 7)]:
        assert torch.equal(host_block(cache, block), expected[was]), f"block {block}"
