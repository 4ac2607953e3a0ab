"""The P/D proxy: an OpenAI-compatible aiohttp server in front of prefill and decode servers: its lifecycle, the
backends' health checks, and each request's way through the hops.

A request is taken in (:mod:`pd_transfer.proxy.intake`), checked and its prompt read once
(:mod:`pd_transfer.proxy.prompt`); it goes straight to a decode server when it is short or a batch, or when a decode
holds all but a few tokens of it (:mod:`pd_transfer.proxy.routing.local_prefill`); else through the prefill hop
(:mod:`pd_transfer.proxy.prefill_hop`) and then the decode hop (:mod:`pd_transfer.proxy.decode_hop`), whose answer
(or SSE stream) goes back to the client. One ``X-Request-Id`` travels through both hops. A request every decode
answered 500 before any output (a pull refused because the prefill no longer held the blocks) runs once more from the
prefill hop, while its client waits.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web

from pd_transfer.proxy import flow
from pd_transfer.proxy.config import ProxyConfig
from pd_transfer.proxy.decode_hop import DecodeHop
from pd_transfer.proxy.hops import Call, HopMeter
from pd_transfer.proxy.intake import BodyBudget, IntakeLimits, Rejected, check_media_type, decode_json, read_body
from pd_transfer.proxy.intake import reservation as body_reservation
from pd_transfer.proxy.metrics import ProxyMetrics
from pd_transfer.proxy.prefill_hop import PrefillHop
from pd_transfer.proxy.prompt import Prompt
from pd_transfer.proxy.release import KVReleases
from pd_transfer.proxy.responses import (
    REQUEST_ID,
    ClientGone,
    HopError,
    Passthrough,
    bind_socket,
    describe_error,
    error_response,
    json_response,
    relayed_response,
)
from pd_transfer.proxy.routing.policy import Choice
from pd_transfer.proxy.routing.pool import DRAINING, Backend, Pool, StateSignal, health_reason
from pd_transfer.proxy.routing.request import RouteRequest
from pd_transfer.proxy.routing.setup import Routing
from pd_transfer.proxy.tokenize import RESULTS as TOKENIZE_RESULTS
from pd_transfer.proxy.tokenize import Tokenizer
from pd_transfer.proxy.upstream import Endpoint, Upstream

log = logging.getLogger(__name__)

# Headers a client sends that the backends need too (vLLM's --api-key); everything else stays at the proxy.
FORWARDED_HEADERS = ("Authorization",)
CLIENT_CLOSED = 499  # nginx's convention for "the client went away", used in metrics only
#: What a decode answered, before any output, that runs its request once more from the prefill hop: its engine
#: failed the request (vLLM's 500; a decode whose pull was refused because the prefill no longer held the blocks
#: answers so under the ``fail`` policy). Not a 503: an overloaded decode is not helped by a second prefill.
RERUN_AFTER = 500
#: Seconds a streamed request's prefill leg may run on after its decode leg ended (the prefill then holds nothing
#: the decode needs: it is cancelled, and vLLM aborts it).
PREFILL_LEG_AFTER_DECODE_S = 5.0


class Proxy:
    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.metrics = ProxyMetrics()
        self.signal = StateSignal()
        self.routing = Routing(config, self.metrics)
        self.prefill = self.routing.pool("prefill", config.prefill, self._state_changed)
        self.decode = self.routing.pool("decode", config.decode, self._state_changed)
        # Label children resolved once: labels() costs a lock and a dict lookup per call on the request path.
        self._request_latency = {e: self.metrics.request_latency.labels(e) for e in flow.ENDPOINTS}
        self._routes = {
            path: self.metrics.routes.labels(path) for path in ("direct", "disaggregated", "local_prefill", "streamed")
        }
        self._requests: dict[tuple[str, int], Any] = {}
        # Idle connections closed before uvicorn's (vLLM's server) 5 s keep-alive ends: never reuse one the server is
        # closing.
        self._upstream = Upstream(config.connect_timeout_s, config.request_timeout_s, keepalive_s=4.0)
        self.releases = KVReleases(self.metrics, config.handshake_secret, config.release_timeout_s)
        # Where each hop's POST goes, request line and Host header encoded once.
        endpoints = {(id(b), e): Endpoint.of(b.url + e) for b in self._backends() for e in flow.ENDPOINTS}
        meter = HopMeter(self.metrics)
        self._prefill_hop = PrefillHop(self.prefill, self._upstream, meter, endpoints, self.releases)
        self._decode_hop = DecodeHop(self.decode, self._upstream, meter, endpoints, self.releases)
        self._tokenizer: Tokenizer | None = None
        if self.routing.tokenize_roles:
            counts = {result: self.metrics.tokenize.labels(result) for result in TOKENIZE_RESULTS}
            self._tokenizer = Tokenizer(
                [self.prefill, self.decode],
                self._upstream,
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
        self.app = web.Application(client_max_size=config.max_body_bytes)
        self.app.router.add_post(flow.COMPLETIONS, self._completions)
        self.app.router.add_post(flow.CHAT, self._chat)
        self.app.router.add_get("/health", self._health)
        self.app.router.add_get("/metrics", self._metrics)
        self.app.router.add_get("/v1/models", self._models)
        self._session: aiohttp.ClientSession | None = None  # health checks and /v1/models
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
        self._upstream.close()
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
                body = flow.validate(endpoint, decode_json(await read_body(request, self._intake)))
                prompt = Prompt.read(endpoint, body)
            except (Rejected, flow.BadRequest) as e:
                status = e.status if isinstance(e, Rejected) else 400
                self.metrics.rejected.labels(e.reason if isinstance(e, Rejected) else "invalid_request").inc()
                kind = "service_unavailable" if status == 503 else "invalid_request_error"
                return error_response(status, str(e), kind, rid)
            try:
                response = await self._serve(request, prompt, rid, started)
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
                    extra["backend"] = e.backend
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

    async def _serve(self, request: web.Request, prompt: Prompt, rid: str, started: float) -> web.StreamResponse:
        """The way of one checked request through the hops: direct to a decode (short, a batch, or held by a decode:
        :meth:`_local_prefill`), else the prefill hop then the decode hop, once more from the prefill hop when every
        decode answered :data:`RERUN_AFTER` before any output."""
        headers = self._headers(request, rid)
        route = RouteRequest(prompt, request.headers.get(self.config.session_header))
        call = Call(request, route, headers, rid, started)
        threshold = self.config.short_prompt_tokens
        direct = prompt.batch or (threshold > 0 and prompt.tokens() < threshold)
        # a pool this request goes through reads the engines' ids of a text or chat prompt
        if self._tokenizer is not None and not prompt.batch and ("decode" in self.routing.tokenize_roles or not direct):
            await self._tokenizer.fill(route, headers)
        local = None if direct else self._local_prefill(route)
        if direct or local is not None:
            self._routes["direct" if direct else "local_prefill"].inc()
            params = None
        else:
            self._routes["disaggregated"].inc()
            picked = None
            if self.config.stream_kv:
                streamed, picked = await self._streamed(call)
                if streamed is not None:
                    return streamed
            params = await self._prefill_hop.run(call, prefer=picked)
        try:
            return await self._decode_hop.run(call, params, prefer=local.backend if local is not None else None)
        except HopError as failure:
            if params is None or failure.hop != "decode" or failure.answered != RERUN_AFTER:
                raise
            # The decode failed the request before any output (e.g. its pull was refused: the prefill no longer
            # held the blocks) and the client is still here: once more from the prefill hop, with fresh KV.
            log.warning("request %s: %s; running it again from the prefill hop (once)", rid, failure)
            self.metrics.retries.labels("prefill", "decode_failed").inc()
            first = failure
        try:
            params = await self._prefill_hop.run(call)
        except HopError as again:  # no fresh KV to be had (the prefill is gone, say): the decode's failure stands
            first.args = (f"{first}; running it again from the prefill hop failed: {again}",)
            raise first from None
        return await self._decode_hop.run(call, params)

    async def _streamed(self, call: Call) -> tuple[web.StreamResponse | None, Backend | None]:
        """Both legs at once: the prefill leg (with a new stream id) to the prefill routing picks, the decode leg,
        naming that prefill's engine and the stream id, beside it; the decode streams the KV as the prefill computes
        it. (None, the prefill picked) when that prefill's engine is not known yet: the sequential way, to it. A
        prefill leg that fails leaves the decode to compute the prompt itself once its wait for the stream ends; a
        decode leg that ends first (it failed, or the client left) cancels the prefill's."""
        backend = self.prefill.pick(request=call.route)
        target = None if backend is None else self._prefill_hop.targets.get(backend.url)
        if backend is None or target is None:
            return None, backend
        stream_id = uuid.uuid4().hex
        self._routes["streamed"].inc()
        prefill = asyncio.create_task(self._prefill_hop.run_streamed(call, backend, stream_id))
        try:
            response = await self._decode_hop.run(call, flow.stream_params(target, stream_id))
        except BaseException:
            prefill.cancel()  # the decode leg failed or the client left: vLLM aborts the prefill's request
            raise
        if response.status != 200:
            prefill.cancel()  # the decode refused the request (a 4xx): no decode reads what the prefill computes
        else:
            await self._prefill_leg_ended(prefill, call.rid)
        return response, backend

    @staticmethod
    async def _prefill_leg_ended(prefill: asyncio.Task[None], rid: str) -> None:
        """The prefill leg of a streamed request, once its decode leg ended: its outcome logged, cancelled if it runs
        on past :data:`PREFILL_LEG_AFTER_DECODE_S`."""
        try:
            await asyncio.wait_for(prefill, PREFILL_LEG_AFTER_DECODE_S)
        except (HopError, TimeoutError) as error:
            log.warning("request %s: the prefill leg of a streamed request: %s", rid, error)

    def _local_prefill(self, route: RouteRequest) -> Choice | None:
        """The decode that prefills ``route`` itself (:mod:`.routing.local_prefill`), told to the decode pool; None when
        there is none, or it is off."""
        chooser = self.routing.local_prefill
        if chooser is None:
            return None
        local = chooser.decode_for(self.decode.healthy(), route, self.prefill.healthy())
        if local is not None:
            self.decode.report(local)
        return local


def in_flight_of(backend: Backend) -> Callable[[], float]:
    """A gauge callback: the backend's requests in flight, read when scraped."""
    return lambda: backend.in_flight
