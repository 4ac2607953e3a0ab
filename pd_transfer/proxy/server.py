"""The P/D proxy: an OpenAI-compatible aiohttp server in front of prefill and decode servers.

A request goes to a prefill server with ``kv_transfer_params: {"do_remote_decode": true, ...}``, ``max_tokens: 1``
and no streaming; the ``kv_transfer_params`` of its answer go with the client's request to a decode server, whose
answer (or SSE stream) goes back to the client. One ``X-Request-Id`` travels through both hops.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec
import yarl
from aiohttp import web

from pd_transfer.proxy import flow
from pd_transfer.proxy.metrics import ProxyMetrics
from pd_transfer.proxy.routing import Backend, Pool, StateSignal

log = logging.getLogger(__name__)

REQUEST_ID = "X-Request-Id"
# Headers a client sends that the backends need too (vLLM's --api-key); everything else stays at the proxy.
FORWARDED_HEADERS = ("Authorization",)
CLIENT_CLOSED = 499  # nginx's convention for "the client went away", used in metrics only


@dataclass
class ProxyConfig:
    prefill: list[str]
    decode: list[str]
    policy: str = "round_robin"
    short_prompt_tokens: int = 0  # prompts with fewer (estimated) tokens skip the prefill hop; 0: never skip
    health_interval_s: float = 5.0
    health_timeout_s: float = 2.0
    connect_timeout_s: float = 5.0
    request_timeout_s: float | None = None  # whole hop; None: unbounded (long generations)
    max_body_bytes: int = 64 * 2**20
    shutdown_timeout_s: float = 5.0  # on close, how long requests in flight may finish


class HopError(Exception):
    """A hop failed on the backend side: the client gets ``status`` (502 by default) naming hop and backend."""

    def __init__(self, hop: str, backend: Backend | None, kind: str, message: str, status: int = 502) -> None:
        super().__init__(message)
        self.hop = hop
        self.backend = backend
        self.kind = kind
        self.status = status
        self.counted = False  # in the errors metric already (failed attempts are counted as they fail)


class _Passthrough(Exception):
    """A backend's 4xx answer, handed to the client as it is (the request is at fault, not the backend)."""

    def __init__(self, response: web.Response) -> None:
        super().__init__(response.status)
        self.response = response


class _ClientGone(Exception):
    def __init__(self, response: web.StreamResponse) -> None:
        super().__init__("client disconnected")
        self.response = response


class Proxy:
    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.metrics = ProxyMetrics()
        self.signal = StateSignal()
        self.prefill = Pool("prefill", config.prefill, config.policy, on_change=self._state_changed)
        self.decode = Pool("decode", config.decode, config.policy, on_change=self._state_changed)
        # Label children resolved once: labels() costs a lock and a dict lookup per call on the request path.
        self._hop_latency = {role: self.metrics.hop_latency.labels(role) for role in ("prefill", "decode")}
        self._request_latency = {e: self.metrics.request_latency.labels(e) for e in flow.ENDPOINTS}
        self._routes = {path: self.metrics.routes.labels(path) for path in ("direct", "disaggregated")}
        self._requests: dict[tuple[str, int], Any] = {}
        # Parsed once: aiohttp would parse a string URL on every request.
        self._urls = {(id(b), e): yarl.URL(b.url + e) for b in self._backends() for e in flow.ENDPOINTS}
        for backend in self._backends():
            self.metrics.healthy.labels(backend.role, backend.url).set(1)
            # Read when scraped, not set twice per hop.
            self.metrics.in_flight.labels(backend.role, backend.url).set_function(_in_flight_of(backend))
        self.app = web.Application(client_max_size=config.max_body_bytes)
        self.app.router.add_post(flow.COMPLETIONS, self._completions)
        self.app.router.add_post(flow.CHAT, self._chat)
        self.app.router.add_get("/health", self._health)
        self.app.router.add_get("/metrics", self._metrics)
        self.app.router.add_get("/v1/models", self._models)
        self._session: aiohttp.ClientSession | None = None
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
        self._runner = web.AppRunner(
            self.app, access_log=None, handler_cancellation=True, shutdown_timeout=self.config.shutdown_timeout_s
        )
        await self._runner.setup()
        sock = bind_socket(host, port)
        await web.SockSite(self._runner, sock, backlog=1024).start()
        self.host, self.port = host, sock.getsockname()[1]
        await self.check_health()
        self._health_task = asyncio.create_task(self._health_loop(), name="pd-proxy-health")
        return self.url

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            await asyncio.gather(self._health_task, return_exceptions=True)
            self._health_task = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
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
                healthy, reason = answer.status == 200, f"GET /health answered {answer.status}"
        except (aiohttp.ClientError, TimeoutError) as e:
            healthy, reason = False, f"GET /health failed: {_describe(e)}"
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
        self._pool(backend).set_health(backend, False, f"connection error: {_describe(error)}")

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
        return _json_response(body, 200 if ok else 503)

    async def _metrics(self, _request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": self.metrics.content_type})

    async def _models(self, request: web.Request) -> web.Response:
        rid = request.headers.get(REQUEST_ID) or uuid.uuid4().hex
        backend = self.decode.pick()
        if backend is None:
            return _error(503, "no healthy decode backend", "service_unavailable", rid, hop="decode")
        assert self._session is not None
        try:
            async with self._session.get(backend.url + "/v1/models", headers=self._headers(request, rid)) as answer:
                raw = await answer.read()
                return _raw_response(answer, raw, rid)
        except (aiohttp.ClientError, TimeoutError) as e:
            return _error(
                502,
                f"decode backend {backend.url} failed: {_describe(e)}",
                "bad_gateway",
                rid,
                hop="decode",
                backend=backend.url,
            )

    async def _handle(self, request: web.Request, endpoint: str) -> web.StreamResponse:
        started = time.perf_counter()
        rid = request.headers.get(REQUEST_ID) or uuid.uuid4().hex
        status = 500
        try:
            try:
                raw = await request.read()
                try:
                    body = msgspec.json.decode(raw)
                except msgspec.DecodeError as e:
                    raise flow.BadRequest(f"the request body is not valid JSON: {e}") from None
                flow.validate(endpoint, body)
            except flow.BadRequest as e:
                status = 400
                return _error(400, str(e), "invalid_request_error", rid)
            except web.HTTPRequestEntityTooLarge:
                status = 413
                return _error(
                    413, f"the request body exceeds {self.config.max_body_bytes} bytes", "invalid_request_error", rid
                )
            try:
                response = await self._serve(request, endpoint, body, rid, started)
            except _Passthrough as p:
                response = p.response
            except _ClientGone as g:
                status = CLIENT_CLOSED
                return g.response
            except HopError as e:
                if not e.counted:
                    self.metrics.errors.labels(e.hop, e.kind).inc()
                status = e.status
                extra: dict[str, Any] = {"hop": e.hop}
                if e.backend is not None:
                    extra["backend"] = e.backend.url
                return _error(
                    e.status, str(e), "bad_gateway" if e.status == 502 else "service_unavailable", rid, **extra
                )
            status = response.status
            return response
        except asyncio.CancelledError:
            status = CLIENT_CLOSED
            self.metrics.errors.labels("client", "disconnect").inc()
            raise
        finally:
            counter = self._requests.get((endpoint, status))
            if counter is None:
                counter = self._requests[endpoint, status] = self.metrics.requests.labels(endpoint, str(status))
            counter.inc()
            self._request_latency[endpoint].observe(time.perf_counter() - started)

    def _headers(self, request: web.Request, rid: str) -> dict[str, str]:
        headers = {REQUEST_ID: rid, "Content-Type": "application/json"}
        for name in FORWARDED_HEADERS:
            value = request.headers.get(name)
            if value is not None:
                headers[name] = value
        return headers

    async def _serve(
        self, request: web.Request, endpoint: str, body: dict[str, Any], rid: str, started: float
    ) -> web.StreamResponse:
        headers = self._headers(request, rid)
        threshold = self.config.short_prompt_tokens
        if flow.is_batch(endpoint, body) or (threshold > 0 and flow.prompt_tokens(endpoint, body) < threshold):
            self._routes["direct"].inc()
            params = None
        else:
            self._routes["disaggregated"].inc()
            params = await self._prefill_hop(endpoint, body, headers)
        return await self._decode_hop(request, endpoint, flow.decode_body(body, params), headers, rid, started)

    # ---- hops ----

    def _enter(self, backend: Backend) -> float:
        backend.in_flight += 1
        backend.served += 1
        return time.perf_counter()

    def _leave(self, backend: Backend, since: float) -> None:
        backend.in_flight -= 1
        self._hop_latency[backend.role].observe(time.perf_counter() - since)

    def _failed_attempt(self, failure: HopError) -> HopError:
        """Counts a failed attempt at a hop as it fails (it may be retried); returns it."""
        self.metrics.errors.labels(failure.hop, failure.kind).inc()
        failure.counted = True
        return failure

    async def _prefill_hop(self, endpoint: str, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
        """Runs the prefill; on a connection error or a 5xx, once more on another prefill server."""
        assert self._session is not None
        payload = msgspec.json.encode(flow.prefill_body(endpoint, body))
        tried: list[Backend] = []
        failure: HopError | None = None
        while len(tried) < 2:
            backend = self.prefill.pick(exclude=tried)
            if backend is None:
                break
            if tried:
                self.metrics.retries.labels("prefill").inc()
            tried.append(backend)
            since = self._enter(backend)
            try:
                async with self._session.post(
                    self._urls[id(backend), endpoint], data=payload, headers=headers
                ) as answer:
                    raw = await answer.read()
            except (aiohttp.ClientError, TimeoutError) as e:
                if isinstance(e, aiohttp.ClientConnectorError):
                    self._connection_failed(backend, e)
                failure = self._failed_attempt(
                    HopError("prefill", backend, "connect", f"prefill backend {backend.url} failed: {_describe(e)}")
                )
                continue
            finally:
                self._leave(backend, since)
            if answer.status >= 500:
                failure = self._failed_attempt(
                    HopError(
                        "prefill",
                        backend,
                        "status",
                        f"prefill backend {backend.url} answered {answer.status}: {_snippet(raw)}",
                    )
                )
                continue
            if answer.status >= 400:
                raise _Passthrough(_raw_response(answer, raw, headers[REQUEST_ID]))
            try:
                decoded = msgspec.json.decode(raw)
            except msgspec.DecodeError:
                raise HopError(
                    "prefill", backend, "bad_answer", f"prefill backend {backend.url} answered with invalid JSON"
                ) from None
            params = flow.kv_params_from_prefill(decoded)
            if params is None:
                raise HopError(
                    "prefill",
                    backend,
                    "no_kv_transfer_params",
                    f"prefill backend {backend.url} answered without kv_transfer_params "
                    "(is it running with a KV connector as kv_producer or kv_both?)",
                )
            return params
        if failure is None:
            raise HopError("prefill", None, "no_backend", "no healthy prefill backend", status=503)
        if len(tried) == 2:
            failure.args = (
                f"{failure}; the retry on another prefill backend failed too: " + ", ".join(b.url for b in tried),
            )
        raise failure

    async def _decode_hop(
        self,
        request: web.Request,
        endpoint: str,
        body: dict[str, Any],
        headers: dict[str, str],
        rid: str,
        started: float,
    ) -> web.StreamResponse:
        """Sends to a decode server and relays its answer. A decode server that cannot be reached at all (the
        request never got there) is taken out and the request tried once on another one."""
        assert self._session is not None
        payload = msgspec.json.encode(body)
        tried: list[Backend] = []
        failure: HopError | None = None
        while len(tried) < 2:
            backend = self.decode.pick(exclude=tried)
            if backend is None:
                break
            if tried:
                self.metrics.retries.labels("decode").inc()
            tried.append(backend)
            since = self._enter(backend)
            try:
                try:
                    upstream = await self._session.post(
                        self._urls[id(backend), endpoint], data=payload, headers=headers
                    )
                except aiohttp.ClientConnectorError as e:  # never connected: safe to send elsewhere
                    self._connection_failed(backend, e)
                    failure = self._failed_attempt(
                        HopError("decode", backend, "connect", f"decode backend {backend.url} failed: {_describe(e)}")
                    )
                    continue
                except (aiohttp.ClientError, TimeoutError) as e:
                    raise HopError(
                        "decode", backend, "connect", f"decode backend {backend.url} failed: {_describe(e)}"
                    ) from None
                try:
                    return await self._relay(request, endpoint, upstream, backend, rid, started)
                finally:
                    upstream.close()  # a no-op once the answer was read to the end; else the decode sees a disconnect
            finally:
                self._leave(backend, since)
        if failure is None:
            raise HopError("decode", None, "no_backend", "no healthy decode backend", status=503)
        raise failure

    async def _relay(
        self,
        request: web.Request,
        endpoint: str,
        upstream: aiohttp.ClientResponse,
        backend: Backend,
        rid: str,
        started: float,
    ) -> web.StreamResponse:
        content_type = upstream.headers.get("Content-Type", "")
        if upstream.status != 200 or not content_type.startswith("text/event-stream"):
            try:
                raw = await upstream.read()
            except (aiohttp.ClientError, TimeoutError) as e:
                if isinstance(e, aiohttp.ClientConnectorError):
                    self._connection_failed(backend, e)
                raise HopError(
                    "decode", backend, "connect", f"decode backend {backend.url} failed: {_describe(e)}"
                ) from None
            if upstream.status >= 500:
                raise HopError(
                    "decode",
                    backend,
                    "status",
                    f"decode backend {backend.url} answered {upstream.status}: {_snippet(raw)}",
                )
            return _raw_response(upstream, raw, rid)
        response = web.StreamResponse(
            status=200, headers={"Content-Type": content_type, "Cache-Control": "no-cache", REQUEST_ID: rid}
        )
        await response.prepare(request)
        first = True
        try:
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
                if first:
                    self.metrics.ttft.labels(endpoint).observe(time.perf_counter() - started)
                    first = False
        except ConnectionResetError:
            self.metrics.errors.labels("client", "disconnect").inc()
            raise _ClientGone(response) from None
        except (aiohttp.ClientError, TimeoutError) as e:
            # The decode server failed mid-stream: the status is sent already; end the stream with an error event.
            self.metrics.errors.labels("decode", "stream").inc()
            event = flow.error_body(
                f"decode backend {backend.url} failed mid-stream: {_describe(e)}",
                "bad_gateway",
                hop="decode",
                backend=backend.url,
            )
            try:
                await response.write(b"data: " + msgspec.json.encode(event) + b"\n\n")
            except ConnectionResetError:
                raise _ClientGone(response) from None
        await response.write_eof()
        return response


def _in_flight_of(backend: Backend) -> Callable[[], float]:
    return lambda: backend.in_flight


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket on ``host:port`` (0: a free port), reusable right after a restart."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def _json_response(body: Any, status: int, rid: str | None = None) -> web.Response:
    headers = {"Content-Type": "application/json"}
    if rid is not None:
        headers[REQUEST_ID] = rid
    return web.Response(body=msgspec.json.encode(body), status=status, headers=headers)


def _error(status: int, message: str, type_: str, rid: str, **extra: Any) -> web.Response:
    return _json_response(flow.error_body(message, type_, code=status, **extra), status, rid)


def _raw_response(upstream: aiohttp.ClientResponse, raw: bytes, rid: str) -> web.Response:
    return web.Response(
        body=raw,
        status=upstream.status,
        headers={"Content-Type": upstream.headers.get("Content-Type", "application/json"), REQUEST_ID: rid},
    )


def _snippet(raw: bytes, limit: int = 200) -> str:
    text = raw.decode("utf-8", "replace").strip()
    return text if len(text) <= limit else text[:limit] + "..."


def _describe(error: BaseException) -> str:
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
