"""The fix-up kernels and staging fences on a plane's own device: on the CPU here, and their CUDA twins (marked
``gpu``, skipped without CUDA) checked against the CPU's results."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pd_transfer.connector.slot_fences import SlotFences, after_mark, mark
from pd_transfer.connector.staging import StagingArea
from pd_transfer.topology import Restage, StagedSource, restage_blocks
from pd_transfer.topology.postprocess import index_on, scatter_staged

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SPECS = {
    "block_16_to_64": Restage("HND", "HND", 8, 64, 16, 128, (StagedSource(0, 8),)),
    "tp_2_to_1_nhd_to_hnd": Restage("NHD", "HND", 4, 16, 16, 64, (StagedSource(0, 2), StagedSource(2, 2))),
    "block_8_to_32_hnd_to_nhd": Restage("HND", "NHD", 2, 32, 8, 32, (StagedSource(0, 2),)),
}


class Registrations:
    def register_spans(self, spans: list[tuple[int, int]]) -> None:
        assert spans


def random_blocks(count: int, spec: Restage, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**15), 2**15, (count, spec.block_elements), dtype=torch.int16, generator=generator)


def test_fences_on_the_cpu_order_nothing_and_give_each_lane_one_group() -> None:
    fences = SlotFences(torch.device("cpu"), 8)
    assert fences.on_host and fences.depth == 1 and fences.lanes == 8
    assert [list(fences.lane_groups(lane)) for lane in (0, 7)] == [[0], [7]]
    with pytest.raises(ValueError, match="lane 8 of 8"):
        fences.lane_groups(8)
    with fences.lane(3):
        fences.filled(3)
        fences.wait_free(3)  # nothing queued: returns at once
    assert mark(torch.device("cpu")) is None
    after_mark(None)


def test_staging_area_on_the_cpu_holds_groups_of_whole_plane_blocks() -> None:
    area = StagingArea(Registrations(), 4096, 3 * 4096 + 100, torch.bfloat16, groups=4)  # type: ignore[arg-type]
    assert area.slots == 3 and area.blocks.shape == (12, 2048) and area.device.type == "cpu"
    rows = area.descriptor_rows(np.array([0, 2048]), 2048)
    assert rows.shape == (24, 3) and int(rows[3, 0]) - int(rows[0, 0]) == 4096 + 2048
    one = StagingArea(Registrations(), 4096, 1, torch.bfloat16, groups=2)  # type: ignore[arg-type]
    assert one.slots == 1  # at least one plane block per group


@pytest.mark.gpu
@cuda
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


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("name", sorted(SPECS))
def test_restage_blocks_on_cuda_matches_the_cpu(name: str) -> None:
    spec = SPECS[name]
    plane = random_blocks(10, spec, 3)
    want = plane.clone()
    restage_blocks(want, torch.tensor([2, 5, 6]), spec, chunk_bytes=1)
    got = plane.cuda()
    restage_blocks(got, index_on(np.array([2, 5, 6]), got.device), spec, chunk_bytes=1)
    assert torch.equal(got.cpu(), want)


@pytest.mark.gpu
@cuda
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
