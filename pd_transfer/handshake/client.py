"""The decode side of the side channel: fetch (and cache) a prefill engine's metadata.

One handshake is two round trips on a fresh DEALER socket: ``Hello`` -> ``Challenge``, then
``GetMetadata`` -> ``Metadata``. Each attempt is bounded by ``timeout_s``; only timeouts are retried.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from types import TracebackType

import msgspec
import zmq

from pd_transfer.topology.spec import ModelFingerprint

from ._endpoint import is_ipv6, peer_name, tcp_endpoint
from .auth import as_secret, get_metadata_mac, new_nonce, reply_mac, verify
from .compat import fingerprint_fields_differing
from .errors import AuthenticationError, HandshakeError, HandshakeRefused, HandshakeTimeout, IncompatiblePeer
from .messages import (
    MAX_FRAME_BYTES,
    Challenge,
    EngineMetadata,
    ErrorReply,
    GetMetadata,
    Hello,
    Message,
    Metadata,
    decode,
    encode,
    encode_engine,
)
from .versions import PROTOCOL_VERSION

logger = logging.getLogger(__name__)

CacheKey = tuple[str, int, tuple[int, ...] | None]


class _AttemptTimedOut(Exception):
    """One attempt ran out of time (internal: turned into a retry or ``HandshakeTimeout``)."""


class HandshakeClient:
    """Fetches ``EngineMetadata`` from handshake servers, checks it, and caches it.

    Results are cached per ``(host, port, tp_ranks)`` and are also reachable by engine id with
    ``cached()``. Thread-safe: concurrent fetches of different peers run in parallel, and concurrent
    fetches of the same key share one handshake. ``timeout_s`` bounds each attempt (seconds);
    ``retries`` is the number of extra attempts after a timeout.
    """

    def __init__(
        self,
        fingerprint: ModelFingerprint,
        secret: bytes | str | None = None,
        timeout_s: float = 5.0,
        retries: int = 2,
        *,
        protocol_version: int = PROTOCOL_VERSION,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        self.fingerprint = fingerprint
        self.timeout_s = timeout_s
        self.retries = retries
        self.protocol_version = protocol_version
        self._secret = as_secret(secret)
        self._context = zmq.Context()
        self._lock = threading.Lock()
        self._cache: dict[CacheKey, EngineMetadata] = {}
        self._inflight: dict[CacheKey, Future[EngineMetadata]] = {}
        self._closed = False
        self.handshakes_performed = 0  # completed network handshakes (cache hits excluded)

    # ------------------------------------------------------------------ public API

    def fetch(self, host: str, port: int, tp_ranks: list[int] | None = None) -> EngineMetadata:
        """The metadata of the engine at ``host:port`` for ``tp_ranks`` (``None``: every rank).

        Returns the cached result when there is one. Raises ``HandshakeTimeout``, ``HandshakeRefused``
        (``IncompatiblePeer`` for a different model), ``AuthenticationError`` or ``HandshakeError``.
        """
        key: CacheKey = (host, int(port), None if tp_ranks is None else tuple(tp_ranks))
        with self._lock:
            if self._closed:
                raise RuntimeError("the handshake client is closed")
            hit = self._cache.get(key)
            if hit is not None:
                return hit
            future = self._inflight.get(key)
            owner = future is None
            if owner:
                future = self._inflight[key] = Future()
        assert future is not None
        if not owner:
            return future.result()  # another thread's handshake, itself bounded by the timeouts
        try:
            engine = self._handshake(host, int(port), tp_ranks)
        except BaseException as exc:
            with self._lock:
                del self._inflight[key]
            future.set_exception(exc)
            raise
        with self._lock:
            del self._inflight[key]
            self._cache[key] = engine
            self.handshakes_performed += 1
        future.set_result(engine)
        return engine

    def cached(self, engine_id: str) -> EngineMetadata | None:
        """Everything cached about ``engine_id``: the union of its fetched ranks, or ``None``."""
        with self._lock:
            found = [engine for engine in self._cache.values() if engine.engine_id == engine_id]
        if not found:
            return None
        ranks = {rank.tp_rank: rank for engine in found for rank in engine.ranks}
        return msgspec.structs.replace(found[-1], ranks=[ranks[tp_rank] for tp_rank in sorted(ranks)])

    def forget(self, host: str, port: int) -> None:
        """Drop every cached result from ``host:port`` (e.g. the peer restarted)."""
        with self._lock:
            for key in [key for key in self._cache if key[0] == host and key[1] == port]:
                del self._cache[key]

    def forget_engine(self, engine_id: str) -> None:
        """Drop every cached result of ``engine_id``, wherever it was fetched from."""
        with self._lock:
            for key in [key for key, engine in self._cache.items() if engine.engine_id == engine_id]:
                del self._cache[key]

    def close(self) -> None:
        """Release the ZMQ context; in-flight fetches fail. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._cache.clear()
        self._context.term()

    def __enter__(self) -> HandshakeClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # ------------------------------------------------------------------ network

    def _handshake(self, host: str, port: int, tp_ranks: list[int] | None) -> EngineMetadata:
        peer = peer_name(host, port)
        attempts = self.retries + 1
        for attempt in range(1, attempts + 1):
            try:
                return self._attempt(host, port, peer, tp_ranks)
            except _AttemptTimedOut as exc:
                logger.info("handshake with %s: attempt %d/%d timed out (%s)", peer, attempt, attempts, exc)
        raise HandshakeTimeout(peer, attempts, self.timeout_s)

    def _attempt(self, host: str, port: int, peer: str, tp_ranks: list[int] | None) -> EngineMetadata:
        deadline = time.monotonic() + self.timeout_s
        try:
            socket = self._context.socket(zmq.DEALER)
        except zmq.ZMQError as exc:
            raise HandshakeError(f"handshake with {peer}: cannot open a socket ({exc}); client closed?") from exc
        try:
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
            if is_ipv6(host):
                socket.setsockopt(zmq.IPV6, 1)
            socket.connect(tcp_endpoint(host, port))
            client_nonce = new_nonce()

            self._send(socket, Hello(protocol_version=self.protocol_version, client_nonce=client_nonce), deadline)
            challenge = self._receive(socket, peer, deadline, "Challenge")
            if not isinstance(challenge, Challenge):
                raise self._unexpected(peer, challenge, "Challenge")
            if challenge.auth_required and self._secret is None:
                raise AuthenticationError(
                    f"handshake server {peer} requires a shared secret and this client has none: "
                    "configure the same handshake secret on both sides"
                )
            if self._secret is not None and not challenge.auth_required:
                raise AuthenticationError(
                    f"handshake server {peer} does not authenticate, but this client has a secret: "
                    "configure the same handshake secret on both sides"
                )

            request = GetMetadata(
                protocol_version=self.protocol_version,
                fingerprint=self.fingerprint,
                tp_ranks=None if tp_ranks is None else list(tp_ranks),
                client_nonce=client_nonce,
                server_nonce=challenge.server_nonce,
            )
            if self._secret is not None:
                request = msgspec.structs.replace(request, mac=get_metadata_mac(self._secret, request))
            self._send(socket, request, deadline)
            reply = self._receive(socket, peer, deadline, "Metadata")
            if not isinstance(reply, Metadata):
                raise self._unexpected(peer, reply, "Metadata")
            return self._check(reply, peer, client_nonce, tp_ranks)
        except zmq.ContextTerminated as exc:
            raise HandshakeError(f"handshake with {peer} aborted: the client was closed") from exc
        finally:
            socket.close(linger=0)

    def _check(self, reply: Metadata, peer: str, client_nonce: bytes, tp_ranks: list[int] | None) -> EngineMetadata:
        engine = reply.engine
        if self._secret is not None:
            expected = reply_mac(self._secret, client_nonce, encode_engine(engine))
            if not verify(expected, reply.mac):
                raise AuthenticationError(
                    f"metadata from {peer} (engine {engine.engine_id!r}) failed MAC verification: "
                    "the server does not hold our shared secret, or the reply was tampered with"
                )
        fields = fingerprint_fields_differing(self.fingerprint, engine.fingerprint)
        if fields:
            detail = "; ".join(self.fingerprint.differences(engine.fingerprint))
            raise IncompatiblePeer(
                f"engine {engine.engine_id!r} serves a different model (client != server): {detail}",
                fields,
                peer=peer,
            )
        got = [rank.tp_rank for rank in engine.ranks]
        if tp_ranks is not None and got != sorted(set(tp_ranks)):
            raise HandshakeError(
                f"engine {engine.engine_id!r} at {peer} answered TP ranks {got}, asked for {sorted(set(tp_ranks))}"
            )
        logger.debug("handshake with %s: engine %r ranks %s", peer, engine.engine_id, got)
        return engine

    @staticmethod
    def _send(socket: zmq.Socket, message: Message, deadline: float) -> None:
        remaining_ms = int((deadline - time.monotonic()) * 1000)
        if remaining_ms <= 0:
            raise _AttemptTimedOut("no time left to send")
        socket.setsockopt(zmq.SNDTIMEO, remaining_ms)
        try:
            socket.send(encode(message))
        except zmq.Again as exc:
            raise _AttemptTimedOut(f"send of {type(message).__name__} timed out") from exc

    @staticmethod
    def _receive(socket: zmq.Socket, peer: str, deadline: float, waiting_for: str) -> Message:
        remaining_ms = int((deadline - time.monotonic()) * 1000)
        if remaining_ms <= 0 or not socket.poll(remaining_ms, zmq.POLLIN):
            raise _AttemptTimedOut(f"no {waiting_for} received")
        frames = socket.recv_multipart(zmq.NOBLOCK)
        if len(frames) != 1:
            raise HandshakeError(f"handshake server {peer} sent {len(frames)} frames, expected 1")
        try:
            return decode(frames[0])
        except Exception as exc:
            raise HandshakeError(f"handshake server {peer} sent an undecodable reply: {exc}") from exc

    @staticmethod
    def _unexpected(peer: str, message: Message, waiting_for: str) -> HandshakeError:
        if isinstance(message, ErrorReply):
            if message.code in ("auth_required", "auth_failed"):
                return AuthenticationError(
                    f"handshake server {peer} refused our credentials ({message.code}): {message.message}",
                    code=message.code,
                )
            if message.code == "incompatible":
                return IncompatiblePeer(message.message, message.fields, peer=peer)
            return HandshakeRefused(message.code, message.message, peer=peer)
        return HandshakeError(f"handshake server {peer} sent {type(message).__name__}, expected {waiting_for}")
