"""Prometheus metrics of the offload tiers (``pd_transfer_offload_*``), labelled by tier (``host``, ``disk``).

Like :class:`pd_transfer.metrics.TransferMetrics`: pass ``registry`` to keep a set apart (tests, several
engines); ``OffloadMetrics()`` uses a fresh registry.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# bytes of one transfer: 64 KiB .. 4 GiB
_SIZES = tuple(float(2**exponent) for exponent in range(16, 33, 2))


class OffloadMetrics:
    """The offload metric families, registered in ``registry`` (a fresh one by default)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.stored_bytes = Counter(
            "pd_transfer_offload_stored_bytes", "Bytes stored into a tier", ["tier"], registry=r
        )
        self.store_seconds = Counter(
            "pd_transfer_offload_store_seconds", "Seconds spent storing into a tier", ["tier"], registry=r
        )
        self.loaded_bytes = Counter(
            "pd_transfer_offload_loaded_bytes", "Bytes loaded from a tier", ["tier"], registry=r
        )
        self.load_seconds = Counter(
            "pd_transfer_offload_load_seconds", "Seconds spent loading from a tier", ["tier"], registry=r
        )
        self.transfer_bytes = Histogram(
            "pd_transfer_offload_transfer_bytes",
            "Bytes of one transfer job, by tier and direction (store, load)",
            ["tier", "direction"],
            buckets=_SIZES,
            registry=r,
        )
        self.hits = Counter("pd_transfer_offload_hits", "Blocks found by lookups", ["tier"], registry=r)
        self.misses = Counter("pd_transfer_offload_misses", "Blocks looked up and not found", ["tier"], registry=r)
        self.evictions = Counter("pd_transfer_offload_evictions", "Blocks evicted from a tier", ["tier"], registry=r)
        self.rejected_blocks = Counter(
            "pd_transfer_offload_rejected_blocks",
            "Stored blocks refused on load: missing, truncated, corrupt, foreign",
            ["tier", "reason"],
            registry=r,
        )
        self.held_bytes = Gauge("pd_transfer_offload_held_bytes", "Bytes of blocks a tier holds", ["tier"], registry=r)

    def observe_transfer(self, tier: str, direction: str, num_bytes: int, seconds: float) -> None:
        """One finished job: ``num_bytes`` moved in ``seconds``."""
        if direction == "store":
            self.stored_bytes.labels(tier).inc(num_bytes)
            self.store_seconds.labels(tier).inc(seconds)
        else:
            self.loaded_bytes.labels(tier).inc(num_bytes)
            self.load_seconds.labels(tier).inc(seconds)
        self.transfer_bytes.labels(tier, direction).observe(num_bytes)
