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

from pd_transfer.handshake.client import HandshakeClient
from pd_transfer.handshake.messages import EngineMetadata
from pd_transfer.topology import PeerPlan, check_compatible, expected_readers, plane_views
from pd_transfer.transfer.agent import DescriptorList, TransferAgent
from pd_transfer.transfer.errors import PeerDisconnected, TransferError

from . import messages
from .cache import KVCache

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


@dataclass
class _RemoteEngine:
    engine: EngineMetadata
    host: str
    port: int
    plan: PeerPlan
    sources: list[_Source]


class DecodeRank:
    """One decode TP rank's receiving side."""

    def __init__(
        self,
        engine_id: str,
        cache: KVCache,
        *,
        secret: bytes | str | None = None,
        handshake_timeout_s: float = 5.0,
        read_timeout_s: float = 30.0,
        min_direct_run_bytes: int | None = None,
        pipeline_groups: int = 8,
        agent_name: str | None = None,
    ) -> None:
        self.engine_id = engine_id
        self.cache = cache
        self.read_timeout_s = read_timeout_s
        self._min_direct_run_bytes = min_direct_run_bytes
        rank = cache.layout.tp_rank
        self.agent = TransferAgent(agent_name or f"{engine_id}-decode-tp{rank}-{uuid.uuid4().hex[:8]}")
        self.agent.register_regions(cache.regions)
        self.client = HandshakeClient(cache.layout.fingerprint, secret=secret, timeout_s=handshake_timeout_s)
        self._planes = plane_views(cache.tensors, cache.regions)
        self._remotes: dict[tuple[str, int], _RemoteEngine] = {}
        self._connect_lock = threading.Lock()
        self.pipeline_groups = pipeline_groups
        self._postprocess_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pd-transfer-postprocess")

    # ------------------------------------------------------------------ connecting
    def connect(self, host: str, port: int) -> EngineMetadata:
        """Handshake with the prefill engine at ``host:port`` and prepare to read from it (idempotent)."""
        key = (host, port)
        with self._connect_lock:
            remote = self._remotes.get(key)
            if remote is None:
                remote = self._connect(host, port)
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
        plan = PeerPlan.build(
            local,
            list(self.cache.regions),
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
                sources.append(_Source(source.remote_rank, peer, local_list, remote_list, readers))
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
            "yes" if plan.postprocess is not None else "no",
            (time.perf_counter() - started) * 1e3,
        )
        return _RemoteEngine(engine=engine, host=host, port=port, plan=plan, sources=sources)

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

        On failure the prefill ranks are told (``ReadFailed``) when reachable, a dead engine is
        forgotten so the next pull handshakes afresh, and the error propagates.
        """
        started = time.perf_counter()
        self.connect(host, port)
        remote = self._remotes[(host, port)]
        timeout_s = self.read_timeout_s if timeout_s is None else timeout_s
        deadline = started + timeout_s
        postprocess = remote.plan.postprocess
        num_planes = len(self._planes)
        groups = _plane_groups(num_planes, self.pipeline_groups if postprocess is not None else 1)
        # rows of each source, split by plane group: row = (plane * num_blocks + block) * units + unit
        reads = []
        for source, source_plan in zip(remote.sources, remote.plan.sources, strict=True):
            local_rows, remote_rows = source_plan.indices(remote_block_ids, local_block_ids, num_tokens)
            rows_per_plane = source.local.num_rows // num_planes
            plane_of_row = local_rows // rows_per_plane
            bounds = np.searchsorted(plane_of_row, [group.start for group in groups] + [num_planes])
            if not np.all(np.diff(plane_of_row) >= 0):  # the plan lists rows plane by plane; keep it honest
                order = np.argsort(plane_of_row, kind="stable")
                local_rows, remote_rows, plane_of_row = local_rows[order], remote_rows[order], plane_of_row[order]
                bounds = np.searchsorted(plane_of_row, [group.start for group in groups] + [num_planes])
            reads.append((source, local_rows, remote_rows, bounds))
        total_bytes = 0
        descriptors = 0
        pending: list[Future[float]] = []
        read_started = time.perf_counter()
        try:
            for index, group in enumerate(groups):
                last = index == len(groups) - 1
                for source, local_rows, remote_rows, bounds in reads:
                    selected = slice(bounds[index], bounds[index + 1])
                    stats = self.agent.read(
                        source.local,
                        local_rows[selected],
                        source.remote,
                        remote_rows[selected],
                        notification=self._done_message(request_id, source) if last else b"",
                        timeout_s=max(0.0, deadline - time.perf_counter()),
                    )
                    total_bytes += stats.bytes
                    descriptors += stats.descriptors
                if postprocess is not None:  # fix this group up while the next one is read
                    pending.append(
                        self._postprocess_pool.submit(
                            _timed, postprocess.apply, self._planes, local_block_ids, num_tokens, group
                        )
                    )
        except TransferError as error:
            for future in pending:
                future.cancel()
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
            raise
        read_seconds = time.perf_counter() - read_started
        reads_done = time.perf_counter()
        postprocess_seconds = sum(
            future.result(timeout=max(0.001, deadline - time.perf_counter())) for future in pending
        )
        exposed_seconds = time.perf_counter() - reads_done
        return PullStats(
            request_id=request_id,
            bytes=total_bytes,
            descriptors=descriptors,
            read_seconds=read_seconds,
            postprocess_seconds=postprocess_seconds,
            postprocess_exposed_seconds=exposed_seconds,
            seconds=time.perf_counter() - started,
        )

    def _done_message(self, request_id: str, source: _Source) -> bytes:
        return messages.encode(
            messages.ReadDone(
                request_id=request_id,
                reader_engine_id=self.engine_id,
                reader_rank=self.cache.layout.tp_rank,
                expected_readers=source.expected_readers,
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

    def close(self) -> None:
        self._postprocess_pool.shutdown(wait=True)
        self.client.close()
        self.agent.close()
