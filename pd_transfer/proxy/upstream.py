"""The hops' HTTP/1.1 client: POSTs to the backends over keep-alive connections, one request at a time on each.

The proxy's two hops used aiohttp's client, which per request builds a request object (URL, header multidicts,
automatic headers, a payload wrapper, request info), a new response parser, a response object with its stream
reader and a timer context: about half of the proxy's CPU per request. The hops need much less: write a request from
bytes built once per backend and endpoint, and read a status, headers and a body framed by ``Content-Length``, by
chunks (a decode's SSE stream) or by the server's close. That is this module; health checks and ``/v1/models`` keep
aiohttp's client (not on the request path). What a backend sends is parsed by llhttp (through ``httptools``: the
parser of Node.js and uvicorn, fuzzed for years), never by hand: this module keeps the connections (keep-alive, the
answers read on after their caller left, back-pressure) and bounds what the parser is fed.

Contract:

- :meth:`Upstream.post` returns an :class:`Answer` once the status line and headers arrived; its body is read with
  :meth:`Answer.read` (all of it) or :meth:`Answer.chunks` (bytes as they arrive), and :meth:`Answer.close` ends it.
- Errors: :class:`ConnectFailed` when no connection could be made (nothing was sent: the request may go elsewhere),
  :class:`UpstreamError` when the connection broke or the answer is not HTTP/1.x as llhttp reads it (a backend's
  fault: a malformed status line, header or chunk size, a body both chunked and of a length, an upgrade),
  ``TimeoutError`` after ``connect_timeout_s`` to connect or ``request_timeout_s`` (None: no bound) for the whole
  exchange, connect to the end of the body.
- A connection goes back to its backend's idle list once its answer was received to the end and the server keeps it
  alive; an idle one is closed rather than reused after ``keepalive_s`` (uvicorn, vLLM's server, closes idle ones
  after 5 s: never send on one it is closing). An answer closed or abandoned (the caller cancelled) before its end
  closes its connection, so the backend sees its client leave (vLLM aborts the request and frees its blocks).
- A caller cancelled while it waits for an answer closes its connection, unless it gave the post a
  :class:`Leftover`: then the connection goes on reading the answer unattended for at most ``within_s`` seconds and
  hands it to ``done`` (the proxy releases the prefill's blocks a cancelled prefill hop was answered with), or closes.
- Memory: an answer's head (its status line and header fields), and its trailer, at most ``MAX_HEAD_BYTES`` each;
  at most ``MAX_HEAD_BYTES`` (and one read) received while the answer makes no progress (a head, a trailer or a chunk
  size line that never ends; bytes while no request is out are an error at once); an answer holds at most about
  ``HIGH_WATER`` bytes its reader has not taken (reading from the socket pauses beyond that), a left-over one at most
  ``Leftover.max_bytes``; :meth:`Answer.read` holds the whole body, as aiohttp's did.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import socket
import ssl
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from types import TracebackType
from typing import NamedTuple, cast

import httptools
import yarl
from multidict import CIMultiDict

__all__ = ["Answer", "ConnectFailed", "Endpoint", "Leftover", "Upstream", "UpstreamError"]

logger = logging.getLogger(__name__)

MAX_HEAD_BYTES = 64 * 1024  # status line and header fields of one answer (and of its trailer, apart)
_LINE_BYTES = 4  # what a header field's line adds to its name and value (": ", CRLF)
HIGH_WATER = 256 * 1024  # an answer's unread bytes beyond which the socket is not read
LOW_WATER = 64 * 1024  # ... and below which it is read again
_NO_BODY_STATUSES = frozenset((204, 304))


class UpstreamError(Exception):
    """The exchange with a backend failed after connecting: the connection broke, or its answer is not HTTP/1.x."""


class ConnectFailed(UpstreamError):
    """No connection to the backend could be made: nothing was sent."""


@dataclass(frozen=True)
class Endpoint:
    """Where a hop's POST goes: ``host``, ``port``, ``tls`` and the request's first lines (request line, ``Host``,
    ``Content-Type: application/json``) as bytes, built once per backend and path."""

    host: str
    port: int
    tls: bool
    head: bytes

    @classmethod
    def of(cls, url: str) -> Endpoint:
        """The endpoint of an ``http://`` or ``https://`` URL with a path (``http://10.0.0.5:8100/v1/completions``).
        Raises ``ValueError`` for any other scheme or a URL without a host."""
        parsed = yarl.URL(url)
        if parsed.scheme not in ("http", "https") or not parsed.host:
            raise ValueError(f"a backend URL must be http:// or https:// with a host, not {url!r}")
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
        target = parsed.raw_path_qs or "/"
        authority = parsed.raw_authority
        head = f"POST {target} HTTP/1.1\r\nHost: {authority}\r\nContent-Type: application/json\r\n".encode("ascii")
        return cls(parsed.host, port, parsed.scheme == "https", head)


class Leftover(NamedTuple):
    """What becomes of an answer whose caller was cancelled before it had read it: read on for at most
    ``within_s`` seconds, then ``done(status, body)``, once; ``done(None, None)`` when it did not end in time, broke,
    or grew past ``max_bytes`` (its connection is then closed: the backend sees its client leave)."""

    within_s: float
    done: Callable[[int | None, bytes | None], None]
    max_bytes: int = 1 << 20


def _header_lines(headers: dict[str, str]) -> bytes:
    """``Name: value\\r\\n`` lines; ``ValueError`` for a name or value with a line break (never sent)."""
    out = []
    for name, value in headers.items():
        line = f"{name}: {value}\r\n"
        if line.count("\n") != 1 or line.count("\r") != 1:
            raise ValueError(f"header {name[:40]!r} has a line break")
        out.append(line)
    return "".join(out).encode("utf-8", "surrogateescape")


class Upstream:
    """Keep-alive connections to every backend this proxy has posted to, idle ones per ``(host, port, tls)``."""

    def __init__(
        self, connect_timeout_s: float, request_timeout_s: float | None = None, keepalive_s: float = 4.0
    ) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.request_timeout_s = request_timeout_s
        self.keepalive_s = keepalive_s
        self._idle: dict[tuple[str, int, bool], list[_Connection]] = {}
        self._unattended: set[_Connection] = set()  # reading a Leftover's answer
        self._tls: ssl.SSLContext | None = None
        self._closed = False

    async def post(
        self, endpoint: Endpoint, headers: dict[str, str], body: bytes, leftover: Leftover | None = None
    ) -> Answer:
        """Sends ``body`` (JSON) with ``headers`` (besides ``Host``, ``Content-Type`` and ``Content-Length``) to
        ``endpoint``; the answer once its headers arrived. See the module for the errors and ``leftover``."""
        if self._closed:
            raise UpstreamError("the proxy's client is closed")
        loop = asyncio.get_running_loop()
        deadline = None if self.request_timeout_s is None else loop.time() + self.request_timeout_s
        request = (
            endpoint.head + _header_lines(headers) + b"Content-Length: " + str(len(body)).encode("ascii") + b"\r\n\r\n"
        )
        connection = self._take_idle(endpoint) or await self._connect(endpoint, deadline)
        head = connection.send(request, body, deadline, leftover)
        # Awaited through a shield: a cancelled caller must not cancel ``head``. Only the connection settles it, so
        # "not done" means the connection is still on this request. (A cancelled ``head`` let the connection read
        # the whole answer, go idle and carry the next request before this caller's handler ran, which then took
        # that request for its own: issue 33.)
        try:
            if deadline is None:
                return await asyncio.shield(head)
            async with asyncio.timeout_at(deadline):
                return await asyncio.shield(head)
        except asyncio.CancelledError:
            head.add_done_callback(_retrieve)
            connection.abandoned(_answer_of(head))
            raise
        except BaseException:
            head.add_done_callback(_retrieve)
            answer = _answer_of(head)
            if answer is None:
                connection.close()  # still this request's: nothing of its answer came
            else:
                answer.close()  # a no-op once it ended (the connection may carry another request by now)
            raise

    def close(self) -> None:
        """Closes the idle connections; later posts fail. (Answers being read close their own.)"""
        self._closed = True
        for connections in self._idle.values():
            for connection in connections:
                connection.close()
        self._idle.clear()
        for connection in list(self._unattended):
            connection.close()

    def _take_idle(self, endpoint: Endpoint) -> _Connection | None:
        """The most recently idle live connection to ``endpoint``; older ones past ``keepalive_s`` are closed."""
        idle = self._idle.get((endpoint.host, endpoint.port, endpoint.tls))
        if not idle:
            return None
        expired_before = time.monotonic() - self.keepalive_s
        while idle:
            connection = idle.pop()
            if connection.idle_since >= expired_before and connection.reusable():
                return connection
            connection.close()
        return None

    def _keep(self, connection: _Connection) -> None:
        """``connection`` finished an answer and stays open: it may carry the next request to its backend."""
        if self._closed:
            connection.close()
            return
        connection.idle_since = time.monotonic()
        self._idle.setdefault(connection.key, []).append(connection)

    def _forget(self, connection: _Connection) -> None:
        """``connection`` closed: out of the idle list if it was there."""
        idle = self._idle.get(connection.key)
        if idle and connection in idle:
            idle.remove(connection)

    async def _connect(self, endpoint: Endpoint, deadline: float | None) -> _Connection:
        loop = asyncio.get_running_loop()
        key = (endpoint.host, endpoint.port, endpoint.tls)
        timeout = self.connect_timeout_s
        if deadline is not None:
            timeout = min(timeout, deadline - loop.time())
        try:
            async with asyncio.timeout(timeout):
                _transport, connection = await loop.create_connection(
                    lambda: _Connection(key, self._keep, self._forget, self._unattended),
                    endpoint.host,
                    endpoint.port,
                    ssl=self._tls_context() if endpoint.tls else None,
                    server_hostname=endpoint.host if endpoint.tls else None,
                )
        except TimeoutError:
            raise TimeoutError(f"connecting to {endpoint.host}:{endpoint.port} took over {timeout:.3g} s") from None
        except OSError as e:
            raise ConnectFailed(f"cannot connect to {endpoint.host}:{endpoint.port}: {e.strerror or e}") from None
        return connection

    def _tls_context(self) -> ssl.SSLContext:
        if self._tls is None:
            self._tls = ssl.create_default_context()
        return self._tls


class Answer:
    """A backend's answer: ``status``, ``headers`` (case-insensitive) and a body read with :meth:`read` or
    :meth:`chunks` (once). An async context manager that closes it on exit."""

    def __init__(
        self,
        connection: _Connection,
        status: int,
        headers: CIMultiDict[str],
        deadline: float | None,
        leftover: Leftover | None = None,
        left: bool = False,
    ) -> None:
        self.status = status
        self.headers = headers
        self.leftover = leftover  # its request's
        self.buffered = 0  # bytes received that its reader has not taken
        self._connection: _Connection | None = connection
        self._deadline = deadline
        self._chunks: collections.deque[bytes] = collections.deque()
        self._done = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._left = left  # handed to its Leftover: close() leaves it alone

    async def read(self) -> bytes:
        """The whole body; the errors of :meth:`chunks`."""
        parts: list[bytes] = []
        while True:
            if self._chunks:
                parts += self._chunks
                self._chunks.clear()
                self.buffered = 0
                if self._connection is not None:
                    self._connection.resume()
            elif self._error is not None:
                raise self._error
            elif self._done:
                return parts[0] if len(parts) == 1 else b"".join(parts)
            else:
                try:
                    await self._wait()
                except asyncio.CancelledError:  # what was read goes back: a Leftover gets the whole body
                    self._chunks.extendleft(reversed(parts))
                    self.buffered += sum(map(len, parts))
                    raise

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive (a chunked body without its framing); raises :class:`UpstreamError` when
        the connection breaks before its end, ``TimeoutError`` past the request's deadline."""
        while True:
            if self._chunks:
                chunk = self._chunks.popleft()
                self.buffered -= len(chunk)
                if self.buffered < LOW_WATER and self._connection is not None:
                    self._connection.resume()
                yield chunk
            elif self._error is not None:
                raise self._error
            elif self._done:
                return
            else:
                await self._wait()

    def close(self) -> None:
        """Ends the answer: a no-op once its body was received to the end; else its connection is closed (the
        backend sees its client leave)."""
        if self._left:
            return
        connection, self._connection = self._connection, None
        if connection is not None and not self._done:
            connection.close()
            self.fail(UpstreamError("the answer was closed before its end"))

    async def __aenter__(self) -> Answer:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    async def _wait(self) -> None:
        waiter = self._waiter = asyncio.get_running_loop().create_future()
        try:
            if self._deadline is None:
                await waiter
            else:
                async with asyncio.timeout_at(self._deadline):
                    await waiter
        except asyncio.CancelledError:
            if self._connection is None:
                self.close()
            else:
                self._connection.abandoned(self)
            raise
        except BaseException:
            self.close()
            raise
        finally:
            self._waiter = None

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    # ---- its connection's side ----

    @property
    def reader_waiting(self) -> bool:
        """Whether a reader waits for the body's next bytes."""
        return self._waiter is not None

    @property
    def ended(self) -> bool:
        """Whether the body was received to its end, or failed."""
        return self._done

    def received(self) -> bytes | None:
        """The body not yet taken by a reader, once received to its end without an error; else None."""
        return b"".join(self._chunks) if self._done and self._error is None else None

    def leave(self) -> None:
        """Handed to its :class:`Leftover`: :meth:`close` leaves its connection alone from now on."""
        self._left = True

    def feed(self, data: bytes) -> bool:
        """Body bytes arrived; whether the reader holds more than ``HIGH_WATER`` (pause the socket)."""
        self._chunks.append(data)
        self.buffered += len(data)
        self._wake()
        return self.buffered > HIGH_WATER

    def finish(self) -> None:
        """The body was received to its end."""
        self._done = True
        self._connection = None
        self._wake()

    def fail(self, error: BaseException) -> None:
        """The body will not end: its reader gets ``error`` once it has taken what arrived."""
        if not self._done:
            self._error = error
            self._done = True
        self._connection = None
        self._wake()


# What a connection waits for: nothing (idle: any byte is an error), the head of its request's answer, or its body.
_IDLE, _HEAD, _BODY = range(3)


class _Connection(asyncio.Protocol):
    """One connection to a backend: sends a request, has its answer parsed by llhttp (``httptools`` calls the
    ``on_*`` methods below as the bytes arrive) and hands the body to the :class:`Answer`. One request at a time;
    handed to ``keep`` after a complete answer (its upstream's idle list) and to ``forget`` once closed; in
    ``unattended`` while it reads an answer for a :class:`Leftover`."""

    def __init__(
        self,
        key: tuple[str, int, bool],
        keep: Callable[[_Connection], None],
        forget: Callable[[_Connection], None],
        unattended: set[_Connection],
    ) -> None:
        self.key = key
        self._keep = keep
        self._forget = forget
        self._unattended_set = unattended
        self.idle_since = 0.0
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._state = _IDLE
        self._fields: list[tuple[str, str]] = []  # the head's header fields so far
        self._field_bytes = 0  # of the head's (then the trailer's) header fields so far
        self._stalled_bytes = 0  # received since the answer last made progress (its head, body bytes, its end)
        self._interim = False  # the head being read is a 1xx: the real answer follows
        self._until_close = False  # the answer's body ends with the connection (no length, not chunked)
        self._head: asyncio.Future[Answer] | None = None
        self._answer: Answer | None = None
        self._deadline: float | None = None
        self._keep_alive = True
        self._paused = False
        self._leftover: Leftover | None = None  # the current request's, if its caller gave one
        self._unattended: asyncio.TimerHandle | None = None  # set while reading an answer nobody waits for

    # ---- used by Upstream and Answer ----

    def send(
        self, request: bytes, body: bytes, deadline: float | None, leftover: Leftover | None
    ) -> asyncio.Future[Answer]:
        """Writes a request (``request``: its head, ``body``); the future of its answer (set once the headers
        arrived), whose body must arrive by ``deadline`` (the loop's time; None: no bound)."""
        transport = self._transport
        if transport is None or transport.is_closing():
            raise UpstreamError("the connection closed before the request was sent")
        self._head = asyncio.get_running_loop().create_future()
        self._deadline, self._leftover = deadline, leftover
        self._state, self._keep_alive, self._stalled_bytes = _HEAD, True, 0
        transport.writelines((request, body))
        return self._head

    def abandoned(self, answer: Answer | None) -> None:
        """The caller was cancelled while waiting for ``answer`` (None: for its head, which the connection has not
        settled: it is still on that request). Without a :class:`Leftover` the connection closes (unless the answer
        had ended); with one it reads on unattended. An ended answer goes to its own Leftover, whatever the
        connection carries now."""
        leftover = self._leftover if answer is None else answer.leftover
        if answer is not None and answer.ended:  # ended before the caller could read it
            body = answer.received()
            if leftover is not None and body is not None:
                asyncio.get_running_loop().call_soon(_hand_over, leftover, answer.status, body)
            return
        if self._transport is None or self._transport.is_closing():
            return  # broken already: nothing more will come
        if leftover is None:
            if answer is not None:
                answer.close()
            else:
                self.close()
            return
        if answer is not None:
            answer.leave()
        self._unattended = asyncio.get_running_loop().call_later(leftover.within_s, self._unattended_expired)
        self._unattended_set.add(self)
        self.resume()

    def reusable(self) -> bool:
        return self._transport is not None and not self._transport.is_closing() and self._answer is None

    def resume(self) -> None:
        if self._paused and self._transport is not None:
            self._paused = False
            self._transport.resume_reading()

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    # ---- asyncio.Protocol ----

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass

    def data_received(self, data: bytes) -> None:
        self._stalled_bytes += len(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserCallbackError as error:  # one of the on_* methods raised
            cause = error.__context__
            if not isinstance(cause, UpstreamError):  # not what the backend sent: a fault of this module's own
                logger.error("reading an answer from %s:%d failed", self.key[0], self.key[1], exc_info=cause)
                cause = UpstreamError("the proxy failed to read the answer (its log has why)")
            self._broken(cause)
            return
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as error:
            self._broken(UpstreamError(f"the answer is not HTTP/1.1 as llhttp reads it: {error}"))
            return
        if self._stalled_bytes > MAX_HEAD_BYTES:
            self._broken(UpstreamError(f"the answer sent over {MAX_HEAD_BYTES} bytes with no head, body or end"))

    def eof_received(self) -> bool:
        return False  # close the transport: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        self._forget(self)
        if self._state == _BODY and self._until_close and self._answer is not None:
            self._complete()
            return
        reason = f": {exc}" if exc else ""
        self._broken(UpstreamError(f"the backend closed the connection before the end of its answer{reason}"))

    # ---- the parser's callbacks (httptools.HttpResponseParser) ----

    def on_message_begin(self) -> None:
        if self._state != _HEAD:  # idle: nothing was asked for these bytes
            raise UpstreamError("the backend sent bytes it was not asked for")
        self._fields = []
        self._field_bytes = 0

    def on_status(self, reason: bytes) -> None:
        self._count_field_bytes(len(reason))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_field_bytes(len(name) + len(value) + _LINE_BYTES)
        if self._state == _HEAD:  # else a trailer's field: read within bounds, and dropped
            self._fields.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        self._stalled_bytes = 0
        status = self._parser.get_status_code()
        if 100 <= status < 200:
            self._interim = True  # an interim answer (103 Early Hints): the real one follows
            return
        headers = CIMultiDict(self._fields)
        self._fields, self._field_bytes = [], 0
        self._keep_alive = self._parser.should_keep_alive()
        self._until_close = status not in _NO_BODY_STATUSES and not _framed(headers)
        self._state = _BODY
        answer = Answer(self, status, headers, self._deadline, self._leftover, left=self._unattended is not None)
        self._answer = answer
        if self._head is not None and not self._head.done():
            self._head.set_result(answer)

    def on_body(self, body: bytes) -> None:
        self._stalled_bytes = 0
        answer = self._answer
        assert answer is not None
        self._deliver(answer, body)

    def on_message_complete(self) -> None:
        self._stalled_bytes = 0
        if self._interim:
            self._interim = False
            return
        self._complete()

    # ---- the answer's end ----

    def _count_field_bytes(self, size: int) -> None:
        self._field_bytes += size
        if self._field_bytes > MAX_HEAD_BYTES:
            part = "head" if self._state == _HEAD else "trailer"
            raise UpstreamError(f"the answer's {part} exceeds {MAX_HEAD_BYTES} bytes")

    def _deliver(self, answer: Answer, data: bytes) -> None:
        """Body bytes to ``answer``; the socket paused when its reader falls ``HIGH_WATER`` behind (an unattended
        answer: an error past its Leftover's ``max_bytes``)."""
        if answer.feed(data) and not self._paused and self._transport is not None:
            if self._unattended is None:
                self._paused = True
                self._transport.pause_reading()
            elif self._leftover is not None and answer.buffered > self._leftover.max_bytes:
                raise UpstreamError(f"an unattended answer exceeds {self._leftover.max_bytes} bytes")

    def _complete(self) -> None:
        """The answer was received to its end: the connection serves the next request, or closes."""
        answer, self._answer = self._answer, None
        self._state = _IDLE
        self._head = None
        if answer is not None:
            answer.finish()
            if self._unattended is not None:
                body = answer.received()
                self._end_unattended(None if body is None else answer.status, body)
        if self._keep_alive and self._transport is not None:
            self.resume()
            self._keep(self)
        else:
            self.close()

    def _broken(self, error: UpstreamError) -> None:
        """The connection cannot go on: its answer (or the wait for one) fails with ``error``; it closes."""
        if self._head is not None and not self._head.done():
            self._head.set_exception(error)
        self._head = None
        answer, self._answer = self._answer, None
        if answer is not None:
            answer.fail(error)
        self._state = _IDLE
        if self._unattended is not None:
            self._end_unattended(None, None)
        self.close()

    def _unattended_expired(self) -> None:
        """The answer read unattended did not end within its Leftover's time: give up on it."""
        self._broken(UpstreamError("the unattended answer did not end in time"))

    def _end_unattended(self, status: int | None, body: bytes | None) -> None:
        timer, self._unattended = self._unattended, None
        if timer is not None:
            timer.cancel()
        self._unattended_set.discard(self)
        leftover, self._leftover = self._leftover, None
        if leftover is not None:
            _hand_over(leftover, status, body)


def _framed(headers: CIMultiDict[str]) -> bool:
    """Whether an answer's body ends by its own framing (chunks last in its ``Transfer-Encoding``, else a
    ``Content-Length``) rather than by the connection's close, as llhttp reads an answer."""
    encoding = headers.get("Transfer-Encoding")
    if encoding is not None:
        return encoding.rsplit(",", 1)[-1].strip().lower() == "chunked"
    return "Content-Length" in headers


def _retrieve(head: asyncio.Future[Answer]) -> None:
    """A done callback: marks the error of a head nobody awaits any more as seen (the shield around it no longer
    does once its caller left), so asyncio does not log it as never retrieved."""
    if not head.cancelled():
        head.exception()


def _answer_of(head: asyncio.Future[Answer]) -> Answer | None:
    """The answer ``head`` was settled with, or None while the connection waits for it (or broke)."""
    return head.result() if head.done() and head.exception() is None else None


def _hand_over(leftover: Leftover, status: int | None, body: bytes | None) -> None:
    """Calls ``leftover.done``; an error there is logged, never raised into the connection."""
    try:
        leftover.done(status, body)
    except Exception:
        logger.exception("handling an unattended answer failed")
