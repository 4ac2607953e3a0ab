"""``PdOffloadConnector``'s metrics on vLLM's ``/metrics`` (``vllm:pd_transfer_offload_*``).

Each side (the scheduler connector: hits, misses, evictions, bytes held; the worker connector: bytes and
seconds stored and loaded, blocks refused on load) counts into its own
:class:`~pd_transfer.offload.OffloadMetrics`. :class:`OffloadStatsCollector` turns the increments since its
last call into a :class:`PdOffloadStats` (plain ``data``: ``"<family>|<tier>"`` -> increment, ``"held|<tier>"``
-> bytes); vLLM aggregates the workers' and the scheduler's stats and hands ``data`` to
:class:`PdOffloadPromMetrics`, which adds the increments to per-engine counters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from pd_transfer.offload import OffloadMetrics

if TYPE_CHECKING:
    from vllm.config import VllmConfig

TIERS = ("host", "disk")
#: stats key -> (sample name in OffloadMetrics, help of the vLLM counter); the vLLM counter is
#: ``vllm:pd_transfer_offload_<key>`` (exported with ``_total``), labelled by tier
COUNTERS: dict[str, tuple[str, str]] = {
    "stored_bytes": ("pd_transfer_offload_stored_bytes_total", "Bytes of KV blocks stored into an offload tier"),
    "store_seconds": ("pd_transfer_offload_store_seconds_total", "Worker seconds spent storing into a tier"),
    "loaded_bytes": ("pd_transfer_offload_loaded_bytes_total", "Bytes of KV blocks loaded from an offload tier"),
    "load_seconds": ("pd_transfer_offload_load_seconds_total", "Worker seconds spent loading from a tier"),
    "hits": ("pd_transfer_offload_hits_total", "Blocks found in a tier by lookups"),
    "misses": ("pd_transfer_offload_misses_total", "Blocks looked up in a tier and not found"),
    "evictions": ("pd_transfer_offload_evictions_total", "Blocks evicted from a tier"),
}
_REJECTED = ("pd_transfer_offload_rejected_blocks_total", ("truncated", "corrupt", "foreign", "missing"))


@dataclass
class PdOffloadStats(KVConnectorStats):
    """Offload counter increments (and bytes held) since the last report; see the module docstring."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        empty: dict[str, Any] = {}
        self.data = empty

    def is_empty(self) -> bool:
        return not any(self.data.values()) and not any(k.startswith("held|") for k in self.data)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Sum ``other``'s increments into this one (bytes held: the latest value wins); returns ``self``."""
        for key, value in other.data.items():
            if key.startswith("held|"):
                self.data[key] = value
            else:
                self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        """The periodic log line: MiB stored and loaded, hits and misses (all tiers)."""

        def total(name: str) -> float:
            return sum(self.data.get(f"{name}|{tier}", 0) for tier in TIERS)

        return {
            "offload MiB stored": round(total("stored_bytes") / 2**20, 3),
            "offload MiB loaded": round(total("loaded_bytes") / 2**20, 3),
            "offload block hits": int(total("hits")),
            "offload block misses": int(total("misses")),
        }


class OffloadStatsCollector:
    """Increments of one :class:`OffloadMetrics` since the previous :meth:`collect`."""

    def __init__(self, metrics: OffloadMetrics, tiers: tuple[str, ...], *, report_held: bool) -> None:
        self.metrics = metrics
        self.tiers = tiers
        self.report_held = report_held
        self._last: dict[str, float] = {}
        self._last_held: dict[str, float] = {}

    def collect(self) -> PdOffloadStats | None:
        """The stats since the last call, or None when nothing changed."""
        stats = PdOffloadStats()
        for tier in self.tiers:
            for key, (sample, _help) in COUNTERS.items():
                self._add(stats, f"{key}|{tier}", sample, {"tier": tier})
            for reason in _REJECTED[1]:
                self._add(stats, f"rejected_{reason}|{tier}", _REJECTED[0], {"tier": tier, "reason": reason})
            if self.report_held:
                held = self._value("pd_transfer_offload_held_bytes", {"tier": tier})
                if held != self._last_held.get(tier):
                    stats.data[f"held|{tier}"] = held
                    self._last_held[tier] = held
        return None if stats.is_empty() else stats

    def _add(self, stats: PdOffloadStats, key: str, sample: str, labels: dict[str, str]) -> None:
        value = self._value(sample, labels)
        increment = value - self._last.get(key, 0.0)
        self._last[key] = value
        if increment:
            stats.data[key] = increment

    def _value(self, sample: str, labels: dict[str, str]) -> float:
        return self.metrics.registry.get_sample_value(sample, labels) or 0.0


class PdOffloadPromMetrics(KVConnectorPromMetrics):
    """``vllm:pd_transfer_offload_<counter>_total{tier}`` for every key of :data:`COUNTERS`,
    ``vllm:pd_transfer_offload_rejected_blocks_total{tier,reason}`` and the gauge
    ``vllm:pd_transfer_offload_held_bytes{tier}``, per engine."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters: dict[str, Any] = {}
        for key, (_sample, documentation) in COUNTERS.items():
            self.counters[key] = self._counter_cls(
                name=f"vllm:pd_transfer_offload_{key}",
                documentation=documentation,
                labelnames=[*self._labelnames, "tier"],
            )
        self.rejected: Any = self._counter_cls(
            name="vllm:pd_transfer_offload_rejected_blocks",
            documentation="Stored blocks refused on load (truncated, corrupt, foreign, missing)",
            labelnames=[*self._labelnames, "tier", "reason"],
        )
        gauge_cls: Any = self._gauge_cls  # vLLM types it as any of its metric classes; it is its Gauge
        self.held = gauge_cls(
            name="vllm:pd_transfer_offload_held_bytes",
            documentation="Bytes of KV blocks an offload tier holds",
            labelnames=[*self._labelnames, "tier"],
            multiprocess_mode="mostrecent",
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Add one aggregated :class:`PdOffloadStats` ``data`` to engine ``engine_idx``'s metrics."""
        labels = self.per_engine_labelvalues.get(engine_idx, [])
        for item, value in transfer_stats_data.items():
            name, _, tier = item.partition("|")
            if name == "held":
                self.held.labels(*labels, tier).set(value)
            elif name.startswith("rejected_"):
                self.rejected.labels(*labels, tier, name.removeprefix("rejected_")).inc(value)
            elif name in self.counters and value > 0:
                self.counters[name].labels(*labels, tier).inc(value)
