"""The decode side of the side channel: fetch (and cache) a prefill engine's metadata.

One handshake is two round trips on a fresh DEALER socket: ``Hello`` -> ``Challenge``, then
``GetMetadata`` -> ``Metadata``. Each attempt is bounded by ``timeout_s`` and watched through a ZMQ socket monitor,
so a refused or dropped connection ends it at once. Retried: an attempt that connected but got no answer in time,
and a refused connection unless a bare TCP connect right after it is refused too (nothing listens there: the fetch
fails at once, a millisecond or two after it began; if the connect is accepted, a side channel came up meanwhile and
the next attempt follows at once; if it neither connects nor is refused, after a short pause); not retried: an
attempt that never got a TCP connection within its timeout (ZMQ keeps re-sending SYNs inside an attempt already),
nor any answer (refusals, auth, model).

Fail-fast: after a connection-level failure (``HandshakeTimeout``) of ``host:port``, fetches from that endpoint
raise ``HandshakeBackoff`` at once (naming the endpoint, the failure, and when it will be tried again) for
``failure_backoff_s`` seconds, doubling with each failure in a row up to ``failure_backoff_max_s``. The first fetch
after the window is the probe (others still fail fast while it runs); a success or ``forget()`` clears the record.

Same-host IPC: a client made with ``prove_host`` answers a ``Challenge`` that names the prefill's host with a proof
that it runs there (:mod:`.host_identity`), and so gets the ranks' same-host offers; others never do.

Knocking: when the failure was that nobody accepted the connection (refused, or no TCP connection in time: the
prefill is down or restarting), a fetch inside the window first knocks, at most once per ``knock_interval_s``
per endpoint: a bare TCP connect bounded by ``knock_timeout_s``. If it connects, something listens again and the
window ends at once (this fetch is the probe), so a restarted prefill is handshaken within about
``knock_interval_s`` of its side channel listening rather than at the end of a window of up to 30 s. An endpoint
that accepts connections but does not answer is never knocked at: the knock would tell nothing new.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from types import TracebackType
from typing import Literal

import msgspec
import zmq

from pd_transfer.metrics import TransferMetrics, default_metrics
from pd_transfer.spec import ModelFingerprint

from .auth import as_secret, new_nonce, reply_mac, signed_request_mac, verify
from .compat import fingerprint_fields_differing, info_labels
from .endpoints import peer_name
from .errors import (
    AuthenticationError,
    HandshakeBackoff,
    HandshakeError,
    HandshakeRefused,
    HandshakeTimeout,
    IncompatiblePeer,
)
from .host_identity import host_proof
from .link import AttemptFailed, greet, open_link, receive, unexpected
from .messages import Challenge, EngineMetadata, GetMetadata, Metadata, encode_engine
from .versions import PROTOCOL_VERSION, SUPPORTED_VERSIONS

logger = logging.getLogger(__name__)

CacheKey = tuple[str, int, tuple[int, ...] | None]
Endpoint = tuple[str, int]

_REFUSED_PAUSE_S = 0.1  # before retrying a refused connection a knock could not judge (doubling)
_UNREACHABLE = ("connection refused", "no TCP connection", "connection closed by the peer")  # nobody listening

Knock = Literal["listening", "refused", "silent"]


def knock(endpoint: Endpoint, timeout_s: float) -> Knock:
    """A bare TCP connect to ``endpoint``, bounded by ``timeout_s``: "listening" (it was accepted, and closed at
    once), "refused" (nothing listens: the host answered with a reset) or "silent" (no answer in time, or another
    error: unreachable, unresolvable)."""
    try:
        with socket.create_connection(endpoint, timeout=timeout_s):
            return "listening"
    except ConnectionRefusedError:
        return "refused"
    except OSError:
        return "silent"


@dataclass
class _Failures:
    """What is remembered of an endpoint whose last handshake failed at the connection level."""

    error: HandshakeTimeout
    count: int  # in a row
    failed_at: float
    retry_at: float
    probing: bool = False  # a fetch is trying it again now (the others keep failing fast)
    next_knock_at: float = 0.0  # no TCP knock before this (clock time)

    @property
    def knockable(self) -> bool:
        """Whether every attempt failed for want of a listener (a knock can tell when one is back)."""
        return bool(self.error.reasons) and all(reason.startswith(_UNREACHABLE) for reason in self.error.reasons)


class HandshakeClient:
    """Fetches ``EngineMetadata`` from handshake servers, checks it, and caches it.

    Results are cached per ``(host, port, tp_ranks)`` and are also reachable by engine id with
    ``cached()``. Thread-safe: concurrent fetches of different peers run in parallel, and concurrent
    fetches of the same key share one handshake. ``timeout_s`` bounds each attempt (seconds);
    ``retries`` is the number of extra attempts after a refused connection (unless a knock finds nothing listening)
    or an unanswered one, so a fetch takes at most ``(retries + 1) * timeout_s`` plus ``retries`` knocks and 0.3 s
    of pauses. ``failure_backoff_s`` (0: off) and ``failure_backoff_max_s`` (default 3 x ``failure_backoff_s``) set
    the fail-fast window after a connection-level failure; ``knock_interval_s`` (0: off) and ``knock_timeout_s``
    (default the smaller of 0.25 s and ``timeout_s``; it also bounds the knock after a refused attempt) the TCP
    knocks that end it early once a peer that was down listens again; ``clock``
    (monotonic seconds) is for tests. ``protocol_version`` is the version asked for in ``Hello``;
    ``supported_versions`` the versions accepted in the server's ``Challenge`` (default: every version this
    package speaks, or only ``protocol_version`` when another is set): a server answering in another version is
    refused, naming both. ``metrics`` (default: the process's) counts handshakes by outcome and their seconds.
    ``prove_host``: prove to servers that offer same-host IPC that we run on their host, when we do (we then get
    their ranks' ``ipc`` sections); off, no server sends us any.
    """

    def __init__(
        self,
        fingerprint: ModelFingerprint,
        secret: bytes | str | None = None,
        timeout_s: float = 5.0,
        retries: int = 2,
        *,
        protocol_version: int = PROTOCOL_VERSION,
        failure_backoff_s: float = 10.0,
        failure_backoff_max_s: float | None = None,
        knock_interval_s: float = 0.5,
        knock_timeout_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        supported_versions: frozenset[int] | None = None,
        metrics: TransferMetrics | None = None,
        prove_host: bool = False,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        if failure_backoff_s < 0:
            raise ValueError(f"failure_backoff_s must be >= 0, got {failure_backoff_s}")
        if failure_backoff_max_s is None:
            failure_backoff_max_s = 3 * failure_backoff_s
        if failure_backoff_max_s < failure_backoff_s:
            raise ValueError(f"failure_backoff_max_s {failure_backoff_max_s} < failure_backoff_s {failure_backoff_s}")
        self.fingerprint = fingerprint
        self.prove_host = prove_host
        self.timeout_s = timeout_s
        self.retries = retries
        self.protocol_version = protocol_version
        if supported_versions is None:
            supported_versions = SUPPORTED_VERSIONS if protocol_version == PROTOCOL_VERSION else frozenset()
        self.supported_versions = frozenset(supported_versions) | {protocol_version}
        self.metrics = metrics if metrics is not None else default_metrics()
        self.metrics.describe(info_labels(fingerprint, protocol_version))
        self.failure_backoff_s = failure_backoff_s
        self.failure_backoff_max_s = failure_backoff_max_s
        if knock_interval_s < 0:
            raise ValueError(f"knock_interval_s must be >= 0, got {knock_interval_s}")
        self.knock_interval_s = knock_interval_s
        self.knock_timeout_s = min(0.25, timeout_s) if knock_timeout_s is None else knock_timeout_s
        if self.knock_timeout_s <= 0:
            raise ValueError(f"knock_timeout_s must be positive, got {self.knock_timeout_s}")
        self._clock = clock
        self._failures: dict[Endpoint, _Failures] = {}
        self._secret = as_secret(secret)
        self._context = zmq.Context()
        self._lock = threading.Lock()
        self._cache: dict[CacheKey, EngineMetadata] = {}
        self._inflight: dict[CacheKey, Future[EngineMetadata]] = {}
        self._closed = False
        self.handshakes_performed = 0  # completed network handshakes (cache hits excluded)

    # ------------------------------------------------------------------ public API

    def fetch(self, host: str, port: int, tp_ranks: list[int] | None = None, *, fresh: bool = False) -> EngineMetadata:
        """The metadata of the engine at ``host:port`` for ``tp_ranks`` (``None``: every rank).

        Returns the cached result when there is one, unless ``fresh`` (then it handshakes, and caches what it
        gets: the peer may have restarted). Raises ``HandshakeTimeout`` (``HandshakeBackoff``, at once, while
        the endpoint is in its fail-fast window), ``HandshakeRefused`` (``IncompatiblePeer`` for a different
        model), ``AuthenticationError`` or ``HandshakeError``.
        """
        key: CacheKey = (host, int(port), None if tp_ranks is None else tuple(tp_ranks))
        endpoint: Endpoint = (host, int(port))
        probe = False
        with self._lock:
            if self._closed:
                raise RuntimeError("the handshake client is closed")
            hit = None if fresh else self._cache.get(key)
            if hit is not None:
                return hit
        self._knock_if_due(endpoint)
        with self._lock:
            if self._closed:
                raise RuntimeError("the handshake client is closed")
            hit = None if fresh else self._cache.get(key)
            if hit is not None:
                return hit
            future = self._inflight.get(key)
            owner = future is None
            if owner:
                probe = self._check_failures(endpoint)  # raises HandshakeBackoff inside the window
                future = self._inflight[key] = Future()
        assert future is not None
        if not owner:
            return future.result()  # another thread's handshake, itself bounded by the timeouts
        started = time.monotonic()
        try:
            engine = self._handshake(host, int(port), tp_ranks)
        except BaseException as exc:
            self._count(exc, started)
            with self._lock:
                del self._inflight[key]
                self._record_failure(endpoint, exc, probe)
            future.set_exception(exc)
            raise
        with self._lock:
            del self._inflight[key]
            self._cache[key] = engine
            self._failures.pop(endpoint, None)
            self.handshakes_performed += 1
        self._count(None, started)
        future.set_result(engine)
        return engine

    def _count(self, error: BaseException | None, started: float) -> None:
        """Count one network handshake by outcome (``error`` None: ok) and its seconds."""
        self.metrics.handshakes.labels(handshake_outcome(error)).inc()
        self.metrics.handshake_seconds.observe(time.monotonic() - started)

    def _check_failures(self, endpoint: Endpoint) -> bool:
        """Under the lock, before a handshake: raises ``HandshakeBackoff`` while ``endpoint`` is in its window
        or being probed; returns whether this handshake is the probe of a failed endpoint."""
        failures = self._failures.get(endpoint)
        if failures is None:
            return False
        now = self._clock()
        if failures.probing or now < failures.retry_at:
            raise HandshakeBackoff(
                peer_name(*endpoint),
                failures.error,
                failures.count,
                failed_ago_s=now - failures.failed_at,
                retry_in_s=max(0.0, failures.retry_at - now),
            )
        failures.probing = True
        return True

    def _knock_if_due(self, endpoint: Endpoint) -> None:
        """Inside the fail-fast window of an endpoint nobody listened at: at most once per ``knock_interval_s``, a
        bare TCP connect (bounded by ``knock_timeout_s``); if it connects, the window ends now."""
        with self._lock:
            failures = self._failures.get(endpoint)
            if failures is None or self.knock_interval_s <= 0 or failures.probing or not failures.knockable:
                return
            now = self._clock()
            if now >= failures.retry_at or now < failures.next_knock_at:
                return  # the window is over anyway (this fetch probes), or it was knocked at just now
            failures.next_knock_at = now + self.knock_interval_s
        if knock(endpoint, self.knock_timeout_s) != "listening":
            return
        with self._lock:
            if self._failures.get(endpoint) is failures and not failures.probing:
                failures.retry_at = min(failures.retry_at, self._clock())
                logger.info("%s accepts connections again: handshaking before its back-off ends", failures.error.peer)

    def _record_failure(self, endpoint: Endpoint, exc: BaseException, probe: bool) -> None:
        """Under the lock, after a failed handshake: remember a connection-level failure (longer each time in a
        row); any answer from the peer (a refusal, a MAC failure) proves it reachable and clears the record."""
        failures = self._failures.get(endpoint)
        if isinstance(exc, HandshakeTimeout) and not isinstance(exc, HandshakeBackoff):
            if self.failure_backoff_s <= 0:
                return
            count = failures.count + 1 if failures is not None else 1
            window = min(self.failure_backoff_s * 2 ** (count - 1), self.failure_backoff_max_s)
            now = self._clock()
            self._failures[endpoint] = _Failures(exc, count, failed_at=now, retry_at=now + window)
            logger.warning("handshake with %s failed (%s); failing fast for %.1f s", exc.peer, exc, window)
        elif isinstance(exc, HandshakeError) and not isinstance(exc, HandshakeBackoff):
            self._failures.pop(endpoint, None)
        elif probe and failures is not None:  # interrupted: let the next fetch probe
            failures.probing = False

    def failing(self, host: str, port: int) -> bool:
        """Whether ``host:port`` is remembered as failing (fetches fail fast, or the next one probes it)."""
        with self._lock:
            return (host, int(port)) in self._failures

    def cached(self, engine_id: str) -> EngineMetadata | None:
        """Everything cached about ``engine_id``: the union of its fetched ranks, or ``None``."""
        with self._lock:
            found = [engine for engine in self._cache.values() if engine.engine_id == engine_id]
        if not found:
            return None
        ranks = {rank.tp_rank: rank for engine in found for rank in engine.ranks}
        return msgspec.structs.replace(found[-1], ranks=[ranks[tp_rank] for tp_rank in sorted(ranks)])

    def forget(self, host: str, port: int, *, failure: bool = True) -> None:
        """Drop every cached result from ``host:port`` (e.g. the peer restarted), and (``failure``) its remembered
        failure."""
        with self._lock:
            if failure:
                self._failures.pop((host, int(port)), None)
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
            self._failures.clear()
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
        reasons: list[str] = []
        for attempt in range(1, attempts + 1):
            try:
                return self._attempt(host, port, peer, tp_ranks)
            except AttemptFailed as exc:
                reasons.append(exc.reason)
                logger.info("handshake with %s: attempt %d/%d failed (%s)", peer, attempt, attempts, exc.reason)
                if not exc.retry or attempt == attempts:
                    break
                if exc.reason == "connection refused" and not self._worth_retrying_refused(host, port, peer, attempt):
                    break
        raise HandshakeTimeout(peer, len(reasons), self.timeout_s, reasons)

    def _worth_retrying_refused(self, host: str, port: int, peer: str, attempt: int) -> bool:
        """After attempt ``attempt`` was refused: knock once. Refused again: nothing listens, no retry (False).
        Accepted: something listens now, retry at once. No verdict: retry after a pause (doubling per attempt)."""
        verdict = knock((host, port), self.knock_timeout_s)
        if verdict == "refused":
            logger.info("handshake with %s: nothing listens there (a TCP connect was refused too): not retried", peer)
            return False
        if verdict == "silent":
            time.sleep(_REFUSED_PAUSE_S * 2 ** (attempt - 1))  # a backoff between attempts, not a sync
        return True

    def _attempt(self, host: str, port: int, peer: str, tp_ranks: list[int] | None) -> EngineMetadata:
        deadline = time.monotonic() + self.timeout_s
        try:
            link = open_link(self._context, host, port)
        except zmq.ZMQError as exc:
            raise HandshakeError(f"handshake with {peer}: cannot open a socket ({exc}); client closed?") from exc
        try:
            client_nonce = new_nonce()
            challenge = greet(
                link,
                peer,
                deadline,
                self.timeout_s,
                version=self.protocol_version,
                accepted=self.supported_versions,
                client_nonce=client_nonce,
                has_secret=self._secret is not None,
            )
            request = GetMetadata(
                protocol_version=challenge.protocol_version,
                fingerprint=self.fingerprint,
                tp_ranks=None if tp_ranks is None else list(tp_ranks),
                client_nonce=client_nonce,
                server_nonce=challenge.server_nonce,
                host_proof=self._host_proof(challenge, client_nonce, peer),
            )
            if self._secret is not None:
                request = msgspec.structs.replace(request, mac=signed_request_mac(self._secret, request))
            link.send(request, deadline)
            reply = receive(link, peer, deadline, "Metadata", self.timeout_s)
            if not isinstance(reply, Metadata):
                raise unexpected(peer, reply, "Metadata", self.protocol_version)
            return self._check(reply, peer, client_nonce, tp_ranks)
        except zmq.ContextTerminated as exc:
            raise HandshakeError(f"handshake with {peer} aborted: the client was closed") from exc
        finally:
            link.close()

    def _host_proof(self, challenge: Challenge, client_nonce: bytes, peer: str) -> bytes:
        """Our proof that we run on the host the challenge names (b"" when not asked for, not wanted, or not so)."""
        if challenge.host is None or not self.prove_host:
            return b""
        proof, why_not = host_proof(challenge.host, challenge.server_nonce, client_nonce)
        if not proof:
            logger.info("handshake with %s: no same-host IPC: %s", peer, why_not)
        return proof

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
        engine = msgspec.structs.replace(engine, ranks=[rank.with_offers() for rank in engine.ranks])
        got = [rank.tp_rank for rank in engine.ranks]
        if tp_ranks is not None and got != sorted(set(tp_ranks)):
            raise HandshakeError(
                f"engine {engine.engine_id!r} at {peer} answered TP ranks {got}, asked for {sorted(set(tp_ranks))}"
            )
        logger.debug("handshake with %s: engine %r ranks %s", peer, engine.engine_id, got)
        return engine


def handshake_outcome(error: BaseException | None) -> str:
    """The ``outcome`` label of a handshake that ended with ``error`` (None: ``ok``)."""
    if error is None:
        return "ok"
    if isinstance(error, HandshakeBackoff):
        return "backoff"
    if isinstance(error, HandshakeTimeout):
        return "timeout"
    if isinstance(error, AuthenticationError):
        return "auth"
    if isinstance(error, IncompatiblePeer):
        return "incompatible"
    if isinstance(error, HandshakeRefused):
        return "version" if error.code == "unsupported_version" else "refused"
    return "error"
