"""The hops' HTTP/1.1 client (pd_transfer.proxy.upstream) against hostile answers from a real socket server in the
test's event loop: heads split across writes, bad chunk sizes, oversized heads and trailers, connections closed at
every byte of an answer, smuggling attempts, and random answers and random damage to them (Hypothesis).

Each answer ends in one of two ways, within a bound the test sets: its body read whole, or an ``UpstreamError``
naming what was wrong; never another exception, never a wait for a timeout (the client has none here: a hang fails
the test's own bound). A server writes an answer's parts one ``send`` each and lets its event loop turn between
them; how the kernel then cuts them into reads is not what is asserted (every cut must give the same outcome)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("httptools", reason="the proxy needs the 'proxy' extra (httptools)")

from test_upstream import Parts, Script, talking_to

from pd_transfer.proxy.upstream import MAX_HEAD_BYTES, Endpoint, Upstream, UpstreamError

pytestmark = pytest.mark.timeout(120)

BOUND_S = 10.0  # every exchange ends within this (a hang would be the failure)
#: Past the client's bound on a head or trailer: ``MAX_HEAD_BYTES``, plus the one read in which the answer last made
#: progress (whatever that read held after it is not counted; an event loop reads at most 256 KiB at once).
OVER = MAX_HEAD_BYTES + 512 * 1024


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    async def bounded() -> None:
        await asyncio.wait_for(scenario(), timeout=BOUND_S * 3)

    asyncio.run(bounded())


async def exchange(server: Script, upstream: Upstream) -> bytes:
    """One request; the whole body of its answer (an ``UpstreamError`` raised as it comes)."""
    endpoint = Endpoint.of(f"http://127.0.0.1:{server.port}/v1/completions")

    async def both() -> bytes:
        async with await upstream.post(endpoint, {"X-Request-Id": "r1"}, b"{}") as answer:
            return await answer.read()

    return await asyncio.wait_for(both(), BOUND_S)


def head(*fields: bytes, status: bytes = b"200 OK") -> bytes:
    return b"HTTP/1.1 " + status + b"\r\n" + b"".join(f + b"\r\n" for f in fields) + b"\r\n"


CHUNKED = head(b"Content-Type: text/event-stream", b"Transfer-Encoding: chunked")
#: A chunked answer with extensions and a trailer, and its body.
STREAM = CHUNKED + b'6\r\ndata: \r\na;ext=1\r\n{"x": 1}\n\n\r\n0\r\nX-Trailer: yes\r\n\r\n'
STREAM_BODY = b'data: {"x": 1}\n\n'
LENGTH = head(b"Content-Type: application/json", b"Content-Length: 11") + b'{"ok":true}'


def test_a_head_split_anywhere_reads_the_same_answer_and_keeps_the_connection() -> None:
    """Every cut of a chunked answer (head, sizes, data, trailer) in two writes, and one write per byte, on one
    keep-alive connection: each answer whole, and the parser ready for the next."""
    cuts = [Parts([STREAM[:k], STREAM[k:]]) for k in range(1, len(STREAM))]

    async def scenario() -> None:
        async with talking_to(*cuts, Parts([bytes([b]) for b in LENGTH]), Parts([LENGTH])) as (server, upstream):
            for _ in cuts:
                assert await exchange(server, upstream) == STREAM_BODY
            assert await exchange(server, upstream) == b'{"ok":true}'
            assert await exchange(server, upstream) == b'{"ok":true}'
            assert server.connections == 1

    run(scenario)


@pytest.mark.parametrize(
    ("answer", "why"),
    [
        (CHUNKED + b"zz\r\nhello\r\n0\r\n\r\n", "chunk size"),
        (CHUNKED + b"-5\r\nhello\r\n0\r\n\r\n", "chunk size"),
        (CHUNKED + b"+5\r\nhello\r\n0\r\n\r\n", "chunk size"),
        (CHUNKED + b"1_0\r\nhello\r\n0\r\n\r\n", "chunk size"),
        (CHUNKED + b"10000000000000000\r\nhello\r\n0\r\n\r\n", "overflow"),  # 2**64: past any length
        (CHUNKED + b"\r\nhello\r\n0\r\n\r\n", "chunk size"),  # no size at all
        (CHUNKED + b"5\r\nhelloXX0\r\n\r\n", "after chunk data"),  # more data than its size
        (head(b"Content-Length: 3", b"Transfer-Encoding: chunked") + b"3\r\nabc\r\n0\r\n\r\n", "Content-Length"),
        (head(b"Content-Length: 3", b"Content-Length: 4") + b"abcd", "Content-Length"),
        (head(b"Content-Length: -1"), "Content-Length"),
        (head(b"Content-Length: 99999999999999999999999"), "Content-Length"),
        (head(b"X-Evil: a\x00b", b"Content-Length: 0"), "header value"),
        (head(b"X-Folded: a", b" continued", b"Content-Length: 0"), "whitespace"),
        (b"HTTP/1.1 200 OK\nContent-Length: 0\n\n", "CR"),
        (b"HTTP/1.1 2000 OK\r\nContent-Length: 0\r\n\r\n", "status"),
        (b"SSH-2.0-OpenSSH_9.6\r\n\r\n", "HTTP/"),
        (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", "HTTP/"),
        (head(b"Upgrade: websocket", b"Connection: upgrade", status=b"101 Switching Protocols"), "HTTP/1.1"),
    ],
)
def test_a_malformed_answer_is_an_upstream_error_naming_it(answer: bytes, why: str) -> None:
    async def scenario() -> None:
        async with talking_to(Parts([answer])) as (server, upstream):
            with pytest.raises(UpstreamError, match=why):
                await exchange(server, upstream)

    run(scenario)


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * OVER,  # one header that never ends
        b"HTTP/1.1 200 " + b"r" * OVER,  # a reason phrase that never ends
        b"HTTP/1.1 200 OK\r\n" + b"X-Many: 1234567890\r\n" * (OVER // 20),  # many fields, no end
        head(b"X-Big: " + b"a" * OVER, b"Content-Length: 0"),  # a whole head, too big
        CHUNKED + b"5\r\nhello\r\n0\r\nX-Trailer: " + b"t" * OVER,  # a trailer that never ends
        CHUNKED + b"5;" + b"e" * OVER,  # a chunk size line that never ends
        b"\r\n" * OVER,  # blank lines where a status line should be
    ],
    ids=["header", "reason", "many-fields", "whole-head", "trailer", "chunk-line", "blank-lines"],
)
def test_an_oversized_head_or_trailer_is_refused_without_waiting_for_its_end(answer: bytes) -> None:
    """The server sends more than the client's bound of a head (or a trailer, or a chunk size line) and keeps the
    connection open: the client gives up on that bound, not on a timeout, and closes the connection."""
    parts = [answer[i : i + 8192] for i in range(0, len(answer), 8192)]

    async def scenario() -> None:
        async with talking_to(Parts(parts)) as (server, upstream):
            with pytest.raises(UpstreamError, match=f"{MAX_HEAD_BYTES}"):
                await exchange(server, upstream)
            await asyncio.wait_for(server.eof.wait(), BOUND_S)  # the connection was closed

    run(scenario)


@pytest.mark.parametrize(
    ("answer", "body"), [(STREAM, STREAM_BODY), (LENGTH, b'{"ok":true}')], ids=["chunked", "length"]
)
def test_a_connection_closed_at_any_byte_of_an_answer_fails_it_and_the_whole_answer_reads(
    answer: bytes, body: bytes
) -> None:
    """The server closes after the first ``k`` bytes, for every ``k``: short of the whole answer, an error; the whole
    answer, its body."""

    async def scenario() -> None:
        for k in range(len(answer)):
            async with talking_to(Parts([answer[:k]], close=True)) as (server, upstream):
                with pytest.raises(UpstreamError, match="closed the connection"):
                    await exchange(server, upstream)
        async with talking_to(Parts([answer], close=True)) as (server, upstream):
            assert await exchange(server, upstream) == body

    run(scenario)


def test_an_answer_framed_by_the_close_ends_there_and_bytes_nobody_asked_for_end_the_connection() -> None:
    until_close = head(b"Content-Type: text/plain") + b"until the close"
    extra = LENGTH + b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"  # a second answer to no request

    async def scenario() -> None:
        async with talking_to(
            Parts([until_close[:20], until_close[20:]], close=True), Parts([extra]), Parts([LENGTH])
        ) as (
            server,
            upstream,
        ):
            assert await exchange(server, upstream) == b"until the close"
            assert await exchange(server, upstream) == b'{"ok":true}'
            assert await exchange(server, upstream) == b'{"ok":true}'  # on a new connection: the last one sent junk
            assert server.connections == 3

    run(scenario)


# ---- random answers, random cuts, random damage ----


@st.composite
def answers(draw: st.DrawFn) -> tuple[bytes, bytes]:
    """A valid answer (framed by length or by chunks, with or without a trailer and interim answers) and its body."""
    body = draw(st.binary(max_size=300))
    fields = [
        b"X-F%d: %s" % (i, draw(st.text("abc xyz-=;", max_size=40)).encode()) for i in range(draw(st.integers(0, 4)))
    ]
    interim = b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n" * draw(st.integers(0, 2))
    if draw(st.booleans()):
        return interim + head(*fields, b"Content-Length: %d" % len(body)) + body, body
    cuts = sorted(draw(st.lists(st.integers(0, len(body)), max_size=6)))
    pieces = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True) if b > a]
    chunks = b"".join(b"%x%s\r\n%s\r\n" % (len(p), draw(st.sampled_from([b"", b";e=1"])), p) for p in pieces)
    trailer = draw(st.sampled_from([b"", b"X-Trailer: done\r\n"]))
    return interim + head(*fields, b"Transfer-Encoding: chunked") + chunks + b"0\r\n" + trailer + b"\r\n", body


def split(data: bytes, points: list[int]) -> list[bytes]:
    cuts = sorted({p % (len(data) + 1) for p in points} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(cuts) if b > a]


FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(answers(), st.lists(st.integers(0, 10_000), max_size=8))
def test_any_valid_answer_cut_anywhere_reads_whole(answer: tuple[bytes, bytes], points: list[int]) -> None:
    raw, body = answer

    async def scenario() -> None:
        async with talking_to(Parts(split(raw, points)), Parts([LENGTH])) as (server, upstream):
            assert await exchange(server, upstream) == body
            assert await exchange(server, upstream) == b'{"ok":true}'
            assert server.connections == 1

    run(scenario)


@FUZZ
@given(
    answers(),
    st.lists(st.tuples(st.integers(0, 10_000), st.binary(max_size=3), st.integers(0, 3)), min_size=1, max_size=4),
    st.lists(st.integers(0, 10_000), max_size=4),
)
def test_a_damaged_answer_is_read_or_refused_never_anything_else(
    answer: tuple[bytes, bytes], damage: list[tuple[int, bytes, int]], points: list[int]
) -> None:
    """Bytes replaced, inserted or cut anywhere in a valid answer, then the connection closed: the client reads an
    answer or raises ``UpstreamError``, within the bound, whatever the damage (nothing else escapes, nothing hangs)."""
    raw = bytearray(answer[0])
    for at, inserted, cut in damage:
        at %= len(raw) + 1
        raw[at : at + cut] = inserted
    data = bytes(raw)

    async def scenario() -> None:
        async with talking_to(Parts(split(data, points), close=True)) as (server, upstream):
            try:
                await exchange(server, upstream)
            except UpstreamError:
                pass  # refused: what the damage made is no HTTP/1.1 answer, or it ended too soon

    run(scenario)
