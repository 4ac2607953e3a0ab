"""pd-transfer's stats through vLLM's connector stats hooks, and its metrics on vLLM's ``/metrics``.

A worker connector reports :class:`PdTransferStats` each step it has something to say (built by
:class:`WorkerStatsCollector`); vLLM aggregates them across workers, ships ``data`` to the frontend, rebuilds
them with ``PdTransferConnector.build_kv_connector_stats`` for its periodic log line (:meth:`PdTransferStats.reduce`)
and hands ``data`` to :class:`PdTransferPromMetrics`, which exports ``vllm:pd_transfer_*`` per engine. The scheduler's
connector reports the same way (vLLM adds its stats to the workers'): its side channel's refusals, the requests
waiting for remote KV (:class:`SchedulerStatsCollector`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from pd_transfer.connector.config import BUILT_IN_TRANSPORTS
from pd_transfer.metrics import default_metrics

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from pd_transfer.connector.worker import LoadOutcome

logger = logging.getLogger(__name__)

#: Counters of the worker process's own pd-transfer metrics whose per-report increments go to vLLM's /metrics:
#: stats key -> (sample name in :func:`~pd_transfer.metrics.default_metrics`, its labels)
LEASE_ENDS = ("read", "expired", "aborted", "released")
HANDSHAKE_OUTCOMES = ("ok", "timeout", "backoff", "refused", "auth", "incompatible", "version", "error")
REJECT_REASONS = (
    "malformed",
    "too_large",
    "unsupported_version",
    "unexpected_message",
    "auth_required",
    "auth_failed",
    "incompatible",
    "unknown_rank",
    "unknown_engine",
)
NONCE_REFUSALS = ("unknown", "expired", "reused", "busy")
STREAM_PHASES = ("computing", "held")
DIGEST_OUTCOMES = ("equal", "mismatch")
COUNTED: dict[str, tuple[str, dict[str, str]]] = {
    "unconfirmed_reads": ("pd_transfer_unconfirmed_reads_total", {}),
    **{f"leases_{reason}": ("pd_transfer_leases_ended_total", {"reason": reason}) for reason in LEASE_ENDS},
    **{f"handshakes_{o}": ("pd_transfer_handshakes_total", {"outcome": o}) for o in HANDSHAKE_OUTCOMES},
    "handshake_seconds": ("pd_transfer_handshake_seconds_sum", {}),
    "streamed_layers": ("pd_transfer_streamed_layers_total", {}),
    **{f"streamed_bytes_{when}": ("pd_transfer_streamed_bytes_total", {"when": when}) for when in STREAM_PHASES},
    **{f"digest_checks_{o}": ("pd_transfer_digest_checks_total", {"outcome": o}) for o in DIGEST_OUTCOMES},
}
#: The same for the scheduler process's counters (its side channel), reported by the scheduler's connector
SCHEDULER_COUNTED: dict[str, tuple[str, dict[str, str]]] = {
    **{f"rejected_{r}": ("pd_transfer_side_channel_rejected_total", {"reason": r}) for r in REJECT_REASONS},
    **{f"nonces_{r}": ("pd_transfer_side_channel_nonces_refused_total", {"reason": r}) for r in NONCE_REFUSALS},
}
#: Labels of ``vllm:pd_transfer_info``, in order
INFO_LABELS = ("protocol_version", "fingerprint", "model", "dtype")

#: Histogram buckets in seconds
_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
#: Histogram buckets in bytes: 4 KiB .. 16 GiB
_BYTES = tuple(2.0 ** (12 + 2 * i) for i in range(12))


@dataclass
class PdTransferStats(KVConnectorStats):
    """What the workers did since their last report (plain data: it crosses processes).

    ``data["pulls"]``: one ``[seconds, bytes, descriptor rows, fix-up seconds after the last read, read seconds,
    connect seconds, confirmation seconds, pushed bytes, layers streamed, seconds from the last layer to usable KV]``
    per loaded request, and ``data["pulls_<transport>"]``
    counting them by transport (``nixl``, ``cuda_ipc``, ``host_ipc``, ``host_cma``); ``data["failed_loads"]``;
    the increments of the counters in :data:`COUNTED` (workers) and :data:`SCHEDULER_COUNTED` (scheduler), under
    their keys; ``data["waiting_for_kv"]``: the scheduler's requests
    waiting for remote KV, once per change (a list: the last one counts); ``data["info"]``: ``[[protocol version,
    fingerprint, model, dtype]]`` when it changed.
    """

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data: dict[str, Any] = {"pulls": [], "failed_loads": 0, **dict.fromkeys(COUNTED, 0)}

    def is_empty(self) -> bool:
        return not any(self.data.values())

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Add ``other``'s data to this one's (lists concatenated, counts summed); returns ``self``."""
        for key, value in other.data.items():
            if isinstance(value, list):
                self.data.setdefault(key, []).extend(value)
            else:
                self.data[key] = self.data.get(key, 0) + value
        return self

    # the lease counts read best as one "read/expired/aborted" field; vLLM only formats the values into its log line
    def reduce(self) -> dict[str, int | float | str]:  # type: ignore[override]
        """The periodic log line's fields: loads, failed loads, MiB loaded, mean load ms, unconfirmed reads,
        and the lease ends as ``"read/expired/aborted/released"``."""
        pulls = self.data.get("pulls", [])
        seconds = sum(pull[0] for pull in pulls)
        return {
            "loads": len(pulls),
            "failed_loads": self.data.get("failed_loads", 0),
            "MiB loaded": round(sum(pull[1] for pull in pulls) / 2**20, 3),
            "avg load ms": round(seconds / len(pulls) * 1e3, 3) if pulls else 0.0,
            "unconfirmed_reads": self.data.get("unconfirmed_reads", 0),
            "leases read/expired/aborted/released": "/".join(
                str(self.data.get(f"leases_{reason}", 0)) for reason in LEASE_ENDS
            ),
        }


class WorkerStatsCollector:
    """One worker connector's source of :class:`PdTransferStats`: each :meth:`collect` reports the loads that
    ended and the :data:`COUNTED` counter increments since the previous call."""

    def __init__(self, counted: dict[str, tuple[str, dict[str, str]]] | None = None) -> None:
        """``counted``: the counters whose increments to report (default :data:`COUNTED`)."""
        self._last_outcome: LoadOutcome | None = None
        self._table = COUNTED if counted is None else counted
        self._counted: dict[str, float] = {}  # last values of the counters
        self._info: dict[str, str] = {}

    def collect(self, outcomes: Sequence[LoadOutcome]) -> PdTransferStats | None:
        """The stats since the last call, or ``None`` if nothing happened. ``outcomes``: the worker's bounded
        list of load outcomes, newest last (copied here; loads that ended before the last call are skipped)."""
        stats = PdTransferStats()
        for outcome in self._fresh_outcomes(list(outcomes)):
            _log_outcome(outcome)
            if not outcome.ok:
                stats.data["failed_loads"] += 1
            elif outcome.stats is not None:
                pulled = outcome.stats
                stats.data["pulls"].append(
                    [
                        outcome.seconds,
                        pulled.bytes,
                        pulled.descriptors,
                        pulled.postprocess_exposed_seconds,
                        pulled.read_seconds,
                        pulled.connect_seconds,
                        pulled.confirm_seconds,
                        pulled.pushed_bytes,
                        pulled.layers_streamed,
                        pulled.last_layer_seconds,
                    ]
                )
                by_transport = f"pulls_{pulled.transport}"
                stats.data[by_transport] = stats.data.get(by_transport, 0) + 1
        self._add_counter_increments(stats)
        self._add_info(stats)
        return None if stats.is_empty() else stats

    def _fresh_outcomes(self, outcomes: list[LoadOutcome]) -> list[LoadOutcome]:
        """The outcomes after the last one seen by the previous call, oldest first."""
        fresh = []
        for outcome in reversed(outcomes):
            if outcome is self._last_outcome:
                break
            fresh.append(outcome)
        if outcomes:
            self._last_outcome = outcomes[-1]
        return fresh[::-1]

    def _add_counter_increments(self, stats: PdTransferStats) -> None:
        """Put each :data:`COUNTED` counter's increase since the previous call into ``stats``."""
        registry = default_metrics().registry
        for key, (sample, labels) in self._table.items():
            value = registry.get_sample_value(sample, labels) or 0.0
            increment = value - self._counted.get(key, 0.0)
            stats.data[key] = increment if sample.endswith("_sum") else int(increment)
            self._counted[key] = value

    def _add_info(self, stats: PdTransferStats) -> None:
        """``data["info"]`` when this process's ``pd_transfer_info`` changed since the last report."""
        labels = default_metrics().info_labels
        if labels and labels != self._info:
            stats.data["info"] = [[labels.get(name, "") for name in INFO_LABELS]]
            self._info = dict(labels)


class SchedulerStatsCollector(WorkerStatsCollector):
    """The scheduler connector's source of :class:`PdTransferStats`: its side channel's refusals
    (:data:`SCHEDULER_COUNTED`), the requests waiting for remote KV when that changed, ``pd_transfer_info``."""

    def __init__(self) -> None:
        super().__init__(SCHEDULER_COUNTED)
        self._waiting: float | None = None

    def collect_scheduler(self) -> PdTransferStats | None:
        stats = self.collect([])
        if stats is None:
            stats = PdTransferStats()
        family = default_metrics().requests_waiting_for_kv
        waiting = sum(sample.value for metric in family.collect() for sample in metric.samples)
        if waiting != self._waiting:
            stats.data["waiting_for_kv"] = [waiting]
            self._waiting = waiting
        return None if stats.is_empty() else stats


def _log_outcome(outcome: LoadOutcome) -> None:
    """One DEBUG line per ended load: ok or why not, milliseconds, and what it moved."""
    pulled = outcome.stats
    logger.debug(
        "request %s: load %s in %.2f ms%s",
        outcome.request_id,
        "ok" if outcome.ok else f"failed ({outcome.error})",
        outcome.seconds * 1e3,
        ""
        if pulled is None
        else f" ({pulled.bytes / 2**20:.2f} MiB, {pulled.descriptors} descriptors,"
        f" read {pulled.read_seconds * 1e3:.2f} ms)",
    )


class PdTransferPromMetrics(KVConnectorPromMetrics):
    """pd-transfer's metrics on vLLM's ``/metrics`` (``vllm:pd_transfer_*``), labelled per engine.

    Histograms per loaded request: ``pull_seconds`` (first read to usable KV), ``pull_bytes``, ``fixup_exposed_seconds``
    (block-size regroup after the last read), and where the pull's time went besides: ``read_seconds`` (first post to
    last completion), ``connect_seconds`` (reaching the prefill: handshake, NIXL peers and warm-up on first contact),
    ``confirm_seconds`` (waiting for the lease confirmation; 0 for a read inside the prefill's hold window),
    ``stream_tail_seconds`` (streamed: last layer to usable KV). Counters (``_total``): ``streamed_layers`` (decode),
    ``streamed_bytes{when=computing|held}`` (prefill), ``digest_checks{outcome=equal|mismatch}`` (decode: layers
    and reads checked against the prefill's digests), ``pulled_bytes`` (and of them ``pushed_bytes``),
    ``pulls{transport=nixl|cuda_ipc|host_ipc|host_cma}`` (what moved them), ``failed_loads``, ``unconfirmed_reads``,
    ``leases_ended{reason=read|expired|aborted|released}``, ``handshakes{outcome}`` and ``handshake_seconds`` (their
    sum), ``side_channel_rejected{reason}``, ``side_channel_nonces_refused{reason}``. Gauges:
    ``requests_waiting_for_kv``, ``info{protocol_version, fingerprint, model, dtype}`` (1).
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.pull_seconds = self._histogram(
            "vllm:pd_transfer_pull_seconds", "Seconds of a request's KV load, first read to usable KV", _SECONDS
        )
        self.pull_bytes = self._histogram("vllm:pd_transfer_pull_bytes", "Bytes of KV loaded per request", _BYTES)
        self.fixup_seconds = self._histogram(
            "vllm:pd_transfer_fixup_exposed_seconds",
            "Seconds the layout fix-up (block-size regroup) added after a load's last read",
            _SECONDS,
        )
        self.read_seconds = self._histogram(
            "vllm:pd_transfer_read_seconds", "Seconds of a KV load's reads, first post to last completion", _SECONDS
        )
        self.connect_seconds = self._histogram(
            "vllm:pd_transfer_connect_seconds",
            "Seconds a KV load spent reaching its prefill (handshake, NIXL peers, warm-up: first contact only)",
            _SECONDS,
        )
        self.confirm_seconds = self._histogram(
            "vllm:pd_transfer_confirm_seconds",
            "Seconds a KV load waited for the prefill's lease confirmation (0: the read ended in the hold window)",
            _SECONDS,
        )
        self.pulled_bytes = self._counter("vllm:pd_transfer_pulled_bytes", "Bytes of KV loaded from prefill engines")
        self.pushed_bytes = self._counter(
            "vllm:pd_transfer_pushed_bytes", "Of the bytes loaded, those the prefill engines wrote (push, over TCP)"
        )
        self.failed_loads = self._counter(
            "vllm:pd_transfer_failed_loads", "KV loads that failed (the failure policy was applied)"
        )
        self.unconfirmed_reads = self._counter(
            "vllm:pd_transfer_unconfirmed_reads",
            "Reads the prefill did not confirm as covered by its lease: discarded, never used as KV",
        )
        self.stream_tail_seconds = self._histogram(
            "vllm:pd_transfer_stream_tail_seconds",
            "Seconds from a streamed request's last layer arriving to its KV being usable (the prefill's hold)",
            _SECONDS,
        )
        #: stats key -> per-engine counter child
        self.counted: dict[str, dict[int, Any]] = {}
        self._pulls = self._labelled(
            "vllm:pd_transfer_pulls",
            "KV loads from prefill engines, by the transport that moved them: nixl, cuda_ipc, host_ipc, host_cma"
            " (same-host IPC), or one of your own",
            "transport",
            {transport: f"pulls_{transport}" for transport in BUILT_IN_TRANSPORTS},
        )
        self._labelled(
            "vllm:pd_transfer_leases_ended",
            "Blocks held for decode readers, by how the hold ended: read, expired, aborted, released (by the proxy)",
            "reason",
            {reason: f"leases_{reason}" for reason in LEASE_ENDS},
        )
        self._labelled(
            "vllm:pd_transfer_handshakes",
            "Side-channel handshakes of this engine's decode ranks, by outcome",
            "outcome",
            {outcome: f"handshakes_{outcome}" for outcome in HANDSHAKE_OUTCOMES},
        )
        self.counted["handshake_seconds"] = self._counter(
            "vllm:pd_transfer_handshake_seconds", "Seconds spent in side-channel handshakes (every attempt)"
        )
        self.counted["streamed_layers"] = self._counter(
            "vllm:pd_transfer_streamed_layers", "Layers of streamed requests received one by one (decode)"
        )
        self._labelled(
            "vllm:pd_transfer_streamed_bytes",
            "Bytes of KV sent to decodes streaming requests (prefill), by when: computing (during the forward) or held",
            "when",
            {when: f"streamed_bytes_{when}" for when in STREAM_PHASES},
        )
        self._labelled(
            "vllm:pd_transfer_digest_checks",
            "Streamed layers and reads this engine's decode ranks checked against the prefill's digests, by outcome:"
            " equal, or mismatch (the KV was not used: the request is recomputed)",
            "outcome",
            {outcome: f"digest_checks_{outcome}" for outcome in DIGEST_OUTCOMES},
        )
        self._labelled(
            "vllm:pd_transfer_side_channel_rejected",
            "Frames this engine's side channel refused, by reason",
            "reason",
            {reason: f"rejected_{reason}" for reason in REJECT_REASONS},
        )
        self._labelled(
            "vllm:pd_transfer_side_channel_nonces_refused",
            "Authenticated side-channel requests refused for their nonce, by why",
            "reason",
            {reason: f"nonces_{reason}" for reason in NONCE_REFUSALS},
        )
        gauge_cls: Any = self._gauge_cls  # vLLM types it as any of its metric classes; it is its Gauge
        self.waiting = self._per_engine(
            gauge_cls(
                name="vllm:pd_transfer_requests_waiting_for_kv",
                documentation="Requests whose KV a remote prefill holds, not loaded yet (queued or loading)",
                labelnames=self._labelnames,
                multiprocess_mode="mostrecent",
            )
        )
        self.info: Any = gauge_cls(
            name="vllm:pd_transfer_info",
            documentation="1, labelled with pd-transfer's protocol version and the model fingerprint",
            labelnames=[*self._labelnames, *INFO_LABELS],
            multiprocess_mode="mostrecent",
        )

    def _labelled(self, name: str, documentation: str, label: str, keys: dict[str, str]) -> Any:
        """A counter ``name`` with one more label (returned); its child for each ``label value -> stats key`` in
        ``counted``."""
        metric = self._counter_cls(name=name, documentation=documentation, labelnames=[*self._labelnames, label])
        for value, key in keys.items():
            self.counted[key] = self._per_engine(metric, value)
        return metric

    def _per_engine(self, metric: Any, *extra: str) -> dict[int, Any]:
        """engine index -> ``metric`` labelled with that engine's label values, then ``extra``."""
        return {engine: metric.labels(*values, *extra) for engine, values in self.per_engine_labelvalues.items()}

    def _histogram(self, name: str, documentation: str, buckets: tuple[float, ...]) -> dict[int, Any]:
        """A histogram ``name`` with ``buckets`` (in the metric's unit), per engine."""
        # vLLM types _histogram_cls as any of its metric classes; it is its Histogram class
        metric = self._histogram_cls(  # type: ignore[call-arg]
            name=name, documentation=documentation, buckets=list(buckets), labelnames=self._labelnames
        )
        return self._per_engine(metric)

    def _counter(self, name: str, documentation: str) -> dict[int, Any]:
        """A counter ``name`` (exported as ``name_total``), per engine."""
        return self._per_engine(self._counter_cls(name=name, documentation=documentation, labelnames=self._labelnames))

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Record one aggregated :class:`PdTransferStats` ``data`` for engine ``engine_idx``."""
        data = transfer_stats_data
        for pull in data.get("pulls", []):
            seconds, num_bytes, _rows, fixup, read, connect, confirm, pushed, layers, tail = pull
            if layers:
                self.stream_tail_seconds[engine_idx].observe(tail)
            self.pull_seconds[engine_idx].observe(seconds)
            self.pull_bytes[engine_idx].observe(num_bytes)
            self.fixup_seconds[engine_idx].observe(fixup)
            self.read_seconds[engine_idx].observe(read)
            self.connect_seconds[engine_idx].observe(connect)
            self.confirm_seconds[engine_idx].observe(confirm)
            self.pulled_bytes[engine_idx].inc(num_bytes)
            self.pushed_bytes[engine_idx].inc(pushed)
        for key, metric in (("failed_loads", self.failed_loads), ("unconfirmed_reads", self.unconfirmed_reads)):
            if data.get(key):
                metric[engine_idx].inc(data[key])
        for key in data:  # pulls by a transport that is not built in: its child made on its first pull
            if key.startswith("pulls_") and key not in self.counted:
                self.counted[key] = self._per_engine(self._pulls, key.removeprefix("pulls_")[:64])
        for key, counter in self.counted.items():
            if data.get(key):
                counter[engine_idx].inc(data[key])
        if data.get("waiting_for_kv"):
            self.waiting[engine_idx].set(data["waiting_for_kv"][-1])
        values = self.per_engine_labelvalues.get(engine_idx, [])
        for info in data.get("info", []):
            self.info.labels(*values, *[str(v) for v in info]).set(1)
