"""The hops' HTTP/1.1 client (pd_transfer.proxy.upstream) against scripted servers in the test's event loop: what it
sends, each body framing it reads, keep-alive reuse, and every way an answer can break (closed, malformed, slow,
abandoned). Waits are bounded; none sleeps for synchronisation."""

from __future__ import annotations

import asyncio
import gc
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest

pytest.importorskip("httptools", reason="the proxy needs the 'proxy' extra (aiohttp, multidict, yarl, httptools)")

from pd_transfer.proxy.upstream import (
    HIGH_WATER,
    Answer,
    ConnectFailed,
    Endpoint,
    Leftover,
    Upstream,
    UpstreamError,
)

pytestmark = pytest.mark.timeout(30)

OK = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{"ok":true}'
CLOSE = b""  # a script step: close the connection without answering
HOLD = None  # a script step: answer nothing and keep the connection open


class ThenClose(bytes):
    """A script step: write these bytes, then close the connection."""


@dataclass(frozen=True)
class Parts:
    """A script step: write ``parts`` one send each, the loop turning between them (so that the client may read each
    apart: not relied on), then close the connection when ``close``."""

    parts: list[bytes]
    close: bool = False


@dataclass(frozen=True)
class Later:
    """A script step: write ``first`` now and ``then`` once the script's ``answer_now`` is set."""

    then: bytes
    first: bytes = b""


@dataclass
class Script:
    """A server answering each request (on any connection) with its next step: bytes to write, CLOSE or HOLD."""

    steps: list[bytes | Later | Parts | None]
    requests: list[bytes] = field(default_factory=list)  # head and body of each request, as received
    connections: int = 0
    arrived: asyncio.Event = field(default_factory=asyncio.Event)  # a request was received
    answer_now: asyncio.Event = field(default_factory=asyncio.Event)  # a Later step may go on
    eof: asyncio.Event = field(default_factory=asyncio.Event)  # a connection's client closed it
    port: int = 0
    after_later: Callable[[], None] | None = None  # called right after a Later step wrote its ``then`` bytes

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                request = await read_request(reader)
                if request is None:
                    self.eof.set()
                    return
                self.requests.append(request)
                self.arrived.set()
                step = self.steps.pop(0)
                if isinstance(step, Parts):
                    for part in step.parts:
                        writer.write(part)
                        await writer.drain()
                        await asyncio.sleep(0)  # a turn of the loop (not relied on: any cut gives the same outcome)
                    if step.close:
                        return
                    continue
                if isinstance(step, Later):
                    writer.write(step.first)
                    await writer.drain()
                    await self.answer_now.wait()
                    step = step.then
                    writer.write(step)
                    if self.after_later is not None:
                        self.after_later()
                    await writer.drain()
                    continue
                if step is HOLD:
                    if await reader.read(1) == b"":
                        self.eof.set()
                    return
                if step == CLOSE:
                    return
                writer.write(step)
                await writer.drain()
                if isinstance(step, ThenClose):
                    return
        except ConnectionError:  # the client closed the connection while the server wrote
            self.eof.set()
        finally:
            writer.close()


async def read_request(reader: asyncio.StreamReader) -> bytes | None:
    """One request as the client sent it (its head and body), None once the client closed the connection."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.startswith(b"Content-Length:"))
    return head + await reader.readexactly(length)


@asynccontextmanager
async def scripted(*steps: bytes | Later | Parts | None) -> AsyncIterator[Script]:
    script = Script(list(steps))
    server = await asyncio.start_server(script.handle, "127.0.0.1", 0)
    script.port = server.sockets[0].getsockname()[1]
    async with server:
        yield script


@asynccontextmanager
async def talking_to(*steps: bytes | Later | Parts | None, **settings: float) -> AsyncIterator[tuple[Script, Upstream]]:
    """A scripted server and a client of it (``settings``: :class:`Upstream`'s, besides a 5 s connect timeout),
    the client closed on the way out."""
    async with scripted(*steps) as script:
        upstream = Upstream(**{"connect_timeout_s": 5.0, **settings})
        try:
            yield script, upstream
        finally:
            upstream.close()


def endpoint(script: Script, path: str = "/v1/completions") -> Endpoint:
    return Endpoint.of(f"http://127.0.0.1:{script.port}{path}")


def run(test: Callable[[], Awaitable[None]]) -> None:
    async def bounded() -> None:
        await asyncio.wait_for(test(), timeout=20)

    asyncio.run(bounded())


async def post(upstream: Upstream, script: Script, body: bytes = b'{"a":1}') -> Answer:
    return await upstream.post(endpoint(script), {"X-Request-Id": "r1"}, body)


def test_sends_one_request_with_its_headers_and_reads_a_content_length_answer_on_a_kept_connection() -> None:
    async def scenario() -> None:
        async with talking_to(OK, OK) as (script, upstream):
            for _ in range(2):
                async with await post(upstream, script) as answer:
                    assert answer.status == 200
                    assert answer.headers["content-type"] == "application/json"
                    assert await answer.read() == b'{"ok":true}'
        assert script.connections == 1  # the second request went on the first's connection
        assert script.requests[0] == (
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: application/json\r\n"
            b"X-Request-Id: r1\r\nContent-Length: 7\r\n\r\n" % script.port + b'{"a":1}'
        )

    run(scenario)


def test_chunked_answer_yields_its_data_without_the_framing_and_keeps_the_connection() -> None:
    chunked = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"6\r\ndata: \r\n"
        b'a;ext=1\r\n{"x": 1}\n\n\r\n'
        b"0\r\nX-Trailer: yes\r\n\r\n"
    )

    async def scenario() -> None:
        async with talking_to(chunked, OK) as (script, upstream):
            answer = await post(upstream, script)
            assert b"".join([chunk async for chunk in answer.chunks()]) == b'data: {"x": 1}\n\n'
            assert await (await post(upstream, script)).read() == b'{"ok":true}'
        assert script.connections == 1

    run(scenario)


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nuntil the close",  # no length: the close ends it
        b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 15\r\n\r\nuntil the close",
        b"HTTP/1.0 200 OK\r\nContent-Length: 15\r\n\r\nuntil the close",
    ],
    ids=["no-length", "connection-close", "http-1.0"],
)
def test_an_answer_the_server_will_not_keep_is_read_whole_and_its_connection_not_reused(answer: bytes) -> None:
    async def scenario() -> None:
        async with talking_to(ThenClose(answer), OK) as (script, upstream):
            assert await (await post(upstream, script)).read() == b"until the close"
            assert await (await post(upstream, script)).read() == b'{"ok":true}'
        assert script.connections == 2

    run(scenario)


def test_interim_and_bodiless_answers() -> None:
    early_hints = b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n" + OK
    no_content = b"HTTP/1.1 204 No Content\r\n\r\n"

    async def scenario() -> None:
        async with talking_to(early_hints, no_content, OK) as (script, upstream):
            assert await (await post(upstream, script)).read() == b'{"ok":true}'
            answer = await post(upstream, script)
            assert (answer.status, await answer.read()) == (204, b"")
            assert await (await post(upstream, script)).read() == b'{"ok":true}'
        assert script.connections == 1

    run(scenario)


def test_a_connection_idle_past_keepalive_is_not_reused() -> None:
    async def scenario() -> None:
        async with talking_to(OK, OK, keepalive_s=0.0) as (script, upstream):
            for _ in range(2):
                assert await (await post(upstream, script)).read() == b'{"ok":true}'
        assert script.connections == 2

    run(scenario)


@pytest.mark.parametrize(
    "answer",
    [
        b"",  # closed before answering
        b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly part",  # closed mid-body
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n",  # closed between chunks
        b"SSH-2.0-OpenSSH\r\n\r\n",  # not HTTP
        b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: ten\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhelloXX0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * 70_000,  # a head past MAX_HEAD_BYTES, never ending
    ],
    ids=["closed", "mid-body", "mid-chunks", "not-http", "bad-header", "bad-length", "bad-chunk-size", "no-crlf",
         "huge-head"],
)  # fmt: skip
def test_a_broken_or_malformed_answer_is_an_upstream_error(answer: bytes) -> None:
    async def scenario() -> None:
        async with talking_to(ThenClose(answer)) as (script, upstream):
            with pytest.raises(UpstreamError) as raised:
                await (await post(upstream, script)).read()
            assert not isinstance(raised.value, ConnectFailed)

    run(scenario)


def test_nothing_listening_is_connect_failed() -> None:
    async def scenario() -> None:
        with socket.socket() as sock:  # a port that was free a moment ago, nobody listening on it
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        upstream = Upstream(connect_timeout_s=5)
        with pytest.raises(ConnectFailed, match=f"127.0.0.1:{port}"):
            await upstream.post(Endpoint.of(f"http://127.0.0.1:{port}/v1/completions"), {}, b"{}")

    run(scenario)


def test_a_silent_backend_times_out_and_sees_its_connection_closed() -> None:
    async def scenario() -> None:
        async with talking_to(HOLD, request_timeout_s=0.2) as (script, upstream):
            with pytest.raises(TimeoutError):
                await post(upstream, script)
            await asyncio.wait_for(script.eof.wait(), 5)

    run(scenario)


def test_an_answer_closed_before_its_end_closes_its_connection() -> None:
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n"

    async def scenario() -> None:
        async with talking_to(head, OK) as (script, upstream):
            answer = await post(upstream, script)
            assert await anext(answer.chunks()) == b"hello"
            answer.close()
            await asyncio.wait_for(script.eof.wait(), 5)  # the backend sees its client leave
            assert await (await post(upstream, script)).read() == b'{"ok":true}'
        assert script.connections == 2

    run(scenario)


def test_a_reader_that_falls_behind_pauses_the_socket_and_reads_everything_after() -> None:
    size = 16 * HIGH_WATER
    big = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size + bytes(range(256)) * (size // 256)

    async def scenario() -> None:
        async with talking_to(big) as (script, upstream):
            answer = await post(upstream, script)
            for _ in range(500):  # bounded poll of the observable state: the answer stops taking bytes
                if answer.buffered > HIGH_WATER:
                    break
                await asyncio.sleep(0.01)
            held = answer.buffered
            assert HIGH_WATER < held < size
            assert await answer.read() == bytes(range(256)) * (size // 256)

    run(scenario)


def test_a_header_value_with_a_line_break_is_refused_before_anything_is_sent() -> None:
    async def scenario() -> None:
        async with talking_to(OK) as (script, upstream):
            with pytest.raises(ValueError, match="line break"):
                await upstream.post(endpoint(script), {"X-Request-Id": "a\r\nX-Evil: 1"}, b"{}")
        assert script.requests == []

    run(scenario)


@pytest.mark.parametrize(
    ("url", "host", "port", "head"),
    [
        ("http://10.0.0.5:8100/v1/completions", "10.0.0.5", 8100,
         b"POST /v1/completions HTTP/1.1\r\nHost: 10.0.0.5:8100"),
        ("http://[::1]:8100/api/v1/chat/completions", "::1", 8100,
         b"POST /api/v1/chat/completions HTTP/1.1\r\nHost: [::1]:8100"),
        ("https://prefill.example/v1/completions", "prefill.example", 443,
         b"POST /v1/completions HTTP/1.1\r\nHost: prefill.example"),
    ],
)  # fmt: skip
def test_endpoint_of_a_url(url: str, host: str, port: int, head: bytes) -> None:
    target = Endpoint.of(url)
    assert (target.host, target.port) == (host, port)
    assert target.head == head + b"\r\nContent-Type: application/json\r\n"
    with pytest.raises(ValueError, match="http"):
        Endpoint.of("ftp://10.0.0.5/v1/completions")


async def cancelled_once_sent(upstream: Upstream, script: Script, leftover: Leftover | None) -> None:
    """A post (with ``leftover``) whose caller is cancelled once the server has the request, before any answer."""
    waiting = asyncio.create_task(upstream.post(endpoint(script), {}, b"{}", leftover))
    await asyncio.wait_for(script.arrived.wait(), 5)
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)


class Handed:
    """A Leftover's ``done``: what it was handed, and an event set when it was."""

    def __init__(self) -> None:
        self.calls: list[tuple[int | None, bytes | None]] = []
        self.event = asyncio.Event()

    def __call__(self, status: int | None, body: bytes | None) -> None:
        self.calls.append((status, body))
        self.event.set()


def test_a_caller_cancelled_before_the_answer_hands_it_to_its_leftover_and_the_connection_serves_on() -> None:
    async def scenario() -> None:
        async with talking_to(Later(then=OK), OK) as (script, upstream):
            handed = Handed()
            await cancelled_once_sent(upstream, script, Leftover(within_s=10.0, done=handed))
            script.answer_now.set()  # the answer comes after its caller left
            await asyncio.wait_for(handed.event.wait(), 5)
            assert handed.calls == [(200, b'{"ok":true}')]
            assert await (await post(upstream, script)).read() == b'{"ok":true}'
        assert script.connections == 1

    run(scenario)


def test_a_caller_cancelled_mid_body_hands_the_whole_body_to_its_leftover() -> None:
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n"
    rest = b"6\r\n world\r\n0\r\n\r\n"

    async def scenario() -> None:
        async with talking_to(Later(then=rest, first=head)) as (script, upstream):
            handed = Handed()
            answer = await upstream.post(endpoint(script), {}, b"{}", Leftover(within_s=10.0, done=handed))
            reading = asyncio.create_task(answer.read())
            for _ in range(1000):  # bounded poll of the observable state: the reader waits for the rest
                if answer.reader_waiting:
                    break
                await asyncio.sleep(0.001)
            assert answer.reader_waiting
            reading.cancel()
            await asyncio.gather(reading, return_exceptions=True)
            answer.close()  # as an `async with` would on the way out: the leftover keeps the connection
            script.answer_now.set()
            await asyncio.wait_for(handed.event.wait(), 5)
            assert handed.calls == [(200, b"hello world")]

    run(scenario)


def test_a_caller_cancelled_as_its_answer_arrives_never_hands_the_next_request_to_its_leftover() -> None:
    """Issue 33's race, its order forced: request A's caller is cancelled while it waits for the head, A's whole
    answer is read before A's task runs again, and request B takes the connection, now idle, in between. A's
    leftover must get A's answer, and B's answer must go to B alone (before the fix A's cancellation handed B's
    answer to B's leftover: the proxy released B's blocks while B went on to its decode)."""
    answer_b = b'HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n{"b":true}'

    async def scenario() -> None:
        async with talking_to(Later(then=OK), answer_b) as (script, upstream):
            handed_a, handed_b = Handed(), Handed()
            go_b = asyncio.Event()
            a = asyncio.create_task(upstream.post(endpoint(script), {}, b"{}", Leftover(10.0, handed_a)))

            async def request_b() -> bytes:
                await go_b.wait()
                answer = await upstream.post(endpoint(script), {}, b"{}", Leftover(10.0, handed_b))
                return await answer.read()

            b = asyncio.create_task(request_b())
            await asyncio.wait_for(script.arrived.wait(), 5)
            loop = asyncio.get_running_loop()

            def interleave() -> None:  # runs before the loop reads A's answer, which is in the socket already
                go_b.set()  # B runs first: once A's answer was read, it takes the idle connection
                a.cancel()  # A's caller leaves; its task runs after B's

            script.after_later = lambda: loop.call_soon(interleave)
            script.answer_now.set()
            assert await asyncio.wait_for(b, 5) == b'{"b":true}'
            await asyncio.gather(a, return_exceptions=True)
            assert handed_b.calls == []  # B's answer was B's caller's alone
            await asyncio.wait_for(handed_a.event.wait(), 5)
            assert handed_a.calls == [(200, b'{"ok":true}')]
        assert script.connections == 1  # B went on A's connection: the order above happened

    run(scenario)


def test_a_leftover_answer_that_does_not_end_in_time_closes_its_connection() -> None:
    async def scenario() -> None:
        async with talking_to(HOLD) as (script, upstream):
            handed = Handed()
            await cancelled_once_sent(upstream, script, Leftover(within_s=0.1, done=handed))
            await asyncio.wait_for(handed.event.wait(), 5)
            assert handed.calls == [(None, None)]
            await asyncio.wait_for(script.eof.wait(), 5)  # the backend sees its client leave

    run(scenario)


def test_a_caller_cancelled_without_a_leftover_closes_the_connection() -> None:
    """... and the error its head gets then (the connection broke) is not reported as never retrieved."""
    reported: list[dict[str, object]] = []

    async def scenario() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _loop, context: reported.append(context))
        async with talking_to(HOLD) as (script, upstream):
            await cancelled_once_sent(upstream, script, None)
            await asyncio.wait_for(script.eof.wait(), 5)  # the socket closes where its head gets the error
        gc.collect()  # an unretrieved error is reported when its future is collected

    run(scenario)
    assert [c.get("message") for c in reported] == []


CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


@pytest.mark.parametrize(
    ("chunks", "expected"),
    [
        (b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n", b"hello world"),  # whole chunks in one read, then the end
        (b"5\r\nhello\r\n6\r\n wo", b"hello world"),  # the second chunk split across reads
        (b"5\r\nhelloXX6\r\n world\r\n0\r\n\r\n", UpstreamError),  # a chunk without its CRLF
        (b"-5\r\nhello\r\n0\r\n\r\n", UpstreamError),  # a signed size
        (b"+5\r\nhello\r\n0\r\n\r\n", UpstreamError),
        (b"1_0\r\nhello\r\n0\r\n\r\n", UpstreamError),  # what int() alone would take
        (b"10000000000000000\r\nhello\r\n0\r\n\r\n", UpstreamError),  # more than 15 hex digits
    ],
    ids=["whole", "split", "no-crlf", "minus", "plus", "underscore", "huge"],
)
def test_chunks_arriving_after_the_head_are_read_as_they_come(chunks: bytes, expected: bytes | type) -> None:
    rest = b"rld\r\n0\r\n\r\n" if chunks.endswith(b" wo") else b""

    async def scenario() -> None:  # the head first, read before the chunks are sent: they come in reads of their own
        async with talking_to(Later(first=CHUNKED_HEAD, then=chunks + rest)) as (script, upstream):
            answer = await post(upstream, script)
            script.answer_now.set()
            if isinstance(expected, bytes):
                assert await answer.read() == expected
            else:
                with pytest.raises(UpstreamError):
                    await answer.read()

    run(scenario)
