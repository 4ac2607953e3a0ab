"""One kernel per pull (issue 34 item 2), what CI can check without a GPU: a pull's rows, read through a direct plan
(every row in its final place, no fix-up after), located in the prefill's segments and ours, and copied two ways on
CPU tensors: by the kernel's reference (:func:`copy_rows_on_host`: the very addresses the kernel is given, copied
row by row) and by torch's fallback (a gather and a scatter per pair of segments); both equal to the prefill's KV,
element by element, in every fused regroup case. And the calls a 16,384-row pull makes: one kernel launch for all
its rows, at most two torch calls per pair of segments, never one per row, run or plane. tests/gpu/test_gpu_row_copy.py
runs the Triton kernel itself against the fallback."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_specs import kv_layout as kv_layout_of

from pd_transfer.connector.cache import KVCache
from pd_transfer.same_host.ipc_engine import ChunkCopy, IpcSource, rows_by_size, run_copies, storages
from pd_transfer.sim.peer import fill_pattern
from pd_transfer.sim.verify import received_correctly
from pd_transfer.spec import KVCacheLayout, ModelFingerprint
from pd_transfer.topology import PeerPlan
from pd_transfer.topology.row_copy import RowAddresses, copy_rows, copy_rows_on_host, kernel_available

FINGERPRINT = ModelFingerprint(model="rows-llama", dtype="bfloat16", num_layers=3, total_num_kv_heads=4, head_size=16)
BLOCKS = 24
TOKENS = 70


def layout(
    tp: int, rank: int, block_size: int, kv_layout: str, fingerprint: ModelFingerprint = FINGERPRINT
) -> KVCacheLayout:
    return kv_layout_of(fingerprint, block_size, tp, rank, kv_layout)


def direct_copies(
    prefills: list[KVCache], decode: KVCache, remote_ids: list[int], local_ids: list[int], tokens: int
) -> list[ChunkCopy]:
    """The copies of one request, per source, through the plan the IPC path reads by (rows into place)."""
    plan = PeerPlan.build(
        decode.layout,
        list(decode.regions),
        {cache.layout.tp_rank: cache.layout for cache in prefills},
        {cache.layout.tp_rank: list(cache.regions) for cache in prefills},
        min_direct_run_bytes=0,
    )
    assert plan.strategy == "direct" and plan.postprocess is None  # nothing is fixed up after the copy
    by_rank = {cache.layout.tp_rank: cache for cache in prefills}
    copies = []
    for source in plan.sources:
        segments = storages(by_rank[source.remote_rank].tensors)
        opened = IpcSource.open(segments, [s.data_ptr() for s in segments], source, storages(decode.tensors))
        local_rows, remote_rows = source.indices(remote_ids, local_ids, tokens)
        copies += opened.copies(local_rows, remote_rows)
    return copies


def prefill_caches(tp: int, block_size: int, kv_layout: str) -> list[KVCache]:
    caches = []
    for rank in range(tp):
        cache = KVCache.allocate(layout(tp, rank, block_size, kv_layout), BLOCKS)
        fill_pattern(cache, seed=5)
        caches.append(cache)
    return caches


CASES = [
    ((1, 16, "HND"), (1, 16, "HND")),
    ((1, 16, "HND"), (1, 64, "HND")),
    ((1, 32, "HND"), (1, 16, "HND")),
    ((1, 16, "NHD"), (1, 16, "HND")),
    ((1, 16, "HND"), (1, 32, "NHD")),
    ((2, 16, "HND"), (1, 16, "HND")),
    ((2, 8, "HND"), (1, 32, "HND")),
    ((1, 16, "HND"), (2, 16, "NHD")),
]
IDS = ["same", "block-16-to-64", "block-32-to-16", "NHD-to-HND", "HND-to-NHD-block-16-to-32", "tp2-to-1",
       "tp2-to-1-block-8-to-32", "tp1-to-2-NHD"]  # fmt: skip


@pytest.mark.parametrize(("prefill", "decode"), CASES, ids=IDS)
@pytest.mark.parametrize("how", ["kernel-reference", "torch"])
def test_every_fused_case_lands_in_place_equal_to_the_prefill_s_kv(
    prefill: tuple[int, int, str], decode: tuple[int, int, str], how: str
) -> None:
    prefills = prefill_caches(*prefill)
    rng = np.random.default_rng(11)
    for decode_rank in range(decode[0]):
        local = KVCache.allocate(layout(decode[0], decode_rank, decode[1], decode[2]), BLOCKS)
        remote_ids = rng.choice(BLOCKS, -(-TOKENS // prefill[1]), replace=False).tolist()
        local_ids = rng.choice(BLOCKS, -(-TOKENS // decode[1]), replace=False).tolist()
        copies = direct_copies(prefills, local, remote_ids, local_ids, TOKENS)
        if how == "torch":
            run_copies(copies, torch.from_numpy)
        else:
            for rows in rows_by_size(copies):
                copy_rows_on_host(rows)
        assert received_correctly(local, local_ids, prefills, remote_ids, TOKENS)


def test_a_16384_row_pull_is_one_launch_of_the_kernel_and_at_most_two_torch_calls_per_segment_pair() -> None:
    fingerprint = ModelFingerprint(model="rows", dtype="bfloat16", num_layers=32, total_num_kv_heads=1, head_size=16)
    blocks, request = 300, 256  # 32 layers x K, V x 256 blocks: 16,384 rows of 512 bytes
    prefill = KVCache.allocate(layout(1, 0, 16, "HND", fingerprint), blocks)
    fill_pattern(prefill, seed=2)
    local = KVCache.allocate(layout(1, 0, 16, "HND", fingerprint), blocks)
    rng = np.random.default_rng(4)
    remote_ids = rng.choice(blocks, request, replace=False).tolist()
    local_ids = rng.choice(blocks, request, replace=False).tolist()
    copies = direct_copies([prefill], local, remote_ids, local_ids, request * 16)
    assert sum(len(c.source_chunks) for c in copies) == 16_384
    pairs = len(copies)
    assert pairs <= len(storages(prefill.tensors)) * len(
        storages(local.tensors)
    )  # one per pair of storages the rows touch
    kernel_rows = rows_by_size(copies)
    assert len(kernel_rows) == 1 and kernel_rows[0].rows == 16_384  # one launch moves all of them
    assert run_copies(copies, torch.from_numpy) <= 2 * pairs
    assert received_correctly(local, local_ids, [prefill], remote_ids, request * 16)


def test_row_addresses_take_the_widest_element_their_alignment_allows() -> None:
    rows = RowAddresses(np.array([0x1000, 0x2000], dtype=np.int64), np.array([0x3000, 0x4008], dtype=np.int64), 64)
    assert rows.element_bytes() == 8 and rows.nbytes == 128
    odd = RowAddresses(np.array([0x1002], dtype=np.int64), np.array([0x3000], dtype=np.int64), 64)
    assert odd.element_bytes() == 2
    assert RowAddresses(np.array([0x1000], dtype=np.int64), np.array([0x3000], dtype=np.int64), 6).element_bytes() == 2
    with pytest.raises(ValueError, match="one address per row"):
        RowAddresses(np.zeros(2, dtype=np.int64), np.zeros(3, dtype=np.int64), 64)
    with pytest.raises(ValueError, match="rows of one size only"):
        RowAddresses.concat([rows, RowAddresses(rows.sources, rows.targets, 32)])


def test_the_kernel_is_used_only_on_cuda_with_triton_and_says_so_elsewhere() -> None:
    assert not kernel_available(torch.device("cpu"))
    rows = RowAddresses(np.array([0], dtype=np.int64), np.array([0], dtype=np.int64), 8)
    if not kernel_available(torch.device("cuda")):
        with pytest.raises(RuntimeError, match="needs Triton"):
            copy_rows(rows, torch.from_numpy)
    assert copy_rows(RowAddresses(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), 8), torch.from_numpy) == 0
