"""The proxy's Prometheus metrics, in a registry of its own (several proxies can live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

#: Label values each failure counter can take, created at zero when the proxy starts: a series that appears only
#: with its first event is invisible to ``increase()`` and ``rate()`` (Prometheus needs a sample before it).
HOPS = ("prefill", "decode")
ERROR_KINDS = (
    "connect", "status", "no_kv_transfer_params", "bad_answer", "disconnect", "no_backend", "draining", "aborted",
    "stream",
)  # fmt: skip
REJECT_REASONS = ("media_type", "too_large", "body_timeout", "busy", "invalid_json", "invalid_request")
RELEASE_OUTCOMES = ("releasing", "not_held", "unreachable", "auth", "refused", "version", "error", "invalid")
RETRY_REASONS = ("connect", "status", "draining", "aborted", "decode_failed")

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ProxyMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "pd_proxy_requests",
            "Client requests answered, by endpoint and HTTP status",
            ["endpoint", "status"],
            registry=r,
        )
        self.routes = Counter(
            "pd_proxy_routes",
            "Requests by path: disaggregated (prefill then decode), direct (short prompt or batch: decode only) or"
            " local_prefill (a decode that held the prompt's prefix prefilled the rest itself); and streamed, of the"
            " disaggregated ones those whose legs went at once (--stream-kv)",
            ["path"],
            registry=r,
        )
        self.errors = Counter(
            "pd_proxy_errors",
            f"Failures by hop (prefill, decode, client) and kind ({', '.join(ERROR_KINDS)}), failed attempts that"
            " were retried too",
            ["hop", "kind"],
            registry=r,
        )
        self.rejected = Counter(
            "pd_proxy_rejected",
            f"Requests refused before routing, by reason ({', '.join(REJECT_REASONS)})",
            ["reason"],
            registry=r,
        )
        self.body_bytes_held = Gauge(
            "pd_proxy_body_bytes_held",
            "Bytes reserved for request bodies in flight (bounded by the budget)",
            registry=r,
        )
        self.releases = Counter(
            "pd_proxy_releases",
            "Prefill leases the proxy released because no decode would read them (client gone between or during the"
            " hops, decode hop failed), by outcome: releasing, not_held (already read or freed), unreachable, auth,"
            " refused, version (the prefill speaks no Release), error, invalid (params naming nothing)",
            ["outcome"],
            registry=r,
        )
        self.drains = Counter(
            "pd_proxy_drains",
            "Backends the proxy saw draining (and stopped routing new requests to), by role",
            ["role"],
            registry=r,
        )
        self.retries = Counter(
            "pd_proxy_retries",
            "Hops retried on another backend, by hop and reason (the first attempt's failure: connect, status,"
            " draining, aborted: a stopping engine's 200 with no output and finish_reason abort; decode_failed: the"
            " prefill hop run again because the decode hop failed with a 5xx before any output)",
            ["hop", "reason"],
            registry=r,
        )
        self.hop_latency = Histogram(
            "pd_proxy_hop_latency_seconds",
            "Time of one hop, request sent to answer read (decode streams: to the end of the stream)",
            ["hop"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.request_latency = Histogram(
            "pd_proxy_request_latency_seconds",
            "Client request, received to answered",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "pd_proxy_time_to_first_token_seconds",
            "Streaming requests: request received to the first decode chunk sent to the client",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge(
            "pd_proxy_backend_in_flight", "Requests in flight per backend", ["role", "backend"], registry=r
        )
        self.healthy = Gauge(
            "pd_proxy_backend_healthy",
            "1 while a backend is in rotation, 0 while taken out",
            ["role", "backend"],
            registry=r,
        )
        self.route_choices = Counter(
            "pd_proxy_route_choices",
            "Backends chosen by the routing policy, by role, backend and reason (rotation, least_busy, two_choices,"
            " balance: the pool was out of balance, prefix: the longest matching prefix, low_match: no prefix worth"
            " following, no_prompt: nothing to match on, session: the session's backend)",
            ["role", "backend", "reason"],
            registry=r,
        )
        self.route_matched = Counter(
            "pd_proxy_route_matched_blocks",
            "Prefix blocks the chosen backend holds of its requests, by role and tier (kv_aware: engine, host, shared,"
            " disk; cache_aware: routed, in prompt chunks of the prefix tree)",
            ["role", "tier"],
            registry=r,
        )
        self.route_prompt_blocks = Counter(
            "pd_proxy_route_prompt_blocks",
            "Prompt blocks (chunks for cache_aware) of the requests the prefix policies routed, by role",
            ["role"],
            registry=r,
        )
        self.kv_faults = Counter(
            "pd_proxy_kv_event_faults",
            "KV event streams' faults, by backend and kind (gap_healed, gap_lost, restart, silent, bad_batch,"
            " hash_mismatch)",
            ["backend", "kind"],
            registry=r,
        )
        self.kv_batches = Gauge(
            "pd_proxy_kv_event_batches",
            "KV event batches applied to the index since the proxy started, by backend",
            ["backend"],
            registry=r,
        )
        self.tokenize = Counter(
            "pd_proxy_tokenize",
            "Text and chat prompts sent to a backend's /tokenize for kv_aware, by result (ok, no_backend, error,"
            " timeout, refused: a non-200 answer); all but ok route without token ids",
            ["result"],
            registry=r,
        )
        self.kv_index_entries = Gauge(
            "pd_proxy_kv_index_entries",
            "(engine, block) entries and shared directory blocks the KV index holds",
            registry=r,
        )

        self._create_failure_series()

    def _create_failure_series(self) -> None:
        """Every known failure series at zero (see :data:`ERROR_KINDS` and the tuples beside it)."""
        for hop in HOPS:
            self.drains.labels(hop)
            for kind in ERROR_KINDS:
                self.errors.labels(hop, kind)
            for reason in RETRY_REASONS:
                self.retries.labels(hop, reason)
        self.errors.labels("client", "disconnect")
        for reason in REJECT_REASONS:
            self.rejected.labels(reason)
        for outcome in RELEASE_OUTCOMES:
            self.releases.labels(outcome)

    def render(self) -> bytes:
        return generate_latest(self.registry)
