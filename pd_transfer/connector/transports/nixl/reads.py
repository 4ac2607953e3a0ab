"""How a decode rank reads one request's KV blocks from an engine opened for NIXL reads: four strategies.

* **in place** (plans without a postprocess, or with no staging area): one READ per source rank straight
  into the cache. With a postprocess (block-size regroup, layout permute), the reads go plane group by plane
  group and a worker thread fixes up each group in place while the next is read (CMA reads and torch kernels
  both release the GIL), so the fix-up mostly hides behind the transfer.
* **staged** (plans with a postprocess and a staging area): chunks of (plane, block) pairs read by every read
  lane at once, each into slot groups of its own of the small :class:`~.staging.StagingArea`, and scattered into
  their final place by the same lane right after (:mod:`.staged_reads`): the fix-up is split across the lanes and
  overlaps the other lanes' reads; the cache is written once, as by a homogeneous read.
* **packed** (engine-packed blocks of another block size): whole remote blocks into the
  :class:`PackedStaging`, a fill at a time, each regrouped into the local blocks before the next is read.

* **pushed** (plans without a postprocess, source ranks that agreed to push: reads over TCP, see
  :mod:`.push_orders`; requests of at least ``PD_TRANSFER_PUSH_MIN_BYTES``): each such rank writes the request's
  rows straight into the cache (a cache on a GPU: into a host landing area, copied into the cache once written,
  :mod:`.push_staging`); the others, and any that answer ``may_read``, are read in place.

Each step posts one READ per source rank; the reads of the last step carry the ``ReadDone`` notifications (staged
reads send them once every lane is done).
Block ids are validated before anything is read (``ValueError``; a
:class:`~pd_transfer.connector.transports.requests.PullRequest` has no repeated remote ids); transfer failures raise
``TransferError``.
"""

from __future__ import annotations

import functools
import itertools
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from pd_transfer.affinity import unpinning
from pd_transfer.connector.cache import KVCache
from pd_transfer.connector.options import DEFAULT_STAGED_JOBS_PER_LANE
from pd_transfer.topology.grids import block_ids_array
from pd_transfer.topology.plan import Postprocess
from pd_transfer.topology.postprocess import index_on
from pd_transfer.transfer.agent import DescriptorList
from pd_transfer.transfer.agent_protocol import Agent
from pd_transfer.transfer.errors import TransferError, TransferTimeout
from pd_transfer.transfer.lanes import LaneRead, split_rows

from ..requests import PullRequest, ReadTotals
from .push_orders import PushOrders
from .slot_fences import after_mark, mark
from .sources import NixlEngine, SourceRank
from .staged_reads import StagedChunks, StagedLaneWork

#: One READ of a step: (source rank, local descriptor list, local rows, remote rows); rows are int arrays.
ReadOrder = tuple[SourceRank, DescriptorList | None, np.ndarray, np.ndarray]
#: The local and remote rows (int64, equal length) a request reads from each source rank, in source order.
SourceRows = list[tuple[np.ndarray, np.ndarray]]


def plane_groups(num_planes: int, groups: int) -> list[range]:
    """Split planes [0, num_planes) into at most ``groups`` consecutive ranges of near-equal size."""
    groups = max(1, min(groups, num_planes))
    edges = [round(i * num_planes / groups) for i in range(groups + 1)]
    return [range(a, b) for a, b in itertools.pairwise(edges) if b > a]


def _timed(function: Callable[..., object], *args: object) -> float:
    """Seconds ``function(*args)`` took."""
    started = time.perf_counter()
    function(*args)
    return time.perf_counter() - started


def _lists_of(step: Sequence[ReadOrder]) -> list[DescriptorList]:
    """The descriptor lists a step reads: each source's local list (if any) and remote list."""
    return [d for source, local, _, _ in step for d in (local, source.remote) if d is not None]


def _until(deadline: float) -> float:
    """Seconds left until ``deadline`` (``time.perf_counter`` time), at least 1 ms: a wait on the fix-up."""
    return max(0.001, deadline - time.perf_counter())


class BlockReader:
    """Reads requests' blocks into ``cache`` with ``agent``; fix-ups of in-place reads run on one worker thread
    (``close`` stops it), those of staged reads on the read lanes.

    ``planes`` are the cache's plane views (``plane_views`` order); ``pipeline_groups`` is how many plane
    groups an in-place read with a postprocess is split into; ``done_message(request_id, source)`` is the
    ``ReadDone`` notification the last READ from ``source`` carries. With ``pushes``, plans without a fix-up are
    written by the source ranks that agreed to push (:mod:`.push_orders`), and read from the others. A staged read
    runs ``staged_jobs_per_lane`` threads per read lane (each reads, in turn with the others of its lane, and
    restages what it read), as many as the staging area has slot groups for.
    """

    def __init__(
        self,
        agent: Agent,
        cache: KVCache,
        planes: list[torch.Tensor],
        *,
        pipeline_groups: int,
        done_message: Callable[[str, SourceRank], bytes],
        pushes: PushOrders | None = None,
        staged_jobs_per_lane: int = DEFAULT_STAGED_JOBS_PER_LANE,
    ) -> None:
        self.agent = agent
        self.cache = cache
        self.planes = planes
        self.pipeline_groups = pipeline_groups
        self._done_message = done_message
        self.pushes = pushes
        self.staged_jobs_per_lane = staged_jobs_per_lane
        self._staging_lock = threading.Lock()  # one staged read at a time: they share the staging area
        self._postprocess_pool = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="pd-transfer-postprocess",
            initializer=unpinning(agent.settings.thread_cpu_set),
        )

    def read(self, remote: NixlEngine, request: PullRequest, deadline: float) -> ReadTotals:
        """Read ``request`` by the strategy ``remote`` calls for, all before ``deadline`` (``time.perf_counter``
        time). Block ids that do not fit ``remote``'s plan or the cache raise ``ValueError`` before anything is
        read."""
        if remote.packed is not None:
            local_ids = self._checked_packed_ids(remote, request)
            return self._read_packed(remote, request, local_ids, deadline)
        # rows per source; validates the block ids before anything moves
        rows = [
            plan.indices(request.remote_block_ids, request.local_block_ids, request.num_tokens)
            for plan in remote.plan.sources
        ]
        if remote.plan.postprocess is not None and remote.sources[0].staging is not None:
            return self._read_staged(remote, request.request_id, rows, deadline)
        if self.pushes is not None and remote.plan.postprocess is None:
            pushes = self.pushes
            ready = [
                source
                for source, (local_rows, _) in zip(remote.sources, rows, strict=True)
                if pushes.ready(source.peer) and pushes.fits(source.peer, len(local_rows))
            ]
            if ready and self._request_bytes(remote, rows) >= self.pushes.min_bytes:
                return self._push_in_place(remote, request, rows, ready, deadline)
        return self._read_in_place(remote, request, rows, deadline)

    def close(self) -> None:
        """Wait for running fix-ups and stop the worker thread."""
        self._postprocess_pool.shutdown(wait=True)

    # ------------------------------------------------------------------ in place
    def _read_in_place(self, remote: NixlEngine, request: PullRequest, rows: SourceRows, deadline: float) -> ReadTotals:
        """Reads straight into the cache; a postprocess, if any, fixes up each plane group in place on the
        worker thread while the next group is read."""
        postprocess = remote.plan.postprocess
        groups = plane_groups(len(self.planes), self.pipeline_groups if postprocess is not None else 1)
        reads = self._in_place_orders(remote, rows, groups)
        if postprocess is not None:  # the request's ids on the planes' device, once
            device = self.planes[0].device
            block_ids = postprocess.block_ids_on(request.local_block_ids, request.num_tokens, device)
            ids_ready = mark(device)
        total_bytes = descriptors = 0
        pending: list[Future[float]] = []
        read_started = time.perf_counter()
        for index, group in enumerate(groups):
            step = [
                (
                    source,
                    source.local,
                    local_rows[bounds[index] : bounds[index + 1]],
                    remote_rows[bounds[index] : bounds[index + 1]],
                )
                for source, local_rows, remote_rows, bounds in reads
            ]
            moved, rows_read = self._read_step(request.request_id, step, index == len(groups) - 1, deadline)
            total_bytes += moved
            descriptors += rows_read
            if postprocess is not None:
                job = (self._fix_up_group, postprocess, block_ids, ids_ready, group)
                pending.append(self._postprocess_pool.submit(_timed, *job))
        reads_done = time.perf_counter()
        post_seconds = sum(future.result(timeout=_until(deadline)) for future in pending)
        return ReadTotals.overlapped(total_bytes, descriptors, read_started, reads_done, post_seconds)

    def _fix_up_group(
        self, postprocess: Postprocess, block_ids: torch.Tensor, ids_ready: torch.cuda.Event | None, group: range
    ) -> None:
        """Fix up plane group ``group`` of the request's blocks ``block_ids``, once their copy to the device is."""
        after_mark(ids_ready)
        postprocess.apply_on(self.planes, block_ids, group)

    def _in_place_orders(
        self, remote: NixlEngine, rows: SourceRows, groups: list[range]
    ) -> list[tuple[SourceRank, np.ndarray, np.ndarray, np.ndarray]]:
        """Per source: (source, local rows, remote rows, bounds), rows sorted by plane (stably), so that rows
        ``bounds[g]:bounds[g + 1]`` are those of plane group ``g``."""
        num_planes = len(self.planes)
        starts = [group.start for group in groups] + [num_planes]
        reads = []
        for source, (local_rows, remote_rows) in zip(remote.sources, rows, strict=True):
            # rows are listed plane by plane: row = (plane * num_blocks + block) * units + unit
            plane_of_row = local_rows // (source.local.num_rows // num_planes)
            order = np.argsort(plane_of_row, kind="stable")
            bounds = np.searchsorted(plane_of_row[order], starts)
            reads.append((source, local_rows[order], remote_rows[order], bounds))
        return reads

    @staticmethod
    def _request_bytes(remote: NixlEngine, rows: SourceRows) -> int:
        """Bytes a request moves: its rows over every source."""
        return sum(len(local) * plan.unit_bytes for (local, _), plan in zip(rows, remote.plan.sources, strict=True))

    def _push_in_place(
        self, remote: NixlEngine, request: PullRequest, rows: SourceRows, ready: list[SourceRank], deadline: float
    ) -> ReadTotals:
        """The ``ready`` sources write the request into the cache; the others, and those that answer ``may_read``,
        are read (one step, with ``ReadDone``). Raises ``TransferTimeout`` when a source did not answer by
        ``deadline``, ``TransferError`` when one refused without ``may_read``."""
        assert self.pushes is not None
        request_id = request.request_id
        started = time.perf_counter()
        outcomes = self.pushes.push(request, ready, deadline)
        asked = {source.peer for source in ready}
        pushed: list[tuple[SourceRank, np.ndarray]] = []
        step: list[ReadOrder] = []
        for source, plan, (local_rows, remote_rows) in zip(remote.sources, remote.plan.sources, rows, strict=True):
            outcome = outcomes.get(source.peer)
            if outcome is not None and outcome.ok:  # written (into a landing area: copied into the cache now)
                self.pushes.land(
                    source.peer, plan.local_grid[local_rows, 0].astype(np.int64), plan.unit_bytes, deadline
                )
                pushed.append((source, local_rows))
                continue
            if source.peer in asked and outcome is None:
                raise TransferTimeout(f"request {request_id}: {source.peer} did not push it in time")
            if outcome is not None and not outcome.may_read:
                raise TransferError(f"request {request_id}: {source.peer} will not push it: {outcome.reason}")
            step.append((source, source.local, local_rows, remote_rows))
        moved, descriptors = self._read_step(request_id, step, True, deadline) if step else (0, 0)
        pushed_bytes = sum(int(source.local.row_lengths[local_rows].sum()) for source, local_rows in pushed)
        descriptors += sum(len(local_rows) for _, local_rows in pushed)
        return ReadTotals(
            bytes=moved + pushed_bytes,
            descriptors=descriptors,
            read_seconds=time.perf_counter() - started,
            postprocess_seconds=0.0,
            postprocess_exposed_seconds=0.0,
            pushed_peers=tuple(source.peer for source, _ in pushed),
            pushed_bytes=pushed_bytes,
        )

    # ------------------------------------------------------------------ staged
    def _read_staged(self, remote: NixlEngine, request_id: str, rows: SourceRows, deadline: float) -> ReadTotals:
        """Reads chunk by chunk into the staging area's slot groups on every read lane at once, each lane
        restaging its chunk into its final place right after reading it (:mod:`.staged_reads`); the ``ReadDone``
        notifications follow once every lane is done. One staged read at a time (the staging area is shared)."""
        postprocess, staging = remote.plan.postprocess, remote.staging
        assert postprocess is not None and staging is not None
        with self._staging_lock:
            chunks = StagedChunks.plan(remote.plan, rows, staging.slots, self.cache.num_blocks, staging.fences)
            runs = staging.scatter_for(postprocess.restage, self.planes)
            work = StagedLaneWork(chunks, remote.sources, staging, runs, deadline)
            agent = self.agent
            # GPU memory (a staging area or a prefill cache on a GPU) is read by this agent alone
            usable = agent.lanes_for([d for s in remote.sources for d in (s.staging, s.remote) if d is not None])
            wanted = usable * self.staged_jobs_per_lane
            lanes = max(1, min(wanted, agent.max_lane_jobs, staging.fences.lanes, chunks.count))
            started = time.perf_counter()
            jobs = [functools.partial(work.run, lane) for lane in range(lanes)]
            totals = agent.run_on_lanes(jobs, max(0.0, deadline - started), lanes=usable)
        for source in remote.sources:
            self.agent.notify(source.peer, self._done_message(request_id, source))
        reads_done = max(lane.reads_done for lane in totals) or started  # nothing to read: no time
        return ReadTotals(
            bytes=sum(lane.bytes for lane in totals),
            descriptors=sum(lane.descriptors for lane in totals),
            read_seconds=reads_done - started,
            postprocess_seconds=sum(lane.restage_seconds for lane in totals),
            postprocess_exposed_seconds=time.perf_counter() - reads_done,
        )

    # ------------------------------------------------------------------ packed
    def _checked_packed_ids(self, remote: NixlEngine, request: PullRequest) -> torch.Tensor:
        """Validate a packed pull's block ids before anything moves; returns the local ids as an int64 tensor on
        the cache's device (moved there once)."""
        source, tokens = remote.plan.sources[0], request.num_tokens
        remote_ids, local_ids = request.remote_block_ids, request.local_block_ids
        block_ids_array(
            "remote_block_ids", remote_ids, tokens, source.remote_block_size, source.remote_num_blocks, False
        )
        local = block_ids_array(
            "local_block_ids", local_ids, tokens, self.cache.layout.block_size, self.cache.num_blocks, True
        )
        return index_on(local, self.planes[0].device)

    def _read_packed(
        self, remote: NixlEngine, request: PullRequest, local_block_ids: torch.Tensor, deadline: float
    ) -> ReadTotals:
        """Whole remote blocks into the packed staging area, a fill (whole regroup groups) at a time; each fill
        is regrouped into the local blocks before the next is read (the staging area is one buffer)."""
        staging = remote.packed
        assert staging is not None
        remote_size, local_size = remote.plan.sources[0].remote_block_size, self.cache.layout.block_size
        request_id, remote_block_ids, num_tokens = request.request_id, request.remote_block_ids, request.num_tokens
        chunk_tokens = staging.tokens_per_chunk
        starts = list(range(0, num_tokens, chunk_tokens))
        total_bytes = descriptors = 0
        read_seconds = post_seconds = 0.0
        for index, first in enumerate(starts):
            tokens = min(chunk_tokens, num_tokens - first)
            remote_ids = remote_block_ids[first // remote_size : first // remote_size + -(-tokens // remote_size)]
            slots = list(range(len(remote_ids)))
            step: list[ReadOrder] = []
            for source, plan in zip(remote.sources, remote.plan.sources, strict=True):
                staging_rows, remote_rows = plan.indices(remote_ids, slots, tokens)
                step.append((source, source.local, staging_rows, remote_rows))
            started = time.perf_counter()
            moved, rows_read = self._read_step(request_id, step, index == len(starts) - 1, deadline)
            read_seconds += time.perf_counter() - started
            total_bytes += moved
            descriptors += rows_read
            local_ids = local_block_ids[first // local_size : first // local_size + -(-tokens // local_size)]
            post_seconds += _timed(staging.regroup_into_place, local_ids, tokens)
        return ReadTotals(
            bytes=total_bytes,
            descriptors=descriptors,
            read_seconds=read_seconds,
            postprocess_seconds=post_seconds,
            postprocess_exposed_seconds=post_seconds,  # regrouping is not overlapped with reading
        )

    # ------------------------------------------------------------------ one step
    def _read_step(self, request_id: str, step: Sequence[ReadOrder], last: bool, deadline: float) -> tuple[int, int]:
        """One READ per source of (local list, local rows) <- remote rows; the reads of the last step carry
        the ``ReadDone`` notifications. Returns (bytes, rows). Several sources, with the read lanes up and enough
        bytes to split, are read on the lanes at once (:meth:`_read_step_on_lanes`)."""
        lanes = self.agent.lanes
        if len(step) > 1 and lanes is not None and self.agent.lanes_for(_lists_of(step)) > 1:
            step_bytes = sum(int(local.row_lengths[rows].sum()) for _, local, rows, _ in step if local is not None)
            if step_bytes >= lanes.split_min_bytes:
                return self._read_step_on_lanes(request_id, step, last, deadline)
        moved = rows = 0
        for source, local_list, local_rows, remote_rows in step:
            assert local_list is not None
            stats = self.agent.read(
                local_list,
                local_rows,
                source.remote,
                remote_rows,
                notification=self._done_message(request_id, source) if last else b"",
                timeout_s=max(0.0, deadline - time.perf_counter()),
            )
            moved += stats.bytes
            rows += stats.descriptors
        return moved, rows

    def _read_step_on_lanes(
        self, request_id: str, step: Sequence[ReadOrder], last: bool, deadline: float
    ) -> tuple[int, int]:
        """:meth:`_read_step` with each source's rows cut into one byte-balanced part per lane: every lane reads
        its part of each source in turn, so no lane waits for the others between sources; the notifications
        follow once every lane is done."""
        count = self.agent.lane_count
        cuts = [split_rows(local.row_lengths[rows], count) if local is not None else [] for _, local, rows, _ in step]

        def lane_job(lane: int) -> Callable[[LaneRead], tuple[int, int]]:
            def run(read: LaneRead) -> tuple[int, int]:
                moved = rows_read = 0
                for (source, local, local_rows, remote_rows), parts in zip(step, cuts, strict=True):
                    if local is None or lane >= len(parts):
                        continue
                    part = parts[lane]
                    timeout_s = max(0.0, deadline - time.perf_counter())
                    stats = read(local, local_rows[part], source.remote, remote_rows[part], timeout_s)
                    moved += stats.bytes
                    rows_read += stats.descriptors
                return moved, rows_read

            return run

        totals = self.agent.run_on_lanes(
            [lane_job(lane) for lane in range(count)], max(0.0, deadline - time.perf_counter())
        )
        if last:
            for source, *_ in step:
                self.agent.notify(source.peer, self._done_message(request_id, source))
        return sum(moved for moved, _ in totals), sum(rows for _, rows in totals)
