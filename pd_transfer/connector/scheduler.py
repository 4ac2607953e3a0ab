"""The scheduler side of the connector: one per engine, engine-agnostic (no vLLM import).

It mirrors the scheduler half of vLLM's KV connector API with typed arguments:

* decode engine: ``on_new_request`` (queued: heartbeats keep the prefill's lease alive) ->
  ``get_num_new_matched_tokens`` (how many tokens can be loaded) -> ``update_state_after_alloc`` (the blocks
  they go to) -> ``build_step_metadata`` (a ``RecvSpec`` for the workers) -> ``update_connector_output``
  (``finished_recving``) -> ``request_finished``;
* prefill engine: ``request_finished`` of a ``do_remote_decode`` request returns ``delay_free=True`` and the
  parameters for the decode; the blocks are held by the workers until ``finished_sending``. ``drain`` stops it
  taking new work (``refuse_new`` raises ``Draining``), waits for every hold to end, then stops the side channel
  (:mod:`.drain`).

Malformed ``kv_transfer_params`` are logged (naming the request) and the request is computed locally; a
remote prefill that will not be loaded (aborted, finished, computed locally, or params valid but for repeated
block ids) is released on the prefill.
Never raises into the engine: every hook catches and logs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

from pd_transfer.connector.leases import hold_window
from pd_transfer.connector.prefill.rank import serve_engine
from pd_transfer.handshake.messages import RankMetadata
from pd_transfer.handshake.server import HandshakeServer
from pd_transfer.metrics import default_metrics

from .config import ConnectorConfig
from .drain import Drain, DrainOutcome
from .metadata import RecvSpec, RemoteRef, StepMetadata, StreamStart
from .params import (
    InvalidTransferParams,
    RemoteDecodeRequest,
    RemotePrefill,
    RepeatedBlockIds,
    incarnation_token,
    parse_transfer_params,
    remote_prefill_params,
)

logger = logging.getLogger(__name__)

#: Finish reasons after which a prefill-only request's KV is complete and worth holding for a decode.
HOLD_REASONS = frozenset({"stop", "length"})
#: A drain waits at most the lease and this much more (seconds): the step that collects the last expired lease.
DRAIN_MARGIN_S = 1.0

Phase = Literal["queued", "matched", "loading", "loaded", "released"]


@dataclass
class _Remote:
    """A decode-side request whose KV a remote prefill holds."""

    ref: RemoteRef
    params: RemotePrefill
    phase: Phase
    next_heartbeat: float
    tokens: int = 0  # tokens to load, decided by get_num_new_matched_tokens
    remote_block_ids: tuple[int, ...] = ()
    skip_blocks: int = 0  # streamed: the prefill's first blocks left out (a local prefix hit)
    trust_until: float | None = None  # reads ended before this (time.monotonic) need no confirmation

    @classmethod
    def received(cls, params: RemotePrefill, phase: Phase, next_heartbeat: float) -> _Remote:
        """Params that arrived just now: their hold window is counted from here."""
        trust_until = params.trust_deadline(time.monotonic(), time.time())
        return cls(_ref(params), params, phase, next_heartbeat, trust_until=trust_until)


def _ref(params: RemotePrefill) -> RemoteRef:
    return RemoteRef(
        remote_engine_id=params.engine_id,
        remote_host=params.host,
        remote_port=params.port,
        remote_request_id=params.request_id,
        remote_tp_size=params.tp_size,
    )


class SchedulerSide:
    """The connector's scheduler half for one engine of ``tp_size`` ranks and ``block_size``-token blocks
    (the engine's side of it: :class:`~.contract.SchedulerContract`)."""

    def __init__(
        self,
        config: ConnectorConfig,
        *,
        engine_id: str,
        block_size: int,
        tp_size: int = 1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if block_size < 1 or tp_size < 1:
            raise ValueError(f"block_size ({block_size}) and tp_size ({tp_size}) must be at least 1")
        self.config = config
        self.engine_id = engine_id
        self.block_size = block_size
        self.tp_size = tp_size
        self._clock = clock
        self._lock = threading.Lock()
        self._holds_ended = threading.Condition(self._lock)  # notified when requests leave _holding
        self.drain_state = Drain(f"engine {engine_id}", clock=clock)
        self._server: HandshakeServer | None = None
        self._remotes: dict[str, _Remote] = {}  # decode side, until request_finished
        self._rejected: set[str] = set()  # invalid params (logged once), until request_finished
        self._holding: set[str] = set()  # prefill side, until finished_sending
        self._streamed: dict[str, str] = {}  # prefill side: request id -> its stream id, until its blocks are free
        self._stream_ids: dict[str, str] = {}  # prefill side: stream id -> request id, as long
        self._incarnation: str | None = None  # prefill side: names this process's ranks in the params
        self._reset_step()
        self.invalid_params = 0
        self.releases = 0

    def _reset_step(self) -> None:
        self._recv: dict[str, RecvSpec] = {}
        self._hold: dict[str, tuple[int, ...]] = {}
        self._abort: set[str] = set()
        self._released: dict[str, bool] = {}
        self._release: dict[str, RemoteRef] = {}
        self._computing: dict[str, StreamStart] = {}
        self._hold_aliases: dict[str, str] = {}

    # ------------------------------------------------------------------ side channel
    def start_side_channel(self, ranks: list[RankMetadata]) -> int:
        """Publish the workers' ranks (``WorkerSide.rank_metadata`` of every TP rank) on the side channel at
        ``config.side_channel_host:port``; returns the port (useful with port 0)."""
        if self._server is not None:
            raise RuntimeError("the side channel is already running")
        self._incarnation = incarnation_token(rank.agent_name for rank in sorted(ranks, key=lambda r: r.tp_rank))
        self._server = serve_engine(
            self.engine_id,
            ranks,
            host=self.config.side_channel_host,
            port=self.config.side_channel_port,
            secret=self.config.secret,
            on_release=self.release_held,
        )
        return self._server.port

    @property
    def side_channel_port(self) -> int | None:
        return None if self._server is None else self._server.port

    def close(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    # ------------------------------------------------------------------ drain
    def refuse_new(self) -> None:
        """Raise ``Draining`` (naming the engine and why) once :meth:`drain` began: call before taking a request."""
        self.drain_state.refuse_new()

    def drain(self, reason: str, timeout_s: float | None = None) -> DrainOutcome:
        """Prefill side: drain this engine (``reason``: what asked for it). From now on :meth:`refuse_new` raises
        ``Draining``. Waits until every request held for decode readers has ended (its workers reported it in
        ``finished_sending``: read by each reader, released, expired or aborted), at most ``timeout_s`` (default:
        the lease plus :data:`DRAIN_MARGIN_S`, by which any hold not extended by a waiting decode has expired), then
        stops the side channel. The engine must go on stepping meanwhile (this call blocks: make it from another
        thread): its steps collect the ends. Returns how it went."""
        bound_s = self.config.lease_seconds + DRAIN_MARGIN_S if timeout_s is None else timeout_s
        started = time.monotonic()
        with self._holds_ended:
            self.drain_state.start(reason)  # with what is held then
            held = len(self._holding)
            self._holds_ended.wait_for(lambda: not self._holding, timeout=bound_s)
            left = len(self._holding)
        outcome = DrainOutcome(held_at_start=held, left=left, seconds=time.monotonic() - started)
        if outcome.complete:
            logger.warning(
                "engine %s drained: %d held request(s) ended in %.2f s", self.engine_id, held, outcome.seconds
            )
        else:
            logger.error(
                "engine %s: drain bound of %.1f s reached with %d of %d held request(s) still held; their readers"
                " will fail over to their policy",
                self.engine_id,
                bound_s,
                left,
                held,
            )
        self.close()
        return outcome

    # ------------------------------------------------------------------ decode side
    def _parse(
        self, request_id: str, params: object, prompt_len: int | None
    ) -> RemotePrefill | RemoteDecodeRequest | None:
        """Parsed params, or None after logging (once per request) why they are unusable."""
        try:
            return parse_transfer_params(params, prompt_len=prompt_len, local_block_size=self.block_size)
        except InvalidTransferParams as error:
            if request_id not in self._rejected:
                self._rejected.add(request_id)
                self.invalid_params += 1
                logger.error("request %s: invalid kv_transfer_params, computing it locally: %s", request_id, error)
                if isinstance(error, RepeatedBlockIds) and error.ref is not None:
                    # all but the block list is valid: the prefill holds that request, and nobody will read it
                    self._release[request_id] = error.ref
                    self.releases += 1
                    logger.info(
                        "request %s: releasing remote KV of %s: %s", request_id, error.ref.remote_engine_id, error
                    )
            return None

    def on_new_request(self, request_id: str, kv_transfer_params: object, *, prompt_len: int | None = None) -> None:
        """A request entered the waiting queue: a remote prefill's lease is kept alive while it waits."""
        try:
            with self._lock:
                parsed = self._parse(request_id, kv_transfer_params, prompt_len)
                if isinstance(parsed, RemoteDecodeRequest) and parsed.stream_id is not None:
                    self._streamed[request_id] = parsed.stream_id
                    self._stream_ids[parsed.stream_id] = request_id
                if isinstance(parsed, RemotePrefill) and request_id not in self._remotes:
                    self._remotes[request_id] = _Remote.received(
                        parsed, "queued", self._clock() + self.config.heartbeat_interval_s
                    )
        except Exception:
            logger.exception("request %s: on_new_request failed", request_id)

    def get_num_new_matched_tokens(
        self, request_id: str, prompt_len: int, num_computed_tokens: int, kv_transfer_params: object
    ) -> tuple[int, bool]:
        """(tokens loadable beyond ``num_computed_tokens``, load asynchronously?). A remote prefill offers
        the whole prompt: on a full-prompt load the engine recomputes the last token itself (vLLM does).
        Invalid params: (0, False), the engine computes the prompt. May be called repeatedly."""
        try:
            with self._lock:
                return self._matched_tokens(request_id, prompt_len, num_computed_tokens, kv_transfer_params)
        except Exception:
            logger.exception("request %s: get_num_new_matched_tokens failed; computing it locally", request_id)
            return 0, False

    def _matched_tokens(
        self, request_id: str, prompt_len: int, num_computed: int, kv_transfer_params: object
    ) -> tuple[int, bool]:
        remote = self._remotes.get(request_id)
        if remote is not None and remote.phase in ("loading", "loaded", "released"):
            return 0, False  # already loaded (or given up): asked again when rescheduled
        parsed = self._parse(request_id, kv_transfer_params, prompt_len)
        if not isinstance(parsed, RemotePrefill):
            return 0, False
        if remote is None:
            remote = _Remote.received(parsed, "matched", self._clock())
            self._remotes[request_id] = remote
        elif parsed != remote.params:
            remote.trust_until = None  # other params than those timed at arrival: confirm the read
        remote.params, remote.ref, remote.phase = parsed, _ref(parsed), "matched"
        remote.tokens, remote.remote_block_ids, remote.skip_blocks = 0, (), 0
        loadable = prompt_len if parsed.num_tokens is None else parsed.num_tokens
        if num_computed >= loadable:
            return 0, False  # the local cache has it all: released at update_state_after_alloc
        skip_blocks = 0
        if num_computed > 0:
            remote_block = parsed.block_size
            if remote_block is None or num_computed % remote_block:
                logger.info(
                    "request %s: local prefix hit of %d tokens does not fall on a remote block boundary (block %s):"
                    " computing the rest locally",
                    request_id,
                    num_computed,
                    remote_block,
                )
                return 0, False
            skip_blocks = num_computed // remote_block
        remote.tokens = loadable - num_computed
        remote.remote_block_ids = parsed.block_ids[skip_blocks:]
        remote.skip_blocks = skip_blocks if parsed.stream else 0
        return remote.tokens, True

    def update_state_after_alloc(
        self, request_id: str, local_block_ids: Iterable[int], num_external_tokens: int
    ) -> None:
        """Blocks were allocated: ``local_block_ids`` will hold the ``num_external_tokens`` loaded tokens, in
        token order (extra trailing blocks are ignored). With 0 external tokens the remote KV is not used
        and the prefill is told to free it."""
        try:
            with self._lock:
                remote = self._remotes.get(request_id)
                if remote is None or remote.phase != "matched":
                    return  # not ours, or called again after the load (for newly allocated blocks)
                if num_external_tokens <= 0 or remote.tokens == 0:
                    self._queue_release(request_id, remote, "not loaded: the decode computes the prompt itself")
                    return
                needed = -(-num_external_tokens // self.block_size)
                self._recv[request_id] = RecvSpec(
                    remote_engine_id=remote.ref.remote_engine_id,
                    remote_host=remote.ref.remote_host,
                    remote_port=remote.ref.remote_port,
                    remote_request_id=remote.ref.remote_request_id,
                    remote_tp_size=remote.ref.remote_tp_size,
                    remote_block_ids=remote.remote_block_ids,
                    local_block_ids=tuple(int(b) for b in local_block_ids)[:needed],
                    num_tokens=num_external_tokens,
                    trust_until=remote.trust_until,
                    incarnation=remote.params.incarnation,
                    stream=remote.params.stream,
                    skip_blocks=remote.skip_blocks,
                )
                remote.phase = "loading"
        except Exception:
            logger.exception("request %s: update_state_after_alloc failed", request_id)

    def _queue_release(self, request_id: str, remote: _Remote, reason: str) -> None:
        remote.phase = "released"
        self._release[request_id] = remote.ref
        self.releases += 1
        logger.info("request %s: releasing remote KV of %s: %s", request_id, remote.ref.remote_engine_id, reason)

    # ------------------------------------------------------------------ both sides
    def build_step_metadata(self) -> StepMetadata:
        """This step's work for the workers; resets the step's state."""
        with self._lock:
            now = self._clock()
            heartbeats = {}
            for request_id, remote in self._remotes.items():
                if remote.phase in ("queued", "matched") and remote.next_heartbeat <= now:
                    heartbeats[request_id] = remote.ref
                    remote.next_heartbeat = now + self.config.heartbeat_interval_s
            waiting = sum(1 for remote in self._remotes.values() if remote.phase in ("queued", "matched", "loading"))
            default_metrics().requests_waiting_for_kv.labels(self.engine_id).set(waiting)
            metadata = StepMetadata(
                reqs_to_recv=self._recv,
                reqs_to_hold=self._hold,
                reqs_to_abort=frozenset(self._abort),
                reqs_released=self._released,
                reqs_to_release=self._release,
                reqs_to_heartbeat=heartbeats,
                reqs_computing=self._computing,
                hold_aliases=self._hold_aliases,
            )
            self._reset_step()
            return metadata

    def computing(self, request_id: str, block_ids: Iterable[int]) -> None:
        """Prefill side: this step computes the rest of ``request_id``'s prompt into ``block_ids`` (all of its blocks,
        in token order). A streamed request (``stream_id`` in its params) is offered to its decode layer by layer
        while the step runs (:attr:`StepMetadata.reqs_computing`); others are not concerned."""
        with self._lock:
            stream_id = self._streamed.get(request_id)
            if stream_id is not None:
                self._computing[request_id] = StreamStart(
                    stream_id=stream_id, block_ids=tuple(int(b) for b in block_ids)
                )

    def request_finished(
        self,
        request_id: str,
        block_ids: list[int],
        finished_reason: str,
        kv_transfer_params: object,
        *,
        num_computed_tokens: int | None = None,
    ) -> tuple[bool, dict[str, object] | None]:
        """A request finished (``finished_reason``: "stop", "length", "abort", "error", ...), before its
        blocks (``block_ids``) are freed. Returns (delay_free, params for the client).

        Prefill side, ``do_remote_decode`` finished by "stop" or "length": (True, NixlConnector-compatible
        params for the decode); the blocks belong to the connector until ``finished_sending``. Pass
        ``num_computed_tokens``: the params then name only the blocks holding computed tokens, and carry
        ``remote_num_tokens``. Decode side:
        (False, None); a remote prefill not loaded yet is released on the prefill; one still loading keeps
        its blocks until it appears in ``finished_recving`` (the engine must wait for it, as vLLM does).
        """
        try:
            with self._lock:
                return self._finished(request_id, block_ids, finished_reason, kv_transfer_params, num_computed_tokens)
        except Exception:
            logger.exception("request %s: request_finished failed; freeing its blocks", request_id)
            return False, None

    def _finished(
        self,
        request_id: str,
        block_ids: list[int],
        reason: str,
        kv_transfer_params: object,
        num_computed_tokens: int | None,
    ) -> tuple[bool, dict[str, object] | None]:
        held, params = self._finished_unless_held(
            request_id, block_ids, reason, kv_transfer_params, num_computed_tokens
        )
        if not held:
            if request_id in self._streamed:  # its workers may offer it as computing: end its stream there
                self._abort.add(request_id)
            self._forget_stream(request_id)
        return held, params

    def _forget_stream(self, request_id: str) -> None:
        stream_id = self._streamed.pop(request_id, None)
        if stream_id is not None:
            self._stream_ids.pop(stream_id, None)

    def _finished_unless_held(
        self,
        request_id: str,
        block_ids: list[int],
        reason: str,
        kv_transfer_params: object,
        num_computed_tokens: int | None,
    ) -> tuple[bool, dict[str, object] | None]:
        if request_id in self._rejected:
            self._rejected.discard(request_id)
            return False, None
        remote = self._remotes.pop(request_id, None)
        if remote is not None:
            if remote.phase in ("queued", "matched"):
                self._queue_release(request_id, remote, f"request finished ({reason}) before its KV was loaded")
            return False, None
        parsed = self._parse(request_id, kv_transfer_params, None)
        self._rejected.discard(request_id)
        if isinstance(parsed, RemotePrefill):
            # never scheduled (e.g. aborted while queued, or a pre-aborted copy): free the prefill's blocks
            remote = _Remote(ref=_ref(parsed), params=parsed, phase="queued", next_heartbeat=0.0)
            self._queue_release(request_id, remote, f"request finished ({reason}) before it was scheduled")
            return False, None
        if not isinstance(parsed, RemoteDecodeRequest):
            return False, None
        if reason not in HOLD_REASONS or not block_ids:
            logger.info("prefill request %s finished (%s) with %d blocks: not held", request_id, reason, len(block_ids))
            return False, None
        port = self.side_channel_port
        if port is None:
            logger.error("prefill request %s: no side channel running: decodes could not read it", request_id)
            return False, None
        blocks = tuple(int(b) for b in block_ids)
        advertised = blocks
        if num_computed_tokens is not None:  # only the blocks holding computed tokens are worth reading
            needed = -(-num_computed_tokens // self.block_size)
            if not 0 < needed <= len(blocks):
                logger.error(
                    "prefill request %s: %d computed tokens do not fit its %d blocks of %d: not held",
                    request_id,
                    num_computed_tokens,
                    len(blocks),
                    self.block_size,
                )
                return False, None
            advertised = blocks[:needed]
        self._hold[request_id] = blocks  # the connector owns every block until finished_sending
        if request_id in self._streamed:  # a decode may ask for it by its stream id (computed in several steps)
            self._hold_aliases[request_id] = self._streamed[request_id]
        self._holding.add(request_id)
        return True, remote_prefill_params(
            engine_id=self.engine_id,
            request_id=request_id,
            block_ids=list(advertised),
            host=self.config.side_channel_host,
            port=port,
            tp_size=self.tp_size,
            num_tokens=num_computed_tokens,
            block_size=self.block_size,
            hold_seconds=hold_window(self.config.lease_seconds),
            incarnation=self._incarnation,
            wall_now=time.time(),
        )

    def abort_held(self, request_id: str) -> None:
        """Prefill side: stop holding a finished request's blocks (they come back in ``finished_sending``)."""
        with self._lock:
            if request_id in self._holding:
                self._abort.add(request_id)

    def release_held(self, request_id: str, read_possible: bool = True) -> bool:
        """Prefill side, from the side channel (a ``Release`` from the proxy): nobody will read ``request_id``'s
        blocks; the workers free them (see ``LeaseLedger.release``). Returns whether they are held here."""
        with self._lock:
            request_id = self._stream_ids.get(request_id, request_id)  # a streamed request, by its stream id
            if request_id not in self._holding:
                return False
            self._released[request_id] = self._released.get(request_id, False) or read_possible
            return True

    def update_connector_output(
        self,
        finished_sending: Iterable[str] = (),
        finished_recving: Iterable[str] = (),
        load_error_block_ids: Iterable[int] = (),
        failed_requests: Iterable[str] = (),
    ) -> None:
        """The workers' aggregated results of a step (``OutputAggregator``)."""
        try:
            with self._lock:
                held = len(self._holding)
                finished_sending = list(finished_sending)
                self._holding.difference_update(finished_sending)
                for request_id in finished_sending:
                    self._forget_stream(request_id)
                if len(self._holding) < held:
                    self._holds_ended.notify_all()
                for request_id in finished_recving:
                    remote = self._remotes.get(request_id)
                    if remote is not None and remote.phase == "loading":
                        remote.phase = "loaded"
                errors = set(load_error_block_ids)
                failed = set(failed_requests)
                if errors or failed:
                    logger.warning(
                        "KV loads failed: requests %s, block ids to recompute %s", sorted(failed), sorted(errors)
                    )
        except Exception:
            logger.exception("update_connector_output failed")

    @property
    def holding(self) -> int:
        """Prefill side: requests whose blocks the workers hold."""
        with self._lock:
            return len(self._holding)

    @property
    def waiting_on_transfers(self) -> bool:
        """Blocks are held for readers (prefill side) or loads are pending (decode side): an engine with nothing
        else to do steps only to learn when these end."""
        with self._lock:
            return bool(self._holding or self._remotes)
