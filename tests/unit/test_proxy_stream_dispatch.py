"""The proxy's streamed dispatch (``--stream-kv``, issue 41) against real HTTP servers on 127.0.0.1: the proxy and
stand-in prefill and decode servers, all in the test's event loop, that answer as vLLM with a KV connector does and
record every body they get.

A prefill's first request goes the sequential way and its answer teaches the proxy the prefill's engine; the next
request to it sends both legs at once, tied by one stream id: the prefill's with ``{"do_remote_decode": true,
"stream_id": ID}``, the decode's naming the engine and ``stream_id`` without block ids. The stand-ins check that both
legs are in flight together: by default each leg of a streamed request holds its answer until the other leg has
reached its server (a sequential dispatch would never get there: the waits are bounded and then answer 504). A decode
leg that fails, or a client that leaves, cancels the prefill leg (its server sees its connection close); a prefill
leg that fails leaves the decode's answer to the client. Every wait is bounded and waits on an event (no sleeps as
synchronisation).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

pytest.importorskip("aiohttp", reason="the proxy needs the 'proxy' extra (aiohttp)")
from aiohttp import ClientSession, ClientTimeout, web
from prometheus_client.parser import text_string_to_metric_families

from pd_transfer.proxy import flow, server
from pd_transfer.proxy.responses import bind_socket
from pd_transfer.proxy.server import Proxy, ProxyConfig

pytestmark = pytest.mark.timeout(60)

MODEL = "standin-model"
PROMPT = "the quick brown fox jumps over the lazy dog " * 4
#: How long a stand-in's leg waits for the other leg of its streamed request, or for a test's event.
WAIT_S = 5.0
#: Where the stand-in prefills say their side channel is: nothing listens there (a release the proxy sends on a
#: failed decode leg times out after ``release_timeout_s``).
SIDE_CHANNEL_PORT = 9
BLOCK_SIZE = 16

#: What a stand-in does with a request before it answers (its body as decoded): the status it then answers.
Gate = Callable[[dict[str, Any]], Awaitable[int]]


def stream_id_of(body: dict[str, Any]) -> str | None:
    params = body.get("kv_transfer_params")
    return params.get("stream_id") if isinstance(params, dict) else None


async def within(event: asyncio.Event, timeout_s: float = WAIT_S) -> bool:
    """Whether ``event`` is set within ``timeout_s``."""
    try:
        await asyncio.wait_for(event.wait(), timeout_s)
    except TimeoutError:
        return False
    return True


@dataclass
class Engine:
    """A stand-in vLLM server of ``role`` with a KV connector: a prefill answers one token and ``kv_transfer_params``
    naming its engine and the request's blocks; a decode answers a completion (an SSE stream when asked ``stream:
    true``) whose text names its engine. ``bodies``: what it was posted, in order; ``closed``: set when a request's
    connection closed before its answer (aiohttp cancels the handler); ``gate``: awaited before answering."""

    role: str
    engine_id: str
    gate: Gate | None = None
    bodies: list[dict[str, Any]] = field(default_factory=list)
    answered: list[int] = field(default_factory=list)
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    host: str = "127.0.0.1"
    port: int = 0

    def __post_init__(self) -> None:
        self._streams: dict[str, asyncio.Event] = {}
        self._runner: web.AppRunner | None = None
        self.app = web.Application()
        self.app.router.add_get("/health", self._health)
        self.app.router.add_post(flow.COMPLETIONS, self._serve)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        self._runner = web.AppRunner(self.app, access_log=None, handler_cancellation=True, shutdown_timeout=1.0)
        await self._runner.setup()
        sock = bind_socket(self.host, 0)
        await web.SockSite(self._runner, sock).start()
        self.port = sock.getsockname()[1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def stream(self, stream_id: str) -> asyncio.Event:
        """Set once a request with ``stream_id`` in its ``kv_transfer_params`` reached this server."""
        return self._streams.setdefault(stream_id, asyncio.Event())

    def stream_ids(self) -> list[str | None]:
        return [stream_id_of(b) for b in self.bodies]

    async def _health(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _serve(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        stream_id = stream_id_of(body)
        if stream_id is not None:
            self.stream(stream_id).set()
        try:
            status = 200 if self.gate is None else await self.gate(body)
            self.answered.append(status)
            if status != 200:
                error = {"message": f"{self.role} stand-in answers {status}", "type": "standin", "code": status}
                return web.json_response({"error": error}, status=status)
            if self.role == "prefill":
                return web.json_response(self._prefill_answer(request, body))
            if body.get("stream"):
                return await self._sse(request)
            choice = {"index": 0, "text": f" from {self.engine_id}", "logprobs": None, "finish_reason": "length"}
            return web.json_response({"id": "cmpl-x", "object": "text_completion", "model": MODEL, "choices": [choice]})
        except asyncio.CancelledError:
            self.closed.set()
            raise

    def _prefill_answer(self, request: web.Request, body: dict[str, Any]) -> dict[str, Any]:
        """vLLM's answer to a prefill hop (NixlConnector's keys, and ours: ``tp_size``, ``remote_block_size``)."""
        first = 3 * (len(self.bodies) - 1)
        params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [[first, first + 1, first + 2]],
            "remote_engine_id": self.engine_id,
            "remote_request_id": request.headers.get("X-Request-Id", "cmpl-x"),
            "remote_host": self.host,
            "remote_port": SIDE_CHANNEL_PORT,
            "tp_size": 1,
            "remote_block_size": BLOCK_SIZE,
            "remote_num_tokens": len(PROMPT.split()),
        }
        choice = {"index": 0, "text": " the", "logprobs": None, "finish_reason": "length"}
        return {"id": "cmpl-x", "object": "text_completion", "choices": [choice], "kv_transfer_params": params}

    async def _sse(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i, word in enumerate(("from", self.engine_id)):
            choice = {"index": 0, "text": " " + word, "logprobs": None, "finish_reason": "length" if i else None}
            event = {"id": "cmpl-x", "object": "text_completion", "model": MODEL, "choices": [choice]}
            await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


@dataclass
class Cluster:
    proxy: Proxy
    prefills: list[Engine]
    decode: Engine
    client: ClientSession

    def prefill_of(self, engine_id: str) -> Engine:
        return next(p for p in self.prefills if p.engine_id == engine_id)

    async def complete(self, rid: str, **extra: Any) -> tuple[int, Any]:
        """A completion through the proxy: its status and its answer (a JSON object, or an SSE stream's events)."""
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, **extra}
        async with self.client.post(self.proxy.url + flow.COMPLETIONS, json=body, headers={"X-Request-Id": rid}) as r:
            if r.headers.get("Content-Type", "").startswith("text/event-stream"):
                return r.status, await read_sse(r)
            return r.status, await r.json(content_type=None)

    async def metric(self, name: str, **labels: str) -> float:
        """A sample's value on the proxy's ``/metrics`` (0 when it has none)."""
        async with self.client.get(self.proxy.url + "/metrics") as r:
            assert r.status == 200
            text = await r.text()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    return float(sample.value)
        return 0.0


async def read_sse(response: Any) -> list[Any]:
    raw = (await response.read()).decode()
    events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


def answer_text(answer: Any) -> str:
    if isinstance(answer, list):
        return "".join(e["choices"][0]["text"] for e in answer if e != "[DONE]")
    return str(answer["choices"][0]["text"])


def legs_meet(prefills: list[Engine], decode: Engine) -> tuple[Gate, Gate]:
    """The default gates: a streamed prefill leg answers once the decode got the same stream id, a streamed decode leg
    once the prefill it names got it (504 when the other leg has not come within :data:`WAIT_S`: the legs were not
    in flight together). A sequential request is answered at once."""

    async def prefill_gate(body: dict[str, Any]) -> int:
        stream_id = stream_id_of(body)
        return 200 if stream_id is None or await within(decode.stream(stream_id)) else 504

    async def decode_gate(body: dict[str, Any]) -> int:
        stream_id = stream_id_of(body)
        if stream_id is None:
            return 200
        prefill = next(p for p in prefills if p.engine_id == body["kv_transfer_params"]["remote_engine_id"])
        return 200 if await within(prefill.stream(stream_id)) else 504

    return prefill_gate, decode_gate


@contextlib.asynccontextmanager
async def cluster(prefills: int = 1, stream_kv: bool = True) -> AsyncIterator[Cluster]:
    """``prefills`` stand-in prefills and one decode behind a proxy (round robin), gated by :func:`legs_meet`."""
    pre = [Engine("prefill", f"prefill-{i}") for i in range(prefills)]
    dec = Engine("decode", "decode-0")
    prefill_gate, decode_gate = legs_meet(pre, dec)
    for p in pre:
        p.gate = prefill_gate
    dec.gate = decode_gate
    engines = [*pre, dec]
    try:
        for engine in engines:
            await engine.start()
        config = ProxyConfig(
            prefill=[p.url for p in pre],
            decode=[dec.url],
            policy="round_robin",
            stream_kv=stream_kv,
            health_interval_s=30.0,
            health_timeout_s=1.0,
            connect_timeout_s=1.0,
            request_timeout_s=20.0,
            release_timeout_s=0.2,
        )
        async with Proxy(config) as proxy:
            await proxy.start()
            async with ClientSession(timeout=ClientTimeout(total=20)) as client:
                yield Cluster(proxy, pre, dec, client)
    finally:
        for engine in engines:
            await engine.stop()


def run(scenario: Callable[[Cluster], Awaitable[None]], **kwargs: Any) -> None:
    async def main() -> None:
        async with cluster(**kwargs) as c:
            await asyncio.wait_for(scenario(c), timeout=30)

    asyncio.run(main())


async def learn(c: Cluster, prefill: Engine, rid: str = "first") -> dict[str, Any]:
    """One sequential request to ``prefill`` (its engine not known yet); the params it answered."""
    status, answer = await c.complete(rid)
    assert status == 200, answer
    assert prefill.stream_ids() == [None], prefill.bodies
    assert c.decode.bodies[-1]["kv_transfer_params"]["remote_engine_id"] == prefill.engine_id
    params: dict[str, Any] = c.decode.bodies[-1]["kv_transfer_params"]
    return params


# ---- the way of a request ----


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_prefills_first_request_goes_sequentially_and_the_next_streams_with_both_legs_at_once(stream: bool) -> None:
    async def scenario(c: Cluster) -> None:
        (prefill,) = c.prefills
        status, answer = await c.complete("first")
        assert status == 200 and answer_text(answer) == " from decode-0", answer
        assert prefill.bodies[0]["kv_transfer_params"] == flow.PREFILL_KV_TRANSFER_PARAMS  # no stream_id
        assert prefill.bodies[0]["max_tokens"] == 1 and prefill.bodies[0]["stream"] is False
        learnt = c.decode.bodies[0]["kv_transfer_params"]
        assert learnt["remote_block_ids"] == [[0, 1, 2]] and learnt["remote_request_id"] == "first"
        assert learnt["remote_engine_id"] == "prefill-0" and "stream_id" not in learnt
        assert await c.metric("pd_proxy_routes_total", path="streamed") == 0

        status, answer = await c.complete("second", stream=stream)
        assert status == 200, answer
        assert answer_text(answer) == " from decode-0"
        if stream:
            assert answer[-1] == "[DONE]"
        leg = c.decode.bodies[1]["kv_transfer_params"]
        stream_id = leg["stream_id"]
        assert isinstance(stream_id, str) and stream_id
        assert leg == {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": "prefill-0",
            "remote_host": prefill.host,
            "remote_port": SIDE_CHANNEL_PORT,
            "tp_size": 1,
            "remote_block_size": BLOCK_SIZE,
            "remote_request_id": stream_id,
            "stream_id": stream_id,
        }
        assert c.decode.bodies[1].get("stream", False) is stream and c.decode.bodies[1]["max_tokens"] == 4
        assert prefill.bodies[1]["kv_transfer_params"] == {**flow.PREFILL_KV_TRANSFER_PARAMS, "stream_id": stream_id}
        assert prefill.bodies[1]["max_tokens"] == 1 and prefill.bodies[1]["stream"] is False
        assert prefill.answered == [200, 200] and c.decode.answered == [200, 200]  # the legs met: none waited out
        assert await c.metric("pd_proxy_routes_total", path="streamed") == 1
        assert await c.metric("pd_proxy_errors_total", hop="prefill") == 0

    run(scenario)


def test_with_stream_kv_off_no_leg_carries_a_stream_id() -> None:
    async def scenario(c: Cluster) -> None:
        for i, stream in enumerate((False, True, False, True)):
            status, answer = await c.complete(f"r{i}", stream=stream)
            assert status == 200 and answer_text(answer) == " from decode-0", answer
        bodies = [b for p in c.prefills for b in p.bodies]
        assert len(bodies) == 4 and all(b["kv_transfer_params"] == flow.PREFILL_KV_TRANSFER_PARAMS for b in bodies)
        assert len(c.decode.bodies) == 4
        for body in c.decode.bodies:
            assert "stream_id" not in body["kv_transfer_params"] and body["kv_transfer_params"]["remote_block_ids"]
        assert await c.metric("pd_proxy_routes_total", path="streamed") == 0
        assert await c.metric("pd_proxy_routes_total", path="disaggregated") == 4

    run(scenario, prefills=2, stream_kv=False)


def test_a_request_to_a_prefill_not_known_yet_goes_sequentially_to_that_prefill() -> None:
    """Round robin picks the prefills in turn: the second request's pick (not known yet) gets its sequential body
    itself; the prefill learnt first would be the next try of a second pick."""

    async def scenario(c: Cluster) -> None:
        status, answer = await c.complete("r0")
        assert status == 200, answer
        (first,) = [p for p in c.prefills if p.bodies]
        (other,) = [p for p in c.prefills if p is not first]
        status, answer = await c.complete("r1")
        assert status == 200, answer
        assert first.stream_ids() == [None] and other.stream_ids() == [None]
        assert c.decode.bodies[1]["kv_transfer_params"]["remote_engine_id"] == other.engine_id
        assert await c.metric("pd_proxy_routes_total", path="streamed") == 0

        for rid, prefill in (("r2", first), ("r3", other)):  # both known now: each streams in its turn
            status, answer = await c.complete(rid)
            assert status == 200 and answer_text(answer) == " from decode-0", answer
            leg = c.decode.bodies[-1]["kv_transfer_params"]
            assert leg["remote_engine_id"] == prefill.engine_id and "remote_block_ids" not in leg
            assert prefill.stream_ids() == [None, leg["stream_id"]]
        assert first.answered == [200, 200] and other.answered == [200, 200]
        assert await c.metric("pd_proxy_routes_total", path="streamed") == 2

    run(scenario, prefills=2)


# ---- faults ----


def test_a_decode_leg_that_fails_cancels_the_prefill_leg() -> None:
    async def scenario(c: Cluster) -> None:
        (prefill,) = c.prefills
        await learn(c, prefill)
        never = asyncio.Event()

        async def prefill_gate(body: dict[str, Any]) -> int:
            await within(never, timeout_s=25.0)  # computing, until its connection closes
            return 200

        async def decode_gate(body: dict[str, Any]) -> int:
            return 500 if await within(prefill.stream(body["kv_transfer_params"]["stream_id"])) else 504

        prefill.gate, c.decode.gate = prefill_gate, decode_gate
        status, answer = await c.complete("second")
        assert status == 502 and answer["error"]["hop"] == "decode", answer
        assert c.decode.answered[-1] == 500
        assert await within(prefill.closed), "the prefill leg was not cancelled"
        assert prefill.stream_ids() == [None, c.decode.bodies[-1]["kv_transfer_params"]["stream_id"]]
        assert await c.metric("pd_proxy_routes_total", path="streamed") == 1

    run(scenario)


def test_a_decode_leg_that_answers_a_client_error_cancels_the_prefill_leg_and_the_client_gets_it_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A decode that refuses the request (400: vLLM's validation of the client's request, which the prefill's one
    token passed) ends the decode leg: the prefill computes for nobody. The prefill leg's grace after a decode leg that
    answered is made longer than the test's wait, so a proxy that waited it out before answering fails here."""
    monkeypatch.setattr(server, "PREFILL_LEG_AFTER_DECODE_S", 60.0)

    async def scenario(c: Cluster) -> None:
        (prefill,) = c.prefills
        await learn(c, prefill)
        never = asyncio.Event()

        async def prefill_gate(body: dict[str, Any]) -> int:
            await within(never, timeout_s=25.0)
            return 200

        async def decode_gate(body: dict[str, Any]) -> int:
            return 400 if await within(prefill.stream(body["kv_transfer_params"]["stream_id"])) else 504

        prefill.gate, c.decode.gate = prefill_gate, decode_gate
        status, answer = await asyncio.wait_for(c.complete("second"), WAIT_S)
        assert status == 400 and answer["error"]["code"] == 400, answer
        assert await within(prefill.closed), "the prefill leg was not cancelled"

    run(scenario)


def test_a_client_that_leaves_cancels_both_legs() -> None:
    async def scenario(c: Cluster) -> None:
        (prefill,) = c.prefills
        await learn(c, prefill)
        never = asyncio.Event()
        legs = asyncio.Event()

        async def hold(body: dict[str, Any]) -> int:
            if prefill.stream_ids()[-1] is not None and c.decode.stream_ids()[-1] is not None:
                legs.set()
            await within(never, timeout_s=25.0)
            return 200

        prefill.gate = c.decode.gate = hold
        request = asyncio.create_task(c.complete("leaving", stream=True))
        assert await within(legs), "both legs were not in flight together"
        request.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await request
        assert await within(prefill.closed), "the prefill leg was not cancelled"
        assert await within(c.decode.closed), "the decode leg was not cancelled"
        assert prefill.stream_ids()[-1] == c.decode.stream_ids()[-1] is not None

    run(scenario)


def test_a_prefill_leg_that_fails_leaves_the_decodes_answer_to_the_client() -> None:
    """The prefill answers 503 to the streamed leg while the decode leg is in flight; the decode (which in reality
    computes the prompt itself once its wait for the stream ends) answers, and the client gets that answer."""

    async def scenario(c: Cluster) -> None:
        (prefill,) = c.prefills
        await learn(c, prefill)
        failed = asyncio.Event()

        async def prefill_gate(body: dict[str, Any]) -> int:
            if not await within(c.decode.stream(body["kv_transfer_params"]["stream_id"])):
                return 504
            failed.set()
            return 503

        async def decode_gate(body: dict[str, Any]) -> int:
            return 200 if await within(failed) else 504

        prefill.gate, c.decode.gate = prefill_gate, decode_gate
        for stream in (False, True):
            status, answer = await c.complete(f"second-{stream}", stream=stream)
            assert status == 200 and answer_text(answer) == " from decode-0", answer
            failed.clear()
        assert prefill.answered == [200, 503, 503] and c.decode.answered == [200, 200, 200]
        assert prefill.stream_ids()[1:] == c.decode.stream_ids()[1:] and None not in prefill.stream_ids()[1:]
        assert await c.metric("pd_proxy_errors_total", hop="prefill", kind="status") == 2
        assert await c.metric("pd_proxy_routes_total", path="streamed") == 2
        assert await c.metric("pd_proxy_requests_total", endpoint=flow.COMPLETIONS, status="200") == 3

    run(scenario)
