"""Prometheus metrics of pd-transfer's endpoints in one process.

Decode ranks record every pull (bytes, seconds, descriptor rows, fix-up time added, outcome; the pulls, their bytes
and seconds labelled with the ``transport`` that moved them: ``nixl``, ``cuda_ipc``, ``host_ipc``, ``host_cma``),
the loads that failed by kind, the prefill engines handshaken afresh at a known address (a restart), their
handshakes by outcome and seconds, and the requests waiting for remote KV; prefill ranks record how each lease ended
(read, expired, aborted, released) and the blocks they hold; side-channel servers the frames they refused by reason
and the nonces they refused. ``pd_transfer_info`` names the protocol version and the model fingerprint served.
``default_metrics()`` registers one set in prometheus_client's global registry, which an exporter of the process
serves; pass a ``TransferMetrics(registry=...)`` of your own to keep them apart (tests, several engines)."""

from __future__ import annotations

import threading

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, Info

_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_ROWS = (1, 8, 64, 512, 4096, 32768, 262144, 2097152)


class TransferMetrics:
    """The metric families, registered in ``registry`` (a fresh one by default)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.pull_seconds = Histogram(
            "pd_transfer_pull_seconds",
            "Seconds of a request's pull, first post to usable KV, by transport: nixl, cuda_ipc, host_ipc, host_cma",
            ["transport"],
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
        self.pulled_bytes = Counter(
            "pd_transfer_pulled_bytes", "Bytes of KV cache pulled, by transport", ["transport"], registry=r
        )
        self.pushed_bytes = Counter(
            "pd_transfer_pushed_bytes",
            "Bytes of KV cache the prefill ranks wrote into this decode (push, where reads would go over TCP); part of"
            " pd_transfer_pulled_bytes",
            registry=r,
        )
        self.pulls = Counter(
            "pd_transfer_pulls",
            "Pulls by outcome of the reads (ok, failed) and transport (nixl, cuda_ipc, host_ipc, host_cma)",
            ["outcome", "transport"],
            registry=r,
        )
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
            "Prefill leases by how they ended: read, expired, aborted, released (by the proxy: nobody will read them)",
            ["reason"],
            registry=r,
        )
        self.streamed_bytes = Counter(
            "pd_transfer_streamed_bytes",
            "Bytes of KV a prefill rank sent to decodes streaming requests, by when: computing (while the engine's"
            " forward was still running) or held (after it finished)",
            ["when"],
            registry=r,
        )
        self.digest_checks = Counter(
            "pd_transfer_digest_checks",
            "Streamed layers and reads a decode rank checked against the digests the prefill computed of its cache, by"
            " outcome: equal, or mismatch (the first that differed in a read: its KV is not used)",
            ["outcome"],
            registry=r,
        )
        self.streamed_layers = Counter(
            "pd_transfer_streamed_layers",
            "Layers a decode rank received one by one from streaming prefills",
            registry=r,
        )
        self.stream_tail_seconds = Histogram(
            "pd_transfer_stream_tail_seconds",
            "Seconds from a streamed request's last layer arriving to its KV being usable (the prefill's hold, the"
            " stream's end)",
            buckets=_SECONDS,
            registry=r,
        )
        self.blocks_held = Gauge(
            "pd_transfer_prefill_blocks_held", "Blocks a prefill rank holds for readers", ["engine", "rank"], registry=r
        )

        self.handshakes = Counter(
            "pd_transfer_handshakes",
            "Side-channel handshakes a decode made (cache hits excluded), by outcome: ok, timeout, backoff (not"
            " attempted: the peer failed moments ago), refused, auth, incompatible, version, error",
            ["outcome"],
            registry=r,
        )
        self.handshake_seconds = Histogram(
            "pd_transfer_handshake_seconds",
            "Seconds of a decode's side-channel handshake, every attempt included (back-offs excluded)",
            buckets=_SECONDS,
            registry=r,
        )
        self.side_channel_rejected = Counter(
            "pd_transfer_side_channel_rejected",
            "Frames a side-channel server refused, by reason: malformed, too_large, unsupported_version,"
            " unexpected_message, auth_required, auth_failed, incompatible, unknown_rank, unknown_engine",
            ["reason"],
            registry=r,
        )
        self.nonces_refused = Counter(
            "pd_transfer_side_channel_nonces_refused",
            "Authenticated requests a side-channel server refused for their nonce: unknown, expired, reused, busy",
            ["reason"],
            registry=r,
        )
        self.requests_waiting_for_kv = Gauge(
            "pd_transfer_requests_waiting_for_kv",
            "Decode requests whose KV a remote prefill holds and that are not loaded yet (queued or loading)",
            ["engine"],
            registry=r,
        )
        self.info = Info(
            "pd_transfer", "pd-transfer's side-channel protocol version and the model fingerprint served", registry=r
        )
        self.info_labels: dict[str, str] = {}

    def describe(self, labels: dict[str, str]) -> None:
        """Set ``pd_transfer_info`` (protocol version, fingerprint, ...); the last labels set are ``info_labels``."""
        self.info.info(labels)
        self.info_labels = dict(labels)

    def observe_pull(
        self,
        seconds: float,
        num_bytes: int,
        rows: int,
        fixup_exposed_seconds: float,
        pushed_bytes: int = 0,
        *,
        transport: str = "nixl",
    ) -> None:
        self.pull_seconds.labels(transport).observe(seconds)
        self.pulled_bytes.labels(transport).inc(num_bytes)
        self.pushed_bytes.inc(pushed_bytes)
        self.pull_rows.observe(rows)
        self.fixup_exposed_seconds.observe(fixup_exposed_seconds)
        self.pulls.labels("ok", transport).inc()


_default: TransferMetrics | None = None
_default_lock = threading.Lock()


def default_metrics() -> TransferMetrics:
    """The process-wide metrics, registered once in prometheus_client's global registry."""
    global _default
    with _default_lock:
        if _default is None:
            _default = TransferMetrics(REGISTRY)
        return _default
