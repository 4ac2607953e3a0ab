"""The receiving side: one decode TP rank that pulls a request's KV blocks from a prefill engine.

A :class:`DecodeRank` composes one NIXL agent (its cache registered; it carries the lease protocol's notifications)
with:

* the decode ends of the transports its ``transport`` option picks (:mod:`pd_transfer.connector.transports.registry`),
  in order of preference: each engine is opened by the first that does, into the link its requests are read by
  (NIXL reads and pushes, same-host IPC copies, reads in place, or a transport of your own);
* :class:`~.remote_engines.RemoteEngines`: per remote engine, once: handshake, compatibility check, the link;
* :class:`~.reports.ReaderReports` and :class:`~.confirmations.LeaseConfirmations`: what it tells the
  prefill ranks (``ReadDone``, ``ReadFailed``, heartbeats, ``ReleaseUnread``) and the ``LeaseConfirm``
  answers it waits for.

``pull`` reads; ``pull_confirmed`` reads, then makes sure the read saw live blocks: it ended inside the hold
window the prefill promised in its params (no round trip), or the prefill confirms the blocks were still held. Either
way (and for a plain ``pull``), under ``verify`` (``all``, ``sample``), the rows :class:`~.read_checks.ReadChecks`
picks are compared with the prefill's digest of them (``RowDigest``: a round trip inside the hold window too).

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
from pd_transfer.connector.errors import LeaseNotConfirmed, StreamUnsupported, WrongEngine
from pd_transfer.connector.options import DecodeOptions
from pd_transfer.connector.params import incarnation_token
from pd_transfer.connector.transports.registry import select
from pd_transfer.connector.transports.requests import PullRequest, PullStats, ReadTotals, StreamRequest
from pd_transfer.connector.transports.seam import DecodeEnd, DecodeSite, Source, StreamingLink
from pd_transfer.handshake.client import HandshakeClient
from pd_transfer.handshake.messages import EngineMetadata
from pd_transfer.metrics import TransferMetrics, default_metrics
from pd_transfer.topology import PeerPlan, expected_readers, plane_views
from pd_transfer.topology.packed import PackedBlockFormat
from pd_transfer.transfer.agent import NIXL_AGENTS
from pd_transfer.transfer.agent_protocol import Agent, AgentFactory
from pd_transfer.transfer.errors import DigestMismatch, PeerDisconnected, TransferError, TransferTimeout

from .confirmations import LeaseConfirmations
from .read_checks import ReadChecks
from .remote_engines import RemoteEngine, RemoteEngines
from .reports import ReaderReports

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
        """``options``: every knob of the rank (:class:`~pd_transfer.connector.options.DecodeOptions`, built at the
        process's edge; its ``transport`` picks the transports, an unknown one raising ``UnknownTransport`` before
        anything is made). ``agent_name``: its NIXL agent's (default: the engine id, the rank and a random suffix).
        ``metrics``: where it records (default: the process-wide ones). ``packed_formats(block_size)`` gives the
        packing of a (block, head) for a block size, for caches whose layout names a ``packing``: pulls from engines of
        another block size then read whole remote blocks into a staging area and regroup them (without it, such
        engines are refused). ``agent_factory``: makes the rank's agent (NIXL agents unless the caller hands in
        others: a fake fabric's in unit tests)."""
        transports = select(options.transport)
        self.engine_id = engine_id
        self.metrics = metrics if metrics is not None else default_metrics()
        self.cache = cache
        self.options = options
        name = agent_name or f"{engine_id}-decode-tp{cache.layout.tp_rank}-{uuid.uuid4().hex[:8]}"
        self.confirmations = LeaseConfirmations(name)
        self.agent: Agent = agent_factory(
            name, on_notification=self._on_notification, read_lanes=options.lane_count, settings=options.settings
        )
        self.ends: dict[str, DecodeEnd] = {}  # the transports' ends, in order of preference
        self._same_host = {transport.name: transport.same_host for transport in transports}
        try:
            self.agent.register_regions(cache.regions)
            self.read_checks = ReadChecks(cache, options.verify)
            self.reports = ReaderReports(
                name,
                engine_id,
                cache.layout.tp_rank,
                reply_to=self.agent.connection_metadata,
                awaits=self.confirmations.awaits,
            )
            site = DecodeSite(
                engine_id=engine_id,
                cache=cache,
                planes=plane_views(cache.tensors, cache.regions),
                agent=self.agent,
                options=options,
                metrics=self.metrics,
                packed_formats=packed_formats,
                read_done=self.reports.read_done,
                tell_read=self.reports.tell_read,
                deliver=self._on_message,
            )
            for transport in transports:
                self.ends[transport.name] = transport.decode_end(site)
        except BaseException:
            self._close_ends()
            self.agent.close()
            raise
        self.client = HandshakeClient(
            cache.layout.fingerprint,
            secret=options.secret,
            timeout_s=options.handshake_timeout_s,
            failure_backoff_s=options.handshake_failure_backoff_s,  # a dead prefill's endpoint fails fast this long
            metrics=self.metrics,
            prove_host=any(transport.same_host for transport in transports),  # then same-host offers are sent
        )
        self.remotes = RemoteEngines(name, cache, self.client, self.ends, metrics=self.metrics)
        self._not_served: dict[tuple[str, int, str], float] = {}  # (host, port, engine id) -> asked again after
        self._not_served_lock = threading.Lock()
        self._pull_lock = threading.Lock()  # pull_confirmed: one pull at a time (the staging area is shared)
        self.reads_in_window = 0  # pulls trusted by the prefill's hold window (no confirmation asked)
        self.reads_confirmed = 0  # pulls confirmed by every prefill rank read from

    def _on_notification(self, peer: str, payload: bytes) -> None:
        """A NIXL notification from prefill rank ``peer``: decoded once, then :meth:`_on_message` (a malformed one
        to :attr:`confirmations`, which logs it)."""
        try:
            message = messages.decode(payload)
        except Exception:
            self.confirmations.on_notification(peer, payload)
            return
        self._on_message(peer, message)

    def _on_message(self, peer: str, message: messages.PeerMessage) -> None:
        """A message from prefill rank ``peer``: to the transport it is meant for (push answers), else to
        :attr:`confirmations`."""
        for end in self.ends.values():
            if end.take(peer, message):
                return
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

    def push_ready(self, host: str, port: int, timeout_s: float) -> bool:
        """Connect to ``host:port`` and wait up to ``timeout_s`` until its source ranks answered whether they write
        into us (push); True when every one of them will (False at once where nothing is written into us: push is
        off here, or the engine's transport is never written into)."""
        return self.remotes.connect(host, port).link.push_ready(timeout_s)

    def forget(self, host: str, port: int) -> None:
        """Drop a remote engine (it restarted or died): its link and cached handshake."""
        self.remotes.forget(host, port)

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
        ``local_block_ids``, then notify every prefill rank read from. ``timeout_s`` (default
        ``read_timeout_s``) bounds the pull from its start, handshake included. Ranks that agreed to push write
        instead.

        Block ids are validated before anything is read (``ValueError``; ``DuplicateBlockIds`` for repeated
        remote ids, before connecting). On a transfer failure the prefill ranks are told (``ReadFailed``) when
        reachable and the error propagates, except that a read failed by a disconnected peer is made once more if
        its address now serves a new incarnation (the prefill restarted); a dead engine is dropped, so the next
        pull handshakes afresh.
        """
        request = PullRequest(request_id, remote_block_ids, local_block_ids, num_tokens)
        return self._pull(request, host, port, timeout_s)[0]

    def _pull(
        self,
        request: PullRequest,
        host: str,
        port: int,
        timeout_s: float | None,
        *,
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
                totals = self._read(remote, request, deadline)
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
                totals = self._read(remote, request, deadline)
        except TransferError as error:
            self._pull_failed(remote, request_id, error, tell=remote is not told)
            if isinstance(error, TransferTimeout):
                self._evict_stalled(remote, request_id)
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

    def _evict_stalled(self, remote: RemoteEngine, request_id: str) -> None:
        """A pull from ``remote`` timed out: drop the engine (its link: NIXL peers and their UCX endpoints, the
        ``tcp`` transport's connections; its cached handshake), so that the next pull handshakes afresh and opens
        new connections, without restarting either engine.

        Why: a read that times out most often waits on a connection the network cut. TCP retransmits with an
        exponential back-off, so a connection that lived through a cut of T seconds may stay silent for about T
        more after the wire is back, and every read on it meanwhile times out too (issue 42: after an 8 s cut, the
        next request's read on the old UCX endpoint timed out 4 s later; a fresh handshake moved KV at once). The
        price where the engine was only slow: one handshake and the peers' setup on the next pull (tens of ms), and
        other reads on the same link in flight now fail (they would have timed out as well). A remembered
        handshake failure is left alone: a timeout opens no fail-fast window."""
        if self.remotes.evict(remote.host, remote.port, remote):
            logger.warning(
                "decode %s: request %s: a pull from engine %s at %s:%d timed out; its link is dropped and the next"
                " pull handshakes afresh",
                self.agent.name,
                request_id,
                remote.engine.engine_id,
                remote.host,
                remote.port,
            )

    def _read(self, remote: RemoteEngine, request: PullRequest, deadline: float) -> ReadTotals:
        """``request``'s blocks from ``remote``, by the link its transport opened; the rows read checks pick compared
        with the prefill's digests of them (:mod:`.read_checks`: ``DigestMismatch`` where one differs, or did not come
        within ``confirm_timeout_s``)."""
        same_host = self._same_host.get(remote.transport, False)
        checks = self.read_checks.plan(remote.link, remote.engine, request, same_host=same_host)
        if not checks:
            return remote.link.read(request, deadline)
        request_id = request.request_id
        with self.confirmations.awaiting_digests(request_id, self.agent.set_expecting_reads):
            for check in checks:
                self.reports.check_rows(check.source, request_id, check.check)  # digested while the read runs
            totals = remote.link.read(request, deadline)
            landed = self.read_checks.landed(checks)
            peers = [check.source.peer for check in checks]
            answers = self.confirmations.wait_digests(request_id, peers, self.options.confirm_timeout_s)
        try:
            equal = self.read_checks.compare(request_id, checks, landed, answers)
        except DigestMismatch:
            self.metrics.digest_checks.labels("mismatch").inc()
            raise
        self.metrics.digest_checks.labels("equal").inc(equal)
        return totals

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

    def pull_streamed(
        self,
        request_id: str,
        host: str,
        port: int,
        local_block_ids: list[int],
        num_tokens: int,
        *,
        skip_blocks: int = 0,
        timeout_s: float | None = None,
    ) -> PullStats:
        """Stream ``num_tokens`` tokens of request ``request_id``'s KV from the prefill engine at ``host:port`` into
        ``local_block_ids`` while the prefill computes it (at once if it finished already): its blocks there are learnt
        from it, each layer arrives once it is written, and the prefill says the stream ended well (the request held,
        never computed again meanwhile): the KV is good when this returns, no confirmation to ask.
        ``request_id``: the prefill's id of the request, or the stream id both legs were given. ``skip_blocks``: the
        prefill's first blocks of it to leave out (a prefix this engine holds already). ``timeout_s`` (default
        ``read_timeout_s``) bounds the wait for the prefill to begin computing it, then each step after: a layer, or
        the end, that does not come within ``timeout_s`` of the one before fails the stream (a long prompt whose
        compute takes longer than ``timeout_s`` still streams while its layers keep coming).

        Raises ``StreamUnsupported`` where the engine's transport does not stream (wait for the prefill's params and
        :meth:`pull_confirmed` instead); ``ValueError`` for block ids that do not fit; a ``TransferError`` for a stream
        refused or broken (do not use the blocks; the prefill ranks are told ``ReadFailed``)."""
        started = time.perf_counter()
        remote = self.remotes.connect(host, port)
        connected = time.perf_counter()
        link = remote.link
        if not isinstance(link, StreamingLink):
            raise StreamUnsupported(f"engine {remote.engine.engine_id} is read by {remote.transport}: no streams")
        deadline = started + (self.options.read_timeout_s if timeout_s is None else timeout_s)
        try:
            totals = link.stream(StreamRequest(request_id, local_block_ids, num_tokens, skip_blocks), deadline)
        except TransferError as error:
            self._pull_failed(remote, request_id, error, tell=True)
            raise
        self._release_unread(totals.streamed_as or request_id, remote)
        stats = replace(
            totals.stats(request_id, time.perf_counter() - started),
            connect_seconds=connected - started,
            transport=remote.transport,
        )
        self.metrics.observe_pull(stats.seconds, stats.bytes, stats.descriptors, 0.0, transport=stats.transport)
        self.metrics.streamed_layers.inc(stats.layers_streamed)
        self.metrics.stream_tail_seconds.observe(stats.last_layer_seconds)
        return stats

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
            self._release_unread(request_id, remote)
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
        self._release_unread(request_id, remote)
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
        remote = self.remotes.connect(host, port)
        return self.reports.heartbeat(request_id, [*remote.sources, *self._unread(remote)])

    def abandon(self, request_id: str, host: str, port: int, reason: str) -> None:
        """We will not read ``request_id`` (aborted, computed locally, or the read was refused before it
        started): tell the prefill ranks so that they free its blocks now rather than at the lease end."""
        remote = self.remotes.connect(host, port)
        self.reports.read_failed(remote.sources, request_id, reason)
        self._release_unread(request_id, remote)

    def _release_unread(self, request_id: str, remote: RemoteEngine) -> None:
        """Free ``request_id`` on the prefill ranks of ``remote`` no decode rank reads (best effort: their lease frees
        it otherwise)."""
        try:
            unread = self._unread(remote)
        except Exception as error:
            logger.info("decode %s: cannot reach unread prefill ranks for %s: %s", self.agent.name, request_id, error)
            return
        self.reports.release_unread(request_id, unread)

    def _unread(self, remote: RemoteEngine) -> list[Source]:
        """Decode rank 0 only: the prefill ranks of ``remote`` that no decode rank of our TP size reads (their heads
        are read from another rank holding the same ones), reached through its link; [] on other ranks."""
        layout = self.cache.layout
        if layout.tp_rank != 0:
            return []
        ranks = remote.engine.ranks
        return [remote.link.reach(r) for r in ranks if expected_readers(r.tp_rank, r.layout, layout.tp_size) == 0]

    def close(self) -> None:
        """Wait for running fix-ups, then close the links, the transports' ends, the handshake client and the NIXL
        agent."""
        self.remotes.close()
        self._close_ends()
        self.client.close()
        self.agent.close()

    def _close_ends(self) -> None:
        for end in self.ends.values():
            end.close()
