"""The receiving side: one decode TP rank that pulls a request's KV blocks from a prefill engine.

A :class:`DecodeRank` composes one NIXL agent (its cache registered) with:

* :class:`~.remote_engines.RemoteEngines`: per remote engine, once: handshake, compatibility check, peers,
  a transfer plan and its descriptor lists, a warm-up read; or, where the engine is on this host and offers its
  memory, that memory opened through same-host IPC (``transport``: CUDA IPC for GPU caches);
* :class:`~.reads.BlockReader`: per request, the plan's rows read in place, staged or packed, one READ per
  prefill rank read from per step, the last carrying a ``ReadDone`` notification; for an engine opened through
  IPC, :class:`~.ipc_reads.IpcReader`: the rows copied on the rank's own stream, waited for, then ``ReadDone``;
* :class:`~.reports.ReaderReports` and :class:`~.confirmations.LeaseConfirmations`: what it tells the
  prefill ranks (``ReadDone``, ``ReadFailed``, heartbeats, ``ReleaseUnread``) and the ``LeaseConfirm``
  answers it waits for.

``pull`` reads; ``pull_confirmed`` reads, then makes sure the read saw live blocks: it ended inside the hold
window the prefill promised in its params (no round trip), or the prefill confirms the blocks were still held.

A prefill restarted at the same address (new NIXL agents, maybe a new engine id) is recognised and handshaken afresh
(:meth:`.remote_engines.RemoteEngines.refresh`): by ``check_engine`` when a request names another engine id than the
one connected there (for a second, an engine id found not served at an address is refused without asking
again), and by ``pull`` when a read fails because the peer disconnected: if the address then publishes a new
incarnation, the read is made once more from it, within the pull's deadline (whether the new incarnation holds
the request is for the lease confirmation to say: a prefill that never held it refuses), unless the request's
params name the incarnation that held it and that is another one (then the pull fails at once). Where nothing
listens at the address any more, the pull fails a few milliseconds after the read did: one handshake attempt and
one TCP connect, both refused.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import NoReturn

from pd_transfer.connector import messages
from pd_transfer.connector.cache import KVCache
from pd_transfer.connector.errors import LeaseNotConfirmed, WrongEngine
from pd_transfer.connector.params import incarnation_token
from pd_transfer.connector.push_staging import LandingArea
from pd_transfer.handshake.client import HandshakeClient
from pd_transfer.handshake.messages import EngineMetadata
from pd_transfer.metrics import TransferMetrics, default_metrics
from pd_transfer.topology import PeerPlan, plane_views
from pd_transfer.topology.packed import PackedBlockFormat
from pd_transfer.transfer.agent import NIXL_AGENTS
from pd_transfer.transfer.agent_protocol import Agent, AgentFactory
from pd_transfer.transfer.errors import PeerDisconnected, TransferError

from .cma_reads import CmaReader
from .confirmations import LeaseConfirmations
from .ipc_reads import IpcReader
from .options import DecodeOptions
from .push_client import PushOrders
from .reader import Reader
from .reads import BlockReader, ReadTotals
from .remote_engines import Claim, RemoteEngine, RemoteEngines
from .reports import ReaderReports
from .request import PullRequest, PullStats

logger = logging.getLogger(__name__)

_NOT_SERVED_S = 1.0  # an engine id found not served at an address is refused this long without asking again
_NOT_SERVED_MAX = 1024  # remembered (address, engine id) pairs before the expired ones are swept
_WINDOW_READ_ALLOWANCE_S = 0.5  # a read relies on the hold window only if this much of it is left at its start


def engine_incarnation(remote: RemoteEngine) -> str:
    """The incarnation token (``remote_incarnation``) of the engine ``remote`` connects to."""
    return incarnation_token(rank.agent_name for rank in sorted(remote.engine.ranks, key=lambda r: r.tp_rank))


class DecodeRank:
    """One decode TP rank's receiving side: ``pull`` and ``pull_confirmed`` from prefill engines, addressed by
    their side channel ``host:port``. Thread-safe; ``close`` releases the agent."""

    def __init__(
        self,
        engine_id: str,
        cache: KVCache,
        options: DecodeOptions,
        *,
        agent_name: str | None = None,
        metrics: TransferMetrics | None = None,
        packed_formats: Callable[[int], PackedBlockFormat] | None = None,
        agent_factory: AgentFactory = NIXL_AGENTS,
    ) -> None:
        """``options``: every knob of the rank (:class:`~.options.DecodeOptions`, built at the process's edge).
        ``agent_name``: its NIXL agent's (default: the engine id, the rank and a random suffix). ``metrics``: where
        it records (default: the process-wide ones). ``packed_formats(block_size)`` gives the packing of a (block,
        head) for a block size, for caches whose layout names a ``packing``: pulls from engines of another block
        size then read whole remote blocks into a staging area and regroup them (without it, such engines are
        refused). ``agent_factory``: makes the rank's agent (NIXL agents unless the caller hands in others: a fake
        fabric's in unit tests)."""
        self.engine_id = engine_id
        self.metrics = metrics if metrics is not None else default_metrics()
        self.cache = cache
        self.options = options
        name = agent_name or f"{engine_id}-decode-tp{cache.layout.tp_rank}-{uuid.uuid4().hex[:8]}"
        self.confirmations = LeaseConfirmations(name)
        settings = options.settings
        lanes = options.lane_count
        mode = options.push_mode
        landed = not cache.place.is_host if options.push_staging is None else options.push_staging
        if not cache.place.is_host and not landed:
            mode = "off"
        self.pushes: PushOrders | None = None
        self.agent: Agent = agent_factory(
            name, on_notification=self._on_notification, read_lanes=lanes, settings=settings
        )
        reply_to = self.agent.connection_metadata
        self.agent.register_regions(cache.regions)
        if mode != "off":
            landing = None
            if landed:
                landing = LandingArea(cache.tensors, landing_bytes=options.push_landing_bytes)
                self.agent.register_spans([landing.span], huge_pages=False)
            self.pushes = PushOrders(self.agent, engine_id, cache.layout.tp_rank, mode=mode, landing=landing)
        self.client = HandshakeClient(
            cache.layout.fingerprint,
            secret=options.secret,
            timeout_s=options.handshake_timeout_s,
            failure_backoff_s=options.handshake_failure_backoff_s,  # a dead prefill's endpoint fails fast this long
            metrics=self.metrics,
            prove_host=options.transport != "nixl",  # same-host prefills then send their IPC handles
        )
        self.remotes = RemoteEngines(
            self.agent,
            cache,
            self.client,
            read_timeout_s=options.read_timeout_s,
            min_direct_run_bytes=options.min_direct_run_bytes,
            staging_bytes=options.staging_bytes,
            packed_formats=packed_formats,
            packed_staging_bytes=options.packed_staging_bytes,
            metrics=self.metrics,
            on_connected=None if self.pushes is None else self.pushes.offer,
            transport=options.transport,
        )
        self._not_served: dict[tuple[str, int, str], float] = {}  # (host, port, engine id) -> asked again after
        self._not_served_lock = threading.Lock()
        self.reports = ReaderReports(
            self.agent, engine_id, cache.layout.tp_rank, reply_to=reply_to, awaits=self.confirmations.awaits
        )
        planes = plane_views(cache.tensors, cache.regions)
        self.reader = BlockReader(
            self.agent,
            cache,
            planes,
            pipeline_groups=options.pipeline_groups,
            done_message=self.reports.read_done,
            pushes=self.pushes,
            staged_jobs_per_lane=options.staged_jobs_per_lane,
        )
        ipc_reader = IpcReader(self.agent, cache, planes, tell_read=self.reports.tell_read)
        cma_reader = CmaReader(
            self.agent, planes, threads=lanes, timeout_s=options.read_timeout_s, tell_read=self.reports.tell_read
        )
        #: The reader of each transport an engine may be connected with (chosen once, at its connect).
        self.readers: dict[str, Reader] = {
            "nixl": self.reader,
            "cuda_ipc": ipc_reader,
            "host_ipc": ipc_reader,
            "host_cma": cma_reader,
        }
        self._pull_lock = threading.Lock()  # pull_confirmed: one pull at a time (the staging area is shared)
        self.reads_in_window = 0  # pulls trusted by the prefill's hold window (no confirmation asked)
        self.reads_confirmed = 0  # pulls confirmed by every prefill rank read from

    def _on_notification(self, peer: str, payload: bytes) -> None:
        """Decoded once: push answers to :attr:`pushes`, the rest (malformed too) to :attr:`confirmations`."""
        if self.pushes is None:
            self.confirmations.on_notification(peer, payload)
            return
        try:
            message = messages.decode(payload)
        except Exception:
            self.confirmations.on_notification(peer, payload)  # counts and logs it
            return
        if not self.pushes.take(message):
            self.confirmations.on_message(peer, message)

    # ------------------------------------------------------------------ remote engines
    def connect(self, host: str, port: int) -> EngineMetadata:
        """Handshake with the prefill engine at ``host:port`` and prepare to read from it (idempotent)."""
        return self.remotes.connect(host, port).engine

    def check_engine(self, host: str, port: int, engine_id: str) -> EngineMetadata:
        """Connect to ``host:port`` and check that it serves ``engine_id`` (``WrongEngine`` otherwise). When the
        engine connected there has another id, the address is handshaken afresh first: the prefill may have
        restarted with a new id (vLLM's default); if so, it is connected in place of the old one."""
        remote = self.remotes.connect(host, port)
        if remote.engine.engine_id == engine_id:
            return remote.engine
        key = (host, port, engine_id)
        now = time.monotonic()
        with self._not_served_lock:
            if self._not_served.get(key, 0.0) > now:
                raise WrongEngine(engine_id, remote.engine.engine_id, host, port)
        engine = self.remotes.refresh(host, port, remote).engine
        if engine.engine_id != engine_id:
            with self._not_served_lock:
                if len(self._not_served) >= _NOT_SERVED_MAX:
                    self._not_served = {k: t for k, t in self._not_served.items() if t > now}
                self._not_served[key] = now + _NOT_SERVED_S
            raise WrongEngine(engine_id, engine.engine_id, host, port)
        return engine

    def remote_plan(self, host: str, port: int) -> PeerPlan:
        """The transfer plan used for the engine at ``host:port`` (connecting first if needed)."""
        return self.remotes.connect(host, port).plan

    def add_reader(self, transport: str, reader: Reader, claims: Claim) -> None:
        """Read the engines ``claims`` takes (asked once per engine, at its connect, before the built-in choice) with
        ``reader``, under the name ``transport`` (its pulls' ``transport`` label). Call before connecting to them; the
        rank closes ``reader`` when it closes. ``ValueError`` for a name already in use."""
        if transport in self.readers:
            raise ValueError(f"decode {self.agent.name}: a reader named {transport!r} is there already")
        self.readers[transport] = reader
        self.remotes.claims[transport] = claims

    def push_ready(self, host: str, port: int, timeout_s: float) -> bool:
        """Connect to ``host:port`` and wait up to ``timeout_s`` until its source ranks answered our push setup;
        True when every one of them will push (False at once when push is off here)."""
        remote = self.remotes.connect(host, port)
        if self.pushes is None:
            return False
        return self.pushes.wait_ready([source.peer for source in remote.sources], timeout_s)

    def forget(self, host: str, port: int) -> None:
        """Drop a remote engine (it restarted or died): its peers, descriptor lists and cached handshake."""
        remote = self.remotes.get(host, port)
        self.remotes.forget(host, port)
        if remote is not None and self.pushes is not None:
            self.pushes.forget([source.peer for source in remote.sources])

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
        pushed: bool = True,
    ) -> PullStats:
        """Read ``num_tokens`` tokens of KV from the prefill engine at ``host:port`` into
        ``local_block_ids``, then notify every prefill rank read from. ``timeout_s`` (default
        ``read_timeout_s``) bounds the pull from its start, handshake included. Ranks that agreed to push write
        instead, unless ``pushed`` is False (benchmarks compare both ways).

        Block ids are validated before anything is read (``ValueError``; ``DuplicateBlockIds`` for repeated
        remote ids, before connecting). On a transfer failure the prefill ranks are told (``ReadFailed``) when
        reachable and the error propagates, except that a read failed by a disconnected peer is made once more if
        its address now serves a new incarnation (the prefill restarted); a dead engine is dropped, so the next
        pull handshakes afresh.
        """
        request = PullRequest(request_id, remote_block_ids, local_block_ids, num_tokens)
        return self._pull(request, host, port, timeout_s, pushed=pushed)[0]

    def _pull(
        self,
        request: PullRequest,
        host: str,
        port: int,
        timeout_s: float | None,
        *,
        pushed: bool = True,
        incarnation: str | None = None,
    ) -> tuple[PullStats, RemoteEngine]:
        """:meth:`pull`; also returns the engine read from (a new incarnation if the prefill restarted). With the
        ``incarnation`` that holds the request (from its params), a restart found after a disconnect fails the pull
        at once unless the new incarnation is that one: another never held the request."""
        started = time.perf_counter()
        remote = self.remotes.connect(host, port)
        connected = time.perf_counter()
        deadline = started + (self.options.read_timeout_s if timeout_s is None else timeout_s)
        request_id = request.request_id
        told: RemoteEngine | None = None  # already sent ReadFailed
        try:
            try:
                totals = self._read(remote, request, deadline, pushed)
            except PeerDisconnected as error:
                self.reports.read_failed(remote.sources, request_id, str(error))  # best effort: it is gone
                told = remote
                remote = self._after_disconnect(remote, request_id, error)  # raises unless it restarted
                if incarnation is not None and engine_incarnation(remote) != incarnation:
                    told = remote  # it never held the request: nothing to tell it
                    raise PeerDisconnected(
                        f"{error}; the prefill at {host}:{port} restarted, and its new incarnation never held"
                        f" request {request_id}"
                    ) from None
                totals = self._read(remote, request, deadline, pushed)
        except TransferError as error:
            self._pull_failed(remote, request_id, error, tell=remote is not told)
            raise
        stats = replace(
            totals.stats(request_id, time.perf_counter() - started),
            connect_seconds=connected - started,
            transport=remote.transport,
        )
        self.metrics.observe_pull(
            stats.seconds,
            stats.bytes,
            stats.descriptors,
            stats.postprocess_exposed_seconds,
            stats.pushed_bytes,
            transport=stats.transport,
        )
        return stats, remote

    def _read(self, remote: RemoteEngine, request: PullRequest, deadline: float, pushed: bool) -> ReadTotals:
        """``request``'s blocks from ``remote``, by the reader of the transport it was connected with."""
        return self.readers[remote.transport].read(remote, request, deadline, pushed=pushed)

    def _after_disconnect(self, remote: RemoteEngine, request_id: str, error: PeerDisconnected) -> RemoteEngine:
        """A read from ``remote`` failed because its peer went away: handshake with its address afresh and return
        the new incarnation there. Raises ``PeerDisconnected`` if there is none, naming why (the engine is then
        dropped, and the next pull handshakes afresh). Where nothing listens at the address any more, that is known
        after one refused attempt and one refused TCP connect (:class:`~pd_transfer.handshake.client.HandshakeClient`),
        a few milliseconds, and while the address is in its fail-fast window at once."""
        try:
            fresh = self.remotes.refresh(remote.host, remote.port, remote, dropping_on_failure=True)
        except Exception as refresh_error:
            logger.info(
                "decode %s: engine %s at %s:%d is gone (%s); dropped",
                self.agent.name,
                remote.engine.engine_id,
                remote.host,
                remote.port,
                refresh_error,
            )
            raise PeerDisconnected(f"{error}; and then: {refresh_error}") from None
        if fresh is remote:  # the same agents answer: not a restart; drop it as a dead engine anyway
            self.forget(remote.host, remote.port)
            raise error
        logger.warning(
            "decode %s: request %s: engine %s at %s:%d restarted; reading from its new incarnation (%s)",
            self.agent.name,
            request_id,
            remote.engine.engine_id,
            remote.host,
            remote.port,
            fresh.engine.engine_id,
        )
        return fresh

    def _pull_failed(self, remote: RemoteEngine, request_id: str, error: TransferError, *, tell: bool) -> None:
        """Tell the source ranks (``tell``), log and count the failure."""
        if tell:
            self.reports.read_failed(remote.sources, request_id, str(error))
        logger.error(
            "decode %s: request %s: pull from engine %s at %s:%d failed: %s",
            self.agent.name,
            request_id,
            remote.engine.engine_id,
            remote.host,
            remote.port,
            error,
        )
        self.metrics.pulls.labels("failed", remote.transport).inc()

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
        trust_until: float | None = None,
        incarnation: str | None = None,
    ) -> PullStats:
        """:meth:`pull`, then make sure the read saw the request's live blocks: either it ended before
        ``trust_until`` (``time.monotonic``; the hold window the prefill promised, see
        :meth:`pd_transfer.connector.params.RemotePrefill.trust_deadline`) and was made from the incarnation
        ``incarnation`` that promised it, or (without a usable window) every prefill rank read from confirms, within
        ``confirm_timeout_s``, that the blocks were still held when our ``ReadDone`` reached it.

        Returns only once the KV is known good. Raises ``LeaseNotConfirmed`` if a rank refuses or stays
        silent, or a read without confirmation ended outside the window (the local blocks may hold stale KV:
        do not use them), and whatever :meth:`pull` raises. On the way, decode rank 0 tells prefill ranks that
        no decode rank reads (``ReleaseUnread``).
        """
        request = PullRequest(request_id, remote_block_ids, local_block_ids, num_tokens)
        started = time.perf_counter()
        remote = self.remotes.connect(host, port)
        connect_seconds = time.perf_counter() - started
        if self._window_usable(remote, trust_until, incarnation):
            assert trust_until is not None
            stats = self.pull_in_window(request, host, port, timeout_s, trust_until, incarnation)
            return replace(stats, connect_seconds=stats.connect_seconds + connect_seconds)
        with self.confirmations.awaiting(request_id, self.agent.set_expecting_reads):  # poll fast meanwhile
            with self._pull_lock:
                stats, remote = self._pull(request, host, port, timeout_s, incarnation=incarnation)
            # of the incarnation read from; a rank that pushed confirmed with the write
            peers = [source.peer for source in remote.sources if source.peer not in stats.pushed_peers]
            self._release_unread(request_id, host, port)
            timeout = self.options.confirm_timeout_s if confirm_timeout_s is None else confirm_timeout_s
            waiting = time.perf_counter()
            ok, reason = self.wait_confirmed(request_id, peers, timeout) if peers else (True, "")
            confirm_seconds = time.perf_counter() - waiting
        if not ok:
            self._unconfirmed(request_id, reason)
        self.reads_confirmed += 1
        return replace(stats, connect_seconds=stats.connect_seconds + connect_seconds, confirm_seconds=confirm_seconds)

    @staticmethod
    def _window_usable(remote: RemoteEngine, trust_until: float | None, incarnation: str | None) -> bool:
        """Whether a read from ``remote`` starting now may rely on the hold window instead of a confirmation:
        the window is known, promised by this incarnation, and has at least ``_WINDOW_READ_ALLOWANCE_S`` left."""
        if trust_until is None or incarnation is None or incarnation != engine_incarnation(remote):
            return False
        return trust_until - time.monotonic() >= _WINDOW_READ_ALLOWANCE_S

    def pull_in_window(
        self,
        request: PullRequest,
        host: str,
        port: int,
        timeout_s: float | None,
        trust_until: float,
        incarnation: str | None,
    ) -> PullStats:
        """:meth:`pull_confirmed` relying on the hold window, whatever is left of it: :meth:`pull` without asking
        for confirmations; the KV counts only if the read ended before ``trust_until`` (``time.monotonic``) from
        the incarnation ``incarnation`` that promised the window (a prefill restarted meanwhile did not), else
        ``LeaseNotConfirmed``. :meth:`pull_confirmed` takes this way only with enough of the window left."""
        request_id = request.request_id
        with self._pull_lock:
            stats, remote = self._pull(request, host, port, timeout_s, incarnation=incarnation)
        ended = time.monotonic()
        self._release_unread(request_id, host, port)
        if len(stats.pushed_peers) == len(remote.sources):  # every rank wrote from blocks it held and pinned
            self.reads_in_window += 1
            return stats
        if engine_incarnation(remote) != incarnation:
            self._unconfirmed(request_id, "read from a restarted prefill, not the one that held the blocks")
        if ended > trust_until:
            late = ended - trust_until
            self._unconfirmed(request_id, f"the read ended {late:.3f} s after the prefill's hold window")
        self.reads_in_window += 1
        return stats

    def _unconfirmed(self, request_id: str, reason: str) -> NoReturn:
        """Log, count and raise ``LeaseNotConfirmed``: the read KV must not be used."""
        logger.error("decode %s: request %s: %s", self.agent.name, request_id, reason)
        self.metrics.unconfirmed_reads.inc()
        raise LeaseNotConfirmed(request_id, reason)

    def wait_confirmed(self, request_id: str, peers: list[str], timeout_s: float) -> tuple[bool, str]:
        """Wait until each of ``peers`` (prefill agents) answered a ``ReadDone`` of ``request_id`` that
        carried ``reply_to`` (only while :meth:`pull_confirmed` awaits it). Returns (True, "") when all
        confirmed, (False, why) as soon as one refuses, or when ``timeout_s`` passes without every answer."""
        return self.confirmations.wait(request_id, peers, timeout_s)

    # ------------------------------------------------------------------ leases without a read
    def heartbeat(self, request_id: str, host: str, port: int) -> int:
        """Tell the prefill ranks we would read ``request_id`` from that we still mean to (extends its lease).
        Returns the number of ranks notified."""
        self.connect(host, port)
        peers = self.remotes.source_peers(host, port) + self.remotes.unread_peers(host, port)
        return self.reports.heartbeat(request_id, peers)

    def abandon(self, request_id: str, host: str, port: int, reason: str) -> None:
        """We will not read ``request_id`` (aborted, computed locally, or the read was refused before it
        started): tell the prefill ranks so that they free its blocks now rather than at the lease end."""
        self.connect(host, port)
        remote = self.remotes.get(host, port)
        if remote is not None:
            self.reports.read_failed(remote.sources, request_id, reason)
        self._release_unread(request_id, host, port)

    def _release_unread(self, request_id: str, host: str, port: int) -> None:
        """Free ``request_id`` on the prefill ranks no decode rank reads (best effort: their lease frees it
        otherwise)."""
        try:
            peers = self.remotes.unread_peers(host, port)
        except Exception as error:
            logger.info("decode %s: cannot reach unread prefill ranks for %s: %s", self.agent.name, request_id, error)
            return
        self.reports.release_unread(request_id, peers)

    def close(self) -> None:
        """Wait for running fix-ups, then close the IPC handles, the handshake client and the NIXL agent."""
        for reader in {id(r): r for r in self.readers.values()}.values():  # each once (IPC serves two transports)
            reader.close()
        self.remotes.close()
        self.client.close()
        self.agent.close()
