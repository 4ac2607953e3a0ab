"""A staged read of one request, pipelined over the read lanes: each lane reads a chunk and restages it at once.

The request's (plane, block) pairs are cut into chunks of one slot group each (:class:`StagedChunks`). Every lane
(the reading thread and the agent's read lanes: :meth:`~pd_transfer.transfer.agent_protocol.Agent.run_on_lanes`)
takes the next chunk not yet taken, reads it from every source rank into a slot group of its own (one READ per
source) and scatters it into its final blocks, regrouped and permuted, on the same thread, while its bytes are
still in that core's cache; then it takes the next. The fix-up is split across the lanes and overlaps the other
lanes' reads, so it is never a serial tail. A chunk is scattered only once all its bytes, from every source, have
landed (the lane read them itself); a slot group is read into again only after its last scatter ran (same thread
on the CPU; :class:`~.slot_fences.SlotFences` elsewhere). When a read fails, the other lanes stop at their next
chunk; the blocks of the request may then be partly written, and the request fails as a whole (its caller reports
it; nothing outside its blocks is written).
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from pd_transfer.topology.plan import PeerPlan
from pd_transfer.topology.postprocess import RunScatter, index_on
from pd_transfer.transfer.lanes import LaneRead

from .slot_fences import SlotFences
from .sources import SourceRank
from .staging import StagingArea


@dataclass(frozen=True)
class SourceChunks:
    """One source rank's rows of a request, sorted by chunk: chunk ``c`` is rows ``bounds[c]:bounds[c + 1]``."""

    staging_rows: np.ndarray  # int32, within a slot group: ``slot * units + unit``
    remote_rows: np.ndarray  # int32
    bounds: np.ndarray  # int64, chunks + 1 entries
    group_rows: int  # rows of one slot group: ``slots * units``


@dataclass(frozen=True)
class StagedChunks:
    """A request's staged reads cut into ``count`` chunks of at most ``slots`` plane blocks.

    The request's plane blocks (``plane * num_blocks + block``, sorted, distinct) are taken ``slots`` at a time;
    the ``i``-th lands in slot ``i % slots`` of the group its chunk is read into. ``segments[c]`` lists chunk
    ``c``'s runs of one plane as (plane, first slot, end slot); ``block_ids`` (int64, on the cache's device, moved
    there once per request) holds the local block of each plane block, so slot ``s`` of chunk ``c`` goes to block
    ``block_ids[c * slots + s]``; a chunk's view of it is :meth:`block_ids_of`.
    """

    slots: int
    count: int
    sources: list[SourceChunks]
    segments: list[list[tuple[int, int, int]]]
    block_ids: torch.Tensor
    ready: torch.cuda.Event | None  # recorded once ``block_ids`` is on an accelerator (None on the CPU)

    @classmethod
    def plan(
        cls, plan: PeerPlan, rows: list[tuple[np.ndarray, np.ndarray]], slots: int, num_blocks: int, fences: SlotFences
    ) -> StagedChunks:
        """The chunks of a request whose rows from each source (``plan.sources`` order) are ``rows``: (local rows,
        remote rows), local rows counted as ``plane block * units + unit``; ``fences`` name the device."""
        plane_blocks_of = [
            local // source.local_units_per_block for (local, _), source in zip(rows, plan.sources, strict=True)
        ]
        plane_blocks = np.unique(np.concatenate(plane_blocks_of))
        count = -(-len(plane_blocks) // slots)
        sources = []
        for source, (local_rows, remote_rows), mine in zip(plan.sources, rows, plane_blocks_of, strict=True):
            units = source.local_units_per_block
            index = np.searchsorted(plane_blocks, mine)  # of each row's plane block in the request
            chunk = index // slots
            staging_rows = (index % slots) * units + local_rows % units
            order = np.argsort(chunk, kind="stable")
            bounds = np.searchsorted(chunk[order], np.arange(count + 1))
            sources.append(
                SourceChunks(
                    staging_rows[order].astype(np.int32),
                    remote_rows[order].astype(np.int32),
                    bounds,
                    slots * units,
                )
            )
        plane_of = plane_blocks // num_blocks
        segments = []
        for first in range(0, len(plane_blocks), slots):
            planes = plane_of[first : first + slots]
            edges = [0, *(np.flatnonzero(np.diff(planes)) + 1).tolist(), len(planes)]
            segments.append([(int(planes[a]), a, b) for a, b in itertools.pairwise(edges)])
        block_ids = index_on(plane_blocks % num_blocks, fences.device)
        return cls(slots, count, sources, segments, block_ids, fences.mark())

    def block_ids_of(self, chunk: int) -> torch.Tensor:
        """The local blocks of chunk ``chunk``'s slots, in slot order (a view of :attr:`block_ids`)."""
        return self.block_ids[chunk * self.slots : (chunk + 1) * self.slots]


@dataclass
class LaneTotals:
    """What one lane read and restaged."""

    bytes: int = 0
    descriptors: int = 0  # rows posted
    reads_done: float = 0.0  # ``perf_counter`` time its last read finished (0: it read nothing)
    restage_seconds: float = 0.0


@dataclass
class StagedLaneWork:
    """The shared state of one request's lanes: each calls :meth:`run` with its lane index and read.

    ``claim`` hands out chunk indices (each once, across lanes); ``stop`` is set by the first lane that fails,
    and the others stop before their next chunk."""

    chunks: StagedChunks
    sources: list[SourceRank]
    staging: StagingArea
    runs: RunScatter  # from the staging area's slots into the cache's planes (:meth:`StagingArea.scatter_for`)
    deadline: float  # ``perf_counter`` time
    claim: Iterator[int] = dataclasses.field(default_factory=itertools.count)
    stop: threading.Event = dataclasses.field(default_factory=threading.Event)

    def run(self, lane: int, read: LaneRead) -> LaneTotals:
        """Take chunks until none is left (or another lane failed); read each into this lane's next slot group
        and restage it. Raises what a read raised, after telling the other lanes to stop."""
        try:
            with self.staging.fences.lane(lane, after=self.chunks.ready):
                return self._run(lane, read)
        except BaseException:
            self.stop.set()
            raise

    def _run(self, lane: int, read: LaneRead) -> LaneTotals:
        totals = LaneTotals()
        groups = self.staging.fences.lane_groups(lane)
        for step, chunk in enumerate(self.claim):
            if chunk >= self.chunks.count or self.stop.is_set():
                break
            group = groups[step % len(groups)]
            self.staging.fences.wait_free(group)
            for source, rows in zip(self.sources, self.chunks.sources, strict=True):
                assert source.staging is not None
                first, end = rows.bounds[chunk], rows.bounds[chunk + 1]
                if first == end:
                    continue
                staging_rows = rows.staging_rows[first:end] + np.int32(group * rows.group_rows)
                timeout_s = max(0.0, self.deadline - time.perf_counter())
                stats = read(source.staging, staging_rows, source.remote, rows.remote_rows[first:end], timeout_s)
                totals.bytes += stats.bytes
                totals.descriptors += stats.descriptors
            totals.reads_done = time.perf_counter()
            segments, block_ids = self.chunks.segments[chunk], self.chunks.block_ids_of(chunk)
            self.staging.scatter(self.runs, group, segments, block_ids)
            self.staging.fences.filled(group)
            totals.restage_seconds += time.perf_counter() - totals.reads_done
        return totals
