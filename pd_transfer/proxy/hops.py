"""What the prefill and decode hops share: the request they carry (:class:`Call`), their bookkeeping on a backend
(:class:`HopMeter`: in-flight counts, hop latency, failed attempts), their tries over a pool (:class:`Tries`: at
most :data:`MAX_TRIES` backends, the next one picked after the last one failed in a way that may go elsewhere), and
what each runs over (:class:`Hop`: its pool, the client, where each backend's POST goes, the releases)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from pd_transfer.proxy.metrics import ProxyMetrics
from pd_transfer.proxy.release import KVReleases
from pd_transfer.proxy.responses import HopError, describe_error
from pd_transfer.proxy.routing.pool import Backend, Pool
from pd_transfer.proxy.routing.request import RouteRequest
from pd_transfer.proxy.upstream import Endpoint, Upstream

#: Backends one hop tries at most: the first choice, and one more after a failure that may go elsewhere.
MAX_TRIES = 2


@dataclass(frozen=True)
class Call:
    """One client request as both hops carry it: ``client`` (its aiohttp request: a streamed answer is written to its
    connection), ``route`` (what routing reads of it; its prompt holds the ``endpoint`` and the ``body``), the
    ``headers`` for the backends, the request id ``rid`` and when the proxy received it (``started``,
    ``time.perf_counter`` seconds: the start of the time to first token)."""

    client: web.Request
    route: RouteRequest
    headers: dict[str, str]
    rid: str
    started: float

    @property
    def endpoint(self) -> str:
        return self.route.prompt.endpoint

    @property
    def body(self) -> dict[str, Any]:
        return self.route.prompt.body


class HopMeter:
    """A hop's bookkeeping on a backend: its in-flight count and hop latency, and failed attempts counted as they
    fail (a failed attempt may be retried; the request's final error is not counted twice)."""

    def __init__(self, metrics: ProxyMetrics) -> None:
        self.metrics = metrics
        # Label children resolved once: labels() costs a lock and a dict lookup per call on the request path.
        self._latency = {role: metrics.hop_latency.labels(role) for role in ("prefill", "decode")}

    def enter(self, backend: Backend) -> float:
        """A hop to ``backend`` starts; returns its start time (``time.perf_counter``, seconds) for :meth:`leave`."""
        backend.in_flight += 1
        backend.served += 1
        return time.perf_counter()

    def leave(self, backend: Backend, since: float) -> None:
        """The hop started at ``since`` (from :meth:`enter`) ended."""
        backend.in_flight -= 1
        self._latency[backend.role].observe(time.perf_counter() - since)

    def failed_attempt(self, failure: HopError) -> HopError:
        """Counts a failed attempt at a hop as it fails; marks it counted and returns it."""
        self.metrics.errors.labels(failure.hop, failure.kind).inc()
        failure.counted = True
        return failure


class Tries:
    """One request's tries at a hop over ``pool``: :meth:`next` picks a backend not tried yet (at most
    :data:`MAX_TRIES`, a retry counted in ``pd_proxy_retries_total`` by the last failure's kind), :meth:`failed`
    records a try's failure, :meth:`exhausted` is the error once no backend is left to try."""

    def __init__(self, pool: Pool, meter: HopMeter) -> None:
        self.pool = pool
        self.meter = meter
        self.tried: list[Backend] = []
        self.failure: HopError | None = None

    def next(self, route: RouteRequest | None, prefer: Backend | None = None) -> Backend | None:
        """The backend of the next try (``prefer`` while it is healthy and untried), None when there is none."""
        if len(self.tried) >= MAX_TRIES:
            return None
        backend = self.pool.pick(exclude=self.tried, request=route, prefer=prefer)
        if backend is None:
            return None
        if self.failure is not None:
            self.meter.metrics.retries.labels(self.pool.role, self.failure.kind).inc()
        self.tried.append(backend)
        return backend

    def failed(self, failure: HopError) -> None:
        """The current try failed with ``failure`` (counted now); the next may go elsewhere."""
        self.failure = self.meter.failed_attempt(failure)

    def exhausted(self) -> HopError:
        """The error of a hop no try answered: the last failure, or a 503 when no backend was healthy."""
        if self.failure is None:
            role = self.pool.role
            return HopError(role, None, "no_backend", f"no healthy {role} backend", status=503)
        return self.failure


class Hop:
    """What one hop runs over: ``pool`` (the backends of its role), ``upstream`` (the client), ``endpoints`` (where a
    backend's POST goes, by ``(id(backend), endpoint)``), ``meter`` (the hops and their failed attempts) and
    ``releases`` (freeing what a prefill holds for no decode)."""

    def __init__(
        self,
        pool: Pool,
        upstream: Upstream,
        meter: HopMeter,
        endpoints: Mapping[tuple[int, str], Endpoint],
        releases: KVReleases,
    ) -> None:
        self.pool = pool
        self.upstream = upstream
        self.meter = meter
        self.metrics = meter.metrics
        self.releases = releases
        self._endpoints = endpoints

    def endpoint(self, backend: Backend, call: Call) -> Endpoint:
        """Where ``call``'s POST to ``backend`` goes."""
        return self._endpoints[id(backend), call.endpoint]

    def tries(self) -> Tries:
        """A request's tries at this hop."""
        return Tries(self.pool, self.meter)

    def unreachable(self, backend: Backend, error: BaseException) -> None:
        """``backend`` could not be connected to (``error``): out of the pool until its health check passes. (A
        connection dropped mid-answer fails that request only.)"""
        self.pool.set_health(backend, False, f"connection error: {describe_error(error)}")
