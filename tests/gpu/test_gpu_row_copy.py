"""On a GPU with Triton: the row mover's kernel (pd_transfer.rows) copies a pull's rows in one launch, equal to
torch's gather and scatter of the same rows and to the prefill's KV, element by element, in every fused regroup case
(rows of whole blocks, 4 KiB head slices, TP head slices, a head's token for a layout change); and a 16,384-row pull
of 32 KiB rows (512 MiB) is one launch. tests/unit/test_row_copy.py runs the same kernel under Triton's interpreter on
CPU tensors against the planner's oracle. Skipped
without CUDA or Triton."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from engine_specs import kv_layout as kv_layout_of

from pd_transfer.connector.cache import KVCache
from pd_transfer.rows import RowCopy, by_row_size, kernel_available, launch_rows, move_rows
from pd_transfer.same_host.ipc_engine import IpcSource, storages
from pd_transfer.sim.peer import fill_pattern
from pd_transfer.sim.verify import received_correctly
from pd_transfer.spec import KVCacheLayout, ModelFingerprint
from pd_transfer.topology import PeerPlan

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton"),
]

FINGERPRINT = ModelFingerprint(model="gpu-rows", dtype="bfloat16", num_layers=4, total_num_kv_heads=8, head_size=128)
BLOCKS = 64
TOKENS = 300


def layout(tp: int, rank: int, block_size: int, kv_layout: str) -> KVCacheLayout:
    return kv_layout_of(FINGERPRINT, block_size, tp, rank, kv_layout)


def upload(values: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(values).to("cuda")


def direct_copies(prefills: list[KVCache], decode: KVCache, remote: list[int], local: list[int]) -> list[RowCopy]:
    plan = PeerPlan.build(
        decode.layout,
        list(decode.regions),
        {c.layout.tp_rank: c.layout for c in prefills},
        {c.layout.tp_rank: list(c.regions) for c in prefills},
        min_direct_run_bytes=0,
    )
    assert plan.postprocess is None
    by_rank = {c.layout.tp_rank: c for c in prefills}
    copies: list[RowCopy] = []
    for source in plan.sources:
        segments = storages(by_rank[source.remote_rank].tensors)
        opened = IpcSource.open(segments, [s.data_ptr() for s in segments], source, storages(decode.tensors))
        copies += opened.copies(*source.indices(remote, local, TOKENS))
    return copies


CASES = [
    ((1, 16, "HND"), (1, 16, "HND")),
    ((1, 16, "HND"), (1, 64, "HND")),
    ((1, 64, "NHD"), (1, 16, "HND")),
    ((2, 16, "HND"), (1, 16, "HND")),
    ((1, 16, "HND"), (2, 16, "NHD")),
]
IDS = ["same", "block16-to-64", "block64-NHD-to-16-HND", "tp2-to-tp1", "tp1-to-tp2-NHD"]


@pytest.mark.parametrize(("prefill", "decode"), CASES, ids=IDS)
def test_the_kernel_equals_torch_and_the_prefill_s_kv(
    prefill: tuple[int, int, str], decode: tuple[int, int, str]
) -> None:
    assert kernel_available(torch.device("cuda"))
    prefills = []
    for rank in range(prefill[0]):
        cache = KVCache.allocate(layout(prefill[0], rank, prefill[1], prefill[2]), BLOCKS, device="cuda")
        fill_pattern(cache, seed=3)
        prefills.append(cache)
    rng = np.random.default_rng(5)
    for rank in range(decode[0]):
        remote = rng.choice(BLOCKS, -(-TOKENS // prefill[1]), replace=False).tolist()
        local = rng.choice(BLOCKS, -(-TOKENS // decode[1]), replace=False).tolist()
        by_kernel = KVCache.allocate(layout(decode[0], rank, decode[1], decode[2]), BLOCKS, device="cuda")
        by_torch = KVCache.allocate(layout(decode[0], rank, decode[1], decode[2]), BLOCKS, device="cuda")
        launches = move_rows(direct_copies(prefills, by_kernel, remote, local), upload, one_kernel=True)
        move_rows(direct_copies(prefills, by_torch, remote, local), upload, one_kernel=False)
        torch.cuda.synchronize()
        assert launches == 1
        assert all(torch.equal(a, b) for a, b in zip(by_kernel.tensors, by_torch.tensors, strict=True))
        assert received_correctly(by_kernel, local, prefills, remote, TOKENS)


def test_16384_rows_of_32_kib_are_one_launch_and_land_right() -> None:
    fingerprint = ModelFingerprint(
        model="gpu-rows", dtype="bfloat16", num_layers=32, total_num_kv_heads=8, head_size=128
    )
    shape = KVCacheLayout(fingerprint=fingerprint, tp_size=1, tp_rank=0, block_size=16)  # 32 KiB plane blocks
    prefill = KVCache.allocate(shape, 320, device="cuda")
    fill_pattern(prefill, seed=8)
    decode = KVCache.allocate(shape, 320, device="cuda")
    rng = np.random.default_rng(6)
    remote = rng.choice(320, 256, replace=False).tolist()
    local = rng.choice(320, 256, replace=False).tolist()
    plan = PeerPlan.build(shape, list(decode.regions), {0: shape}, {0: list(prefill.regions)}, min_direct_run_bytes=0)
    (source,) = plan.sources
    segments = storages(prefill.tensors)
    opened = IpcSource.open(segments, [s.data_ptr() for s in segments], source, storages(decode.tensors))
    copies = opened.copies(*source.indices(remote, local, 256 * 16))
    (rows,) = by_row_size(copy.addresses for copy in copies)
    assert (rows.rows, rows.row_bytes) == (16_384, 32_768)
    assert launch_rows([rows], upload) == 1
    torch.cuda.synchronize()
    assert received_correctly(decode, local, [prefill], remote, 256 * 16)
