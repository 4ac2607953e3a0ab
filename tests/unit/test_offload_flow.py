"""The offload pieces together, as an engine adapter drives them: one engine stores through its manager and
worker, another finds the blocks in the shared directory and loads them byte-exact; a damaged file fails the
load and is invalidated; the directory bound holds with two writers; the benchmark runs and verifies."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pd_transfer.bench.offload.tiers import Shape, run
from pd_transfer.offload import (
    BlocksEvicted,
    BlocksStored,
    DirectoryTier,
    HostPool,
    OffloadManager,
    OffloadMetrics,
    PageFormat,
    TransferJob,
    TransferResult,
    TransferWorker,
    chain_block_keys,
)
from pd_transfer.spec import ModelFingerprint

MODEL = ModelFingerprint(model="m", dtype="bfloat16", num_layers=2, total_num_kv_heads=2, head_size=8)
FORMAT = PageFormat(fingerprint=MODEL, page_bytes=(8192, 4096), block_size=16)
TOKENS = list(range(1000, 1000 + 16 * 6))


def engine(seed: int, blocks: int = 16) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (blocks, size), dtype=torch.uint8, generator=generator) for size in FORMAT.page_bytes]


def one(worker: TransferWorker, job: TransferJob) -> TransferResult:
    assert worker.submit(job)
    results = worker.poll(timeout=30)
    assert len(results) == 1, "the worker did not finish within 30 s"
    return results[0]


def test_a_prefix_stored_by_one_engine_is_loaded_by_another(tmp_path: Path) -> None:
    keys = chain_block_keys(MODEL, TOKENS, 16)
    metrics = OffloadMetrics()
    cache_a, cache_b = engine(1), engine(2)
    tier_a = DirectoryTier(tmp_path, FORMAT, max_bytes=1 << 30, metrics=metrics)
    tier_b = DirectoryTier(tmp_path, FORMAT, max_bytes=1 << 30, metrics=metrics)
    manager_a = OffloadManager("disk", 1 << 20, FORMAT.block_bytes, probe=tier_a.exists)
    manager_b = OffloadManager("disk", 1 << 20, FORMAT.block_bytes, probe=tier_b.exists, metrics=metrics)
    worker_a, worker_b = TransferWorker(cache_a, tier_a, metrics=metrics), TransferWorker(cache_b, tier_b)
    try:
        plan = manager_a.prepare_store(keys)
        assert plan is not None
        stored = one(worker_a, TransferJob(1, "store", (3, 4, 5, 6, 7, 8), plan.blocks))
        manager_a.complete_store(plan.blocks.keys, success=stored.ok)
        assert manager_a.take_events() == [BlocksStored("disk", tuple(keys))]

        assert manager_b.lookup(keys) == 6  # adopted from the shared directory
        blocks = manager_b.prepare_load(keys[:4])
        loaded = one(worker_b, TransferJob(2, "load", (10, 11, 12, 13), blocks))
        manager_b.complete_load(keys[:4])
        assert loaded.ok
        for a, b in zip(cache_a, cache_b, strict=True):
            assert torch.equal(b[10:14], a[3:7])

        tier_b.path_of(keys[5]).write_bytes(b"torn")
        blocks = manager_b.prepare_load(keys[4:])
        failed = one(worker_b, TransferJob(3, "load", (14, 15), blocks))
        manager_b.complete_load(keys[4:])
        assert not failed.ok and failed.failed_keys == (keys[5],)
        assert manager_b.invalidate(failed.failed_keys) == [keys[5]]
        assert manager_b.lookup(keys) == 5 and not tier_b.exists(keys[5])
        assert isinstance(manager_b.take_events()[-1], BlocksEvicted)
    finally:
        worker_a.close()
        worker_b.close()
    value = metrics.registry.get_sample_value
    assert value("pd_transfer_offload_rejected_blocks_total", {"tier": "disk", "reason": "truncated"}) == 1
    assert value("pd_transfer_offload_stored_bytes_total", {"tier": "disk"}) == 6 * FORMAT.block_bytes
    assert value("pd_transfer_offload_hits_total", {"tier": "disk"}) == 6 + 5


def test_the_bound_holds_with_two_writers_on_one_directory(tmp_path: Path) -> None:
    keys = chain_block_keys(MODEL, list(range(16 * 40)), 16)
    cache = engine(3, blocks=40)
    pages = [[t[b].numpy() for t in cache] for b in range(40)]
    first = DirectoryTier(tmp_path, FORMAT, max_bytes=10 * (64 + FORMAT.block_bytes))
    second = DirectoryTier(tmp_path, FORMAT, max_bytes=first.max_bytes)
    first.store(keys[0], pages[0])
    for index in range(1, 11):
        second.store(keys[index], pages[index])  # 11 files now; the second writer sweeps as it goes
    for index in range(11, 20):
        (first if index % 2 else second).store(keys[index], pages[index])
    files = list(tmp_path.rglob("*.kvblock"))
    assert len(files) <= 11  # within the bound plus one writer's 10% share
    assert first.exists(keys[19]) and second.exists(keys[18])


def test_the_host_pool_closes_once() -> None:
    pool = HostPool.create(FORMAT, 4 * FORMAT.block_bytes)
    pool.close()
    pool.close()


def test_the_benchmark_runs_verifies_and_names_no_machine_path(tmp_path: Path) -> None:
    shape = Shape(num_tensors=2, page_bytes=4096, blocks=4, engine_blocks=8)
    result = run(shape, repeats=1, directory=str(tmp_path), group_blocks=2)
    assert result["verified"] and result["end_to_end"] is None
    per_block = result["disk"]["per_block"]  # the layout before groups, measured beside them
    assert result["disk"]["group_blocks"] == 2 and all(per_block[c]["verified"] for c in ("scattered", "full_tier"))
    for key in ("store_ratio_vs_memcpy", "load_ratio_vs_memcpy"):
        assert result["host"][key] > 0
    for key in ("store_ratio_vs_file_write", "load_ratio_vs_file_read"):
        assert result["disk"][key] > 0
    assert result["host_copy_gb_s"] > 0 and result["disk"]["filesystem"]
    assert str(tmp_path) not in json.dumps(result) and not list(tmp_path.iterdir())
