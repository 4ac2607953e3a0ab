"""The decode side of push, the NIXL transport's push target (the prefill side: :mod:`.push_writer`): asking prefill
ranks to write instead of reading from them.

On connecting to an engine whose plan needs no fix-up, :meth:`PushOrders.offer` sends each source rank a
``PushSetup``; a rank that answers ``PushReady(ok)`` is pushed to from then on, one that refuses or never answers
(it predates push) is read from. :meth:`PushOrders.push` sends one ``PushOrder`` per ready source rank of a request
and waits, until the pull's deadline, for their ``PushOutcome``: a successful one arrives after the data, and says
the blocks were held and pinned throughout (no lease confirmation needed).

The prefill gives up writing at :data:`PREFILL_SHARE` of the time left when the order is sent, so a write never
lands after the decode stopped waiting for it.

A decode whose cache is on a GPU pushes through a :class:`~.push_staging.LandingArea` (host memory
registered with its agent): each source rank of an engine is given a part of it in its setup and writes there, and
:meth:`PushOrders.land` copies a pushed request's rows from it into the cache before the pull uses them. A request whose
rows from a source exceed its part is read from that source.

Thread-safe: one condition guards the answers; the agent's poller delivers them (:meth:`PushOrders.take`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np

from pd_transfer.connector import messages
from pd_transfer.transfer import sever
from pd_transfer.transfer.agent_protocol import Agent
from pd_transfer.transfer.errors import PeerDisconnected, TransferError
from pd_transfer.transfer.tcp import push_to

from ..requests import PullRequest
from .push_plans import plan_to_wire
from .push_staging import LandingArea
from .sources import NixlEngine, SourceRank

logger = logging.getLogger(__name__)

#: The share of the pull's time left that a prefill may spend writing (the rest is the answer's way back).
PREFILL_SHARE = 0.8
#: Seconds between probes of a prefill rank that has not answered an order yet (is it still there?).
PROBE_INTERVAL_S = 0.5
#: Seconds between polls of the agent while an order is answered (as a read checks its state).
POLL_WAIT_S = 50e-6


class PushOrders:
    """Push for decode rank ``reader_rank`` of engine ``engine_id``, whose ``agent`` has its cache registered.

    Requests smaller than ``PD_TRANSFER_PUSH_MIN_BYTES`` (the agent's ``settings.push_min_bytes``, default 4 MiB) are
    read: an order costs 0.3-0.5 ms more than a read before the first byte moves, and a read costs about 0.08 ms more
    per MiB over loopback TCP (``bench pd-tcp``: 1 MiB read in 1.4 ms, pushed in 1.8; 64 MiB read in 29 ms, pushed
    in 23.5).
    """

    def __init__(
        self,
        agent: Agent,
        engine_id: str,
        reader_rank: int,
        *,
        mode: str,
        landing: LandingArea | None = None,
    ) -> None:
        """``mode``: "on" offers push to every engine, "auto" where reads would go over TCP
        (:func:`~pd_transfer.transfer.tcp.push_to`, with the agent's ``settings.ucx_tls``). ``landing``: the area,
        registered with ``agent``, that prefill ranks write into (else they write into the cache's rows)."""
        self.agent = agent
        self.landing = landing
        self._parts: dict[str, tuple[int, int]] = {}  # prefill agent -> its landing part (address, rows)
        self.mode = mode
        self.min_bytes = agent.settings.push_min_bytes
        self.engine_id = engine_id
        self.reader_rank = reader_rank
        self._cond = threading.Condition()
        self._ready: dict[str, bool | None] = {}  # prefill agent -> ready, refused, or asked (None)
        self._outcomes: dict[str, dict[str, messages.PushOutcome]] = {}  # awaited request -> prefill agent -> outcome
        self._setups: dict[str, bytes] = {}  # prefill agent -> the setup sent to it (sent again when it asks)
        self.pushed = 0  # sources that wrote a request
        self.read_instead = 0  # sources asked to write that said to read

    # ------------------------------------------------------------------ setup
    def offer(self, remote: NixlEngine) -> None:
        """Ask each source rank of a just opened engine to push, if its plan needs no fix-up (best effort; a prefill
        whose cache is on a GPU and that cannot stage it refuses). With a landing area, source ``i`` of ``n`` is given
        part ``i`` of ``n`` of it (a source whose rows do not fit one is read)."""
        if remote.plan.postprocess is not None or remote.packed is not None:
            return
        if not push_to(remote.host, self.mode, self.agent.settings.ucx_tls):
            return
        metadata = self.agent.metadata
        count = len(remote.sources)
        for index, (source, plan) in enumerate(zip(remote.sources, remote.plan.sources, strict=True)):
            address = rows = 0
            if self.landing is not None:
                address, rows = self.landing.part(index, count, plan.unit_bytes)
                if rows == 0:
                    logger.info(
                        "decode %s: no landing room for rows of %d bytes; reading", self.agent.name, plan.unit_bytes
                    )
                    continue
            setup = messages.PushSetup(
                reader_engine_id=self.engine_id,
                reader_rank=self.reader_rank,
                agent_metadata=metadata,
                plan=plan_to_wire(plan),
                landing_address=address,
                landing_rows=rows,
            )
            payload = messages.encode(setup)
            if len(payload) > messages.MAX_NOTIFICATION_BYTES:
                logger.info("decode %s: a push setup of %d bytes is too large; reading", self.agent.name, len(payload))
                continue
            with self._cond:
                self._setups[source.peer] = payload
                if self.landing is not None:
                    self._parts[source.peer] = (address, rows)
            self._send_setup(source.peer)

    def _send_setup(self, peer: str) -> None:
        """Send ``peer`` its setup; it is read from until it answers."""
        with self._cond:
            self._ready[peer] = None
            payload = self._setups[peer]
        try:
            self.agent.notify(peer, payload)
        except TransferError as error:
            logger.info("decode %s: push setup to %s not sent (reading): %s", self.agent.name, peer, error)
            with self._cond:
                self._ready[peer] = False

    def ready(self, peer: str) -> bool:
        """Whether prefill agent ``peer`` agreed to push."""
        return self._ready.get(peer) is True

    def wait_ready(self, peers: Sequence[str], timeout_s: float) -> bool:
        """Wait until each of ``peers`` answered its setup; True if all agreed to push."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while any(self._ready.get(peer, False) is None for peer in peers):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            return all(self._ready.get(peer) is True for peer in peers)

    def forget(self, peers: Sequence[str]) -> None:
        """Drop what is known of ``peers`` (their engine was dropped)."""
        with self._cond:
            for peer in peers:
                self._ready.pop(peer, None)
                self._setups.pop(peer, None)
                self._parts.pop(peer, None)

    # ------------------------------------------------------------------ landing
    def fits(self, peer: str, rows: int) -> bool:
        """Whether ``rows`` rows of a request may be pushed by ``peer``: always without a landing area, else when
        they fit its part."""
        if self.landing is None:
            return True
        part = self._parts.get(peer)
        return part is not None and rows <= part[1]

    def land(self, peer: str, targets: np.ndarray, row_bytes: int, deadline: float) -> None:
        """Copy the rows ``peer`` pushed (``len(targets)`` of ``row_bytes``) from its landing part to ``targets``
        (int64 addresses in the cache), done on return; nothing without a landing area. ``TransferTimeout`` past
        ``deadline`` (``time.perf_counter`` time)."""
        if self.landing is None:
            return
        with self._cond:
            address, _ = self._parts[peer]
        self.landing.land(address, targets, row_bytes, deadline)

    # ------------------------------------------------------------------ answers
    def take(self, message: messages.PeerMessage) -> bool:
        """A decoded notification: True when it was a push answer (recorded), False for anything else."""
        if isinstance(message, messages.PushReady):
            rank = message.prefill_agent  # sent by the rank's writing agent (``peer``)
            with self._cond:
                if rank in self._ready:
                    self._ready[rank] = message.ok
                    self._cond.notify_all()
            if not message.ok:
                logger.info("decode %s: %s will not push (reading): %s", self.agent.name, rank, message.reason[:200])
            return True
        if isinstance(message, messages.PushOutcome):
            with self._cond:
                answers = self._outcomes.get(message.request_id)
                if answers is not None:  # else a late answer: nobody waits for it any more
                    answers[message.prefill_agent] = message
                    self._cond.notify_all()
                again = message.setup_again and message.prefill_agent in self._setups
            if again:
                self._send_setup(message.prefill_agent)
            return True
        return False

    # ------------------------------------------------------------------ orders
    def push(
        self, request: PullRequest, sources: Sequence[SourceRank], deadline: float
    ) -> dict[str, messages.PushOutcome]:
        """Order each of ``sources`` to write ``request``; returns the outcome of each that answered by
        ``deadline`` (``time.perf_counter`` time; an order that could not be sent answers ``may_read`` at once).

        A source silent at ``deadline`` may still be writing: its WRITE, past its own timeout, is not over until
        NIXL ends it (a cut TCP connection delivers its bytes when it resumes), and the source answers once it
        ended (:meth:`pd_transfer.transfer.agent.TransferAgent._drained`). So, with ``settings.sever_stalled``,
        this process's connections to their hosts are shut down (:mod:`~pd_transfer.transfer.sever`: nothing of
        them lands after), and this waits for their answers, or for our endpoints to them to fail, at most
        ``settings.drain_s`` more, before returning without them: the caller must not give the request's blocks to
        another request while a write into them may still land."""
        with self.agent.expecting_traffic(), self._awaiting(request.request_id) as answers:
            for source in sources:
                self._send_order(request, source, deadline, answers)
            outcomes = self._wait(request.request_id, sources, answers, deadline)
            if len(outcomes) < len(sources):
                self._drain(request.request_id, sources, answers, deadline)
        self.pushed += sum(1 for outcome in outcomes.values() if outcome.ok)
        self.read_instead += sum(1 for outcome in outcomes.values() if outcome.may_read)
        return outcomes

    def _wait(
        self,
        request_id: str,
        sources: Sequence[SourceRank],
        answers: dict[str, messages.PushOutcome],
        deadline: float,
    ) -> dict[str, messages.PushOutcome]:
        """The answers once every source answered or at ``deadline``. Every :data:`PROBE_INTERVAL_S` without them,
        the sources still silent get a ``LeaseHeartbeat`` (harmless: the lease is held), so that a prefill that died
        raises ``PeerDisconnected`` here rather than at the deadline."""
        probe_at = time.perf_counter() + PROBE_INTERVAL_S
        while True:
            self.agent.poll()  # our side of the writes progresses, and the answers arrive, on this thread
            with self._cond:
                now = time.perf_counter()
                if len(answers) >= len(sources) or now >= deadline:
                    return dict(answers)
                self._cond.wait(min(POLL_WAIT_S, deadline - now))
                silent = [source.peer for source in sources if source.peer not in answers]
            if silent and time.perf_counter() >= probe_at:
                probe_at = time.perf_counter() + PROBE_INTERVAL_S
                self._probe(request_id, silent)

    def _drain(
        self,
        request_id: str,
        sources: Sequence[SourceRank],
        answers: dict[str, messages.PushOutcome],
        deadline: float,
    ) -> None:
        """Wait (at most ``settings.drain_s`` past ``deadline``) for the answers of sources silent at ``deadline``:
        each answers once its write ended. Logged either way; a source still silent is logged as abandoned."""
        drain_s = self.agent.settings.drain_s
        if self.agent.settings.sever_stalled:  # our end of their connections shut: nothing of them lands later
            severed = sum(sever.sever_peer(source.peer) for source in sources if source.peer not in answers)
            logger.warning("decode %s: request %s: %d connections severed", self.agent.name, request_id, severed)
        try:
            drained = self._wait(request_id, sources, answers, deadline + drain_s)
        except PeerDisconnected as error:  # our endpoint to it failed: nothing of it lands any more
            logger.warning("decode %s: request %s: a pushing prefill is gone: %s", self.agent.name, request_id, error)
            return
        silent = [source.peer for source in sources if source.peer not in drained]
        waited = time.perf_counter() - deadline
        if silent:
            logger.error(
                "decode %s: request %s: %s still silent %.1f s after the push's deadline: abandoned, its writes may"
                " still land",
                self.agent.name,
                request_id,
                ", ".join(silent),
                waited,
            )
        else:
            logger.warning(
                "decode %s: request %s: every push past its deadline ended %.2f s later",
                self.agent.name,
                request_id,
                waited,
            )

    def _probe(self, request_id: str, peers: list[str]) -> None:
        """A ``LeaseHeartbeat`` to each of ``peers``: raises ``PeerDisconnected`` for one that is gone."""
        beat = messages.LeaseHeartbeat(
            request_id=request_id, reader_engine_id=self.engine_id, reader_rank=self.reader_rank
        )
        for peer in peers:
            try:
                self.agent.notify(peer, messages.encode(beat))
            except PeerDisconnected:
                raise
            except TransferError as error:
                logger.info("decode %s: probing %s for request %s: %s", self.agent.name, peer, request_id, error)

    def _send_order(
        self, request: PullRequest, source: SourceRank, deadline: float, answers: dict[str, messages.PushOutcome]
    ) -> None:
        """Send ``source`` its order for ``request``; one that cannot be sent is answered ``may_read`` in
        ``answers`` at once."""
        request_id = request.request_id
        order = messages.PushOrder(
            request_id=request_id,
            expected_readers=source.expected_readers,
            remote_block_ids=request.remote_block_ids,
            local_block_ids=request.local_block_ids,
            num_tokens=request.num_tokens,
            timeout_ms=max(0, int((deadline - time.perf_counter()) * PREFILL_SHARE * 1000)),
        )
        payload = messages.encode(order)
        reason = ""
        if len(payload) > messages.MAX_NOTIFICATION_BYTES:
            reason = f"an order of {len(payload)} bytes is too large for a notification"
        else:
            try:
                self.agent.notify(source.peer, payload)
            except TransferError as error:
                reason = f"the order was not sent: {error}"
        if reason:
            with self._cond:
                refused = messages.PushOutcome(
                    prefill_agent=source.peer, request_id=request_id, ok=False, reason=reason, may_read=True
                )
                answers[source.peer] = refused

    @contextmanager
    def _awaiting(self, request_id: str) -> Iterator[dict[str, messages.PushOutcome]]:
        """The answers to ``request_id``'s orders, recorded while inside this block."""
        answers: dict[str, messages.PushOutcome] = {}
        with self._cond:
            self._outcomes[request_id] = answers
        try:
            yield answers
        finally:
            with self._cond:
                self._outcomes.pop(request_id, None)
