"""The pipelined staged read (connector/transports/nixl/staged_reads.py) with reads done by ``memmove`` over the
descriptor rows.

Each lane runs on a thread of its own, as on the read lanes; caches are the encoded caches of ``topology_sim``
(through ``staged_pulls``), so every received element is checked against what the prefill held, and every byte
outside the request against its sentinel. Cases: a block 16 -> 64 regroup (one source), TP 2 -> 1 with a layout
permute (two sources into one staged block), chunk boundaries of one plane block and of several, a read that
fails in the middle of a request, a read of a prefill cache freed under its rows (refused, naming them: the
reads check every row against the live registered memory first), and the GPU timing stress's CPU side (lanes started
in a random order; its GPU sleeps skipped). The CUDA twin is in tests/gpu/test_gpu_staged_reads.py.
"""

from __future__ import annotations

import itertools
import threading

import numpy as np
import pytest
import torch
from staged_pulls import CASES, TimingStress, UnregisteredMemory, memmove_read, run_lanes, staged_pull
from topology_sim import check_received

from pd_transfer.connector.transports.nixl.staged_reads import LaneTotals
from pd_transfer.transfer.agent import DescriptorList, ReadStats
from pd_transfer.transfer.errors import TransferError


@pytest.mark.parametrize("lanes", [1, 3])
@pytest.mark.parametrize("group_blocks", [1, 3], ids=["one-block-chunks", "three-block-chunks"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_lanes_read_and_restage_every_chunk(case: str, group_blocks: int, lanes: int) -> None:
    pull = staged_pull(CASES[case], group_blocks)
    assert pull.chunks.count > lanes  # every lane takes several chunks, through its slot groups in turn
    totals = run_lanes(pull.work, lanes)
    check_received(pull.local, pull.local_ids, pull.tokens)
    sources = pull.work.sources
    assert sum(t.descriptors for t in totals) == sum(len(s.staging_rows) for s in pull.chunks.sources)
    assert sum(t.bytes for t in totals) == sum(
        int(source.remote.row_lengths[rows.remote_rows].sum())
        for source, rows in zip(sources, pull.chunks.sources, strict=True)
    )
    assert max(t.reads_done for t in totals) > 0  # lanes take chunks as they come free: some may take none


@pytest.mark.parametrize("case", sorted(CASES))
def test_chunks_cover_each_plane_block_once_within_a_slot_group(case: str) -> None:
    pull = staged_pull(CASES[case], 3)
    chunks = pull.chunks
    slots = chunks.slots
    assert slots == 3 and chunks.count == -(-len(chunks.block_ids) // slots)
    for rows in chunks.sources:
        assert rows.bounds[0] == 0 and rows.bounds[-1] == len(rows.staging_rows)
        assert (np.diff(rows.bounds) >= 0).all()
        assert (rows.staging_rows >= 0).all() and (rows.staging_rows < rows.group_rows).all()
        assert len(np.unique(rows.remote_rows)) == len(rows.remote_rows)
        for chunk in range(chunks.count):  # within a chunk no two rows land on the same staging row
            mine = rows.staging_rows[rows.bounds[chunk] : rows.bounds[chunk + 1]]
            assert len(np.unique(mine)) == len(mine)
    planes_seen = set()
    for chunk, segments in enumerate(chunks.segments):
        size = len(chunks.block_ids_of(chunk))
        assert segments[0][1] == 0 and segments[-1][2] == size  # segments partition the chunk's slots
        assert all(a[2] == b[1] for a, b in itertools.pairwise(segments))
        for plane, first, end in segments:
            planes_seen.update((plane, int(block)) for block in chunks.block_ids_of(chunk)[first:end])
    expected_blocks = len(pull.local_ids) * len(pull.local.planes())
    assert len(planes_seen) == expected_blocks  # each (plane, block) of the request exactly once


def test_a_read_failing_mid_request_stops_every_lane_and_writes_nothing_else() -> None:
    pull = staged_pull(CASES["tp_2_to_1_nhd_to_hnd"], 1)
    before = [buffer.clone() for buffer in pull.local.buffers]
    calls = 0
    lock = threading.Lock()
    fail_at = pull.chunks.count // 2  # reads made before it land; the one at it fails

    def failing_read(
        local: DescriptorList, local_rows: np.ndarray, remote: DescriptorList, remote_rows: np.ndarray, timeout_s: float
    ) -> ReadStats:
        nonlocal calls
        with lock:
            calls += 1
            mine = calls
        if mine == fail_at:
            raise TransferError("prefill-1: connection reset while reading")
        return memmove_read(local, local_rows, remote, remote_rows, timeout_s)

    with pytest.raises(TransferError, match="connection reset"):
        run_lanes(pull.work, 3, failing_read)
    assert pull.work.stop.is_set()
    reads_per_chunk = len(pull.work.sources)
    assert calls < pull.chunks.count * reads_per_chunk  # the lanes stopped: not every chunk was read
    assert calls <= fail_at + 2 * reads_per_chunk  # at most the chunk each other lane had taken
    request = set(pull.local_ids)
    for buffer, old in zip(pull.local.buffers, before, strict=True):  # nothing outside the request's blocks
        for block in range(buffer.shape[0]):
            if block not in request:
                assert torch.equal(buffer[block], old[block])


def test_a_lane_taking_no_chunk_reports_nothing() -> None:
    pull = staged_pull(CASES["block_16_to_64"], 64, tokens=20)
    assert pull.chunks.count == 1
    totals = run_lanes(pull.work, 2)
    assert sorted(t.bytes > 0 for t in totals) == [False, True]
    idle = next(t for t in totals if t.bytes == 0)
    assert idle.reads_done == 0 and idle.restage_seconds == 0
    check_received(pull.local, pull.local_ids, pull.tokens)


def test_a_request_of_no_tokens_reads_and_writes_nothing() -> None:
    pull = staged_pull(CASES["tp_2_to_1_nhd_to_hnd"], 1, tokens=0)
    before = [buffer.clone() for buffer in pull.local.buffers]
    assert pull.chunks.count == 0 and pull.chunks.block_ids.numel() == 0
    totals = run_lanes(pull.work, 1)
    assert totals == [LaneTotals()]
    assert all(torch.equal(a, b) for a, b in zip(pull.local.buffers, before, strict=True))


def test_a_read_of_a_prefill_cache_freed_under_its_rows_is_refused_before_a_byte_is_copied() -> None:
    """What the harness did before its pulls kept their prefill caches (issue 34): the rows outlived the memory
    they name. The read now fails at once, naming them, instead of copying freed bytes into the decode's blocks."""
    pull = staged_pull(CASES["tp_2_to_1_block_8_to_32"], 1)
    before = [buffer.clone() for buffer in pull.local.buffers]
    rank, freed = pull.remotes.popitem()
    assert rank == 1 and len(pull.remotes) == 1  # rank 0's cache stays: its reads pass the check
    del freed  # the last reference: its buffers are freed, and with them their registrations
    with pytest.raises(UnregisteredMemory, match=r"remote rows lie outside every live registered region"):
        run_lanes(pull.work, 2)
    assert pull.work.stop.is_set()
    assert all(torch.equal(a, b) for a, b in zip(pull.local.buffers, before, strict=True))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("case", sorted(CASES))
def test_lanes_started_in_a_random_order_under_the_timing_stress_read_every_chunk(case: str, seed: int) -> None:
    """The timing stress of the CUDA twin on the CPU: lanes start in its random order, its GPU sleeps are skipped,
    and the reads are the plain ones."""
    stress = TimingStress(seed)
    pull = staged_pull(CASES[case], 1, stress=stress)
    assert stress.stressed(memmove_read, pull.work.staging.device) is memmove_read  # nothing queued to perturb
    totals = run_lanes(pull.work, 3, stress=stress)
    check_received(pull.local, pull.local_ids, pull.tokens)
    assert stress.sleeps == 0 and len(stress.orders) == 1 and sorted(stress.orders[0]) == [0, 1, 2]
    assert len(totals) == 3 and sum(t.descriptors for t in totals) == sum(
        len(rows.staging_rows) for rows in pull.chunks.sources
    )


def test_the_timing_stress_draws_other_lane_orders_from_other_seeds() -> None:
    orders = {tuple(TimingStress(seed).lane_order(3)) for seed in range(12)}
    assert len(orders) > 1 and all(sorted(order) == [0, 1, 2] for order in orders)
