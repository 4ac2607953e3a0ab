"""Drains without vLLM: ``DrainMiddleware`` (the ASGI middleware a vLLM API server loads with ``--middleware``)
answers 503 from the first real SIGTERM on, and the proxy, facing real HTTP stand-ins of which one answers as a
draining server does, moves the request to another backend and routes nothing more to the drained one.

The end-to-end drains of real vLLM servers are in ``tests/vllm/test_drain.py``.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import os
import signal
import sys
import time
import types
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest

import pd_transfer.integrations

# The middleware imports no vLLM, but its package's __init__ does (the connector): import the module from its folder
# under a stand-in parent package (no __init__ run; relative imports such as ``.logs`` resolve in the same folder),
# so that this test runs where vLLM is not installed.
_VLLM_DIR = os.path.join(os.path.dirname(pd_transfer.integrations.__file__), "vllm")
_PARENT = "pd_transfer_vllm_under_test"
if _PARENT not in sys.modules:
    _parent = types.ModuleType(_PARENT)
    _parent.__path__ = [_VLLM_DIR]
    sys.modules[_PARENT] = _parent
drain = importlib.import_module(f"{_PARENT}.drain")
DRAINING_HEADER, DrainMiddleware, DrainState = drain.DRAINING_HEADER, drain.DrainMiddleware, drain.DrainState

aiohttp = pytest.importorskip("aiohttp", reason="the proxy needs the 'proxy' extra (aiohttp)")
from aiohttp import web  # noqa: E402

from pd_transfer.proxy.routing.pool import DRAINING_HEADER as PROXY_DRAINING_HEADER  # noqa: E402
from pd_transfer.proxy.server import Proxy, ProxyConfig  # noqa: E402
from pd_transfer.sim.http_standin import StandIn  # noqa: E402

pytestmark = pytest.mark.timeout(60)

MODEL = "standin-model"
PROMPT = "the quick brown fox jumps over the lazy dog " * 4


# ---- the middleware -----------------------------------------------------------------------------------------------


async def _inner(scope: dict[str, Any], receive: Callable[[], Awaitable[Any]], send: Callable[..., Any]) -> None:
    """The wrapped app: answers 200 ``inner`` to HTTP, completes the lifespan startup."""
    if scope["type"] == "lifespan":
        await receive()
        await send({"type": "lifespan.startup.complete"})
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"inner"})


async def _call(app: Any, method: str, path: str) -> tuple[int, dict[str, str], bytes]:
    """One HTTP request through ``app``: (status, headers, body)."""
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app({"type": "http", "method": method, "path": path, "headers": []}, receive, send)
    headers = {k.decode(): v.decode() for k, v in sent[0].get("headers", [])}
    return sent[0]["status"], headers, b"".join(m.get("body", b"") for m in sent[1:])


async def _lifespan(app: Any) -> None:
    messages = [{"type": "lifespan.startup"}]

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    async def send(_message: dict[str, Any]) -> None:
        return None

    await app({"type": "lifespan"}, receive, send)


@pytest.fixture
def restored_signals() -> Iterator[list[int]]:
    """SIGTERM and SIGINT handled by a recorder for the test (so a real SIGTERM does not end pytest); the
    process's own handlers are put back after. Yields the signals the recorder saw. (A handler on the package's
    logger meanwhile, so that the middleware leaves the logging of the session's other tests alone.)"""
    seen: list[int] = []
    saved = {number: signal.getsignal(number) for number in (signal.SIGTERM, signal.SIGINT)}
    for number in saved:
        signal.signal(number, lambda signum, _frame: seen.append(signum))
    package, quiet = logging.getLogger("pd_transfer"), logging.NullHandler()
    package.addHandler(quiet)
    try:
        yield seen
    finally:
        package.removeHandler(quiet)
        for number, handler in saved.items():
            signal.signal(number, handler)


def test_middleware_refuses_with_503_from_the_first_sigterm_and_chains_the_previous_handler(
    restored_signals: list[int],
) -> None:
    state = DrainState()
    app = DrainMiddleware(_inner, state=state)

    async def scenario() -> None:
        await _lifespan(app)
        assert await _call(app, "GET", "/health") == (200, {}, b"inner")
        assert (await _call(app, "POST", "/v1/completions"))[0] == 200
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 5.0
        while not state.draining:
            assert time.monotonic() < deadline, "SIGTERM did not start the drain"
            await asyncio.sleep(0.01)  # the handler runs in the main thread between bytecodes; bounded
        status, headers, body = await _call(app, "GET", "/health")
        assert (status, body) == (503, b"draining") and headers[DRAINING_HEADER.lower()] == "1"
        status, headers, body = await _call(app, "POST", "/v1/chat/completions")
        assert status == 503 and headers[DRAINING_HEADER.lower()] == "1"
        assert json.loads(body)["error"]["type"] == "draining"
        assert await _call(app, "GET", "/metrics") == (200, {}, b"inner")  # scrapes go on during the drain
        assert await _call(app, "GET", "/v1/models") == (200, {}, b"inner")

    asyncio.run(scenario())
    assert restored_signals == [signal.SIGTERM], "the handler before ours did not run"
    assert not state.start("again"), "a drain starts once"


def test_the_proxy_and_the_middleware_name_one_header() -> None:
    assert DRAINING_HEADER == PROXY_DRAINING_HEADER


# ---- the proxy ----------------------------------------------------------------------------------------------------


def _drain_switch(server: StandIn) -> dict[str, bool]:
    """An aiohttp middleware on ``server`` answering as a draining vLLM server (with ``DrainMiddleware``) does
    while the returned switch's ``on`` is set."""
    switch = {"on": False}

    @web.middleware
    async def draining(request: Any, handler: Callable[[Any], Awaitable[Any]]) -> Any:
        if switch["on"] and (request.method == "POST" or request.path == "/health"):
            return web.json_response({"error": {"type": "draining"}}, status=503, headers={DRAINING_HEADER: "1"})
        return await handler(request)

    server.app.middlewares.append(draining)
    return switch


async def _post(client: Any, proxy: Proxy, tag: str) -> int:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4}
    async with client.post(f"{proxy.url}/v1/completions", json=body, headers={"X-Request-Id": tag}) as answer:
        await answer.read()
        return int(answer.status)


async def _proxy_metric(client: Any, proxy: Proxy, line_start: str) -> float:
    async with client.get(f"{proxy.url}/metrics") as answer:
        text = await answer.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(line_start))


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_the_proxy_retries_a_draining_backends_503_elsewhere_and_routes_nothing_more_to_it(role: str) -> None:
    """Backend A of ``role`` starts draining: the next request it gets is answered by B (the client sees 200), A is
    out with reason ``draining`` (counted in ``pd_proxy_drains_total``), and the next 6 requests all go to B."""

    async def scenario() -> None:
        servers = {r: [StandIn(r, engine_id=f"{r}-{i}") for i in range(2)] for r in ("prefill", "decode")}
        switch = _drain_switch(servers[role][0])
        for server in servers["prefill"] + servers["decode"]:
            await server.start()
        config = ProxyConfig(
            prefill=[s.url for s in servers["prefill"]],
            decode=[s.url for s in servers["decode"]],
            policy="round_robin",
            health_interval_s=30.0,  # no health round during the test: the requests' answers decide
            health_timeout_s=1.0,
            connect_timeout_s=1.0,
            request_timeout_s=10.0,
        )
        proxy = Proxy(config)
        await proxy.start()
        drained, other = servers[role]
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as client:
                switch["on"] = True
                statuses = [await _post(client, proxy, f"drain-{i}") for i in range(2)]  # one of them meets A
                backend = next(b for b in getattr(proxy, role).backends if b.url == drained.url)
                assert not backend.healthy and backend.reason == "draining"
                served_by_a = len(drained.records)
                statuses += [await _post(client, proxy, f"after-{i}") for i in range(6)]
                assert statuses == [200] * 8
                assert len(drained.records) == served_by_a, "the proxy sent new requests to a draining backend"
                assert len(other.records) >= 8
                drains = await _proxy_metric(client, proxy, f'pd_proxy_drains_total{{role="{role}"}}')
                assert drains == 1
        finally:
            await proxy.close()
            for server in servers["prefill"] + servers["decode"]:
                await server.stop()

    asyncio.run(asyncio.wait_for(scenario(), timeout=30))


def test_a_prefill_aborted_by_its_stopping_engine_is_retried_on_another_prefill() -> None:
    """vLLM's engine, once it got its SIGTERM, aborts a request that reached it late: 200, an empty text,
    ``finish_reason: "abort"``, no ``kv_transfer_params``. The proxy sends that request to the other prefill (the
    client sees 200); a 200 without params that was not aborted stays a 502 (a server without a KV connector)."""

    async def scenario() -> None:
        prefills = [StandIn("prefill", engine_id=f"prefill-{i}") for i in range(2)]
        decode = StandIn("decode", engine_id="decode-0")
        mode = {"answer": ""}

        @web.middleware
        async def stopping(request: Any, handler: Callable[[Any], Awaitable[Any]]) -> Any:
            if mode["answer"] and request.method == "POST":
                choice = {"index": 0, "text": "", "finish_reason": mode["answer"]}
                return web.json_response({"id": "x", "object": "text_completion", "choices": [choice]})
            return await handler(request)

        prefills[0].app.middlewares.append(stopping)
        for server in [*prefills, decode]:
            await server.start()
        config = ProxyConfig(
            prefill=[s.url for s in prefills],
            decode=[decode.url],
            policy="round_robin",
            health_interval_s=30.0,
            health_timeout_s=1.0,
            connect_timeout_s=1.0,
            request_timeout_s=10.0,
        )
        proxy = Proxy(config)
        await proxy.start()
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as client:
                mode["answer"] = "abort"
                assert [await _post(client, proxy, f"abort-{i}") for i in range(4)] == [200] * 4
                assert len(prefills[1].records) == 4 and len(decode.records) == 4
                mode["answer"] = "length"
                statuses = [await _post(client, proxy, f"plain-{i}") for i in range(2)]
                assert 502 in statuses, statuses  # the one that met prefill 0: no KV connector there
        finally:
            await proxy.close()
            for server in [*prefills, decode]:
                await server.stop()

    asyncio.run(asyncio.wait_for(scenario(), timeout=30))
