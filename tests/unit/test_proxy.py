"""The P/D proxy against real HTTP servers on 127.0.0.1: the proxy and 2 prefill + 2 decode stand-ins, all in
the test's event loop. Every wait is bounded and waits on an event (no sleeps as synchronisation). The proxy's
benchmark with the proxy and stand-ins as processes: tests/process/test_bench_proxy.py."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest

aiohttp = pytest.importorskip("aiohttp", reason="the proxy needs the 'proxy' extra (aiohttp)")

from pd_transfer.proxy import flow  # noqa: E402
from pd_transfer.proxy.cli import add_arguments, config_from_args  # noqa: E402
from pd_transfer.proxy.prompt import CHAT_TOKENS_PER_MESSAGE, Prompt  # noqa: E402
from pd_transfer.proxy.server import Proxy, ProxyConfig  # noqa: E402
from pd_transfer.sim.http_standin import StandIn  # noqa: E402

pytestmark = pytest.mark.timeout(60)

MODEL = "standin-model"
PROMPT = "the quick brown fox jumps over the lazy dog " * 4  # 36 words: ~47 tokens by the estimate


@dataclass
class Cluster:
    proxy: Proxy
    prefills: list[StandIn]
    decodes: list[StandIn]
    client: aiohttp.ClientSession

    def post(self, path: str, body: Any, **kwargs: Any) -> Any:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {"Content-Type": "application/json", **kwargs.pop("headers", {})}
        return self.client.post(self.proxy.url + path, data=data, headers=headers, **kwargs)

    async def call(self, path: str, body: Any, **kwargs: Any) -> tuple[int, Any, Any]:
        async with self.post(path, body, **kwargs) as r:
            return r.status, await r.json(content_type=None), r.headers

    async def metrics(self) -> str:
        async with self.client.get(self.proxy.url + "/metrics") as r:
            assert r.status == 200
            return await r.text()

    async def health(self) -> tuple[int, Any]:
        async with self.client.get(self.proxy.url + "/health") as r:
            return r.status, await r.json()

    def backend(self, server: StandIn) -> Any:
        return next(b for b in self.proxy.prefill.backends + self.proxy.decode.backends if b.url == server.url)

    async def wait_health(self, server: StandIn, healthy: bool) -> None:
        backend = self.backend(server)
        await self.proxy.signal.wait_until(lambda: backend.healthy == healthy, timeout_s=5.0)


@contextlib.asynccontextmanager
async def cluster(
    policy: str = "round_robin",
    short_prompt_tokens: int = 0,
    health_interval_s: float = 30.0,
    prefill_kwargs: dict[str, Any] | None = None,
    settings_of: Callable[[list[StandIn], list[StandIn]], dict[str, Any]] | None = None,
    **proxy_settings: Any,
) -> AsyncIterator[Cluster]:
    """Two prefill and two decode stand-ins behind a proxy; ``settings_of(prefills, decodes)``: proxy settings that
    name the started stand-ins (their URLs)."""
    prefills = [StandIn("prefill", engine_id=f"prefill-{i}", **(prefill_kwargs or {})) for i in range(2)]
    decodes = [StandIn("decode", engine_id=f"decode-{i}") for i in range(2)]
    servers = prefills + decodes
    try:
        for server in servers:
            await server.start()
        if settings_of is not None:
            proxy_settings = {**proxy_settings, **settings_of(prefills, decodes)}
        proxy = Proxy(
            ProxyConfig(
                prefill=[s.url for s in prefills],
                decode=[s.url for s in decodes],
                policy=policy,
                short_prompt_tokens=short_prompt_tokens,
                health_interval_s=health_interval_s,
                health_timeout_s=1.0,
                connect_timeout_s=1.0,
                request_timeout_s=10.0,
                **proxy_settings,
            )
        )
        await proxy.start()
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as client:
                yield Cluster(proxy, prefills, decodes, client)
        finally:
            await proxy.close()
    finally:
        for server in servers:
            await server.stop()


def run(scenario: Callable[..., Awaitable[None]], **kwargs: Any) -> None:
    async def main() -> None:
        async with cluster(**kwargs) as c:
            await asyncio.wait_for(scenario(c), timeout=30)

    asyncio.run(main())


def completion(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, **extra}


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4, **extra}


def served(servers: list[StandIn]) -> list[int]:
    return [len(s.records) for s in servers]


def only_record(servers: list[StandIn]) -> Any:
    records = [r for s in servers for r in s.records]
    assert len(records) == 1, records
    return records[0]


async def read_sse(response: Any) -> list[Any]:
    events: list[Any] = []
    buffer = b""
    async for chunk in response.content.iter_any():
        buffer += chunk
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            assert event.startswith(b"data: "), event
            data = event[len(b"data: ") :]
            events.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    assert buffer == b""
    return events


# ---- the flow ----


@pytest.mark.parametrize("endpoint", [flow.COMPLETIONS, flow.CHAT])
def test_non_streaming_flow_through_both_hops(endpoint: str) -> None:
    async def scenario(c: Cluster) -> None:
        body = completion() if endpoint == flow.COMPLETIONS else chat()
        status, answer, headers = await c.call(endpoint, body, headers={"X-Request-Id": "client-rid-1"})
        assert status == 200, answer
        assert headers["X-Request-Id"] == "client-rid-1"
        text = (
            answer["choices"][0]["text"] if endpoint == flow.COMPLETIONS else answer["choices"][0]["message"]["content"]
        )
        assert text == " the quick brown fox"  # the decode stand-in echoes the prompt, max_tokens 4

        pre = only_record(c.prefills)
        assert pre.request_id == "client-rid-1" and pre.endpoint == endpoint
        assert pre.kv_transfer_params == flow.PREFILL_KV_TRANSFER_PARAMS
        assert pre.body["max_tokens"] == 1 and pre.body["stream"] is False
        if endpoint == flow.CHAT:
            assert pre.body["max_completion_tokens"] == 1

        dec = only_record(c.decodes)
        assert dec.request_id == "client-rid-1"
        assert dec.body["max_tokens"] == 4 and "stream" not in dec.body  # the client's request, untouched
        params = dec.kv_transfer_params
        prefill = next(s for s in c.prefills if s.records)
        assert params["do_remote_prefill"] is True and params["remote_engine_id"] == prefill.engine_id
        assert params["remote_request_id"] == "client-rid-1" and params["remote_block_ids"] == [[0, 1, 2]]

    run(scenario)


@pytest.mark.parametrize("endpoint", [flow.COMPLETIONS, flow.CHAT])
def test_streaming_passes_sse_through_with_a_generated_request_id(endpoint: str) -> None:
    async def scenario(c: Cluster) -> None:
        extra = {"stream": True, "stream_options": {"include_usage": True}, "max_tokens": 5, "min_tokens": 3}
        body = completion(**extra) if endpoint == flow.COMPLETIONS else chat(**extra)
        async with c.post(endpoint, body) as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/event-stream")
            rid = r.headers["X-Request-Id"]
            events = await read_sse(r)
        assert events[-1] == "[DONE]" and len(events) == 6
        if endpoint == flow.COMPLETIONS:
            text = "".join(e["choices"][0]["text"] for e in events[:-1])
        else:
            text = "".join(e["choices"][0]["delta"]["content"] for e in events[:-1])
        assert text == " the quick brown fox jumps"
        assert events[-2]["choices"][0]["finish_reason"] == "length"

        pre, dec = only_record(c.prefills), only_record(c.decodes)
        assert len(rid) >= 16 and pre.request_id == rid and dec.request_id == rid
        assert pre.body["stream"] is False and "stream_options" not in pre.body and "min_tokens" not in pre.body
        assert dec.body["stream"] is True and dec.body["stream_options"] == {"include_usage": True}
        assert dec.kv_transfer_params["do_remote_prefill"] is True and dec.finished

    run(scenario)


# ---- routing ----


def test_round_robin_spreads_over_two_prefills_and_two_decodes() -> None:
    async def scenario(c: Cluster) -> None:
        for i in range(8):
            status, _, _ = await c.call(flow.COMPLETIONS if i % 2 else flow.CHAT, completion() if i % 2 else chat())
            assert status == 200
        assert served(c.prefills) == [4, 4] and served(c.decodes) == [4, 4]
        # Concurrent requests spread too.
        results = await asyncio.gather(*(c.call(flow.COMPLETIONS, completion()) for _ in range(8)))
        assert all(status == 200 for status, _, _ in results)
        assert served(c.prefills) == [8, 8] and served(c.decodes) == [8, 8]

    run(scenario, policy="round_robin")


def test_least_outstanding_avoids_the_busy_decode() -> None:
    async def scenario(c: Cluster) -> None:
        # Idle: ties go round robin, so both decodes serve.
        for _ in range(4):
            assert (await c.call(flow.COMPLETIONS, completion()))[0] == 200
        assert served(c.prefills) == [2, 2] and served(c.decodes) == [2, 2]

        # One long stream holds a decode: while it runs, every other request goes to the other decode.
        slow = completion(stream=True, max_tokens=400, standin_token_delay_s=0.02)
        async with c.post(flow.COMPLETIONS, slow, headers={"X-Request-Id": "long"}) as long_stream:
            assert long_stream.status == 200
            await long_stream.content.readuntil(b"\n\n")  # it is streaming now
            busy = next(d for d in c.decodes if any(r.request_id == "long" for r in d.records))
            idle = next(d for d in c.decodes if d is not busy)
            assert c.backend(busy).in_flight == 1
            assert f'pd_proxy_backend_in_flight{{backend="{busy.url}",role="decode"}} 1.0' in await c.metrics()
            before_busy, before_idle = len(busy.records), len(idle.records)
            for _ in range(6):
                assert (await c.call(flow.CHAT, chat()))[0] == 200
            assert len(busy.records) == before_busy and len(idle.records) == before_idle + 6
            long_stream.close()
        await busy.wait_for(lambda s: "long" in s.aborts)
        assert c.backend(busy).in_flight == 0

    run(scenario, policy="least_outstanding")


# ---- health ----


def test_backend_taken_out_by_health_checks_and_back() -> None:
    async def scenario(c: Cluster) -> None:
        down = c.decodes[1]
        async with c.client.post(down.url + "/control/health", json={"healthy": False}) as r:
            assert r.status == 200
        await c.wait_health(down, False)
        status, body = await c.health()
        assert status == 200 and [b["healthy"] for b in body["decode"]] == [True, False]
        assert "503" in body["decode"][1]["reason"]
        assert f'pd_proxy_backend_healthy{{backend="{down.url}",role="decode"}} 0.0' in await c.metrics()
        for _ in range(4):
            assert (await c.call(flow.COMPLETIONS, completion()))[0] == 200
        assert served(c.decodes) == [4, 0]

        async with c.client.post(down.url + "/control/health", json={"healthy": True}) as r:
            assert r.status == 200
        await c.wait_health(down, True)
        for _ in range(4):
            assert (await c.call(flow.COMPLETIONS, completion()))[0] == 200
        assert served(c.decodes) == [6, 2]

        # Both prefills down: the proxy reports itself unavailable and names the states.
        for p in c.prefills:
            await p.stop()
        for p in c.prefills:
            await c.wait_health(p, False)
        status, body = await c.health()
        assert status == 503 and body["status"] == "unavailable"
        assert all(not b["healthy"] and "GET /health failed" in b["reason"] for b in body["prefill"])
        status, answer, _ = await c.call(flow.COMPLETIONS, completion())
        assert status == 503 and answer["error"]["hop"] == "prefill"
        for p in c.prefills:
            await p.start()  # the same port again
        for p in c.prefills:
            await c.wait_health(p, True)
        assert (await c.health())[0] == 200
        assert (await c.call(flow.COMPLETIONS, completion()))[0] == 200

    run(scenario, health_interval_s=0.05)


def test_stopped_decode_is_taken_out_on_connection_error_and_the_request_goes_elsewhere() -> None:
    async def scenario(c: Cluster) -> None:
        gone = c.decodes[0]
        await gone.stop()
        for _ in range(3):  # the health interval is long: only the connection error can take it out
            status, answer, _ = await c.call(flow.COMPLETIONS, completion())
            assert status == 200, answer
        assert not c.backend(gone).healthy and "connection error" in c.backend(gone).reason
        assert served(c.decodes) == [0, 3]
        assert 'pd_proxy_retries_total{hop="decode",reason="connect"} 1.0' in await c.metrics()
        await gone.start()
        await c.proxy.check_health()
        assert c.backend(gone).healthy

    run(scenario, health_interval_s=30.0)


# ---- failures ----


def test_failing_prefill_is_retried_on_the_other_then_502_naming_the_hop() -> None:
    async def scenario(c: Cluster) -> None:
        c.prefills[0].fail_next(500)  # round robin picks it first
        status, answer, _ = await c.call(flow.COMPLETIONS, completion())  # it fails, the retry succeeds
        assert status == 200, answer
        assert served(c.prefills) == [1, 1] and c.prefills[1].records[0].request_id == answer["id"][len("cmpl-") :]
        assert 'pd_proxy_retries_total{hop="prefill",reason="status"} 1.0' in await c.metrics()

        # A 4xx is the request's fault: handed back as it is, not retried.
        c.prefills[0].fail_next(400)
        status, answer, _ = await c.call(flow.COMPLETIONS, completion())
        assert status == 400 and "injected failure" in answer["error"]["message"]
        assert served(c.prefills) == [2, 1]

        for p in c.prefills:
            p.fail_next(503)
        status, answer, headers = await c.call(flow.CHAT, chat(), headers={"X-Request-Id": "doomed"})
        assert status == 502 and headers["X-Request-Id"] == "doomed"
        error = answer["error"]
        assert error["hop"] == "prefill" and error["backend"] in (c.prefills[0].url, c.prefills[1].url)
        assert "answered 503" in error["message"] and "retry" in error["message"] and error["type"] == "bad_gateway"
        assert served(c.decodes) == [1, 0]  # the failed requests never reached a decode

        # Connection errors: both prefills gone (the health interval is long: the request finds out).
        for p in c.prefills:
            await p.stop()
        status, answer, _ = await c.call(flow.COMPLETIONS, completion())
        assert status == 502 and answer["error"]["hop"] == "prefill" and "failed" in answer["error"]["message"]
        assert not any(c.backend(p).healthy for p in c.prefills)
        metrics = await c.metrics()
        assert 'pd_proxy_errors_total{hop="prefill",kind="connect"} 2.0' in metrics
        assert 'pd_proxy_requests_total{endpoint="/v1/chat/completions",status="502"} 1.0' in metrics

    run(scenario)


def test_decode_5xx_is_retried_on_the_other_decode_then_a_502_naming_the_decode() -> None:
    async def scenario(c: Cluster) -> None:
        c.decodes[0].fail_next(500)  # round robin picks it first: its 5xx came before any output
        status, answer, _ = await c.call(flow.COMPLETIONS, completion())
        assert status == 200, answer
        assert served(c.decodes) == [1, 1] and c.decodes[1].records[0].request_id == answer["id"][len("cmpl-") :]
        assert c.backend(c.decodes[0]).healthy  # a 5xx leaves the judging to the health checks
        assert 'pd_proxy_retries_total{hop="decode",reason="status"} 1.0' in await c.metrics()

        for d in c.decodes:
            d.fail_next(500, count=2)  # the request's two decode attempts, then the two after its second prefill
        prefilled = served(c.prefills)
        status, answer, _ = await c.call(flow.COMPLETIONS, completion())
        assert status == 502 and answer["error"]["hop"] == "decode"
        assert answer["error"]["backend"] in (c.decodes[0].url, c.decodes[1].url)
        assert "answered 500" in answer["error"]["message"]
        assert sum(served(c.prefills)) == sum(prefilled) + 2  # run once more from the prefill hop, once only
        metrics = await c.metrics()
        assert 'pd_proxy_retries_total{hop="decode",reason="status"} 3.0' in metrics
        assert 'pd_proxy_retries_total{hop="prefill",reason="decode_failed"} 1.0' in metrics

    run(scenario)


def test_a_request_every_decode_failed_with_500_runs_once_more_from_the_prefill_hop() -> None:
    """Issue 33: both decodes answered 500 before any output (their pulls refused: the prefill's blocks gone) while
    the client waits: the proxy prefills again and decodes with the new params; a 503 (overloaded) does not."""

    async def scenario(c: Cluster) -> None:
        for d in c.decodes:
            d.fail_next(500)
        status, answer, _ = await c.call(flow.COMPLETIONS, completion())
        assert status == 200, answer
        assert served(c.prefills) == [1, 1] and sum(served(c.decodes)) == 3  # two refused, then the answer
        answered = [r for d in c.decodes for r in d.records if r.finished]
        assert len(answered) == 1 and answered[0].kv_transfer_params is not None
        assert answered[0].kv_transfer_params["remote_engine_id"] == c.prefills[1].engine_id  # the second prefill's
        assert 'pd_proxy_retries_total{hop="prefill",reason="decode_failed"} 1.0' in await c.metrics()

        for d in c.decodes:
            d.fail_next(503)
        status, answer, _ = await c.call(flow.COMPLETIONS, completion())
        assert status == 502 and "answered 503" in answer["error"]["message"]
        assert sum(served(c.prefills)) == 3

        # the decodes fail with 500 and no prefill can answer the second hop: the decode's failure is what the
        # client is told (its hop, its backend), with why the rerun did not help
        for d in c.decodes:
            d.fail_next(500)
        before = [len(p.records) for p in c.prefills]
        first_hop = [
            asyncio.create_task(p.wait_for(lambda s, n=n: len(s.records) > n))
            for p, n in zip(c.prefills, before, strict=True)
        ]
        call = asyncio.create_task(c.call(flow.COMPLETIONS, completion()))
        _done, waiting = await asyncio.wait(first_hop, timeout=5, return_when=asyncio.FIRST_COMPLETED)
        for task in waiting:
            task.cancel()
        for p in c.prefills:  # the first hop has its answer: every later prefill hop fails
            p.fail_next(500)
        status, answer, _ = await call
        assert status == 502 and answer["error"]["hop"] == "decode", answer
        assert "answered 500" in answer["error"]["message"]
        assert "running it again from the prefill hop failed" in answer["error"]["message"]

    run(scenario)


def test_prefill_answer_without_kv_transfer_params_is_a_502_naming_them() -> None:
    async def scenario(c: Cluster) -> None:
        status, answer, _ = await c.call(flow.COMPLETIONS, completion())
        assert status == 502 and answer["error"]["hop"] == "prefill"
        assert "without kv_transfer_params" in answer["error"]["message"]
        assert served(c.decodes) == [0, 0]

    run(scenario, prefill_kwargs={"omit_kv_transfer_params": True})


MALFORMED = [
    (flow.COMPLETIONS, b"{not json", "not valid JSON"),
    (flow.COMPLETIONS, b"", "not valid JSON"),
    (flow.COMPLETIONS, b"[1, 2]", "must be a JSON object, got an array"),
    (flow.CHAT, b'"hello"', "must be a JSON object, got a string"),
    (flow.COMPLETIONS, {"prompt": "hi"}, "'model' is required"),
    (flow.CHAT, {"model": "", "messages": [{"role": "user", "content": "x"}]}, "'model' is required"),
    (flow.COMPLETIONS, {"model": MODEL}, "'prompt' is required"),
    (flow.COMPLETIONS, {"model": MODEL, "prompt": 42}, "'prompt' must be"),
    (flow.COMPLETIONS, {"model": MODEL, "prompt": ""}, "'prompt' must be"),
    (flow.CHAT, {"model": MODEL}, "'messages' is required"),
    (flow.CHAT, {"model": MODEL, "messages": []}, "'messages' is required"),
    (flow.CHAT, {"model": MODEL, "messages": ["hi"]}, "'messages[0]'"),
    (flow.COMPLETIONS, completion(stream="yes"), "'stream' must be a boolean"),
    (flow.COMPLETIONS, completion(kv_transfer_params={"do_remote_prefill": True}), "clients must not send it"),
    (flow.CHAT, chat(kv_transfer_params=None), "clients must not send it"),
]


def test_malformed_requests_get_400_and_reach_no_backend() -> None:
    async def scenario(c: Cluster) -> None:
        for endpoint, body, message in MALFORMED:
            status, answer, headers = await c.call(endpoint, body, headers={"X-Request-Id": "bad"})
            assert status == 400, (body, answer)
            assert message in answer["error"]["message"], (body, answer)
            assert answer["error"]["type"] == "invalid_request_error" and headers["X-Request-Id"] == "bad"
        assert served(c.prefills) == [0, 0] and served(c.decodes) == [0, 0]
        assert f'pd_proxy_requests_total{{endpoint="/v1/completions",status="400"}} {9.0}' in await c.metrics()

    run(scenario)


UNUSABLE_BODIES = [
    (b'{"model": "m", "prompt": "\xff\xfe"}', "application/json", 400, "not valid UTF-8"),
    (b"[" * 200_000 + b"]" * 200_000, "application/json", 400, "nested too deeply"),
    (b'{"model": "m", "prompt": ' + b"[" * 200_000 + b"]" * 200_000 + b"}", "application/json", 400, "nested"),
    (json.dumps(completion()).encode(), "text/plain", 415, "must be application/json, not 'text/plain'"),
    (json.dumps(completion()).encode(), "application/x-www-form-urlencoded", 415, "must be application/json"),
]


def test_unusable_bodies_get_a_4xx_with_the_reason_and_reach_no_backend() -> None:
    """Before: invalid UTF-8 and a 200,000-deep array got 500, and JSON sent as text/plain was served."""

    async def scenario(c: Cluster) -> None:
        for raw, content_type, want, reason in UNUSABLE_BODIES:
            status, answer, _ = await c.call(flow.COMPLETIONS, raw, headers={"Content-Type": content_type})
            assert status == want and reason in answer["error"]["message"], (raw[:40], answer)
        assert served(c.prefills) == [0, 0] and served(c.decodes) == [0, 0]
        metrics = await c.metrics()
        assert 'pd_proxy_rejected_total{reason="invalid_json"} 3.0' in metrics
        assert 'pd_proxy_rejected_total{reason="media_type"} 2.0' in metrics
        status, _, _ = await c.call(flow.COMPLETIONS, completion())
        assert status == 200

    run(scenario)


async def until(predicate: Callable[[], bool], timeout_s: float) -> None:
    """Polls ``predicate`` every 10 ms until it holds; TimeoutError after ``timeout_s``."""
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.01)


async def open_raw(c: Cluster) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection(c.proxy.host, c.proxy.port)


def test_a_client_dribbling_headers_is_disconnected_at_the_header_deadline() -> None:
    """Before: 200 connections sending a header byte now and then were held for as long as they kept it up."""

    async def scenario(c: Cluster) -> None:
        connections = [await open_raw(c) for _ in range(20)]
        for _, writer in connections:
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")

        async def dribble_until_closed(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
            for _ in range(100):  # 10 s at most
                writer.write(b"X-Slow: 1\r\n")
                try:
                    return await asyncio.wait_for(reader.read(), timeout=0.1)
                except TimeoutError:
                    continue
            return b"still open"

        outcomes = await asyncio.gather(*(dribble_until_closed(r, w) for r, w in connections))
        assert all(outcome != b"still open" for outcome in outcomes)
        for _, writer in connections:
            writer.close()
        assert (await c.call(flow.COMPLETIONS, completion()))[0] == 200

    run(scenario, header_timeout_s=1.0)


def test_a_withheld_body_gets_408_and_frees_its_reservation() -> None:
    async def scenario(c: Cluster) -> None:
        reader, writer = await open_raw(c)
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n{"
        )
        head = await asyncio.wait_for(reader.readline(), timeout=10.0)
        writer.close()
        assert head.startswith(b"HTTP/1.1 408"), head
        assert "pd_proxy_body_bytes_held 0.0" in await c.metrics()
        assert 'pd_proxy_rejected_total{reason="body_timeout"} 1.0' in await c.metrics()

    run(scenario, body_timeout_s=1.0)


def test_bodies_in_flight_are_bounded_and_the_excess_is_refused_with_503() -> None:
    """Before: eight concurrent 50 MB bodies took the proxy to 1.2 GB (64 MiB allowed per body, no total)."""
    size = 3 * 2**20

    async def scenario(c: Cluster) -> None:
        head = (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % size
        )
        held = [await open_raw(c) for _ in range(2)]
        for _, writer in held:
            writer.write(head)  # bodies promised, not sent: their reservations stay held
        await until(lambda: c.proxy._bodies.held_bytes == 2 * size, timeout_s=5.0)
        big = completion(prompt="word " * (size // 5 - 40))
        status, answer, _ = await c.call(flow.COMPLETIONS, big)
        assert status == 503 and "too many request bodies" in answer["error"]["message"]
        status, _, _ = await c.call(flow.COMPLETIONS, completion())  # a small one still fits
        assert status == 200
        for reader, writer in held:
            assert (await asyncio.wait_for(reader.readline(), timeout=10.0)).startswith(b"HTTP/1.1 408")
            writer.close()
        assert c.proxy._bodies.held_bytes == 0
        async with c.post(flow.COMPLETIONS, big) as answer:  # accepted, then refused by the stand-in (1 MiB limit)
            assert answer.status == 413 and 'reason="busy"} 1.0' in await c.metrics()
        assert 'pd_proxy_rejected_total{reason="too_large"} 0.0' in await c.metrics()

    run(scenario, body_timeout_s=2.0, max_body_bytes=4 * 2**20, max_inflight_body_bytes=7 * 2**20)


def test_client_disconnect_mid_stream_aborts_the_decode_request() -> None:
    async def scenario(c: Cluster) -> None:
        body = chat(stream=True, max_tokens=500, standin_token_delay_s=0.01)
        async with c.post(flow.CHAT, body, headers={"X-Request-Id": "leaver"}) as r:
            assert r.status == 200
            await r.content.readuntil(b"\n\n")
            await r.content.readuntil(b"\n\n")
            r.close()  # the client goes away mid-stream
        decode = next(d for d in c.decodes if d.records)
        await decode.wait_for(lambda s: "leaver" in s.aborts, timeout_s=5.0)
        record = only_record(c.decodes)
        assert record.aborted and not record.finished
        assert c.backend(decode).in_flight == 0
        metrics = await c.metrics()
        assert 'pd_proxy_errors_total{hop="client",kind="disconnect"}' in metrics
        assert 'pd_proxy_time_to_first_token_seconds_count{endpoint="/v1/chat/completions"} 1.0' in metrics
        # The proxy keeps serving.
        assert (await c.call(flow.COMPLETIONS, completion()))[0] == 200

    run(scenario)


def test_decode_dying_mid_stream_ends_the_stream_with_an_error_event() -> None:
    async def scenario(c: Cluster) -> None:
        async with c.post(flow.COMPLETIONS, completion(stream=True, max_tokens=6, standin_drop_after=2)) as r:
            assert r.status == 200
            events = await read_sse(r)
        assert [e["choices"][0]["text"] for e in events[:2]] == [" the", " quick"]
        assert events[-1]["error"]["hop"] == "decode" and "mid-stream" in events[-1]["error"]["message"]
        assert 'pd_proxy_errors_total{hop="decode",kind="stream"} 1.0' in await c.metrics()
        assert (await c.call(flow.COMPLETIONS, completion()))[0] == 200

    run(scenario)


# ---- conditional disaggregation ----


def test_short_prompts_skip_the_prefill_hop() -> None:
    async def scenario(c: Cluster) -> None:
        status, answer, _ = await c.call(flow.COMPLETIONS, completion(prompt="a short prompt"))
        assert status == 200 and answer["choices"][0]["text"] == " a short prompt a"
        assert served(c.prefills) == [0, 0]
        assert only_record(c.decodes).kv_transfer_params is None
        # 40 token ids: counted exactly, at the threshold, disaggregated.
        assert (await c.call(flow.COMPLETIONS, completion(prompt=list(range(40)))))[0] == 200
        assert sum(served(c.prefills)) == 1
        # 39 token ids: skip.
        assert (await c.call(flow.COMPLETIONS, completion(prompt=list(range(39)))))[0] == 200
        assert sum(served(c.prefills)) == 1
        # A long chat: disaggregated.
        assert (await c.call(flow.CHAT, chat()))[0] == 200
        assert sum(served(c.prefills)) == 2
        metrics = await c.metrics()
        assert 'pd_proxy_routes_total{path="direct"} 2.0' in metrics
        assert 'pd_proxy_routes_total{path="disaggregated"} 2.0' in metrics

    run(scenario, short_prompt_tokens=40)


def test_prompt_token_estimates() -> None:
    def tokens(endpoint: str, body: dict[str, Any]) -> int:
        return Prompt.read(endpoint, body).tokens()

    assert tokens(flow.COMPLETIONS, {"prompt": [1, 2, 3]}) == 3
    assert tokens(flow.COMPLETIONS, {"prompt": "one two three four five six seven eight nine ten"}) == 13
    assert tokens(flow.COMPLETIONS, {"prompt": "x" * 400}) == 100  # no spaces: characters / 4
    assert tokens(flow.COMPLETIONS, {"prompt": [[1, 2], [3, 4, 5]]}) == 3  # a batch: its largest prompt
    chat_body = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hello there"}]},
        ]
    }
    assert tokens(flow.CHAT, chat_body) == 2 * CHAT_TOKENS_PER_MESSAGE + 3 + 3
    assert Prompt.read(flow.CHAT, chat_body).text() == "<system>\nbe brief\n<user>\nhello there"
    assert Prompt.read(flow.COMPLETIONS, {"prompt": ["a", "b"]}).batch
    assert not Prompt.read(flow.COMPLETIONS, {"prompt": [1, 2]}).batch
    assert Prompt.read(flow.COMPLETIONS, {"prompt": [[7, 8]]}).sent_ids() == [7, 8]


# ---- metrics and CLI ----


def test_metrics_expose_requests_errors_latencies_ttft_and_in_flight() -> None:
    async def scenario(c: Cluster) -> None:
        assert (await c.call(flow.COMPLETIONS, completion()))[0] == 200
        async with c.post(flow.CHAT, chat(stream=True)) as r:
            assert (await read_sse(r))[-1] == "[DONE]"
        async with c.client.get(c.proxy.url + "/metrics") as r:
            assert r.headers["Content-Type"].startswith("text/plain")
        metrics = await c.metrics()
        for line in (
            'pd_proxy_requests_total{endpoint="/v1/completions",status="200"} 1.0',
            'pd_proxy_requests_total{endpoint="/v1/chat/completions",status="200"} 1.0',
            'pd_proxy_hop_latency_seconds_count{hop="prefill"} 2.0',
            'pd_proxy_hop_latency_seconds_count{hop="decode"} 2.0',
            'pd_proxy_time_to_first_token_seconds_count{endpoint="/v1/chat/completions"} 1.0',
            'pd_proxy_request_latency_seconds_count{endpoint="/v1/completions"} 1.0',
            f'pd_proxy_backend_in_flight{{backend="{c.decodes[0].url}",role="decode"}} 0.0',
            f'pd_proxy_backend_healthy{{backend="{c.prefills[1].url}",role="prefill"}} 1.0',
            "# TYPE pd_proxy_errors_total counter",
            # failure series exist at zero before their first event (Prometheus's increase() needs a sample before)
            'pd_proxy_errors_total{hop="decode",kind="connect"} 0.0',
            'pd_proxy_errors_total{hop="client",kind="disconnect"} 0.0',
            'pd_proxy_retries_total{hop="prefill",reason="status"} 0.0',
            'pd_proxy_rejected_total{reason="invalid_json"} 0.0',
            'pd_proxy_releases_total{outcome="releasing"} 0.0',
            'pd_proxy_drains_total{role="decode"} 0.0',
        ):
            assert line in metrics, line
        async with c.client.get(c.proxy.url + "/v1/models") as r:
            assert r.status == 200 and (await r.json())["data"][0]["id"] == MODEL

    run(scenario)


def test_cli_arguments_make_the_config() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        [
            "--prefill",
            "http://p1:8100",
            "http://p2:8100",
            "--decode",
            "http://d1:8200",
            "--decode",
            "http://d2:8200",
            "--port",
            "9000",
            "--policy",
            "least_outstanding",
            "--short-prompt-tokens",
            "256",
            "--health-interval",
            "2.5",
        ]
    )
    config = config_from_args(args)
    assert config.prefill == ["http://p1:8100", "http://p2:8100"] and config.decode == [
        "http://d1:8200",
        "http://d2:8200",
    ]
    assert (config.policy, config.short_prompt_tokens, config.health_interval_s) == ("least_outstanding", 256, 2.5)
    assert args.port == 9000
    with pytest.raises(SystemExit):
        parser.parse_args(["--prefill", "http://p", "--decode", "http://d", "--policy", "random"])


def test_vllm_routers_name_of_the_shared_tier_credit_is_taken_too() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    base = ["--prefill", "http://p", "--decode", "http://d"]
    assert config_from_args(parser.parse_args([*base, "--kv-penalty-external", "0.5"]), {}).kv_penalty_shared == 0.5
    assert config_from_args(parser.parse_args([*base, "--kv-penalty-shared", "0.4"]), {}).kv_penalty_shared == 0.4
    busy = config_from_args(parser.parse_args([*base, "--local-prefill-max-busy", "3"]), {})
    assert busy.local_prefill_max_busy == 3


def test_the_proxy_takes_the_secret_from_the_environment_variable_it_is_named_by() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        ["--prefill", "http://p", "--decode", "http://d", "--handshake-secret-env", "PD_TEST_RELEASE_SECRET"]
    )
    assert config_from_args(args, {"PD_TEST_RELEASE_SECRET": "s3"}).handshake_secret == "s3"
    with pytest.raises(SystemExit, match="PD_TEST_RELEASE_SECRET"):
        config_from_args(args, {})
    plain = parser.parse_args(["--prefill", "http://p", "--decode", "http://d"])
    assert config_from_args(plain, {"PD_TEST_RELEASE_SECRET": "s3"}).handshake_secret is None
