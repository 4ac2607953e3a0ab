"""``DrainMiddleware``: a vLLM API server that says it is draining from the first SIGTERM (or SIGINT) on.

vLLM 0.32 drains on SIGTERM when started with ``--shutdown-timeout N`` (N > 0): its engine core stops taking
requests and keeps stepping until every request it holds is done, for at most N seconds, and only then exits. A
prefill's held blocks count as such requests until our workers report them ``finished_sending`` (read by every
decode reader, lease expired or aborted), so outstanding reads finish before the engine goes. But until the engine
exits, the API server's ``/health`` still answers 200, and a new request is taken by the HTTP server and answered
**200 with an empty text and ``finish_reason: "abort"``**: a load balancer keeps sending traffic that silently fails.

Loaded with vLLM's ``--middleware pd_transfer.integrations.vllm.drain.DrainMiddleware``, this pure ASGI middleware
chains a handler onto the API server's SIGTERM and SIGINT (at its lifespan startup, after vLLM registered its own
on the event loop: both still run) and from then on answers

* ``GET /health`` with ``503`` (body ``draining``), so health-based routers take the server out;
* every new ``POST`` (completions, chat, ...) with ``503``, an OpenAI-style error of type ``draining`` and the
  header ``X-PD-Draining: 1`` (the request never reached the engine: a proxy may send it elsewhere; ours does and
  routes nothing more to the server).

Requests already in the server when the signal came run to their end. Everything else (``/metrics``, ``GET
/v1/models``) passes through. This module imports neither vLLM nor a web framework.

The switch and the refusal's wording are the engine-agnostic drain's (:class:`pd_transfer.connector.drain.Drain`,
which the KV stand-in's prefill drains with too); what a prefill then waits for (every lease read, released or
expired) is vLLM's ``--shutdown-timeout`` here, the connector's ``SchedulerSide.drain`` elsewhere.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
from collections.abc import Awaitable, Callable, MutableMapping
from types import FrameType
from typing import Any

from pd_transfer.connector.drain import Drain
from pd_transfer.settings import read_settings

from .logs import log_to_stderr

logger = logging.getLogger(__name__)

#: The header of a draining server's 503 (the proxy's ``pd_transfer.proxy.routing.DRAINING_HEADER``).
DRAINING_HEADER = "X-PD-Draining"
DRAIN_SIGNALS = (signal.SIGTERM, signal.SIGINT)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class DrainState(Drain):
    """Whether this API server drains, why and since when (:class:`~pd_transfer.connector.drain.Drain`, started from
    a signal handler); set once."""

    def __init__(self) -> None:
        super().__init__("this vLLM server")

    def install_signal_handlers(self) -> None:
        """Start the drain on SIGTERM or SIGINT, then run whatever handled the signal before (vLLM's, via the
        event loop's wakeup fd, runs regardless). Call from the main thread."""
        for number in DRAIN_SIGNALS:
            previous = signal.getsignal(number)
            signal.signal(number, self._handler(number, previous))

    def _handler(self, number: int, previous: Any) -> Callable[[int, FrameType | None], None]:
        def on_signal(signum: int, frame: FrameType | None) -> None:
            self.start(f"received {signal.Signals(number).name}")
            if callable(previous):
                previous(signum, frame)
            elif previous == signal.SIG_DFL:  # nothing else handled it: do what it would have done
                signal.signal(number, signal.SIG_DFL)
                os.kill(os.getpid(), number)

        return on_signal


#: The process's drain state (one API server per process).
STATE = DrainState()


class DrainMiddleware:
    """ASGI middleware for vLLM's ``--middleware``: see the module's docstring. ``state``: for tests."""

    def __init__(self, app: ASGIApp, state: DrainState | None = None) -> None:
        self.app = app
        self.state = state if state is not None else STATE
        self._installed = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan" and not self._installed:
            self._install()
        refusal = self.state.refusal() if scope["type"] == "http" else None
        if refusal is not None and _refused(scope):
            await _answer_draining(scope, send, refusal)
            return
        await self.app(scope, receive, send)

    def _install(self) -> None:
        self._installed = True
        log_to_stderr(read_settings().log_level)  # this vLLM process is our edge
        if threading.current_thread() is not threading.main_thread():
            logger.warning("not in the main thread: the drain will not start on SIGTERM")
            return
        self.state.install_signal_handlers()
        logger.info("SIGTERM or SIGINT starts a drain: /health 503, new requests 503 (%s)", DRAINING_HEADER)


def _refused(scope: Scope) -> bool:
    """Whether a draining server refuses this request: ``GET /health`` and every ``POST``."""
    method = scope.get("method", "")
    return method == "POST" or (method in ("GET", "HEAD") and scope.get("path") == "/health")


async def _answer_draining(scope: Scope, send: Send, refusal: str) -> None:
    """503: ``draining`` for ``/health``, else an OpenAI-style error naming the drain (``refusal``), with
    ``DRAINING_HEADER``."""
    if scope.get("path") == "/health":
        body, content_type = b"draining", b"text/plain; charset=utf-8"
    else:
        error = {"message": refusal, "type": "draining"}
        body, content_type = json.dumps({"error": error, "code": 503}).encode(), b"application/json"
    headers = [
        (b"content-type", content_type),
        (b"content-length", str(len(body)).encode()),
        (DRAINING_HEADER.lower().encode(), b"1"),
        (b"connection", b"close"),
    ]
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": body if scope.get("method") != "HEAD" else b""})
