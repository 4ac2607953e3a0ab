"""The receiving side: one decode TP rank that pulls a request's KV blocks from a prefill engine.

Per remote engine, once: handshake (cached by the client), compatibility check, NIXL agents added,
a transfer plan built and its descriptor lists prepared, and the connection warmed up with a one-unit
read into a scratch buffer. Per request: the plan's row indices, one READ per prefill rank read from,
the last carrying a ``ReadDone`` notification. When the plan needs a postprocess (block-size regroup,
layout permute), the reads go plane group by plane group and a worker thread fixes up each group while
the next is read (CMA reads and torch kernels both release the GIL), so the fix-up mostly hides behind
the transfer.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from pd_transfer.affinity import unpin_current_thread
from pd_transfer.handshake.client import HandshakeClient
from pd_transfer.handshake.messages import EngineMetadata
from pd_transfer.metrics import TransferMetrics, default_metrics
from pd_transfer.spec import planes_of
from pd_transfer.topology import PeerPlan, SourcePlan, check_compatible, expected_readers, plane_views
from pd_transfer.topology.grids import block_ids_array
from pd_transfer.topology.mapping import TopologyError
from pd_transfer.topology.packed import PackedBlockFormat
from pd_transfer.transfer.agent import DescriptorList, TransferAgent
from pd_transfer.transfer.errors import PeerDisconnected, TransferError

from . import messages
from .cache import KVCache
from .errors import LeaseNotConfirmed, WrongEngine
from .packed_staging import PackedStaging
from .staging import StagingArea

logger = logging.getLogger(__name__)


def _plane_groups(num_planes: int, groups: int) -> list[range]:
    """Split planes [0, num_planes) into at most ``groups`` consecutive ranges of near-equal size."""
    groups = max(1, min(groups, num_planes))
    edges = [round(i * num_planes / groups) for i in range(groups + 1)]
    return [range(a, b) for a, b in itertools.pairwise(edges) if b > a]


def _timed(function: Callable[..., object], *args: object) -> float:
    started = time.perf_counter()
    function(*args)
    return time.perf_counter() - started


@dataclass(frozen=True)
class PullStats:
    """What one request's pull moved (bytes, seconds) and how."""

    request_id: str
    bytes: int
    descriptors: int
    read_seconds: float  # first post to last DONE
    postprocess_seconds: float  # fixing layouts up, summed over plane groups (overlaps the reads)
    postprocess_exposed_seconds: float  # of which after the last read: what the fix-up adds to the pull
    seconds: float  # whole pull, handshake excluded when cached

    @property
    def gbps(self) -> float:
        """GiB/s over the whole pull."""
        return self.bytes / self.seconds / 2**30 if self.seconds > 0 else 0.0


@dataclass
class _Source:
    remote_rank: int
    peer: str
    local: DescriptorList
    remote: DescriptorList
    expected_readers: int
    staging: DescriptorList | None = None  # units of the staging area, for plans that fix layouts up


@dataclass
class _RemoteEngine:
    engine: EngineMetadata
    host: str
    port: int
    plan: PeerPlan
    sources: list[_Source]
    packed: PackedStaging | None = None  # packed blocks of another block size: read whole, then regrouped


class DecodeRank:
    """One decode TP rank's receiving side."""

    def __init__(
        self,
        engine_id: str,
        cache: KVCache,
        *,
        secret: bytes | str | None = None,
        handshake_timeout_s: float = 5.0,
        handshake_failure_backoff_s: float = 10.0,
        read_timeout_s: float = 30.0,
        min_direct_run_bytes: int | None = None,
        pipeline_groups: int = 8,
        staging_bytes: int = 16 * 2**20,
        agent_name: str | None = None,
        confirm_timeout_s: float = 5.0,
        metrics: TransferMetrics | None = None,
        packed_formats: Callable[[int], PackedBlockFormat] | None = None,
        packed_staging_bytes: int = 32 * 2**20,
    ) -> None:
        """``packed_formats(block_size)`` gives the packing of a (block, head) for a block size, for caches whose
        layout names a ``packing``: pulls from engines of another block size then read whole remote blocks into
        a staging area of ``packed_staging_bytes`` and regroup them (without it, such engines are refused)."""
        self.engine_id = engine_id
        self.metrics = metrics if metrics is not None else default_metrics()
        self.cache = cache
        self.read_timeout_s = read_timeout_s
        self._min_direct_run_bytes = min_direct_run_bytes
        rank = cache.layout.tp_rank
        self._init_confirmations(confirm_timeout_s)
        self.agent = TransferAgent(
            agent_name or f"{engine_id}-decode-tp{rank}-{uuid.uuid4().hex[:8]}", on_notification=self._on_notification
        )
        self._reply_to = self.agent.connection_metadata
        self.agent.register_regions(cache.regions)
        self.client = HandshakeClient(
            cache.layout.fingerprint,
            secret=secret,
            timeout_s=handshake_timeout_s,
            failure_backoff_s=handshake_failure_backoff_s,  # a dead prefill's endpoint fails fast this long
        )
        self._planes = plane_views(cache.tensors, cache.regions)
        self._remotes: dict[tuple[str, int], _RemoteEngine] = {}
        self._connect_lock = threading.Lock()  # guards _remotes and _engine_locks
        self._engine_locks: dict[tuple[str, int], threading.Lock] = {}
        self._staging_lock = threading.Lock()
        self.pipeline_groups = pipeline_groups
        self.staging_bytes = staging_bytes  # per half of the double-buffered staging area; 0: fix up in place
        self._staging: StagingArea | None = None
        self._postprocess_pool = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="pd-transfer-postprocess", initializer=unpin_current_thread
        )
        self._packed_formats = packed_formats
        self.packed_staging_bytes = packed_staging_bytes
        self._packed_staging: dict[int, PackedStaging] = {}  # remote block size -> its staging area

    # ------------------------------------------------------------------ connecting
    def connect(self, host: str, port: int) -> EngineMetadata:
        """Handshake with the prefill engine at ``host:port`` and prepare to read from it (idempotent)."""
        key = (host, port)
        with self._connect_lock:  # held briefly: a slow or dead engine must not stall the others
            remote = self._remotes.get(key)
            if remote is not None:
                return remote.engine
            engine_lock = self._engine_locks.setdefault(key, threading.Lock())
        with engine_lock:  # one handshake per engine at a time
            with self._connect_lock:
                remote = self._remotes.get(key)
            if remote is None:
                remote = self._connect(host, port)
                with self._connect_lock:
                    self._remotes[key] = remote
            return remote.engine

    def _connect(self, host: str, port: int) -> _RemoteEngine:
        started = time.perf_counter()
        local = self.cache.layout
        engine = self.client.fetch(host, port)
        by_rank = {rank.tp_rank: rank for rank in engine.ranks}
        for rank in engine.ranks:
            check_compatible(local, rank.layout)
        plan_kwargs = {} if self._min_direct_run_bytes is None else {"min_direct_run_bytes": self._min_direct_run_bytes}
        remote_block_size = engine.ranks[0].layout.block_size if engine.ranks else local.block_size
        packed = None
        plan_layout, plan_regions = local, list(self.cache.regions)
        if local.packing is not None and remote_block_size != local.block_size:
            packed = self._packed_staging_for(remote_block_size)
            plan_layout, plan_regions = packed.layout, list(packed.cache.regions)
        plan = PeerPlan.build(
            plan_layout,
            plan_regions,
            {r: by_rank[r].layout for r in by_rank},
            {r: list(by_rank[r].regions) for r in by_rank},
            **plan_kwargs,
        )
        sources: list[_Source] = []
        try:
            for source in plan.sources:
                rank = by_rank[source.remote_rank]
                peer = self.agent.add_peer(rank.agent_metadata)
                remote_list = self.agent.prepare_remote(peer, source.remote_grid)
                local_list = self.agent.prepare_local(source.local_grid)
                readers = expected_readers(source.remote_rank, rank.layout, local.tp_size)
                staging = self._prepare_staging(source) if plan.postprocess is not None else None
                sources.append(_Source(source.remote_rank, peer, local_list, remote_list, readers, staging))
                self._warm_up(peer, remote_list, source.unit_bytes)
        except Exception:
            for item in sources:
                self.agent.remove_peer(item.peer)
            raise
        logger.info(
            "decode %s: connected to engine %s at %s:%d (TP %d, %d source rank(s), postprocess: %s) in %.0f ms",
            self.agent.name,
            engine.engine_id,
            host,
            port,
            engine.tp_size,
            len(sources),
            "packed regroup" if packed is not None else "yes" if plan.postprocess is not None else "no",
            (time.perf_counter() - started) * 1e3,
        )
        return _RemoteEngine(engine=engine, host=host, port=port, plan=plan, sources=sources, packed=packed)

    def _packed_staging_for(self, remote_block_size: int) -> PackedStaging:
        """The staging area for packed blocks of ``remote_block_size`` tokens (created on first use)."""
        local = self.cache.layout
        if self._packed_formats is None:
            raise TopologyError(
                f"blocks packed as {local.packing!r}: a prefill of {remote_block_size}-token blocks needs a regroup"
                f" that knows the packing, and this decode rank ({local.block_size}-token blocks) was given none"
            )
        with self._staging_lock:
            staging = self._packed_staging.get(remote_block_size)
            if staging is None:
                staging = self._packed_staging[remote_block_size] = PackedStaging(
                    self.agent,
                    self.cache,
                    self._packed_formats(remote_block_size),
                    self._packed_formats(local.block_size),
                    self.packed_staging_bytes,
                )
            return staging

    def _prepare_staging(self, source: SourcePlan) -> DescriptorList | None:
        """Descriptor rows of a source's units in every slot of the staging area (created on first use)."""
        if self.staging_bytes <= 0:
            return None
        with self._staging_lock:
            if self._staging is None:
                plane_block_bytes = self.cache.regions[0].plane_block_len
                self._staging = StagingArea(self.agent, plane_block_bytes, self.staging_bytes, self._planes[0].dtype)
        first_block = planes_of(list(self.cache.regions))[0].base_address
        unit_offsets = source.local_grid[: source.local_units_per_block, 0].astype(np.int64) - first_block
        return self.agent.prepare_local(self._staging.descriptor_rows(unit_offsets, source.unit_bytes))

    def _warm_up(self, peer: str, remote_list: DescriptorList, unit_bytes: int) -> None:
        """The first read to a peer pays for connection setup (25-36 ms): pay it now, into scratch memory."""
        for _ in self._scratch_reads(remote_list, unit_bytes, samples=1):
            pass

    def _scratch_reads(self, remote_list: DescriptorList, unit_bytes: int, samples: int) -> Iterator[float]:
        """Read remote row 0 into a registered scratch buffer ``samples`` times; yields post-to-done seconds."""
        scratch = torch.empty(unit_bytes, dtype=torch.uint8)
        registration = self.agent.register_spans([(scratch.data_ptr(), scratch.data_ptr() + unit_bytes)])
        try:
            local = self.agent.prepare_local(np.array([[scratch.data_ptr(), unit_bytes, 0]], dtype=np.uint64))
            try:
                zero = np.zeros(1, dtype=np.int32)
                for _ in range(samples):
                    yield self.agent.read(local, zero, remote_list, zero, timeout_s=self.read_timeout_s).seconds
            finally:
                local.release()
        finally:
            self.agent.deregister(registration)

    def one_unit_read_latencies(self, host: str, port: int, samples: int) -> list[float]:
        """Post-to-done seconds of ``samples`` one-row reads (one plane block when the plan reads whole
        blocks) from the first source rank, into scratch memory: the cache is not touched."""
        self.connect(host, port)
        remote = self._remotes[(host, port)]
        source = remote.sources[0]
        unit = remote.plan.sources[0].unit_bytes
        return list(self._scratch_reads(source.remote, unit, samples))

    def remote_plan(self, host: str, port: int) -> PeerPlan:
        """The transfer plan used for the engine at ``host:port`` (connecting first if needed)."""
        self.connect(host, port)
        return self._remotes[(host, port)].plan

    def forget(self, host: str, port: int) -> None:
        """Drop a remote engine (it restarted or died): its peers, descriptor lists and cached handshake."""
        with self._connect_lock:
            remote = self._remotes.pop((host, port), None)
        self.client.forget(host, port)
        if remote is not None:
            for source in remote.sources:
                self.agent.remove_peer(source.peer)

    # ------------------------------------------------------------------ pulling
    def pull(
        self,
        request_id: str,
        host: str,
        port: int,
        remote_block_ids: list[int],
        local_block_ids: list[int],
        num_tokens: int,
        *,
        timeout_s: float | None = None,
    ) -> PullStats:
        """Read ``num_tokens`` tokens of KV from the prefill engine at ``host:port`` into
        ``local_block_ids``, then notify every prefill rank read from.

        Block ids are validated before anything is read (``ValueError``). On a transfer failure the
        prefill ranks are told (``ReadFailed``) when reachable, a dead engine is forgotten so the next
        pull handshakes afresh, and the error propagates.
        """
        started = time.perf_counter()
        self.connect(host, port)
        remote = self._remotes[(host, port)]
        timeout_s = self.read_timeout_s if timeout_s is None else timeout_s
        deadline = started + timeout_s
        if remote.packed is None:
            # rows per source; validates the block ids before anything moves
            rows = [plan.indices(remote_block_ids, local_block_ids, num_tokens) for plan in remote.plan.sources]
        else:
            local_ids = self._checked_packed_ids(remote, remote_block_ids, local_block_ids, num_tokens)
        try:
            if remote.packed is not None:
                moved = self._read_packed(remote, request_id, remote_block_ids, local_ids, num_tokens, deadline)
            elif remote.plan.postprocess is not None and remote.sources[0].staging is not None:
                moved = self._read_staged(remote, request_id, rows, deadline)
            else:
                moved = self._read_in_place(remote, request_id, rows, local_block_ids, num_tokens, deadline)
        except TransferError as error:
            self._report_failure(remote, request_id, str(error))
            if isinstance(error, PeerDisconnected):
                self.forget(host, port)
            logger.error(
                "decode %s: request %s: pull from engine %s at %s:%d failed: %s",
                self.agent.name,
                request_id,
                remote.engine.engine_id,
                host,
                port,
                error,
            )
            self.metrics.pulls.labels("failed").inc()
            raise
        stats = PullStats(request_id=request_id, seconds=time.perf_counter() - started, **moved)
        self.metrics.observe_pull(stats.seconds, stats.bytes, stats.descriptors, stats.postprocess_exposed_seconds)
        return stats

    def _read_in_place(
        self,
        remote: _RemoteEngine,
        request_id: str,
        rows: list[tuple[np.ndarray, np.ndarray]],
        local_block_ids: list[int],
        num_tokens: int,
        deadline: float,
    ) -> dict[str, float | int]:
        """Reads straight into the cache; a postprocess, if any, fixes up each plane group in place on the
        worker thread while the next group is read."""
        postprocess = remote.plan.postprocess
        num_planes = len(self._planes)
        groups = _plane_groups(num_planes, self.pipeline_groups if postprocess is not None else 1)
        starts = [group.start for group in groups] + [num_planes]
        reads = []
        for source, (local_rows, remote_rows) in zip(remote.sources, rows, strict=True):
            # rows are listed plane by plane: row = (plane * num_blocks + block) * units + unit
            plane_of_row = local_rows // (source.local.num_rows // num_planes)
            order = np.argsort(plane_of_row, kind="stable")
            bounds = np.searchsorted(plane_of_row[order], starts)
            reads.append((source, local_rows[order], remote_rows[order], bounds))
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
            moved, rows_read = self._read_step(request_id, step, index == len(groups) - 1, deadline)
            total_bytes += moved
            descriptors += rows_read
            if postprocess is not None:
                job = (postprocess.apply, self._planes, local_block_ids, num_tokens, group)
                pending.append(self._postprocess_pool.submit(_timed, *job))
        reads_done = time.perf_counter()
        post_seconds = sum(f.result(timeout=max(0.001, deadline - time.perf_counter())) for f in pending)
        return {
            "bytes": total_bytes,
            "descriptors": descriptors,
            "read_seconds": reads_done - read_started,
            "postprocess_seconds": post_seconds,
            "postprocess_exposed_seconds": time.perf_counter() - reads_done,
        }

    def _read_staged(
        self,
        remote: _RemoteEngine,
        request_id: str,
        rows: list[tuple[np.ndarray, np.ndarray]],
        deadline: float,
    ) -> dict[str, float | int]:
        """Reads into a small registered staging area (two halves, each ``slots`` plane blocks, kept in the
        CPU cache) chunk by chunk, and scatters each chunk into its final place in the local layout on the
        worker thread while the next chunk is read: the cache is written once, as by a homogeneous read."""
        postprocess = remote.plan.postprocess
        staging = self._staging
        assert postprocess is not None and staging is not None
        slots = staging.slots
        num_blocks = self.cache.num_blocks
        plane_blocks_of = [
            local_rows // plan.local_units_per_block
            for (local_rows, _), plan in zip(rows, remote.plan.sources, strict=True)
        ]
        plane_blocks = np.unique(np.concatenate(plane_blocks_of))  # (plane * num_blocks + block), sorted
        num_chunks = -(-len(plane_blocks) // slots)
        reads = []
        for source, plan, (local_rows, remote_rows), mine in zip(
            remote.sources, remote.plan.sources, rows, plane_blocks_of, strict=True
        ):
            units = plan.local_units_per_block
            slot = np.searchsorted(plane_blocks, mine)
            chunk = slot // slots
            staging_rows = (slot % slots) * units + local_rows % units
            order = np.argsort(chunk, kind="stable")
            bounds = np.searchsorted(chunk[order], np.arange(num_chunks + 1))
            reads.append((source, staging_rows[order], remote_rows[order], bounds, slots * units))
        total_bytes = descriptors = 0
        in_flight: list[Future[float] | None] = [None, None]
        post_seconds = 0.0
        read_started = time.perf_counter()
        for index in range(num_chunks):
            half = index % 2
            previous = in_flight[half]
            if previous is not None:  # this half's last chunk must be scattered before it is overwritten
                post_seconds += previous.result(timeout=max(0.001, deadline - time.perf_counter()))
            step = [
                (
                    source,
                    source.staging,
                    staging_rows[bounds[index] : bounds[index + 1]] + half * half_rows,
                    remote_rows[bounds[index] : bounds[index + 1]],
                )
                for source, staging_rows, remote_rows, bounds, half_rows in reads
            ]
            moved, rows_read = self._read_step(request_id, step, index == num_chunks - 1, deadline)
            total_bytes += moved
            descriptors += rows_read
            chunk_blocks = plane_blocks[index * slots : (index + 1) * slots]
            job = (staging.scatter, postprocess.restage, chunk_blocks, half, self._planes, num_blocks)
            in_flight[half] = self._postprocess_pool.submit(_timed, *job)
        reads_done = time.perf_counter()
        for future in in_flight:
            if future is not None:
                post_seconds += future.result(timeout=max(0.001, deadline - time.perf_counter()))
        return {
            "bytes": total_bytes,
            "descriptors": descriptors,
            "read_seconds": reads_done - read_started,
            "postprocess_seconds": post_seconds,
            "postprocess_exposed_seconds": time.perf_counter() - reads_done,
        }

    def _checked_packed_ids(
        self, remote: _RemoteEngine, remote_block_ids: list[int], local_block_ids: list[int], num_tokens: int
    ) -> torch.Tensor:
        """Validate a packed pull's block ids before anything moves; returns the local ids as a tensor."""
        source = remote.plan.sources[0]
        block_ids_array(
            "remote_block_ids", remote_block_ids, num_tokens, source.remote_block_size, source.remote_num_blocks, False
        )
        local = block_ids_array(
            "local_block_ids", local_block_ids, num_tokens, self.cache.layout.block_size, self.cache.num_blocks, True
        )
        return torch.from_numpy(np.ascontiguousarray(local, dtype=np.int64))

    def _read_packed(
        self,
        remote: _RemoteEngine,
        request_id: str,
        remote_block_ids: list[int],
        local_block_ids: torch.Tensor,
        num_tokens: int,
        deadline: float,
    ) -> dict[str, float | int]:
        """Whole remote blocks into the packed staging area, a fill (whole regroup groups) at a time; each fill
        is regrouped into the local blocks before the next is read (the staging area is one buffer)."""
        staging = remote.packed
        assert staging is not None
        remote_size, local_size = remote.plan.sources[0].remote_block_size, self.cache.layout.block_size
        chunk_tokens = staging.tokens_per_chunk
        starts = list(range(0, num_tokens, chunk_tokens))
        total_bytes = descriptors = 0
        read_seconds = post_seconds = 0.0
        for index, first in enumerate(starts):
            tokens = min(chunk_tokens, num_tokens - first)
            remote_ids = remote_block_ids[first // remote_size : first // remote_size + -(-tokens // remote_size)]
            slots = list(range(len(remote_ids)))
            step = []
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
        return {
            "bytes": total_bytes,
            "descriptors": descriptors,
            "read_seconds": read_seconds,
            "postprocess_seconds": post_seconds,
            "postprocess_exposed_seconds": post_seconds,
        }

    def _read_step(
        self,
        request_id: str,
        step: list[tuple[_Source, DescriptorList | None, np.ndarray, np.ndarray]],
        last: bool,
        deadline: float,
    ) -> tuple[int, int]:
        """One READ per source of (local list, local rows) <- remote rows; the reads of the last step carry
        the ``ReadDone`` notifications. Returns (bytes, rows)."""
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

    def _done_message(self, request_id: str, source: _Source) -> bytes:
        return messages.encode(
            messages.ReadDone(
                request_id=request_id,
                reader_engine_id=self.engine_id,
                reader_rank=self.cache.layout.tp_rank,
                expected_readers=source.expected_readers,
                reply_to=self._reply_to if request_id in self._awaiting else b"",
            )
        )

    def _report_failure(self, remote: _RemoteEngine, request_id: str, reason: str) -> None:
        for source in remote.sources:
            failed = messages.ReadFailed(
                request_id=request_id,
                reader_engine_id=self.engine_id,
                reader_rank=self.cache.layout.tp_rank,
                expected_readers=source.expected_readers,
                reason=reason[:500],
            )
            try:
                self.agent.notify(source.peer, messages.encode(failed))
            except TransferError as error:
                logger.info(
                    "decode %s: could not tell %s about request %s: %s", self.agent.name, source.peer, request_id, error
                )

    # ------------------------------------------------------------------ leases: read, then confirm
    def _init_confirmations(self, confirm_timeout_s: float) -> None:
        self.confirm_timeout_s = confirm_timeout_s
        self._confirm_cond = threading.Condition()
        self._awaiting: dict[str, dict[str, messages.LeaseConfirm]] = {}  # request -> prefill agent -> answer
        self._pull_lock = threading.Lock()  # pull_confirmed: one pull at a time (the staging area is shared)
        self.malformed_notifications = 0
        self.unexpected_notifications = 0
        self.late_confirmations = 0

    def _on_notification(self, peer: str, payload: bytes) -> None:
        try:
            message = messages.decode(payload)
        except Exception as error:
            self.malformed_notifications += 1
            logger.warning("decode %s: malformed notification from %s dropped: %s", self.agent.name, peer, error)
            return
        if not isinstance(message, messages.LeaseConfirm):
            self.unexpected_notifications += 1
            logger.warning("decode %s: unexpected %s from %s dropped", self.agent.name, type(message).__name__, peer)
            return
        with self._confirm_cond:
            answers = self._awaiting.get(message.request_id)
            if answers is None:
                self.late_confirmations += 1
                logger.info(
                    "decode %s: confirmation of request %s from %s came after we stopped waiting",
                    self.agent.name,
                    message.request_id,
                    peer,
                )
                return
            answers[peer] = message
            self._confirm_cond.notify_all()

    def check_engine(self, host: str, port: int, engine_id: str) -> EngineMetadata:
        """Connect to ``host:port`` and check that it serves ``engine_id`` (``WrongEngine`` otherwise)."""
        engine = self.connect(host, port)
        if engine.engine_id != engine_id:
            raise WrongEngine(engine_id, engine.engine_id, host, port)
        return engine

    def pull_confirmed(
        self,
        request_id: str,
        host: str,
        port: int,
        remote_block_ids: list[int],
        local_block_ids: list[int],
        num_tokens: int,
        *,
        timeout_s: float | None = None,
        confirm_timeout_s: float | None = None,
    ) -> PullStats:
        """:meth:`pull`, then wait (at most ``confirm_timeout_s``) until every prefill rank read from confirms
        that the request's blocks were still held when our ``ReadDone`` reached it.

        Returns only once the KV is known good. Raises ``LeaseNotConfirmed`` if a rank refuses or stays
        silent (the local blocks may hold stale KV: do not use them), and whatever :meth:`pull` raises.
        On the way, decode rank 0 tells prefill ranks that no decode rank reads (``ReleaseUnread``).
        """
        self.connect(host, port)
        peers = self._source_peers(host, port)
        with self._confirm_cond:
            self._awaiting[request_id] = {}
            self.agent.set_expecting_reads(True)  # poll fast: the confirmations are on their way
        try:
            with self._pull_lock:
                stats = self.pull(
                    request_id, host, port, remote_block_ids, local_block_ids, num_tokens, timeout_s=timeout_s
                )
            self._release_unread(request_id, host, port)
            timeout = self.confirm_timeout_s if confirm_timeout_s is None else confirm_timeout_s
            ok, reason = self.wait_confirmed(request_id, peers, timeout)
        finally:
            with self._confirm_cond:
                self._awaiting.pop(request_id, None)
                self.agent.set_expecting_reads(bool(self._awaiting))
        if not ok:
            logger.error("decode %s: request %s: %s", self.agent.name, request_id, reason)
            self.metrics.unconfirmed_reads.inc()
            raise LeaseNotConfirmed(request_id, reason)
        return stats

    def wait_confirmed(self, request_id: str, peers: list[str], timeout_s: float) -> tuple[bool, str]:
        """Wait until each of ``peers`` (prefill agents) answered a ``ReadDone`` of ``request_id`` that
        carried ``reply_to`` (only while :meth:`pull_confirmed` awaits it). Returns (True, "") when all
        confirmed, (False, why) as soon as one refuses, or when ``timeout_s`` passes without every answer."""
        deadline = time.monotonic() + timeout_s
        with self._confirm_cond:
            while True:
                answers = self._awaiting.get(request_id, {})
                refused = [f"{peer}: {answer.reason}" for peer, answer in answers.items() if not answer.ok]
                if refused:
                    return False, "refused by " + "; ".join(refused)
                missing = [peer for peer in peers if peer not in answers]
                if not missing:
                    return True, ""
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False, f"no confirmation from {', '.join(missing)} within {timeout_s:g} s"
                self._confirm_cond.wait(remaining)

    def heartbeat(self, request_id: str, host: str, port: int) -> int:
        """Tell the prefill ranks we would read ``request_id`` from that we still mean to (extends its lease).
        Returns the number of ranks notified."""
        self.connect(host, port)
        sent = 0
        for peer in self._source_peers(host, port) + self._unread_peers(host, port):
            beat = messages.LeaseHeartbeat(
                request_id=request_id, reader_engine_id=self.engine_id, reader_rank=self.cache.layout.tp_rank
            )
            try:
                self.agent.notify(peer, messages.encode(beat))
                sent += 1
            except TransferError as error:
                logger.info("decode %s: heartbeat of %s to %s failed: %s", self.agent.name, request_id, peer, error)
        return sent

    def abandon(self, request_id: str, host: str, port: int, reason: str) -> None:
        """We will not read ``request_id`` (aborted, computed locally, or the read was refused before it
        started): tell the prefill ranks so that they free its blocks now rather than at the lease end."""
        self.connect(host, port)
        remote = self._remotes.get((host, port))
        if remote is not None:
            self._report_failure(remote, request_id, reason)
        self._release_unread(request_id, host, port)

    def _source_peers(self, host: str, port: int) -> list[str]:
        remote = self._remotes.get((host, port))
        return [] if remote is None else [source.peer for source in remote.sources]

    def _unread_peers(self, host: str, port: int) -> list[str]:
        """Decode rank 0 only: the agents of the prefill ranks no decode rank of our TP size reads (their
        heads are read from another rank holding the same ones), added as peers on first use."""
        remote = self._remotes.get((host, port))
        if remote is None or self.cache.layout.tp_rank != 0:
            return []
        peers = []
        for rank in remote.engine.ranks:
            if expected_readers(rank.tp_rank, rank.layout, self.cache.layout.tp_size) != 0:
                continue
            peers.append(
                rank.agent_name if self.agent.has_peer(rank.agent_name) else self.agent.add_peer(rank.agent_metadata)
            )
        return peers

    def _release_unread(self, request_id: str, host: str, port: int) -> None:
        """Free ``request_id`` on the prefill ranks no decode rank reads (best effort: their lease frees it
        otherwise)."""
        try:
            peers = self._unread_peers(host, port)
        except Exception as error:
            logger.info("decode %s: cannot reach unread prefill ranks for %s: %s", self.agent.name, request_id, error)
            return
        release = messages.encode(messages.ReleaseUnread(request_id=request_id, reader_engine_id=self.engine_id))
        for peer in peers:
            try:
                self.agent.notify(peer, release)
            except TransferError as error:
                logger.info("decode %s: releasing %s on %s failed: %s", self.agent.name, request_id, peer, error)

    def close(self) -> None:
        self._postprocess_pool.shutdown(wait=True)
        self.client.close()
        self.agent.close()
