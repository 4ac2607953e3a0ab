"""The pipelined staged read (connector/staged_reads.py) with reads done by ``memmove`` over the descriptor rows.

Each lane runs on a thread of its own, as on the read lanes; caches are the encoded caches of ``topology_sim``, so
every received element is checked against what the prefill held, and every byte outside the request against its
sentinel. Cases: a block 16 -> 64 regroup (one source), TP 2 -> 1 with a layout permute (two sources into one staged
block), chunk boundaries of one plane block and of several, and a read that fails in the middle of a request.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from topology_sim import LOCAL_SENTINEL, REMOTE_SENTINEL, RankCache, build_cache, check_received, fill_request

from pd_transfer.connector.remote_engines import SourceRank
from pd_transfer.connector.staged_reads import LaneTotals, StagedChunks, StagedLaneWork
from pd_transfer.connector.staging import StagingArea
from pd_transfer.spec import KVCacheLayout, ModelFingerprint, planes_of
from pd_transfer.topology import PeerPlan
from pd_transfer.transfer.agent import DescriptorList, ReadStats
from pd_transfer.transfer.errors import TransferError
from pd_transfer.transfer.lanes import LaneRead

MODEL = ModelFingerprint(model="staged-llama", dtype="float32", num_layers=2, total_num_kv_heads=4, head_size=8)


@dataclass(frozen=True)
class Case:
    remote_tp: int
    remote_block: int
    remote_layout: str
    local_block: int
    local_layout: str


CASES = {
    "block_16_to_64": Case(1, 16, "HND", 64, "HND"),
    "tp_2_to_1_nhd_to_hnd": Case(2, 16, "NHD", 16, "HND"),
    "tp_2_to_1_block_8_to_32": Case(2, 8, "HND", 32, "NHD"),
}


class Registrations:
    """What a staging area needs of an agent here: registering is nothing without NIXL."""

    def register_spans(self, spans: list[tuple[int, int]]) -> None:
        assert spans and all(end > start for start, end in spans)

    def release_dlist(self, dlist: DescriptorList) -> None:
        dlist.released = True


def memmove_read(
    local: DescriptorList, local_rows: np.ndarray, remote: DescriptorList, remote_rows: np.ndarray, timeout_s: float
) -> ReadStats:
    """A READ as NIXL makes it on one host: each remote row's bytes into the local row of the same index."""
    assert timeout_s > 0 and len(local_rows) == len(remote_rows)
    for mine, theirs in zip(local_rows.tolist(), remote_rows.tolist(), strict=True):
        length = int(local.rows[mine, 1])
        assert length == int(remote.rows[theirs, 1])
        ctypes.memmove(int(local.rows[mine, 0]), int(remote.rows[theirs, 0]), length)
    return ReadStats(
        bytes=int(local.row_lengths[local_rows].sum()), descriptors=len(local_rows), post_seconds=0.0, seconds=0.0
    )


def device_read(staging: StagingArea) -> LaneRead:
    """:func:`memmove_read` into a staging area on an accelerator: each row copied by torch from host memory (the
    prefill caches here) into the staging buffer, on the lane's stream."""
    buffer = staging.blocks.view(torch.uint8).view(-1)
    start = buffer.data_ptr()

    def read(
        local: DescriptorList, local_rows: np.ndarray, remote: DescriptorList, remote_rows: np.ndarray, timeout_s: float
    ) -> ReadStats:
        for mine, theirs in zip(local_rows.tolist(), remote_rows.tolist(), strict=True):
            length = int(local.rows[mine, 1])
            origin = (ctypes.c_uint8 * length).from_address(int(remote.rows[theirs, 0]))
            offset = int(local.rows[mine, 0]) - start
            buffer[offset : offset + length].copy_(torch.from_numpy(np.ctypeslib.as_array(origin)))
        return ReadStats(int(local.row_lengths[local_rows].sum()), len(local_rows), 0.0, 0.0)

    return read


@dataclass
class Pull:
    """One request, planned and staged: what a lane needs, and the caches to check (``local`` on the host; with
    another ``device``, the planes the lanes write are copies there: :meth:`received` brings them back)."""

    local: RankCache
    local_ids: list[int]
    tokens: int
    chunks: StagedChunks
    work: StagedLaneWork
    planes: list[torch.Tensor]  # what the lanes write: ``local``'s planes, or their copies on another device

    def received(self) -> None:
        """Copy the planes the lanes wrote back into ``local`` (nothing to do on the CPU)."""
        for mine, written in zip(self.local.planes(), self.planes, strict=True):
            if written.data_ptr() != mine.data_ptr():
                mine.copy_(written.cpu())


def staged_pull(case: Case, group_blocks: int, tokens: int = 150, seed: int = 5, device: str = "cpu") -> Pull:
    """The request of ``tokens`` tokens, its slot groups ``group_blocks`` plane blocks each, read into planes on
    ``device``."""
    rng = np.random.default_rng(seed)
    remote_blocks, local_blocks = 24, 12
    remote_ids = rng.permutation(remote_blocks)[: -(-tokens // case.remote_block)].tolist()
    local_ids = rng.permutation(local_blocks)[: -(-tokens // case.local_block)].tolist()
    remotes = {}
    for rank in range(case.remote_tp):
        layout = KVCacheLayout(MODEL, case.remote_tp, rank, case.remote_block, case.remote_layout)  # type: ignore[arg-type]
        remotes[rank] = build_cache(layout, remote_blocks, False, 0, REMOTE_SENTINEL[4])
        fill_request(remotes[rank], remote_ids, tokens)
    layout = KVCacheLayout(MODEL, 1, 0, case.local_block, case.local_layout)  # type: ignore[arg-type]
    local = build_cache(layout, local_blocks, False, 0, LOCAL_SENTINEL[4])
    plan = PeerPlan.build(
        layout,
        local.regions,
        {r: c.layout for r, c in remotes.items()},
        {r: c.regions for r, c in remotes.items()},
        strategy="staged",
    )
    assert plan.postprocess is not None and len(plan.sources) == case.remote_tp
    planes = [plane if device == "cpu" else plane.to(device) for plane in local.planes()]
    block_bytes = local.regions[0].plane_block_len
    staging = StagingArea(
        Registrations(),  # type: ignore[arg-type]
        block_bytes,
        group_blocks * block_bytes,
        planes[0].dtype,
        device=device,
    )
    first_plane = planes_of(local.regions)[0].base_address
    owner = Registrations()
    sources = [
        SourceRank(
            source.remote_rank,
            f"prefill-{source.remote_rank}",
            DescriptorList(owner, None, "", source.local_grid),
            DescriptorList(owner, None, f"prefill-{source.remote_rank}", source.remote_grid),
            1,
            DescriptorList(owner, None, "", staging.source_rows(source, first_plane)),
        )
        for source in plan.sources
    ]
    rows = [source.indices(remote_ids, local_ids, tokens) for source in plan.sources]
    chunks = StagedChunks.plan(plan, rows, staging.slots, local_blocks, staging.fences)
    deadline = time.perf_counter() + 60
    work = StagedLaneWork(chunks, sources, staging, staging.scatter_for(plan.postprocess.restage, planes), deadline)
    return Pull(local, local_ids, tokens, chunks, work, planes)


def run_lanes(work: StagedLaneWork, lanes: int, read: LaneRead = memmove_read) -> list[LaneTotals]:
    """Every lane on a thread of its own, as the read lanes run them; the first failure is raised."""
    with ThreadPoolExecutor(max_workers=lanes) as pool:
        futures = [pool.submit(work.run, lane, read) for lane in range(lanes)]
        return [future.result(timeout=60) for future in futures]


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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
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


def test_a_request_of_no_tokens_reads_and_writes_nothing() -> None:
    pull = staged_pull(CASES["tp_2_to_1_nhd_to_hnd"], 1, tokens=0)
    before = [buffer.clone() for buffer in pull.local.buffers]
    assert pull.chunks.count == 0 and pull.chunks.block_ids.numel() == 0
    totals = run_lanes(pull.work, 1)
    assert totals == [LaneTotals()]
    assert all(torch.equal(a, b) for a, b in zip(pull.local.buffers, before, strict=True))
