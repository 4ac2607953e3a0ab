"""The worker side of the connector: one per TP rank, engine-agnostic (no vLLM import).

A ``WorkerSide`` owns its rank's :class:`PrefillRank` (created at once: its NIXL agent is what the side
channel publishes) and :class:`DecodeRank` (created on first use). Each step the engine hands it the
scheduler's :class:`StepMetadata` (``start_load``: holds start their lease inline, pulls, releases and
heartbeats go to a thread pool, so the engine step never waits on the network) and collects what finished
(``get_finished``, ``get_failed_requests``, ``get_block_ids_with_load_errors``, or all at once with
``step_output``). Lease expiry is swept in ``get_finished``.

Streams (issue 41): a step's metadata names the streamed requests whose prompt it computes (``reqs_computing``); the
prefill rank offers them as computing (under their stream id too: ``streams_computing``, which an engine whose
``start_load`` comes after the forward, as vLLM's does, calls at its first layer), and the engine tells the worker
after each layer's attention wrote its KV (``layers_saved``, host caches: the KV is in memory when the layer returns),
so that a decode streaming them receives each layer while the next is computed. A decode's streamed load
(``RecvSpec.stream``) runs on threads of its own (:data:`STREAM_THREADS`), as it waits for the prefill's compute.

Ordering on a device: a GPU engine's kernels write blocks asynchronously, so the engine hands over, at the end of
each computing step, an event recorded after them (``step_computed``); holds started later carry it, and the prefill
rank offers their blocks to readers only once it completed (that event only, never the whole device). A CPU engine
hands none: its blocks are written when the step returns.

A pull counts as received only when every prefill rank read from confirmed that the blocks were still held
when our ``ReadDone`` arrived, or when the read ended inside the hold window the prefill promised in its params
(``DecodeRank.pull_confirmed``). Anything else (handshake timeout, wrong
engine, bad block ids, failed or refused read, no confirmation) applies the failure policy: ``recompute``
reports the request's local block ids as load errors, ``fail`` reports the request failed; either way the
request is reported in ``finished_recving`` and nothing is raised into the engine.

``OutputAggregator`` merges the ranks' reports: a request is finished only once every rank reported it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from pd_transfer.affinity import unpinning
from pd_transfer.connector.decode.rank import DecodeRank, PullStats
from pd_transfer.connector.options import DecodeOptions, PrefillOptions
from pd_transfer.connector.prefill.rank import PrefillRank, ReadyEvent
from pd_transfer.handshake.errors import HandshakeError
from pd_transfer.handshake.messages import RankMetadata
from pd_transfer.metrics import TransferMetrics, default_metrics
from pd_transfer.settings import Settings
from pd_transfer.topology.packed import PackedBlockFormat
from pd_transfer.transfer.agent import NIXL_AGENTS
from pd_transfer.transfer.agent_protocol import AgentFactory
from pd_transfer.transfer.errors import TransferError

from .cache import KVCache
from .config import ConnectorConfig
from .errors import WrongEngine, failure_kind
from .metadata import RecvSpec, RemoteRef, StepMetadata, TransferResults

logger = logging.getLogger(__name__)

#: Streamed loads waiting on prefills at once, per rank (each on a thread of its own: it mostly waits).
STREAM_THREADS = 64


@dataclass(frozen=True)
class LoadOutcome:
    """How one request's load ended on this rank."""

    request_id: str
    ok: bool
    local_block_ids: tuple[int, ...]
    error: str = ""
    stats: PullStats | None = None
    seconds: float = 0.0


class WorkerSide:
    """The connector's worker half for one TP rank of engine ``engine_id`` (the engine's side of it:
    :class:`~.contract.WorkerContract`)."""

    def __init__(
        self,
        engine_id: str,
        cache: KVCache,
        config: ConnectorConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        packed_formats: Callable[[int], PackedBlockFormat] | None = None,
        metrics: TransferMetrics | None = None,
        settings: Settings,
        agent_factory: AgentFactory = NIXL_AGENTS,
    ) -> None:
        """``packed_formats``: for caches with a ``packing``, the (block, head) packing of a block size
        (see :class:`DecodeRank`), so that engines of other block sizes can be read. ``metrics``: where the
        decode side records (default: the process-wide ones). ``settings``: the process's (read at its edge), handed
        to both ranks; the push mode both follow is ``config.push``, else ``settings.push``. ``agent_factory``: makes
        both ranks' agents (NIXL agents unless the caller hands in others)."""
        self.engine_id = engine_id
        self.metrics = metrics if metrics is not None else default_metrics()
        self._packed_formats = packed_formats
        self.cache = cache
        self.config = config
        self.settings = settings
        self._agent_factory = agent_factory
        self.rank = cache.layout.tp_rank
        self.prefill = PrefillRank(
            engine_id, cache, PrefillOptions.from_config(config, settings), clock=clock, agent_factory=agent_factory
        )
        self._computed: ReadyEvent | None = None  # the latest step's "KV written" event (GPU engines)
        self._decode: DecodeRank | None = None
        self._decode_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(
            config.load_threads,
            thread_name_prefix=f"pd-transfer-load-tp{self.rank}",
            initializer=unpinning(settings.thread_cpu_set),
        )
        self._streams = ThreadPoolExecutor(
            STREAM_THREADS,
            thread_name_prefix=f"pd-transfer-stream-tp{self.rank}",
            initializer=unpinning(settings.thread_cpu_set),
        )
        self._streaming_now: list[str] = []  # prefill: streamed requests this step computes
        self._computing_step: StepMetadata | None = None  # the step they were offered for
        self._lock = threading.Lock()
        self._sending: set[str] = set()
        self._completed: list[LoadOutcome] = []
        self._load_errors: set[int] = set()
        self._failed: set[str] = set()
        self._closed = False
        self.outcomes: list[LoadOutcome] = []  # every load's outcome, newest last (bounded)

    @property
    def rank_metadata(self) -> RankMetadata:
        """This rank's entry on the engine's side channel (``SchedulerSide.start_side_channel``)."""
        return self.prefill.rank_metadata

    def decode_rank(self) -> DecodeRank:
        """This rank's receiving side, created on first use."""
        with self._decode_lock:
            if self._closed:
                raise RuntimeError("the worker is closed")
            if self._decode is None:
                self._decode = DecodeRank(
                    self.engine_id,
                    self.cache,
                    DecodeOptions.from_config(self.config, self.settings),
                    packed_formats=self._packed_formats,
                    metrics=self.metrics,
                    agent_factory=self._agent_factory,
                )
            return self._decode

    # ------------------------------------------------------------------ each step
    def step_computed(self, ready: ReadyEvent) -> None:
        """The latest step's KV is written once ``ready`` completes: holds started from now on wait for it."""
        self._computed = ready

    def layers_saved(self, layers: int) -> None:
        """Prefill: the step's first ``layers`` layers wrote their KV (host memory): readers of the streamed requests
        it computes may have them."""
        for request_id in self._streaming_now:
            logger.debug("worker tp%d: request %s: %d layers written", self.rank, request_id, layers)
            try:
                self.prefill.layers_written(request_id, layers)
            except Exception:
                logger.exception(
                    "worker tp%d: request %s: marking %d layers written failed", self.rank, request_id, layers
                )

    def streams_computing(self, metadata: StepMetadata) -> None:
        """Prefill: offer the streamed requests whose prompt the step of ``metadata`` computes (once per step: the
        engine may call this before its forward, and :meth:`start_load` does, which vLLM calls after it)."""
        if metadata is self._computing_step:
            return
        self._computing_step = metadata
        self._streaming_now = []
        for request_id, start in metadata.reqs_computing.items():
            try:
                self.prefill.computing(request_id, list(start.block_ids), alias=start.stream_id)
                self._streaming_now.append(request_id)
                logger.debug(
                    "worker tp%d: request %s offered as computed (stream %s)", self.rank, request_id, start.stream_id
                )
            except Exception:
                logger.exception("worker tp%d: offering request %s as it is computed failed", self.rank, request_id)

    def start_load(self, metadata: StepMetadata) -> None:
        """Act on a step's metadata without blocking: holds now (after the latest step's KV is written, which it
        is by then but for the kernels still running), network work in the background."""
        self.streams_computing(metadata)
        for request_id, block_ids in metadata.reqs_to_hold.items():
            try:
                alias = metadata.hold_aliases.get(request_id)
                freed = self.prefill.hold(request_id, list(block_ids), ready=self._computed, alias=alias)
                if freed is not None:
                    with self._lock:
                        self._sending.add(request_id)
            except Exception:
                logger.exception("worker tp%d: holding request %s failed; freeing it", self.rank, request_id)
                with self._lock:
                    self._sending.add(request_id)
        for request_id in metadata.reqs_to_abort:
            try:
                if self.prefill.abort(request_id) is not None:
                    with self._lock:
                        self._sending.add(request_id)
            except Exception:
                logger.exception("worker tp%d: aborting request %s failed", self.rank, request_id)
        for request_id, read_possible in metadata.reqs_released.items():
            try:
                if self.prefill.release(request_id, read_possible=read_possible) is not None:
                    with self._lock:
                        self._sending.add(request_id)
            except Exception:
                logger.exception("worker tp%d: releasing request %s failed", self.rank, request_id)
        for request_id, spec in metadata.reqs_to_recv.items():
            try:
                (self._streams if spec.stream else self._pool).submit(self._load, request_id, spec)
            except Exception as error:  # closed: still report the request, as failed
                self._record(LoadOutcome(request_id, False, spec.local_block_ids, f"not started: {error}"))
        for request_id, ref in metadata.reqs_to_release.items():
            self._submit(self._release, request_id, ref)
        for request_id, ref in metadata.reqs_to_heartbeat.items():
            self._submit(self._heartbeat, request_id, ref)

    def _submit(self, function: Callable[[str, RemoteRef], None], request_id: str, ref: RemoteRef) -> None:
        try:
            self._pool.submit(function, request_id, ref)
        except Exception as error:
            logger.warning(
                "worker tp%d: request %s: %s not started: %s", self.rank, request_id, function.__name__, error
            )

    def get_finished(self) -> tuple[set[str], set[str]]:
        """(finished_sending, finished_recving) since the last call; sweeps expired leases. Failed loads are
        staged for ``get_failed_requests`` / ``get_block_ids_with_load_errors`` in the same call, so they are
        never reported after the request."""
        try:
            freed = self.prefill.expire() + self.prefill.take_freed()
        except Exception:
            logger.exception("worker tp%d: sweeping leases failed", self.rank)
            freed = []
        with self._lock:
            self._sending.update(item.request_id for item in freed)
            sending, self._sending = self._sending, set()
            completed, self._completed = self._completed, []
            for outcome in completed:
                if outcome.ok:
                    continue
                if self.config.failure_policy == "recompute":
                    self._load_errors.update(outcome.local_block_ids)
                else:
                    self._failed.add(outcome.request_id)
        return sending, {outcome.request_id for outcome in completed}

    def get_failed_requests(self) -> set[str]:
        """Policy ``fail``: requests whose load failed (also in ``finished_recving``)."""
        with self._lock:
            failed, self._failed = self._failed, set()
        return failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Policy ``recompute``: local blocks whose KV must be recomputed."""
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def step_output(self) -> TransferResults:
        """Everything finished since the last call, as one report for ``OutputAggregator``."""
        sending, recving = self.get_finished()
        return TransferResults(
            rank=self.rank,
            finished_sending=frozenset(sending),
            finished_recving=frozenset(recving),
            failed_recving=frozenset(self.get_failed_requests()),
            load_error_block_ids=frozenset(self.get_block_ids_with_load_errors()),
        )

    # ------------------------------------------------------------------ background work
    def _load(self, request_id: str, spec: RecvSpec) -> None:
        started = time.perf_counter()
        reached = False  # we talked to the right engine: tell it if we give up before reading
        try:
            decode = self.decode_rank()
            engine = decode.check_engine(spec.remote_host, spec.remote_port, spec.remote_engine_id)
            reached = True
            if engine.tp_size != spec.remote_tp_size:
                raise ValueError(
                    f"tp_size {spec.remote_tp_size} in the params, but the engine runs TP {engine.tp_size}"
                )
            stats = self._pull(decode, spec)
        except Exception as error:
            self.metrics.pull_failures.labels(failure_kind(error)).inc()
            logger.error(
                "worker tp%d: request %s: loading its KV from engine %s at %s:%d failed (policy %s): %s: %s",
                self.rank,
                request_id,
                spec.remote_engine_id,
                spec.remote_host,
                spec.remote_port,
                self.config.failure_policy,
                type(error).__name__,
                error,
            )
            # a failed read already told the prefill (ReadFailed, or ReadDone before a refusal)
            if reached and not isinstance(error, TransferError | WrongEngine | HandshakeError):
                self._release(request_id, spec.ref, f"load failed: {error}")
            outcome = LoadOutcome(
                request_id,
                False,
                spec.local_block_ids,
                f"{type(error).__name__}: {error}",
                seconds=time.perf_counter() - started,
            )
        else:
            outcome = LoadOutcome(
                request_id, True, spec.local_block_ids, stats=stats, seconds=time.perf_counter() - started
            )
        self._record(outcome)

    def _pull(self, decode: DecodeRank, spec: RecvSpec) -> PullStats:
        """``spec``'s KV, streamed while the prefill computes it, or read from what it holds, confirmed."""
        if spec.stream:
            return decode.pull_streamed(
                spec.remote_request_id,
                spec.remote_host,
                spec.remote_port,
                list(spec.local_block_ids),
                spec.num_tokens,
                skip_blocks=spec.skip_blocks,
                timeout_s=self.config.read_timeout_s,
            )
        return decode.pull_confirmed(
            spec.remote_request_id,
            spec.remote_host,
            spec.remote_port,
            list(spec.remote_block_ids),
            list(spec.local_block_ids),
            spec.num_tokens,
            timeout_s=self.config.read_timeout_s,
            confirm_timeout_s=self.config.confirm_timeout_s,
            trust_until=spec.trust_until,
            incarnation=spec.incarnation,
        )

    def _record(self, outcome: LoadOutcome) -> None:
        with self._lock:
            self._completed.append(outcome)
            self.outcomes.append(outcome)
            del self.outcomes[:-1000]

    def _release(self, request_id: str, ref: RemoteRef, reason: str = "the decode will not read it") -> None:
        try:
            decode = self.decode_rank()
            decode.check_engine(ref.remote_host, ref.remote_port, ref.remote_engine_id)
            decode.abandon(ref.remote_request_id, ref.remote_host, ref.remote_port, reason[:500])
        except Exception as error:
            logger.warning(
                "worker tp%d: request %s: could not release it on engine %s (its lease will): %s",
                self.rank,
                request_id,
                ref.remote_engine_id,
                error,
            )

    def _heartbeat(self, request_id: str, ref: RemoteRef) -> None:
        try:
            decode = self.decode_rank()
            decode.check_engine(ref.remote_host, ref.remote_port, ref.remote_engine_id)
            decode.heartbeat(ref.remote_request_id, ref.remote_host, ref.remote_port)
        except Exception as error:
            logger.info("worker tp%d: request %s: heartbeat failed: %s", self.rank, request_id, error)

    def close(self) -> None:
        """Stop taking work, wait for what runs (pulls are bounded by their timeouts), release NIXL."""
        with self._decode_lock:
            self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._streams.shutdown(wait=False, cancel_futures=True)  # those waiting on a prefill end with the decode
        if self._decode is not None:
            self._decode.close()
        self.prefill.close()


class OutputAggregator:
    """Merges the ``TransferResults`` of an engine's ``world_size`` workers, step after step: a request is
    finished sending (receiving) once every rank reported it; failures go out with the request's
    ``finished_recving``; load-error block ids are unioned and passed on at once."""

    def __init__(self, world_size: int) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        self.world_size = world_size
        self._sending: dict[str, set[int]] = {}
        self._recving: dict[str, set[int]] = {}
        self._failed: set[str] = set()

    def aggregate(self, outputs: Sequence[TransferResults]) -> TransferResults:
        errors: set[int] = set()
        for output in outputs:
            if not 0 <= output.rank < self.world_size:
                raise ValueError(f"rank {output.rank} is outside world size {self.world_size}")
            errors.update(output.load_error_block_ids)
            self._failed.update(output.failed_recving)
            for request_id in output.finished_sending:
                self._sending.setdefault(request_id, set()).add(output.rank)
            for request_id in output.finished_recving:
                self._recving.setdefault(request_id, set()).add(output.rank)
        sending = self._complete(self._sending)
        recving = self._complete(self._recving)
        failed = self._failed & recving
        self._failed -= failed
        return TransferResults(
            rank=-1,
            finished_sending=frozenset(sending),
            finished_recving=frozenset(recving),
            failed_recving=frozenset(failed),
            load_error_block_ids=frozenset(errors),
        )

    def _complete(self, counts: dict[str, set[int]]) -> set[str]:
        done = {request_id for request_id, ranks in counts.items() if len(ranks) >= self.world_size}
        for request_id in done:
            del counts[request_id]
        return done
