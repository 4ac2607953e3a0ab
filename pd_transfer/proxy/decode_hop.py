"""The proxy's decode hop: the client's request (with the prefill's ``kv_transfer_params``) to a decode server, and
its answer relayed back, whole (a JSON answer) or event by event (an SSE stream).

The request is tried once more on another decode server when the first attempt failed before any byte of its
answer reached the client:

* it never reached the first one's engine, and that server is taken out: it could not be connected to; it refused
  with a drain's 503 (``X-PD-Draining``); or it answered 200 with no output and ``finish_reason: "abort"``
  (:mod:`pd_transfer.proxy.aborts`: its engine is stopping and refused the request; a stream is held back until its
  first output, so the client has seen nothing);
* or it answered a 5xx (a stream's status comes before its first event): its engine failed the request, or died
  under it. vLLM answers 500 to a request that reaches it while its engine tears down after a drain, and while its
  engine is dead. The server stays in rotation; its health checks decide.

After an abort or a 5xx the second decode gets the prefill's params without their hold window
(:func:`flow.without_hold_window`), so that it confirms its read with the prefill: the first decode may have read and
reported, and then the prefill freed the blocks. The confirmation then fails and the decode's failure policy
decides: recomputed or a clear error, never KV read from freed blocks. A hop that timed out
(``request_timeout_s``) is not tried again: it used the time the client was promised for it.

Retries are counted in ``pd_proxy_retries_total{hop="decode",reason}`` (reason: the first attempt's failure kind:
``connect``, ``draining``, ``aborted``, ``status``). Anything else a decode answers goes to the client: a 4xx as it
is; a second failure, or a failed read, as a 502 naming the hop and the backend (before any byte was relayed); a
failure mid-stream as a final error event.

A hop that did not answer 200 releases the prefill's blocks it was given (:mod:`pd_transfer.proxy.release`): at
once when no decode can be reading them, at the end of their hold window when the client left while one may be.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web

from pd_transfer.proxy import flow
from pd_transfer.proxy.aborts import StreamOpening, Verdict, is_empty_abort
from pd_transfer.proxy.hops import Call, Hop
from pd_transfer.proxy.responses import REQUEST_ID, ClientGone, HopError, describe_error, relayed_response, snippet
from pd_transfer.proxy.routing.pool import DRAINING, Backend
from pd_transfer.proxy.upstream import Answer, ConnectFailed, UpstreamError

log = logging.getLogger(__name__)

ABORTED = "aborted"  # the failure kind (and retry reason) of an empty abort


class _Retryable(Exception):
    """An attempt that failed before any byte reached the client (``failure``): it may go elsewhere.
    ``saw_params``: the decode may have read the prefill's blocks (its engine had the request)."""

    def __init__(self, failure: HopError, *, saw_params: bool) -> None:
        super().__init__(str(failure))
        self.failure = failure
        self.saw_params = saw_params


@dataclass
class DecodeProgress:
    """How far a request's decode hop got: ``sent`` (a decode may have it), ``answered`` (its answer was read)."""

    sent: bool = False
    answered: bool = False

    @property
    def read_possible(self) -> bool:
        """Whether a decode may be reading the prefill's blocks now."""
        return self.sent and not self.answered


class DecodeHop(Hop):
    """Runs decode hops over the decode pool (:class:`~pd_transfer.proxy.hops.Hop`); its ``releases`` free the
    prefill's blocks a hop will not read."""

    async def run(self, call: Call, params: dict[str, Any] | None, prefer: Backend | None = None) -> web.StreamResponse:
        """Sends ``call`` with the prefill's ``params`` (None: no prefill hop) to a decode server, ``prefer`` first
        when given (a local prefill's), and relays its answer; once more on another decode server when the first try
        failed before any byte reached the client (see the module). Unless it answered 200, the prefill is told to
        free the blocks ``params`` name (:mod:`pd_transfer.proxy.release`): at once when no decode can be reading
        them, at the end of their hold window when the client left while one may be."""
        progress = DecodeProgress()
        try:
            response = await self._send(call, flow.decode_body(call.body, params), prefer, progress)
        except BaseException as error:
            if params is not None:
                why = "the client left" if isinstance(error, asyncio.CancelledError | ClientGone) else "decode failed"
                self.releases.release(params, call.rid, read_possible=progress.read_possible, why=why)
            raise
        if params is not None and response.status != 200:
            self.releases.release(params, call.rid, read_possible=False, why=f"the decode answered {response.status}")
        return response

    async def _send(
        self, call: Call, body: dict[str, Any], prefer: Backend | None, progress: DecodeProgress
    ) -> web.StreamResponse:
        """The decode hop of ``body``: each try's answer relayed, or its failure recorded for the next try."""
        payload = msgspec.json.encode(body)
        tries = self.tries()
        while (backend := tries.next(call.route, prefer)) is not None:
            since = self.meter.enter(backend)
            try:
                return await self._attempt(call, backend, payload, progress)
            except _Retryable as retry:
                tries.failed(retry.failure)
                if retry.saw_params:
                    payload = msgspec.json.encode(flow.without_hold_window(body))
            finally:
                self.meter.leave(backend, since)
        raise tries.exhausted()

    async def _attempt(
        self, call: Call, backend: Backend, payload: bytes, progress: DecodeProgress
    ) -> web.StreamResponse:
        """One decode server's try at ``call`` (``payload``: its encoded body); raises :class:`_Retryable` when the
        request never reached that server's engine."""
        try:
            progress.sent = True
            answer = await self.upstream.post(self.endpoint(backend, call), call.headers, payload)
        except ConnectFailed as e:  # never connected: safe to send elsewhere
            progress.sent = False
            self.unreachable(backend, e)
            message = f"decode backend {backend.url} failed: {describe_error(e)}"
            raise _Retryable(HopError("decode", backend.url, "connect", message), saw_params=False) from None
        except (UpstreamError, TimeoutError) as e:
            raise HopError(
                "decode", backend.url, "connect", f"decode backend {backend.url} failed: {describe_error(e)}"
            ) from None
        try:
            if self.pool.note_answer(backend, answer.status, answer.headers):  # refused before its engine
                progress.sent = False
                raise _Retryable(HopError("decode", backend.url, "draining", f"{backend.url} drains"), saw_params=False)
            return await self._relay(call, answer, backend, progress)
        finally:
            answer.close()  # a no-op once the answer was read to the end; else the decode sees a disconnect

    def _aborted(self, call: Call, backend: Backend, progress: DecodeProgress) -> _Retryable:
        """``backend`` answered 200 with no output and ``finish_reason: "abort"``: its engine is stopping. It is
        out as a drain's 503 would take it out; the request never reached its engine (nothing read, nothing
        relayed). Returns the exception to raise."""
        self.pool.set_health(backend, False, DRAINING)
        progress.sent = progress.answered = False
        log.warning(
            "request %s: decode backend %s answered with no output, finish_reason abort (its engine is stopping?)",
            call.rid,
            backend.url,
        )
        message = f"decode backend {backend.url} aborted the request with no output (is it stopping?)"
        return _Retryable(HopError("decode", backend.url, ABORTED, message), saw_params=True)

    def _failed(self, call: Call, backend: Backend, status: int, raw: bytes, progress: DecodeProgress) -> _Retryable:
        """``backend`` answered ``status`` (a 5xx) before any output: the decode is done with the request (nothing
        reads the prefill's blocks for it any more) and it may go to another decode. Returns the exception to
        raise."""
        progress.sent = progress.answered = False
        log.warning("request %s: decode backend %s answered %d", call.rid, backend.url, status)
        message = f"decode backend {backend.url} answered {status}: {snippet(raw)}"
        return _Retryable(HopError("decode", backend.url, "status", message, answered=status), saw_params=True)

    async def _relay(
        self, call: Call, upstream: Answer, backend: Backend, progress: DecodeProgress
    ) -> web.StreamResponse:
        content_type = upstream.headers.get("Content-Type", "")
        if upstream.status != 200 or not content_type.startswith("text/event-stream"):
            try:
                raw = await upstream.read()
            except (UpstreamError, TimeoutError) as e:
                raise HopError(
                    "decode", backend.url, "connect", f"decode backend {backend.url} failed: {describe_error(e)}"
                ) from None
            progress.answered = True
            if upstream.status >= 500:
                raise self._failed(call, backend, upstream.status, raw, progress)
            if upstream.status == 200 and is_empty_abort(raw):
                raise self._aborted(call, backend, progress)
            return relayed_response(upstream.status, upstream.headers, raw, call.rid)
        return await self._stream(call, upstream, backend, progress, content_type)

    async def _stream(
        self,
        call: Call,
        upstream: Answer,
        backend: Backend,
        progress: DecodeProgress,
        content_type: str,
    ) -> web.StreamResponse:
        """Relays an SSE stream: its opening held until its first output (:class:`StreamOpening`), then chunk by
        chunk as it comes. A stream that ends with an abort and no output raises :class:`_Retryable`."""
        opening = StreamOpening()
        chunks = upstream.chunks()
        try:
            verdict = await _judge(opening, chunks)
        except (UpstreamError, TimeoutError) as e:
            message = f"decode backend {backend.url} failed before its first output: {describe_error(e)}"
            raise HopError("decode", backend.url, "stream", message) from None
        if verdict is Verdict.ABORTED:
            raise self._aborted(call, backend, progress)
        response = web.StreamResponse(
            status=200, headers={"Content-Type": content_type, "Cache-Control": "no-cache", REQUEST_ID: call.rid}
        )
        await response.prepare(call.client)
        try:
            if opening.held:
                await response.write(bytes(opening.held))
                self.metrics.ttft.labels(call.endpoint).observe(time.perf_counter() - call.started)
            async for chunk in chunks:
                await response.write(chunk)
        except ConnectionResetError:
            self.metrics.errors.labels("client", "disconnect").inc()
            raise ClientGone(response) from None
        except (UpstreamError, TimeoutError) as e:
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
        try:
            await response.write_eof()
        except ConnectionResetError:  # the client left as the stream ended
            self.metrics.errors.labels("client", "disconnect").inc()
            raise ClientGone(response) from None
        return response


async def _judge(opening: StreamOpening, chunks: AsyncIterator[bytes]) -> Verdict:
    """Feeds ``chunks`` to ``opening`` until it can tell whether to relay the stream (or the stream ends)."""
    async for chunk in chunks:
        verdict = opening.feed(chunk)
        if verdict is not Verdict.HOLD:
            return verdict
    return opening.end()
