"""The proxy's prefill hop: the client's request, cut to one token and not streamed, to a prefill server, which holds
the KV for a decode and answers the ``kv_transfer_params`` that name it (:func:`pd_transfer.proxy.flow.prefill_body`).

The request goes to another prefill server once when the first try failed on the backend's side: it could not be
connected to (that server is then out until its health check passes), the connection broke or timed out, it answered
a 5xx (a drain's 503 also takes it out), or it answered 200 without params because its engine is stopping (every
choice finished ``abort``: it holds nothing for the request). Retries are counted in
``pd_proxy_retries_total{hop="prefill",reason}``. A 4xx goes back to the client as it is (:class:`Passthrough`); an
answer that is not JSON, or a 200 without params from a server with no KV connector, is a 502 naming the hop and the
backend at once.

A client that leaves during the hop cancels it; the connection then reads the prefill's answer on, unattended, for up
to :data:`PREFILL_LEFTOVER_S`, and the blocks its params name are released (:mod:`pd_transfer.proxy.release`).
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

import msgspec

from pd_transfer.proxy import flow
from pd_transfer.proxy.hops import Call, Hop
from pd_transfer.proxy.responses import HopError, Passthrough, describe_error, relayed_response, snippet
from pd_transfer.proxy.routing.pool import Backend
from pd_transfer.proxy.upstream import ConnectFailed, Leftover, UpstreamError

log = logging.getLogger(__name__)

#: Seconds the proxy goes on reading a prefill's answer after the client left during the prefill hop. vLLM aborts a
#: request whose connection closes while its engine computes (our connector holds nothing for it), but one its engine
#: had finished holds its blocks until the lease ends: an answer read within this time names them, released at once.
#: Past it the connection closes (vLLM aborts the request if it still runs).
PREFILL_LEFTOVER_S = 1.0


class PrefillHop(Hop):
    """Runs prefill hops over the prefill pool (:class:`~pd_transfer.proxy.hops.Hop`); its ``releases`` free what a
    prefill answered a client that had left; ``targets``: each prefill backend's engine as its latest params named it
    (by URL), what a streamed request's decode leg needs (:meth:`run_streamed`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.targets: dict[str, dict[str, Any]] = {}

    async def run_streamed(self, call: Call, backend: Backend, stream_id: str) -> None:
        """The prefill leg of a streamed request (its decode leg sent beside it, naming ``stream_id``) to ``backend``,
        once (the decode waits for this prefill: no retry elsewhere). Its answer only refreshes ``targets``. Raises
        :class:`HopError` when it fails or the backend answers an error."""
        payload = msgspec.json.encode(flow.prefill_body(call.endpoint, call.body, stream_id))
        leftover = Leftover(PREFILL_LEFTOVER_S, partial(self._left_over, call.rid))
        since = self.meter.enter(backend)
        try:
            async with await self.upstream.post(
                self.endpoint(backend, call), call.headers, payload, leftover
            ) as answer:
                raw = await answer.read()
        except (UpstreamError, TimeoutError) as e:
            if isinstance(e, ConnectFailed):
                self.unreachable(backend, e)
            failure = HopError(
                "prefill", backend.url, "connect", f"prefill backend {backend.url} failed: {describe_error(e)}"
            )
            raise self.meter.failed_attempt(failure) from None
        finally:
            self.meter.leave(backend, since)
        self.pool.note_answer(backend, answer.status, answer.headers)
        if answer.status >= 400:
            message = f"prefill backend {backend.url} answered {answer.status}: {snippet(raw)}"
            raise self.meter.failed_attempt(HopError("prefill", backend.url, "status", message))
        try:
            self._learn(backend, flow.kv_params_from_prefill(msgspec.json.decode(raw)))
        except msgspec.DecodeError:
            pass  # the decode has its KV or recomputes: nothing to learn here

    def _learn(self, backend: Backend, params: dict[str, Any] | None) -> None:
        target = None if params is None else flow.stream_target(params)
        if target is not None:
            self.targets[backend.url] = target

    async def run(self, call: Call, prefer: Backend | None = None) -> dict[str, Any]:
        """The prefill of ``call``: the ``kv_transfer_params`` its prefill answered; on a failure that may go
        elsewhere, once more on another prefill server (see the module). ``prefer``: the server routing picked for it
        already (tried first while healthy). Raises :class:`HopError` or :class:`Passthrough`."""
        payload = msgspec.json.encode(flow.prefill_body(call.endpoint, call.body))
        leftover = Leftover(PREFILL_LEFTOVER_S, partial(self._left_over, call.rid))
        tries = self.tries()
        while (backend := tries.next(call.route, prefer)) is not None:
            since = self.meter.enter(backend)
            try:
                endpoint = self.endpoint(backend, call)
                async with await self.upstream.post(endpoint, call.headers, payload, leftover) as answer:
                    raw = await answer.read()
            except (UpstreamError, TimeoutError) as e:
                if isinstance(e, ConnectFailed):
                    self.unreachable(backend, e)
                message = f"prefill backend {backend.url} failed: {describe_error(e)}"
                tries.failed(HopError("prefill", backend.url, "connect", message))
                continue
            finally:
                self.meter.leave(backend, since)
            self.pool.note_answer(backend, answer.status, answer.headers)  # a drain's 503 is retried elsewhere
            if answer.status >= 500:
                message = f"prefill backend {backend.url} answered {answer.status}: {snippet(raw)}"
                tries.failed(HopError("prefill", backend.url, "status", message))
                continue
            if answer.status >= 400:
                raise Passthrough(relayed_response(answer.status, answer.headers, raw, call.rid))
            try:
                decoded = msgspec.json.decode(raw)
            except msgspec.DecodeError:
                message = f"prefill backend {backend.url} answered with invalid JSON"
                raise HopError("prefill", backend.url, "bad_answer", message) from None
            params = flow.kv_params_from_prefill(decoded)
            if params is not None:
                self._learn(backend, params)
                return params
            failure = HopError("prefill", backend.url, *without_params(backend.url, decoded))
            tries.failed(failure)
            if failure.kind != "aborted":
                raise failure  # no KV connector there: another prefill would not help
        failure = tries.exhausted()
        if len(tries.tried) == 2:
            urls = ", ".join(b.url for b in tries.tried)
            failure.args = (f"{failure}; the retry on another prefill backend failed too: {urls}",)
        raise failure

    def _left_over(self, rid: str, status: int | None, raw: bytes | None) -> None:
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


def without_params(url: str, answer: Any) -> tuple[str, str]:
    """(kind, message) of a prefill's 200 answer without ``kv_transfer_params``. ``aborted`` when every choice
    finished ``abort``: an engine that is stopping (vLLM's drain) aborts a request that reached it after its SIGTERM
    and holds nothing for it, so the request may go to another prefill. Else the backend lacks a KV connector."""
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if isinstance(choices, list) and choices and all(isinstance(c, dict) for c in choices):
        if all(c.get("finish_reason") == "abort" for c in choices):
            return "aborted", f"prefill backend {url} aborted the request (is it stopping?)"
    return "no_kv_transfer_params", (
        f"prefill backend {url} answered without kv_transfer_params"
        " (is it running with a KV connector as kv_producer or kv_both?)"
    )
