"""The fix-up kernels' staging and fences on a plane's own device, here the CPU; their CUDA twins, checked against
the CPU's results, are in tests/gpu/test_gpu_staged_reads.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from staged_pulls import Registrations

from pd_transfer.connector.transports.nixl.slot_fences import SlotFences, after_mark, mark
from pd_transfer.connector.transports.nixl.staging import StagingArea
from pd_transfer.spec import HOST


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
    agent = Registrations()
    area = StagingArea(agent, 4096, 3 * 4096 + 100, torch.bfloat16, groups=4)  # type: ignore[arg-type]
    assert area.slots == 3 and area.blocks.shape == (12, 2048) and area.device.type == "cpu"
    assert agent.places == [HOST] == [area.place]
    rows = area.descriptor_rows(np.array([0, 2048]), 2048)
    assert rows.shape == (24, 3) and int(rows[3, 0]) - int(rows[0, 0]) == 4096 + 2048
    one = StagingArea(Registrations(), 4096, 1, torch.bfloat16, groups=2)  # type: ignore[arg-type]
    assert one.slots == 1  # at least one plane block per group
