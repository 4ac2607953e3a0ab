"""The P/D proxy: an OpenAI-compatible aiohttp server in front of prefill and decode servers.

A request goes to a prefill server with ``kv_transfer_params: {"do_remote_decode": true, ...}``, ``max_tokens: 1``
and no streaming; the ``kv_transfer_params`` of its answer go with the client's request to a decode server, whose
answer (or SSE stream) goes back to the client. One ``X-Request-Id`` travels through both hops. When no decode will
read what the prefill holds (the client left, the decode hop failed), the prefill is told to free it
(:mod:`pd_transfer.proxy.release`). A request every decode answered 500 before any output (a pull refused because
the prefill no longer held the blocks) runs once more from the prefill hop, while its client waits.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from functools import partial
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from pd_transfer.proxy import flow
from pd_transfer.proxy.config import ProxyConfig
from pd_transfer.proxy.decode_hop import DecodeCall, DecodeHop
from pd_transfer.proxy.intake import BodyBudget, IntakeLimits, Rejected, check_media_type, decode_json, read_body
from pd_transfer.proxy.intake import reservation as body_reservation
from pd_transfer.proxy.metrics import HopMeter, ProxyMetrics
from pd_transfer.proxy.policies import Choice, RouteRequest
from pd_transfer.proxy.release import KVReleases
from pd_transfer.proxy.responses import (
    REQUEST_ID,
    ClientGone,
    HopError,
    Passthrough,
    bind_socket,
    describe_error,
    error_response,
    in_flight_of,
    json_response,
    relayed_response,
    snippet,
)
from pd_transfer.proxy.routing import DRAINING, Backend, Pool, StateSignal, health_reason, prefill_without_params
from pd_transfer.proxy.routing_setup import Routing
from pd_transfer.proxy.tokenize import RESULTS as TOKENIZE_RESULTS
from pd_transfer.proxy.tokenize import Tokenizer
from pd_transfer.proxy.upstream import ConnectFailed, Endpoint, Leftover, Upstream, UpstreamError

log = logging.getLogger(__name__)

# Headers a client sends that the backends need too (vLLM's --api-key); everything else stays at the proxy.
FORWARDED_HEADERS = ("Authorization",)
CLIENT_CLOSED = 499  # nginx's convention for "the client went away", used in metrics only
#: Seconds the proxy goes on reading a prefill's answer after the client left during the prefill hop. vLLM aborts a
#: request whose connection closes while its engine computes (our connector holds nothing for it), but one its engine
#: had finished holds its blocks until the lease ends: an answer read within this time names them, released at once.
#: Past it the connection closes (vLLM aborts the request if it still runs).
PREFILL_LEFTOVER_S = 1.0
#: What a decode answered, before any output, that runs its request once more from the prefill hop: its engine
#: failed the request (vLLM's 500; a decode whose pull was refused because the prefill no longer held the blocks
#: answers so under the ``fail`` policy). Not a 503: an overloaded decode is not helped by a second prefill.
RERUN_AFTER = 500


class Proxy:
    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.metrics = ProxyMetrics()
        self.signal = StateSignal()
        self.routing = Routing(config, self.metrics)
        self.prefill = self.routing.pool("prefill", config.prefill, self._state_changed)
        self.decode = self.routing.pool("decode", config.decode, self._state_changed)
        self._meter = HopMeter(self.metrics)
        # Label children resolved once: labels() costs a lock and a dict lookup per call on the request path.
        self._request_latency = {e: self.metrics.request_latency.labels(e) for e in flow.ENDPOINTS}
        self._routes = {path: self.metrics.routes.labels(path) for path in ("direct", "disaggregated", "local_prefill")}
        self._requests: dict[tuple[str, int], Any] = {}
        # Where each hop's POST goes, request line and Host header encoded once.
        self._endpoints = {(id(b), e): Endpoint.of(b.url + e) for b in self._backends() for e in flow.ENDPOINTS}
        self._decode_hop = DecodeHop(self.decode, self._meter, self._endpoints)
        self._tokenizer: Tokenizer | None = None
        if self.routing.tokenize_roles:
            counts = {result: self.metrics.tokenize.labels(result) for result in TOKENIZE_RESULTS}
            self._tokenizer = Tokenizer(
                [self.prefill, self.decode],
                lambda: self._upstream,
                config.tokenize_timeout_s,
                lambda result: counts[result].inc(),
            )
        for backend in self._backends():
            self.metrics.healthy.labels(backend.role, backend.url).set(1)
            # Read when scraped, not set twice per hop.
            self.metrics.in_flight.labels(backend.role, backend.url).set_function(in_flight_of(backend))
        self._intake = IntakeLimits(config.max_body_bytes, config.body_timeout_s)
        self._bodies = BodyBudget(config.max_inflight_body_bytes)
        self.metrics.body_bytes_held.set_function(lambda: self._bodies.held_bytes)
        self.releases = KVReleases(self.metrics, config.handshake_secret, config.release_timeout_s)
        self.app = web.Application(client_max_size=config.max_body_bytes)
        self.app.router.add_post(flow.COMPLETIONS, self._completions)
        self.app.router.add_post(flow.CHAT, self._chat)
        self.app.router.add_get("/health", self._health)
        self.app.router.add_get("/metrics", self._metrics)
        self.app.router.add_get("/v1/models", self._models)
        self._session: aiohttp.ClientSession | None = None  # health checks and /v1/models
        self._upstream: Upstream | None = None  # the hops
        self._runner: web.AppRunner | None = None
        self._health_task: asyncio.Task[None] | None = None
        self.host = ""
        self.port = 0

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    # ---- lifecycle ----

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serves on ``host:port`` (0: a free port), checks every backend once, then keeps checking; returns the URL."""
        self._session = aiohttp.ClientSession(
            # Idle connections closed before uvicorn's (vLLM's server) 5 s keep-alive ends: never reuse one the
            # server is closing.
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=4.0),
            cookie_jar=aiohttp.DummyCookieJar(),  # backends set no cookies the proxy should keep
            timeout=aiohttp.ClientTimeout(
                total=self.config.request_timeout_s, sock_connect=self.config.connect_timeout_s
            ),
        )
        self._upstream = Upstream(self.config.connect_timeout_s, self.config.request_timeout_s, keepalive_s=4.0)
        # handler_cancellation: a client that goes away cancels its handler at once, which closes the upstream
        # connection, so the decode server aborts the request and frees its blocks.
        # keepalive_timeout: aiohttp closes a connection whose next request's headers are not complete this long
        # after it opened or answered its last request, which also ends clients that dribble headers.
        self._runner = web.AppRunner(
            self.app,
            access_log=None,
            handler_cancellation=True,
            shutdown_timeout=self.config.shutdown_timeout_s,
            keepalive_timeout=self.config.header_timeout_s,
        )
        await self._runner.setup()
        sock = bind_socket(host, port)
        await web.SockSite(self._runner, sock, backlog=1024).start()
        self.host, self.port = host, sock.getsockname()[1]
        await self.check_health()
        self._health_task = asyncio.create_task(self._health_loop(), name="pd-proxy-health")
        await self.routing.start()
        return self.url

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            await asyncio.gather(self._health_task, return_exceptions=True)
            self._health_task = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await self.routing.close()
        await self.releases.close()
        if self._upstream is not None:
            self._upstream.close()
            self._upstream = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> Proxy:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- health ----

    def _backends(self) -> list[Backend]:
        return self.prefill.backends + self.decode.backends

    def _pool(self, backend: Backend) -> Pool:
        return self.prefill if backend.role == "prefill" else self.decode

    def _state_changed(self, backend: Backend) -> None:
        self.metrics.healthy.labels(backend.role, backend.url).set(1 if backend.healthy else 0)
        self.metrics.drains.labels(backend.role).inc(1 if backend.reason == DRAINING else 0)
        self.signal.fire(backend)

    async def check_health(self) -> None:
        """One round of ``GET /health`` on every backend, concurrently."""
        await asyncio.gather(*(self._check(b) for b in self._backends()))

    async def _check(self, backend: Backend) -> None:
        assert self._session is not None
        try:
            async with self._session.get(
                backend.url + "/health", timeout=aiohttp.ClientTimeout(total=self.config.health_timeout_s)
            ) as answer:
                await answer.read()
                healthy, reason = answer.status == 200, health_reason(answer.status, answer.headers)
        except (aiohttp.ClientError, TimeoutError) as e:
            healthy, reason = False, f"GET /health failed: {describe_error(e)}"
        self._pool(backend).set_health(backend, healthy, reason)

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            try:
                await self.check_health()
            except Exception:  # a bug here must not stop the checks
                log.exception("health check round failed")

    def _connection_failed(self, backend: Backend, error: BaseException) -> None:
        """A backend that cannot be connected to is out until its health check passes. (A connection dropped
        mid-answer fails that request only.)"""
        self._pool(backend).set_health(backend, False, f"connection error: {describe_error(error)}")

    # ---- handlers ----

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, flow.COMPLETIONS)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, flow.CHAT)

    async def _health(self, _request: web.Request) -> web.Response:
        ok = bool(self.prefill.healthy()) and bool(self.decode.healthy())
        body = {
            "status": "ok" if ok else "unavailable",
            "prefill": [b.state() for b in self.prefill.backends],
            "decode": [b.state() for b in self.decode.backends],
        }
        return json_response(body, 200 if ok else 503)

    async def _metrics(self, _request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": self.metrics.content_type})

    async def _models(self, request: web.Request) -> web.Response:
        rid = request.headers.get(REQUEST_ID) or uuid.uuid4().hex
        backend = self.decode.pick()
        if backend is None:
            return error_response(503, "no healthy decode backend", "service_unavailable", rid, hop="decode")
        assert self._session is not None
        try:
            async with self._session.get(backend.url + "/v1/models", headers=self._headers(request, rid)) as answer:
                raw = await answer.read()
                return relayed_response(answer.status, answer.headers, raw, rid)
        except (aiohttp.ClientError, TimeoutError) as e:
            return error_response(
                502,
                f"decode backend {backend.url} failed: {describe_error(e)}",
                "bad_gateway",
                rid,
                hop="decode",
                backend=backend.url,
            )

    async def _handle(self, request: web.Request, endpoint: str) -> web.StreamResponse:
        started = time.perf_counter()
        rid = request.headers.get(REQUEST_ID) or uuid.uuid4().hex
        status = 500
        reserved = 0
        try:
            try:
                check_media_type(request)
                size = body_reservation(request, self._intake)
                if not self._bodies.try_reserve(size):
                    raise Rejected(503, "busy", "the proxy holds too many request bodies right now; retry shortly")
                reserved = size
                body = decode_json(await read_body(request, self._intake))
                flow.validate(endpoint, body)
            except (Rejected, flow.BadRequest) as e:
                status = e.status if isinstance(e, Rejected) else 400
                self.metrics.rejected.labels(e.reason if isinstance(e, Rejected) else "invalid_request").inc()
                kind = "service_unavailable" if status == 503 else "invalid_request_error"
                return error_response(status, str(e), kind, rid)
            try:
                response = await self._serve(request, endpoint, body, rid, started)
            except Passthrough as p:
                response = p.response
            except ClientGone as g:
                status = CLIENT_CLOSED
                return g.response
            except HopError as e:
                if not e.counted:
                    self.metrics.errors.labels(e.hop, e.kind).inc()
                status = e.status
                extra: dict[str, Any] = {"hop": e.hop}
                if e.backend is not None:
                    extra["backend"] = e.backend.url
                return error_response(
                    e.status, str(e), "bad_gateway" if e.status == 502 else "service_unavailable", rid, **extra
                )
            status = response.status
            return response
        except asyncio.CancelledError:
            status = CLIENT_CLOSED
            self.metrics.errors.labels("client", "disconnect").inc()
            raise
        finally:
            self._bodies.release(reserved)
            counter = self._requests.get((endpoint, status))
            if counter is None:
                counter = self._requests[endpoint, status] = self.metrics.requests.labels(endpoint, str(status))
            counter.inc()
            self._request_latency[endpoint].observe(time.perf_counter() - started)

    def _headers(self, request: web.Request, rid: str) -> dict[str, str]:
        headers = {REQUEST_ID: rid}  # the hops send Content-Type themselves (upstream.Endpoint)
        for name in FORWARDED_HEADERS:
            value = request.headers.get(name)
            if value is not None:
                headers[name] = value
        return headers

    async def _serve(
        self, request: web.Request, endpoint: str, body: dict[str, Any], rid: str, started: float
    ) -> web.StreamResponse:
        headers = self._headers(request, rid)
        route = RouteRequest(endpoint, body, request.headers.get(self.config.session_header))
        threshold = self.config.short_prompt_tokens
        batch = flow.is_batch(endpoint, body)
        direct = batch or (threshold > 0 and flow.prompt_tokens(endpoint, body) < threshold)
        # a kv_aware pool this request goes through reads the engines' ids of a text or chat prompt
        if self._tokenizer is not None and not batch and ("decode" in self.routing.tokenize_roles or not direct):
            await self._tokenizer.fill(route, headers)
        local = None if direct else self._local_prefill(route)
        if direct or local is not None:
            self._routes["direct" if direct else "local_prefill"].inc()
            params = None
        else:
            self._routes["disaggregated"].inc()
            params = await self._prefill_hop(endpoint, body, headers, route)
        try:
            prefer = local.backend if local is not None else None
            return await self._decode(request, endpoint, body, headers, params, rid, started, route, prefer)
        except HopError as failure:
            if params is None or failure.hop != "decode" or failure.answered != RERUN_AFTER:
                raise
            # The decode failed the request before any output (e.g. its pull was refused: the prefill no longer
            # held the blocks) and the client is still here: once more from the prefill hop, with fresh KV.
            log.warning("request %s: %s; running it again from the prefill hop (once)", rid, failure)
            self.metrics.retries.labels("prefill", "decode_failed").inc()
            first = failure
        try:
            params = await self._prefill_hop(endpoint, body, headers, route)
        except HopError as again:  # no fresh KV to be had (the prefill is gone, say): the decode's failure stands
            first.args = (f"{first}; running it again from the prefill hop failed: {again}",)
            raise first from None
        return await self._decode(request, endpoint, body, headers, params, rid, started, route)

    def _local_prefill(self, route: RouteRequest) -> Choice | None:
        """The decode that prefills ``route`` itself (:mod:`.local_prefill`), told to the decode pool; None when
        there is none, or it is off."""
        chooser = self.routing.local_prefill
        if chooser is None:
            return None
        local = chooser.decode_for(self.decode.healthy(), route, self.prefill.healthy())
        if local is not None:
            self.decode.report(local)
        return local

    async def _decode(
        self,
        request: web.Request,
        endpoint: str,
        body: dict[str, Any],
        headers: dict[str, str],
        params: dict[str, Any] | None,
        rid: str,
        started: float,
        route: RouteRequest | None = None,
        prefer: Backend | None = None,
    ) -> web.StreamResponse:
        """The decode hop of ``body`` with the prefill's ``params`` (None: no prefill hop), to ``prefer`` first when
        given; the prefill's blocks are released unless it answered 200."""
        call = DecodeCall(request, endpoint, flow.decode_body(body, params), headers, rid, started, route, prefer)
        upstream = self._upstream
        assert upstream is not None
        return await self.releases.decode_then(
            params, rid, lambda progress: self._decode_hop.run(upstream, call, progress)
        )

    # ---- hops ----

    async def _prefill_hop(
        self, endpoint: str, body: dict[str, Any], headers: dict[str, str], route: RouteRequest | None = None
    ) -> dict[str, Any]:
        """Runs the prefill; on a connection error or a 5xx, once more on another prefill server."""
        upstream = self._upstream
        assert upstream is not None
        payload = msgspec.json.encode(flow.prefill_body(endpoint, body))
        leftover = Leftover(PREFILL_LEFTOVER_S, partial(self._prefill_left_over, headers[REQUEST_ID]))
        tried: list[Backend] = []
        failure: HopError | None = None
        while len(tried) < 2:
            backend = self.prefill.pick(exclude=tried, request=route)
            if backend is None:
                break
            if failure is not None:
                self.metrics.retries.labels("prefill", failure.kind).inc()
            tried.append(backend)
            since = self._meter.enter(backend)
            try:
                async with await upstream.post(
                    self._endpoints[id(backend), endpoint], headers, payload, leftover
                ) as answer:
                    raw = await answer.read()
            except (UpstreamError, TimeoutError) as e:
                if isinstance(e, ConnectFailed):
                    self._connection_failed(backend, e)
                failure = self._meter.failed_attempt(
                    HopError(
                        "prefill", backend, "connect", f"prefill backend {backend.url} failed: {describe_error(e)}"
                    )
                )
                continue
            finally:
                self._meter.leave(backend, since)
            self.prefill.note_answer(backend, answer.status, answer.headers)  # a drain's 503 is retried elsewhere
            if answer.status >= 500:
                failure = self._meter.failed_attempt(
                    HopError(
                        "prefill",
                        backend,
                        "status",
                        f"prefill backend {backend.url} answered {answer.status}: {snippet(raw)}",
                    )
                )
                continue
            if answer.status >= 400:
                raise Passthrough(relayed_response(answer.status, answer.headers, raw, headers[REQUEST_ID]))
            try:
                decoded = msgspec.json.decode(raw)
            except msgspec.DecodeError:
                raise HopError(
                    "prefill", backend, "bad_answer", f"prefill backend {backend.url} answered with invalid JSON"
                ) from None
            params = flow.kv_params_from_prefill(decoded)
            if params is None:
                failure = self._meter.failed_attempt(
                    HopError("prefill", backend, *prefill_without_params(backend.url, decoded))
                )
                if failure.kind == "aborted":  # its engine is stopping and holds nothing for it: try another
                    continue
                raise failure
            return params
        if failure is None:
            raise HopError("prefill", None, "no_backend", "no healthy prefill backend", status=503)
        if len(tried) == 2:
            failure.args = (
                f"{failure}; the retry on another prefill backend failed too: " + ", ".join(b.url for b in tried),
            )
        raise failure

    def _prefill_left_over(self, rid: str, status: int | None, raw: bytes | None) -> None:
        """The answer of a prefill hop whose client had left (see :data:`PREFILL_LEFTOVER_S`): the blocks it names
        are released (no decode was sent them). ``status`` None: no answer in time; vLLM aborted the request."""
        if status != 200 or raw is None:
            log.info("request %s: the client left during the prefill hop; the prefill answered %s", rid, status)
            return
        try:
            params = flow.kv_params_from_prefill(msgspec.json.decode(raw))
        except msgspec.DecodeError:
            params = None
        if params is not None:
            self.releases.release(params, rid, read_possible=False, why="the client left during the prefill hop")
