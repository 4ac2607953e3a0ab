"""Prometheus metrics of pd-transfer's endpoints in one process.

Decode ranks record every pull (bytes, seconds, descriptor rows, fix-up time added, outcome), the loads
that failed by kind, and the prefill engines handshaken afresh at a known address (a restart); prefill
ranks record how each lease ended (read, expired, aborted) and the blocks they hold. ``default_metrics()``
registers one set in prometheus_client's global registry, which an exporter of the process serves; pass
a ``TransferMetrics(registry=...)`` of your own to keep them apart (tests, several engines).
"""

from __future__ import annotations

import threading

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_ROWS = (1, 8, 64, 512, 4096, 32768, 262144, 2097152)


class TransferMetrics:
    """The metric families, registered in ``registry`` (a fresh one by default)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.pull_seconds = Histogram(
            "pd_transfer_pull_seconds",
            "Seconds of a request's pull, first post to usable KV",
            buckets=_SECONDS,
            registry=r,
        )
        self.fixup_exposed_seconds = Histogram(
            "pd_transfer_fixup_exposed_seconds",
            "Seconds the layout fix-up added after a pull's last read",
            buckets=_SECONDS,
            registry=r,
        )
        self.pull_rows = Histogram(
            "pd_transfer_pull_descriptor_rows", "Descriptor rows posted per pull", buckets=_ROWS, registry=r
        )
        self.pulled_bytes = Counter("pd_transfer_pulled_bytes", "Bytes of KV cache pulled", registry=r)
        self.pulls = Counter("pd_transfer_pulls", "Pulls by outcome of the reads: ok, failed", ["outcome"], registry=r)
        self.pull_failures = Counter(
            "pd_transfer_pull_failures",
            "Loads of a request's KV that failed, handshake to lease confirmation, by kind: handshake, wrong_engine,"
            " invalid, incompatible, disconnected, timeout, transfer, unconfirmed, other",
            ["kind"],
            registry=r,
        )
        self.peer_rehandshakes = Counter(
            "pd_transfer_peer_rehandshakes",
            "Prefill engines handshaken afresh at a known address, by what gave the restart away: engine_id (a"
            " request named another engine id), agents (a read failed, the engine came back with new agents),"
            " reconnect (connected again after it was dropped for a failure)",
            ["reason"],
            registry=r,
        )
        self.unconfirmed_reads = Counter(
            "pd_transfer_unconfirmed_reads",
            "Reads whose lease the prefill did not confirm: the KV was discarded, never used",
            registry=r,
        )
        self.leases_ended = Counter(
            "pd_transfer_leases_ended",
            "Prefill leases by how they ended: read, expired, aborted",
            ["reason"],
            registry=r,
        )
        self.blocks_held = Gauge(
            "pd_transfer_prefill_blocks_held", "Blocks a prefill rank holds for readers", ["engine", "rank"], registry=r
        )

    def observe_pull(self, seconds: float, num_bytes: int, rows: int, fixup_exposed_seconds: float) -> None:
        self.pull_seconds.observe(seconds)
        self.pulled_bytes.inc(num_bytes)
        self.pull_rows.observe(rows)
        self.fixup_exposed_seconds.observe(fixup_exposed_seconds)
        self.pulls.labels("ok").inc()


_default: TransferMetrics | None = None
_default_lock = threading.Lock()


def default_metrics() -> TransferMetrics:
    """The process-wide metrics, registered once in prometheus_client's global registry."""
    global _default
    with _default_lock:
        if _default is None:
            _default = TransferMetrics(REGISTRY)
        return _default
