"""A pull's rows through the IPC engine and the row mover, on CPU tensors: every fused case of a direct plan (block
16 -> 64 and 64 -> 16, TP 2 -> 1 and 1 -> 2, HND <-> NHD, and two at once) moved by the real Triton kernel under
Triton's interpreter and by torch's fallback, each element by element against the planner's oracle (every token's
code in place, every other byte untouched, padding included); the same check failing when a row's address or the
kernel's mask is broken on purpose; and the calls a 16,384-row pull makes: one kernel launch for all its rows, at
most two torch calls per pair of storages, never one per row, run or plane. tests/gpu/test_gpu_row_copy.py runs the
compiled kernel on a GPU against the fallback."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_specs import kv_layout as kv_layout_of
from row_pulls import FUSED, launch_with_mask_off_by, pulls, shifted, storage_pairs
from topology_sim import Scenario

from pd_transfer.connector.cache import KVCache
from pd_transfer.rows import by_row_size, move_rows
from pd_transfer.rows.by_torch import FEW_RUNS
from pd_transfer.same_host.ipc_engine import IpcSource, storages
from pd_transfer.sim.peer import fill_pattern
from pd_transfer.sim.verify import received_correctly
from pd_transfer.spec import ModelFingerprint
from pd_transfer.topology import PeerPlan


@pytest.mark.parametrize("case", FUSED.values(), ids=FUSED.keys())
@pytest.mark.parametrize("one_kernel", [True, False], ids=["kernel", "torch"])
def test_every_fused_case_lands_in_place_equal_to_the_oracle(case: Scenario, one_kernel: bool) -> None:
    for pull in pulls(case):
        calls = move_rows(pull.copies, torch.from_numpy, one_kernel=one_kernel)
        pull.check()
        if one_kernel:
            assert calls == 1  # every row of the request, every source, in one launch
        else:  # per pair of storages, a slice copy per run where they are few, else a gather and a scatter at most
            assert 1 <= calls <= max(FEW_RUNS, 2) * storage_pairs(pull.copies)


@pytest.mark.parametrize("case", ["block-16-to-64", "tp-2-to-1", "HND-to-NHD"])
def test_a_row_read_one_element_off_fails_the_oracle(case: str) -> None:
    (pull, *_) = pulls(FUSED[case])
    row = len(pull.copies[0].addresses.sources) // 2
    move_rows(shifted(pull.copies, row, by_elements=1), torch.from_numpy, one_kernel=True)
    with pytest.raises(AssertionError, match="elements wrong"):
        pull.check()


@pytest.mark.parametrize("off_by", [-1, 1], ids=["tail-dropped", "end-run-past"])
@pytest.mark.parametrize("case", ["block-64-to-16", "tp-2-to-1", "NHD-to-HND"])
def test_the_kernel_with_its_mask_off_by_one_element_fails_the_oracle(case: str, off_by: int) -> None:
    (pull, *_) = pulls(FUSED[case])
    launch_with_mask_off_by(pull.copies, off_by)
    with pytest.raises(AssertionError, match="elements wrong"):
        pull.check()
    fixed = pulls(FUSED[case])[0]  # the same harness with the mask as the mover launches it: right
    launch_with_mask_off_by(fixed.copies, 0)
    fixed.check()


def test_a_16384_row_pull_is_one_launch_of_the_kernel_and_at_most_two_torch_calls_per_storage_pair() -> None:
    fingerprint = ModelFingerprint(model="rows", dtype="bfloat16", num_layers=32, total_num_kv_heads=1, head_size=16)
    layout = kv_layout_of(fingerprint, 16, 1, 0, "HND")
    blocks, request = 300, 256  # 32 layers x K, V x 256 blocks: 16,384 rows of 512 bytes
    prefill = KVCache.allocate(layout, blocks)
    fill_pattern(prefill, seed=2)
    local = KVCache.allocate(layout, blocks)
    rng = np.random.default_rng(4)
    remote_ids = rng.choice(blocks, request, replace=False).tolist()
    local_ids = rng.choice(blocks, request, replace=False).tolist()
    plan = PeerPlan.build(layout, list(local.regions), {0: layout}, {0: list(prefill.regions)})
    (source,) = plan.sources
    segments = storages(prefill.tensors)
    opened = IpcSource.open(segments, [s.data_ptr() for s in segments], source, storages(local.tensors))
    copies = opened.copies(*source.indices(remote_ids, local_ids, request * 16))
    (kernel_rows,) = by_row_size(copy.addresses for copy in copies)
    assert kernel_rows.rows == 16_384  # one launch moves all of them
    pairs = storage_pairs(copies)
    assert pairs <= len(segments) * len(storages(local.tensors))
    assert move_rows(copies, torch.from_numpy, one_kernel=False) <= 2 * pairs
    assert received_correctly(local, local_ids, [prefill], remote_ids, request * 16)
