"""The sending side: one prefill TP rank whose blocks decode ranks read, and the server that
publishes an engine's ranks on the side channel.

A rank makes the prefill end of each transport its ``transport`` option picks (NIXL always:
:mod:`pd_transfer.connector.transports.registry`) and publishes their offers under their names in its metadata (e.g.
same-host IPC, :mod:`pd_transfer.connector.transports.ipc`: a GPU cache in memory a legacy CUDA IPC handle can share, a
host cache allocated shareable, any host cache read in place), made once, here; the side channel sends the same-host
ones only to decode processes that proved they run on this host. Messages meant for a transport's writer (push) go to
its end. The rank keeps its cache registered until ``close``; the cache itself is the engine's and outlives the rank, so
closing a rank whose memory decodes still have open is safe.

Ordering: a hold may carry a ``ready`` event (:class:`ReadyEvent`, e.g. a ``torch.cuda.Event`` the engine recorded
after the kernels that wrote the request's KV); the lease starts only once it completed, so the blocks are never
offered to readers (nor written by a push, nor confirmed) before their KV is complete.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import msgspec

from pd_transfer.affinity import unpinning
from pd_transfer.connector import messages
from pd_transfer.connector.cache import KVCache
from pd_transfer.connector.held_digests import HeldDigests
from pd_transfer.connector.leases import Freed, LeaseLedger, Reply
from pd_transfer.connector.options import PrefillOptions
from pd_transfer.connector.prefill.read_checks import RowDigests, Verdict
from pd_transfer.connector.streams import StreamBoard
from pd_transfer.connector.transports.registry import select
from pd_transfer.connector.transports.seam import Answer, PrefillEnd, PrefillSite
from pd_transfer.handshake.messages import EngineMetadata, RankMetadata, TransportOffer
from pd_transfer.handshake.server import HandshakeServer
from pd_transfer.handshake.server import ReleaseHandler as SideChannelRelease
from pd_transfer.metrics import TransferMetrics, default_metrics
from pd_transfer.transfer.agent import NIXL_AGENTS
from pd_transfer.transfer.agent_protocol import Agent, AgentFactory
from pd_transfer.transfer.errors import PeerDisconnected, TransferError

logger = logging.getLogger(__name__)

#: Read checks a rank queues at most; more are refused at once (a reader asking faster than digests are made).
MAX_QUEUED_CHECKS = 256
#: Called once per request when every expected decode reader has reported: (request_id, readers).
ReleaseHandler = Callable[[str, list[messages.PeerMessage]], None]


class ReadyEvent(Protocol):
    """Completes once the work that wrote some KV has finished (``torch.cuda.Event`` is one)."""

    def synchronize(self) -> None:
        """Block until the event completed."""


class PrefillRank:
    """One prefill TP rank: its cache registered with NIXL, and the :class:`LeaseLedger` of the requests whose
    blocks it holds for decode readers.

    ``hold`` starts a finished request's lease; the blocks come back, once, from ``hold`` itself, from
    ``expire`` (lease over), ``abort``, or from ``take_freed`` (every reader reported; collected on the
    notification thread). A ``ReadDone`` carrying ``reply_to`` is answered with a ``LeaseConfirm`` sent back
    to the reader over NIXL, or the way its transport brought the report (on a helper thread, so the progress thread
    never waits for a connection). A ``CheckRows`` (read checks, a host cache's rank) is answered with the
    ``RowDigest`` of the rows it names, computed on a thread of its own while the reader reads.
    ``on_release`` fires once per request when every expected reader has reported, on the progress thread.
    """

    def __init__(
        self,
        engine_id: str,
        cache: KVCache,
        options: PrefillOptions,
        *,
        on_release: ReleaseHandler | None = None,
        agent_name: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        metrics: TransferMetrics | None = None,
        agent_factory: AgentFactory = NIXL_AGENTS,
    ) -> None:
        """``options``: every knob of the rank (:class:`~pd_transfer.connector.options.PrefillOptions`, built at the
        process's edge; its ``transport`` picks the transports, an unknown one raising ``UnknownTransport`` before
        anything is made). ``on_release``: called once per request when every expected reader has reported.
        ``agent_name``: its NIXL agent's (default: the engine id, the rank and a random suffix). ``clock``: the leases'
        (``time.monotonic``). ``metrics``: where it records (default: the process-wide ones). ``agent_factory``: makes
        the rank's agent and its writers' (NIXL agents unless the caller hands in others: a fake fabric's in unit
        tests)."""
        transports = select(options.transport)
        if all(transport.name != "nixl" for transport in transports):
            transports = (*transports, *select("nixl"))  # the rank's agent serves reads and carries the notifications
        settings = options.settings
        self.engine_id = engine_id
        self.metrics = metrics if metrics is not None else default_metrics()
        self.cache = cache
        self._on_release = on_release
        self.options = options
        self.ledger = LeaseLedger(options.lease_seconds, clock=clock)
        self.streams = StreamBoard(len({region.layer for region in cache.regions}))
        self.held = HeldDigests(cache) if cache.place.is_host else None  # each request digested at its hold
        if self.held is not None:
            self.streams.observe(self.held)
        self.row_digests = RowDigests(cache, self.held) if self.held is not None else None
        self._cond = threading.Condition()
        self._freed: list[Freed] = []  # freed by reader reports, until take_freed()
        self._answers: dict[str, Answer] = {}  # reader -> how its confirmations reach it (NIXL: its metadata)
        self._replies = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="pd-transfer-confirm", initializer=unpinning(settings.thread_cpu_set)
        )
        self._checks = ThreadPoolExecutor(  # read checks' digests, apart: confirmations never wait behind them
            max_workers=1, thread_name_prefix="pd-transfer-check", initializer=unpinning(settings.thread_cpu_set)
        )
        self._checks_queued = 0  # CheckRows taken and not yet answered (at most MAX_QUEUED_CHECKS)
        rank = cache.layout.tp_rank
        self.agent: Agent = agent_factory(
            agent_name or f"{engine_id}-prefill-tp{rank}-{uuid.uuid4().hex[:8]}",
            on_notification=self._on_notification,
            serves_reads=True,
            settings=settings,
        )
        self.ends: dict[str, PrefillEnd] = {}  # the transports' ends
        try:
            self.agent.register_regions(cache.regions)
            site = PrefillSite(
                engine_id=engine_id,
                cache=cache,
                agent=self.agent,
                options=options,
                ledger=self.ledger,
                agent_factory=agent_factory,
                receive=self.receive,
                freed=self._freed_by_unpin,
                streams=self.streams,
                metrics=self.metrics,
                held=self.held,
            )
            for transport in transports:
                self.ends[transport.name] = transport.prefill_end(site)
        except BaseException:
            self.close()
            raise
        self.offers = [
            TransportOffer(transport=transport.name, payload=payload, same_host=transport.same_host)
            for transport in transports
            if (payload := self.ends[transport.name].offer()) is not None
        ]
        if self.row_digests is not None:
            checks = TransportOffer(transport=messages.READ_CHECKS_OFFER, payload=messages.READ_CHECKS_DIGEST)
            self.offers.append(checks)  # taken by no transport: decodes may send CheckRows

    @property
    def rank_metadata(self) -> RankMetadata:
        return RankMetadata(
            tp_rank=self.cache.layout.tp_rank,
            agent_name=self.agent.name,
            agent_metadata=self.agent.metadata,
            layout=self.cache.layout,
            regions=list(self.cache.regions),
            offers=self.offers,
        )

    # ------------------------------------------------------------------ the engine's side
    def computing(self, request_id: str, block_ids: list[int], *, alias: str | None = None) -> None:
        """``request_id`` is being computed into ``block_ids`` (again, into other blocks, after a preemption): readers
        may stream its layers as :meth:`layers_written` says they are written (:mod:`pd_transfer.connector.streams`),
        asking for it by its id or by ``alias`` (the stream id its decode was given)."""
        self.streams.computing(request_id, block_ids, alias)

    def layers_written(self, request_id: str, layers: int) -> None:
        """The first ``layers`` layers of ``request_id`` (computing) hold every token's KV: readers may have them."""
        self.streams.written(request_id, layers)

    def hold(
        self, request_id: str, block_ids: list[int], *, ready: ReadyEvent | None = None, alias: str | None = None
    ) -> Freed | None:
        """Hold a finished request's blocks for its readers, once ``ready`` (if given) completed; returns it freed
        at once if they all reported already. ``alias``: the stream id a streaming decode may ask for it by."""
        if ready is not None:
            ready.synchronize()
        freed = self.ledger.hold(request_id, block_ids)
        self.streams.held(request_id, block_ids, alias)
        self._after_change([freed] if freed is not None else [])
        return freed

    def heartbeat(self, request_id: str) -> bool:
        return self.ledger.heartbeat(request_id)

    def abort(self, request_id: str) -> Freed | None:
        freed = self.ledger.abort(request_id)
        if freed is None and self.ledger.status(request_id) != "held":  # held: ends with its lease (hold window)
            self.streams.ended(request_id, "aborted")
        self._after_change([freed] if freed is not None else [])
        return freed

    def release(self, request_id: str, *, read_possible: bool = True) -> Freed | None:
        """Free a held request nobody will read (see ``LeaseLedger.release``)."""
        freed = self.ledger.release(request_id, read_possible=read_possible)
        self._after_change([freed] if freed is not None else [])
        return freed

    def expire(self) -> list[Freed]:
        """Requests whose lease ran out (their blocks are free now)."""
        freed = self.ledger.expire()
        self._after_change(freed)
        return freed

    def take_freed(self) -> list[Freed]:
        """Requests freed by their readers' reports since the last call."""
        with self._cond:
            freed, self._freed = self._freed, []
        return freed

    # ------------------------------------------------------------------ readers' notifications
    def _on_notification(self, peer: str, payload: bytes) -> None:
        """A NIXL notification from decode rank ``peer``: decoded, then :meth:`receive` (answered by NIXL)."""
        try:
            message = messages.decode(payload)
        except Exception as error:
            logger.warning("prefill %s: malformed notification from %s dropped: %s", self.agent.name, peer, error)
            return
        self.receive(peer, message, None)

    def receive(self, peer: str, message: messages.PeerMessage, answer: Answer | None) -> None:
        """A message from decode rank ``peer``: a heartbeat extends its request's lease, one meant for a transport's
        writer goes to its end, a report counts towards freeing its request. ``answer``: how a ``LeaseConfirm``
        reaches ``peer`` (None: by NIXL, to the ``reply_to`` its ``ReadDone`` carries)."""
        if isinstance(message, messages.LeaseHeartbeat):
            if not self.ledger.heartbeat(self.streams.resolve(message.request_id)):  # by its id or its stream id
                logger.info("prefill %s: heartbeat for request %s, not held here", self.agent.name, message.request_id)
            return
        if isinstance(message, messages.CheckRows):
            self._check_rows(peer, message, answer)
            return
        if any(end.take(peer, message) for end in self.ends.values()):
            return
        if isinstance(
            message,
            messages.LeaseConfirm
            | messages.RowDigest
            | messages.PushReady
            | messages.PushOutcome
            | messages.PushSetup
            | messages.PushOrder,
        ):
            logger.warning("prefill %s: unexpected %s from %s dropped", self.agent.name, type(message).__name__, peer)
            return
        self._take_report(peer, message, answer)

    def _take_report(self, peer: str, message: messages.ReaderReport, answer: Answer | None) -> None:
        """A reader's report (from a notification, a transport's connection, or a push that landed): counted towards
        freeing the request (one naming a stream's alias, as a decode that streamed the request names it when it gives
        up: towards the request the alias stands for)."""
        request_id = self.streams.resolve(message.request_id)
        if request_id != message.request_id:
            message = msgspec.structs.replace(message, request_id=request_id)
        reply_to = None
        if isinstance(message, messages.ReadDone) and message.reply_to:
            reply_to = peer
            self._route(peer, message.reply_to, answer)
        outcome = self.ledger.report(message, reply_to=reply_to)
        newly_freed = [] if outcome.freed is None else [outcome.freed]
        if outcome.freed is not None:
            with self._cond:
                self._freed.append(outcome.freed)
        if outcome.readers_complete:
            with self._cond:
                self._cond.notify_all()
            reports = self.ledger.readers_complete(message.request_id) or ()
            logger.debug(
                "prefill %s: request %s released by %d readers", self.agent.name, message.request_id, len(reports)
            )
            if self._on_release is not None:
                self._on_release(message.request_id, list(reports))
        self._after_change(newly_freed)

    def _route(self, peer: str, reply_to: bytes, answer: Answer | None) -> None:
        """How answers reach reader ``peer``: ``answer`` (its transport's connection), else NIXL to ``reply_to``."""
        with self._cond:
            self._answers[peer] = answer if answer is not None else self._nixl_answer(peer, reply_to)

    def _check_rows(self, peer: str, message: messages.CheckRows, answer: Answer | None) -> None:
        """Reader ``peer`` is about to read: digest the rows it names (:mod:`.read_checks`) on the checking thread
        while it reads, the request pinned meanwhile (a ``ReadDone`` arriving first frees it once unpinned), and answer
        ``RowDigest``."""
        request_id = self.streams.resolve(message.request_id)
        self._route(peer, message.reply_to, answer)
        with self._cond:
            busy = self._checks_queued >= MAX_QUEUED_CHECKS
            self._checks_queued += 0 if busy else 1
        if busy:  # bounded: a reader that asks faster than digests are made is told so, at once
            refusal = messages.RowDigest(request_id=message.request_id, refused="too many checks queued here")
            with contextlib.suppress(RuntimeError):  # closed
                self._replies.submit(self._send_answer, peer, refusal)
            return
        pinned = not self.ledger.pin(request_id, message.check.block_ids)  # "" when pinned
        try:
            self._checks.submit(self._answer_check, peer, request_id, message, pinned)
        except RuntimeError:  # closed
            if pinned:
                self.ledger.unpin(request_id)

    def _answer_check(self, peer: str, request_id: str, message: messages.CheckRows, pinned: bool) -> None:
        try:
            if self.row_digests is None:
                verdict = Verdict(None, refused="this rank offers no read checks")
            else:
                verdict = self.row_digests.verdict(message.check)
        except Exception as error:  # answered all the same: the reader must not wait for it
            logger.exception("prefill %s: checking request %s for %s failed", self.agent.name, request_id, peer)
            verdict = Verdict(None, refused=f"the check failed here: {str(error)[:200]}")
        finally:
            with self._cond:
                self._checks_queued -= 1
            freed = self.ledger.unpin(request_id) if pinned else None
            if freed is not None:
                self._freed_by_unpin(freed)
        if verdict.changed:
            logger.error("prefill %s: request %s read by %s: %s", self.agent.name, request_id, peer, verdict.changed)
        digest = messages.RowDigest(
            request_id=message.request_id, digest=verdict.digest, changed=verdict.changed, refused=verdict.refused
        )
        self._send_answer(peer, digest)

    def _nixl_answer(self, peer: str, metadata: bytes) -> Answer:
        """How a confirmation reaches reader ``peer`` by NIXL: its agent added as a peer (from ``metadata``, its
        connection metadata) when first needed, then notified.

        A peer NIXL reports disconnected is removed and added afresh from ``metadata`` (the reader's report that
        asks for this answer just came, so the reader is there), then notified once more. Its endpoint breaks for
        good when the network is cut under it, or when the reader dropped its side of the link and made it again
        (a read that timed out): kept, it would refuse every later confirmation to that reader, and each of that
        decode's reads would end unconfirmed until one of the engines restarted (issue 42, tests/process/
        test_network_cut.py). Only the rank's own agent is touched: it prepares nothing for readers."""

        def add() -> None:
            added = self.agent.add_peer(metadata)
            if added != peer:
                raise TransferError(f"reader {peer} sent the connection metadata of agent {added}")

        def send(payload: bytes) -> None:
            if not self.agent.has_peer(peer):
                add()
            try:
                self.agent.notify(peer, payload)
            except PeerDisconnected as error:
                logger.info("prefill %s: reader %s disconnected (%s); adding it afresh", self.agent.name, peer, error)
                self.agent.remove_peer(peer)
                add()
                self.agent.notify(peer, payload)

        return send

    def _freed_by_unpin(self, freed: Freed) -> None:
        """A request freed when its last push ended (something asked for it meanwhile)."""
        with self._cond:
            self._freed.append(freed)
        self._after_change([freed])

    def _after_change(self, freed: list[Freed]) -> None:
        """Count freed leases, send queued confirmations; poll fast only while blocks are held for readers."""
        for item in freed:
            self.metrics.leases_ended.labels(item.reason).inc()
            self.streams.ended(item.request_id, item.reason)
        self.metrics.blocks_held.labels(self.engine_id, str(self.cache.layout.tp_rank)).set(self.ledger.blocks_held)
        for reply in self.ledger.take_replies():
            try:
                self._replies.submit(self._send_reply, reply)
            except RuntimeError:  # closed
                return
        self.agent.set_expecting_reads(self.ledger.held_requests > 0)

    def _send_reply(self, reply: Reply) -> None:
        self._send_answer(reply.to, reply.confirm)

    def _send_answer(self, to: str, message: messages.LeaseConfirm | messages.RowDigest) -> None:
        """Send reader ``to`` an answer, the way its report came (logged where it cannot: the reader then counts the
        read unconfirmed, or unchecked as a mismatch)."""
        try:
            with self._cond:
                answer = self._answers.get(to)
            if answer is None:
                raise TransferError(f"no way back to reader {to}")
            answer(messages.encode(message))
        except Exception as error:
            logger.warning(
                "prefill %s: could not send the %s of request %s to %s: %s",
                self.agent.name,
                type(message).__name__,
                message.request_id,
                to,
                error,
            )

    def wait_released(self, request_id: str, timeout_s: float) -> list[messages.PeerMessage] | None:
        """The readers' reports once every expected reader of ``request_id`` reported, or None after
        ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while (reports := self.ledger.readers_complete(request_id)) is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._cond.wait(remaining)
            return list(reports)

    def forget(self, request_id: str) -> None:
        """Drop what is known of a request without freeing it (the engine freed its blocks)."""
        self.ledger.forget(request_id)
        self.streams.ended(request_id, "forgotten")
        self._after_change([])

    def close(self) -> None:
        for end in self.ends.values():
            end.close()
        self._checks.shutdown(wait=True, cancel_futures=True)
        self._replies.shutdown(wait=True, cancel_futures=True)
        self.agent.close()


def serve_engine(
    engine_id: str,
    ranks: list[RankMetadata],
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    secret: bytes | str | None = None,
    on_release: SideChannelRelease | None = None,
) -> HandshakeServer:
    """Start the side channel for an engine whose ranks are ``ranks`` (all of one fingerprint); ``on_release``
    answers the proxy's ``Release`` messages."""
    if not ranks:
        raise ValueError("an engine needs at least one rank")
    fingerprint = ranks[0].layout.fingerprint
    tp_size = ranks[0].layout.tp_size
    for rank in ranks:
        if rank.layout.fingerprint != fingerprint or rank.layout.tp_size != tp_size:
            raise ValueError(f"rank {rank.tp_rank} of engine {engine_id} disagrees with rank {ranks[0].tp_rank}")
    engine = EngineMetadata(
        engine_id=engine_id,
        fingerprint=fingerprint,
        tp_size=tp_size,
        ranks=sorted(ranks, key=lambda r: r.tp_rank),
    )
    server = HandshakeServer(engine, host=host, port=port, secret=secret, on_release=on_release)
    server.start()
    logger.info("engine %s serves %d rank(s) on %s", engine_id, len(ranks), server.address)
    return server
