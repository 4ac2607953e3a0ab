"""The staged read's fix-ups on CUDA (marked ``gpu``, skipped without CUDA): the scatter and restage kernels against
their CPU results, the slot fences on each lane's stream, the staging area registered as the GPU's memory, and the
pipelined staged read with planes and staging on the GPU, plain and under the timing stress (staged_pulls'
``TimingStress``: random GPU sleeps before the block ids move, before each read on a stream of the reader's own and
before each fix-up, lanes started in a random order; ``PD_TRANSFER_STRESS_SEED`` moves its seeds). The CPU tests are
tests/unit/test_device_kernels.py and tests/unit/test_staged_reads.py."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from staged_pulls import (
    CASES,
    HOST_MEMORY,
    SPECS,
    Registrations,
    TimingStress,
    random_blocks,
    run_lanes,
    staged_pull,
    stress_seed,
)
from topology_sim import check_received

from pd_transfer.connector.transports.nixl.slot_fences import SlotFences, mark
from pd_transfer.connector.transports.nixl.staging import StagingArea
from pd_transfer.spec import MemoryPlace
from pd_transfer.topology import restage_blocks
from pd_transfer.topology.postprocess import index_on, scatter_staged
from pd_transfer.transfer.agent import DescriptorList, ReadStats
from pd_transfer.transfer.lanes import LaneRead

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: torch sees no GPU here"),
]


def device_read(staging: StagingArea) -> LaneRead:
    """A READ into a staging area on the GPU: each row copied by torch from host memory (the prefill caches here,
    checked live in :data:`HOST_MEMORY` first) into the staging buffer, on the current stream (the lane's)."""
    buffer = staging.blocks.view(torch.uint8).view(-1)
    start = buffer.data_ptr()

    def read(
        local: DescriptorList, local_rows: np.ndarray, remote: DescriptorList, remote_rows: np.ndarray, timeout_s: float
    ) -> ReadStats:
        HOST_MEMORY.check(remote.rows[remote_rows], "remote")
        for mine, theirs in zip(local_rows.tolist(), remote_rows.tolist(), strict=True):
            length = int(local.rows[mine, 1])
            origin = (ctypes.c_uint8 * length).from_address(int(remote.rows[theirs, 0]))
            offset = int(local.rows[mine, 0]) - start
            buffer[offset : offset + length].copy_(torch.from_numpy(np.ctypeslib.as_array(origin)))
        return ReadStats(int(local.row_lengths[local_rows].sum()), len(local_rows), 0.0, 0.0)

    return read


@pytest.mark.parametrize("name", sorted(SPECS))
def test_scatter_staged_on_cuda_matches_the_cpu(name: str) -> None:
    spec = SPECS[name]
    plane, staged = random_blocks(10, spec, 1), random_blocks(4, spec, 2)
    ids = [7, 0, 3, 9]
    want = plane.clone()
    scatter_staged(want, torch.tensor(ids), staged, spec)
    got = plane.cuda()
    device_ids = index_on(np.array(ids), got.device)
    assert device_ids.is_cuda
    scatter_staged(got, device_ids, staged.cuda(), spec)
    assert torch.equal(got.cpu(), want)
    with pytest.raises(ValueError, match="block_ids is on cpu"):
        scatter_staged(got, torch.tensor(ids), staged.cuda(), spec)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_restage_blocks_on_cuda_matches_the_cpu(name: str) -> None:
    spec = SPECS[name]
    plane = random_blocks(10, spec, 3)
    want = plane.clone()
    restage_blocks(want, torch.tensor([2, 5, 6]), spec, chunk_bytes=1)
    got = plane.cuda()
    restage_blocks(got, index_on(np.array([2, 5, 6]), got.device), spec, chunk_bytes=1)
    assert torch.equal(got.cpu(), want)


def test_fences_on_cuda_wait_for_the_groups_last_fix_up_only() -> None:
    fences = SlotFences(torch.device("cuda", torch.cuda.current_device()), 8)
    assert not fences.on_host and fences.depth == 2 and fences.lanes == 4
    assert list(fences.lane_groups(1)) == [2, 3]
    source = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
    ready = mark(source.device)
    assert ready is not None
    target = torch.empty_like(source)
    with fences.lane(1, after=ready):
        assert torch.cuda.current_stream() != torch.cuda.default_stream()
        target.copy_(source * 2)
        fences.filled(2)
        fences.wait_free(2)
        assert torch.equal(target[:4].cpu(), torch.tensor([0.0, 2.0, 4.0, 6.0]))
    hooked: list[torch.cuda.Stream] = []
    fences.wait_for = hooked.append
    with fences.lane(0):
        pass
    assert len(hooked) == 1 and hooked[0] != torch.cuda.default_stream()


def test_a_staging_area_on_cuda_is_registered_as_the_gpus_memory() -> None:
    agent, index = Registrations(), torch.cuda.current_device()
    area = StagingArea(agent, 4096, 8192, torch.bfloat16, device=f"cuda:{index}")  # type: ignore[arg-type]
    assert area.blocks.is_cuda and agent.places == [MemoryPlace("cuda", index)] == [area.place]


@pytest.mark.parametrize("case", sorted(CASES))
def test_lanes_read_and_restage_on_cuda(case: str) -> None:
    """The twin of the lanes test with planes and staging on the GPU: two slot groups per lane, fenced by events
    on each lane's stream; every lane's fix-ups done when its run returns."""
    pull = staged_pull(CASES[case], 1, device="cuda")
    staging = pull.work.staging
    assert staging.blocks.is_cuda and pull.chunks.block_ids.is_cuda and staging.fences.depth == 2
    run_lanes(pull.work, 3, device_read(staging))
    pull.received()
    check_received(pull.local, pull.local_ids, pull.tokens)


@pytest.mark.parametrize("repeat", range(4))
@pytest.mark.parametrize("group_blocks", [1, 3], ids=["one-block-chunks", "three-block-chunks"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_lanes_read_and_restage_on_cuda_under_timing_stress(case: str, group_blocks: int, repeat: int) -> None:
    """The lanes test with the GPU's timing perturbed (``TimingStress``): fix-ups late on their lanes' streams,
    reads landing from a stream of their own, block ids moved late, lanes started in a random order. Every element
    must still be right: a fence missing between a group's fix-up and the next read into it, or between the block
    ids' copy and the fix-ups, shows here as wrong bytes."""
    stress = TimingStress(stress_seed(repeat))
    pull = staged_pull(CASES[case], group_blocks, device="cuda", stress=stress)
    run_lanes(pull.work, 3, device_read(pull.work.staging), stress)
    pull.received()
    check_received(pull.local, pull.local_ids, pull.tokens)
    assert stress.sleeps > 2 * pull.chunks.count and len(stress.orders) == 1
