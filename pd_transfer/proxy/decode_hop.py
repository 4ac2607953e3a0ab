"""The proxy's decode hop: the client's request (with the prefill's ``kv_transfer_params``) to a decode server, and
its answer relayed back, whole (a JSON answer) or event by event (an SSE stream).

A decode server that cannot be reached at all, or that refuses the request with a drain's 503 (the request never got
to its engine), is taken out and the request tried once on another decode server. Anything else a decode answers
goes to the client: a 4xx as it is, a 5xx or a failed read as a 502 naming the hop and the backend (before any byte
was relayed), a failure mid-stream as a final error event.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec
import yarl
from aiohttp import web

from pd_transfer.proxy import flow
from pd_transfer.proxy.metrics import HopMeter
from pd_transfer.proxy.release import DecodeProgress
from pd_transfer.proxy.responses import REQUEST_ID, ClientGone, HopError, describe_error, relayed_response, snippet
from pd_transfer.proxy.routing import Backend, Pool


@dataclass(frozen=True)
class DecodeCall:
    """One client request's decode hop: the client's ``request`` (its connection, for a stream), the ``endpoint``,
    the decode ``body`` (the client's, plus the prefill's params), the ``headers`` for the backend, the request id
    ``rid`` and when the proxy received it (``started``, ``time.perf_counter`` seconds: the start of the TTFT)."""

    request: web.Request
    endpoint: str
    body: dict[str, Any]
    headers: dict[str, str]
    rid: str
    started: float


class DecodeHop:
    """Runs decode hops over ``pool`` (the decode backends); ``urls`` maps ``(id(backend), endpoint)`` to the
    parsed URL; ``meter`` counts the hops and their failed attempts."""

    def __init__(self, pool: Pool, meter: HopMeter, urls: Mapping[tuple[int, str], yarl.URL]) -> None:
        self.pool = pool
        self.meter = meter
        self.metrics = meter.metrics
        self._urls = urls

    def _connection_failed(self, backend: Backend, error: BaseException) -> None:
        """A backend that cannot be connected to is out until its health check passes."""
        self.pool.set_health(backend, False, f"connection error: {describe_error(error)}")

    async def run(
        self, session: aiohttp.ClientSession, call: DecodeCall, progress: DecodeProgress
    ) -> web.StreamResponse:
        """Sends ``call`` to a decode server and relays its answer. A decode server that cannot be reached at all
        (the request never got there) is taken out and the request tried once on another one. ``progress``: whether
        the request was sent and its answer read (for the release of the prefill's blocks)."""
        payload = msgspec.json.encode(call.body)
        tried: list[Backend] = []
        failure: HopError | None = None
        while len(tried) < 2:
            backend = self.pool.pick(exclude=tried)
            if backend is None:
                break
            if tried:
                self.metrics.retries.labels("decode").inc()
            tried.append(backend)
            since = self.meter.enter(backend)
            try:
                try:
                    progress.sent = True
                    upstream = await session.post(
                        self._urls[id(backend), call.endpoint], data=payload, headers=call.headers
                    )
                except aiohttp.ClientConnectorError as e:  # never connected: safe to send elsewhere
                    progress.sent = False
                    self._connection_failed(backend, e)
                    failure = self.meter.failed_attempt(
                        HopError(
                            "decode", backend, "connect", f"decode backend {backend.url} failed: {describe_error(e)}"
                        )
                    )
                    continue
                except (aiohttp.ClientError, TimeoutError) as e:
                    raise HopError(
                        "decode", backend, "connect", f"decode backend {backend.url} failed: {describe_error(e)}"
                    ) from None
                if self.pool.note_answer(backend, upstream.status, upstream.headers):  # refused before its engine
                    upstream.close()
                    progress.sent = False
                    failure = self.meter.failed_attempt(
                        HopError("decode", backend, "draining", f"{backend.url} drains")
                    )
                    continue
                try:
                    return await self._relay(call, upstream, backend, progress)
                finally:
                    upstream.close()  # a no-op once the answer was read to the end; else the decode sees a disconnect
            finally:
                self.meter.leave(backend, since)
        if failure is None:
            raise HopError("decode", None, "no_backend", "no healthy decode backend", status=503)
        raise failure

    async def _relay(
        self, call: DecodeCall, upstream: aiohttp.ClientResponse, backend: Backend, progress: DecodeProgress
    ) -> web.StreamResponse:
        content_type = upstream.headers.get("Content-Type", "")
        if upstream.status != 200 or not content_type.startswith("text/event-stream"):
            try:
                raw = await upstream.read()
            except (aiohttp.ClientError, TimeoutError) as e:
                if isinstance(e, aiohttp.ClientConnectorError):
                    self._connection_failed(backend, e)
                raise HopError(
                    "decode", backend, "connect", f"decode backend {backend.url} failed: {describe_error(e)}"
                ) from None
            progress.answered = True
            if upstream.status >= 500:
                raise HopError(
                    "decode",
                    backend,
                    "status",
                    f"decode backend {backend.url} answered {upstream.status}: {snippet(raw)}",
                )
            return relayed_response(upstream, raw, call.rid)
        return await self._stream(call, upstream, backend, progress, content_type)

    async def _stream(
        self,
        call: DecodeCall,
        upstream: aiohttp.ClientResponse,
        backend: Backend,
        progress: DecodeProgress,
        content_type: str,
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            status=200, headers={"Content-Type": content_type, "Cache-Control": "no-cache", REQUEST_ID: call.rid}
        )
        await response.prepare(call.request)
        first = True
        try:
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
                if first:
                    self.metrics.ttft.labels(call.endpoint).observe(time.perf_counter() - call.started)
                    first = False
        except ConnectionResetError:
            self.metrics.errors.labels("client", "disconnect").inc()
            raise ClientGone(response) from None
        except (aiohttp.ClientError, TimeoutError) as e:
            # The decode server failed mid-stream: the status is sent already; end the stream with an error event.
            self.metrics.errors.labels("decode", "stream").inc()
            event = flow.error_body(
                f"decode backend {backend.url} failed mid-stream: {describe_error(e)}",
                "bad_gateway",
                hop="decode",
                backend=backend.url,
            )
            try:
                await response.write(b"data: " + msgspec.json.encode(event) + b"\n\n")
            except ConnectionResetError:
                raise ClientGone(response) from None
        progress.answered = True
        await response.write_eof()
        return response
