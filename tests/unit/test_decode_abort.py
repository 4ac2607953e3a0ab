"""A decode whose engine is stopping answers 200 with no output and ``finish_reason: "abort"`` (vLLM's API server
serves on while its engine refuses requests that reached it after SIGTERM). The proxy, facing real HTTP stand-ins
of which decode A answers that way, sends the request to decode B (the client sees B's tokens, streamed or not), B
gets the prefill's params without their hold window, A is out as draining, and the retry is counted. Once a stream
has relayed output, or with no other decode, nothing is retried: the client gets what was relayed, or a 502.

The stream judge (:class:`pd_transfer.proxy.aborts.StreamOpening`) is checked on its own too, fed byte by byte.
The same gap on real vLLM servers: ``tests/vllm/test_drain.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest

aiohttp = pytest.importorskip("aiohttp", reason="the proxy needs the 'proxy' extra (aiohttp)")
from aiohttp import web  # noqa: E402

from pd_transfer.proxy import flow  # noqa: E402
from pd_transfer.proxy.aborts import StreamOpening, Verdict, is_empty_abort  # noqa: E402
from pd_transfer.proxy.server import Proxy, ProxyConfig  # noqa: E402
from pd_transfer.sim.http_standin import Record, StandIn  # noqa: E402

pytestmark = pytest.mark.timeout(60)

MODEL = "standin-model"
PROMPT = "the quick brown fox jumps over the lazy dog " * 4
HOLD = {"remote_hold_seconds": 3.0, "remote_hold_until": 2.0e9, "remote_incarnation": "0123abcd"}


def _choice(chat: bool, stream: bool, text: str, finish: str | None) -> dict[str, Any]:
    if not chat:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    key = "delta" if stream else "message"
    return {"index": 0, key: {"role": "assistant", "content": text}, "finish_reason": finish}


def _event(chat: bool, text: str, finish: str | None) -> bytes:
    body = {"id": "x", "object": "chunk", "model": MODEL, "choices": [_choice(chat, True, text, finish)]}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def _stopping(server: StandIn) -> dict[str, str]:
    """A middleware on decode ``server`` answering as vLLM 0.32 does for a request its stopping engine refused while
    ``mode`` says so: ``empty`` (JSON: no output, finish ``abort``; a stream: no event but a chat stream's opening
    role, then ``[DONE]``), ``partial`` (one word, then ``abort``), ``teardown`` (500, as vLLM answers a request
    that reached it while its engine tears down after a drain, or is dead). It records the request first."""
    mode = {"answer": ""}

    @web.middleware
    async def stopping(request: Any, handler: Callable[[Any], Awaitable[Any]]) -> Any:
        if request.method != "POST" or not mode["answer"]:
            return await handler(request)
        body = await request.json()
        server.records.append(Record("", request.path, body.get("kv_transfer_params"), body))
        if mode["answer"] == "teardown":
            return web.Response(status=500, text="Internal Server Error")
        chat, text = request.path == flow.CHAT, " partial" if mode["answer"] == "partial" else ""
        if not body.get("stream"):
            usage = {"prompt_tokens": 9, "completion_tokens": 1 if text else 0, "total_tokens": 9}
            return web.json_response({"id": "x", "choices": [_choice(chat, False, text, "abort")], "usage": usage})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        opening = _event(chat, "", None) if chat else b""  # vLLM's chat stream opens with the role
        if text:  # an empty abort event is skipped by vLLM; one after output is sent
            opening += _event(chat, text, None) + _event(chat, "", "abort")
        await response.write(opening + b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    server.app.middlewares.append(stopping)
    return mode


def _with_hold_window(server: StandIn) -> None:
    """A middleware on prefill ``server`` adding a hold window to the params it answers (as our connector does)."""

    @web.middleware
    async def hold(request: Any, handler: Callable[[Any], Awaitable[Any]]) -> Any:
        response = await handler(request)
        if request.method != "POST" or response.status != 200:
            return response
        answer = json.loads(response.body)
        answer["kv_transfer_params"].update(HOLD)
        return web.json_response(answer)

    server.app.middlewares.append(hold)


@dataclass
class Setup:
    proxy: Proxy
    prefill: StandIn
    decodes: list[StandIn]
    mode: dict[str, str]
    client: Any

    async def metric(self, line_start: str) -> float:
        async with self.client.get(f"{self.proxy.url}/metrics") as answer:
            text = await answer.text()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(line_start))


@contextlib.asynccontextmanager
async def setup(decodes: int = 2) -> AsyncIterator[Setup]:
    prefill = StandIn("prefill", engine_id="prefill-0")
    servers = [StandIn("decode", engine_id=f"decode-{i}") for i in range(decodes)]
    _with_hold_window(prefill)
    mode = _stopping(servers[0])
    for server in [prefill, *servers]:
        await server.start()
    config = ProxyConfig(
        prefill=[prefill.url],
        decode=[s.url for s in servers],
        policy="round_robin",  # decode A first
        health_interval_s=30.0,  # no health round during the test: the answers decide
        health_timeout_s=1.0,
        connect_timeout_s=1.0,
        request_timeout_s=10.0,
        release_timeout_s=0.2,
    )
    proxy = Proxy(config)
    await proxy.start()
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as client:
            yield Setup(proxy, prefill, servers, mode, client)
    finally:
        await proxy.close()
        for server in [prefill, *servers]:
            await server.stop()


def _request(endpoint: str, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 4, "stream": stream}
    if endpoint == flow.CHAT:
        body["messages"] = [{"role": "user", "content": PROMPT}]
    else:
        body["prompt"] = PROMPT
    return body


async def _send(s: Setup, endpoint: str, stream: bool) -> tuple[int, str]:
    async with s.client.post(f"{s.proxy.url}{endpoint}", json=_request(endpoint, stream)) as answer:
        return answer.status, await answer.text()


def run(scenario: Callable[[Setup], Awaitable[None]], decodes: int = 2) -> None:
    async def main() -> None:
        async with setup(decodes) as s:
            await asyncio.wait_for(scenario(s), timeout=30)

    asyncio.run(main())


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("endpoint", [flow.COMPLETIONS, flow.CHAT], ids=["completions", "chat"])
def test_an_empty_abort_from_a_stopping_decode_is_retried_on_the_other_with_the_params_confirmed(
    endpoint: str, stream: bool
) -> None:
    async def scenario(s: Setup) -> None:
        a, b = s.decodes
        s.mode["answer"] = "empty"
        status, text = await _send(s, endpoint, stream)
        assert status == 200, text
        assert "abort" not in text and "quick" in text, text  # decode B's words (the stand-in echoes the prompt)
        assert len(a.records) == 1 and len(b.records) == 1
        first, second = a.records[0].kv_transfer_params, b.records[0].kv_transfer_params
        assert {k: first[k] for k in HOLD} == HOLD, "decode A should have got the prefill's hold window"
        assert second == {k: v for k, v in first.items() if k not in HOLD}, "B must confirm its read: no window"
        backend = next(x for x in s.proxy.decode.backends if x.url == a.url)
        assert not backend.healthy and backend.reason == "draining"
        assert await s.metric('pd_proxy_retries_total{hop="decode",reason="aborted"}') == 1
        assert await s.metric('pd_proxy_drains_total{role="decode"}') == 1
        assert await s.metric('pd_proxy_errors_total{hop="decode",kind="aborted"}') == 1
        status, text = await _send(s, endpoint, stream)  # A is out: the next one goes to B at once
        assert status == 200 and len(a.records) == 1 and len(b.records) == 2

    run(scenario)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_5xx_before_any_output_is_retried_on_the_other_with_the_params_confirmed(stream: bool) -> None:
    """A decode whose engine tears down (or died) answers 500: the request goes to B, which confirms its read (A may
    have read and reported); A stays in rotation for its health checks to judge."""

    async def scenario(s: Setup) -> None:
        a, b = s.decodes
        s.mode["answer"] = "teardown"
        status, text = await _send(s, flow.COMPLETIONS, stream)
        assert status == 200 and "quick" in text, text
        first, second = a.records[0].kv_transfer_params, b.records[0].kv_transfer_params
        assert {k: first[k] for k in HOLD} == HOLD and second == {k: v for k, v in first.items() if k not in HOLD}
        assert all(x.healthy for x in s.proxy.decode.backends)
        assert await s.metric('pd_proxy_retries_total{hop="decode",reason="status"}') == 1
        assert await s.metric('pd_proxy_errors_total{hop="decode",kind="status"}') == 1

    run(scenario)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_output_already_given_is_relayed_as_it_is_not_retried(stream: bool) -> None:
    """A stream that relayed a word before its abort (or an answer with a word and abort) reaches the client as the
    decode sent it; decode B never sees the request."""

    async def scenario(s: Setup) -> None:
        a, b = s.decodes
        s.mode["answer"] = "partial"
        status, text = await _send(s, flow.COMPLETIONS, stream)
        assert status == 200 and "partial" in text and '"abort"' in text, text
        assert len(a.records) == 1 and not b.records
        assert await s.metric("pd_proxy_retries_total") == 0
        assert all(x.healthy for x in s.proxy.decode.backends)

    run(scenario)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_an_empty_abort_with_no_other_decode_is_a_502_naming_the_decode(stream: bool) -> None:
    async def scenario(s: Setup) -> None:
        (a,) = s.decodes
        s.mode["answer"] = "empty"
        status, text = await _send(s, flow.CHAT, stream)
        assert status == 502, text
        error = json.loads(text)["error"]
        assert error["hop"] == "decode" and error["backend"] == a.url and error["type"] == "bad_gateway"
        assert "aborted" in error["message"], error
        assert await s.metric('pd_proxy_requests_total{endpoint="/v1/chat/completions",status="502"}') == 1

    run(scenario, decodes=1)


def _opening(chat: bool, events: list[tuple[str, str | None]]) -> bytes:
    return b"".join(_event(chat, text, finish) for text, finish in events)


@pytest.mark.parametrize(
    ("stream", "verdict"),
    [
        (_opening(False, [("", "abort")]) + b"data: [DONE]\n\n", Verdict.ABORTED),
        (_opening(True, [("", None), ("", "abort")]) + b"data: [DONE]\n\n", Verdict.ABORTED),
        (b": keep-alive\r\n\r\n" + _opening(False, [("", "abort")]), Verdict.ABORTED),  # ended without [DONE]
        (_opening(True, [("", None), (" hi", None)]), Verdict.RELAY),
        (_opening(False, [("", "length")]) + b"data: [DONE]\n\n", Verdict.RELAY),
        (_opening(False, [(" hi", "abort")]) + b"data: [DONE]\n\n", Verdict.RELAY),
        (b'data: {"error": {"message": "no"}}\n\n', Verdict.RELAY),
        (b"data: not json\n\n", Verdict.RELAY),
        (b"data: [DONE]\n\n", Verdict.ABORTED),  # vLLM's completions stream of a refused request
        (_opening(True, [("", None)]), Verdict.ABORTED),  # its chat stream (ended without [DONE] here)
        (b'data: {"choices": [], "usage": {"completion_tokens": 0}}\n\ndata: [DONE]\n\n', Verdict.ABORTED),
    ],
)
def test_the_stream_judge_byte_by_byte(stream: bytes, verdict: Verdict) -> None:
    opening = StreamOpening()
    seen = Verdict.HOLD
    for i in range(len(stream)):
        seen = opening.feed(stream[i : i + 1])
        if seen is not Verdict.HOLD:
            break
    assert (seen if seen is not Verdict.HOLD else opening.end()) is verdict


def test_a_stream_that_holds_too_much_without_output_is_relayed() -> None:
    opening = StreamOpening(limit=1000)
    assert opening.feed(b": padding " * 50 + b"\n\n") is Verdict.HOLD
    assert opening.feed(b"data: " + b"x" * 1000) is Verdict.RELAY


def test_json_answers_judged() -> None:
    empty = {"choices": [{"index": 0, "text": "", "finish_reason": "abort"}], "usage": {"completion_tokens": 0}}
    assert is_empty_abort(json.dumps(empty).encode())
    chat = {"choices": [{"index": 0, "message": {"role": "assistant", "content": None}, "finish_reason": "abort"}]}
    assert is_empty_abort(json.dumps(chat).encode())
    for changed in (
        {"usage": {"completion_tokens": 1}},
        {"choices": [{"index": 0, "text": "x", "finish_reason": "abort"}]},
        {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]},
        {"choices": []},
    ):
        assert not is_empty_abort(json.dumps({**empty, **changed}).encode()), changed
    assert not is_empty_abort(b'{"abort": ')
