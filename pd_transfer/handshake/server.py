"""The prefill side of the side channel: a ZMQ ROUTER answering ``Hello``, ``GetMetadata`` and ``Release``.

Each request is one frame from a DEALER client; the ROUTER sees ``[identity, payload]`` and answers
``[identity, reply]``. Nothing a peer sends can stop the serving loop: undecodable input gets
``ErrorReply("malformed")``, unexpected failures ``ErrorReply("internal")``, and frames larger than
``MAX_REQUEST_BYTES`` are dropped by ZMQ itself (``ZMQ_MAXMSGSIZE``), which disconnects that peer. A peer that sends
without reading its replies costs bounded memory: ZMQ queues at most ``PEER_REQUEST_QUEUE`` of its requests (then TCP
holds it back) and ``PEER_REPLY_QUEUE`` replies to it (then drops them).

Where a rank has an offer for decodes on its host (a ``TransportOffer`` with ``same_host``, e.g. same-host IPC), the
server makes a host token (:mod:`.host_identity`) on the first ``Hello``, names it in every ``Challenge``, and keeps
those offers in a ``Metadata`` only for a request whose ``host_proof`` verifies under a fresh nonce of its own (used up
then, as a MAC's is); everyone else gets the ranks without them. The token file is removed by :meth:`stop`. Each client
gets the ranks as its protocol version reads them (:meth:`~.messages.RankMetadata.for_version`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from types import TracebackType

import msgspec
import zmq

from pd_transfer.metrics import TransferMetrics, default_metrics

from .auth import as_secret, new_nonce, reply_mac, signed_request_mac, verify
from .compat import fingerprint_fields_differing, info_labels
from .endpoints import is_ipv6, tcp_endpoint
from .host_identity import HostToken
from .messages import (
    MAX_FRAME_BYTES,
    MAX_REQUEST_BYTES,
    Challenge,
    EngineMetadata,
    ErrorCode,
    ErrorReply,
    GetMetadata,
    Hello,
    HostIdentity,
    Metadata,
    RankMetadata,
    Release,
    ReleaseOutcome,
    ReleaseReply,
    decode,
    encode,
    encode_engine,
)
from .nonces import NonceBook
from .refusal_log import RefusalLog
from .versions import PROTOCOL_VERSION, RELEASE_VERSION, SUPPORTED_VERSIONS

logger = logging.getLogger(__name__)

Reply = Challenge | Metadata | ReleaseReply | ErrorReply
#: Ends the lease of a request's blocks, nobody will read them: (request id, a decode may be reading it now) ->
#: whether they were held. Called on the serving thread: it must not block.
ReleaseHandler = Callable[[str, bool], bool]

#: Error codes counted as refusals in ``HandshakeServer.stats`` (the peer was understood, then refused).
_REFUSALS: frozenset[str] = frozenset(
    {
        "unsupported_version",
        "unexpected_message",
        "auth_required",
        "auth_failed",
        "incompatible",
        "unknown_rank",
        "unknown_engine",
    }
)
_NONCE_REFUSALS: dict[str, str] = {
    "unknown": "unknown server nonce (not issued by this server): send Hello first",
    "expired": "expired server nonce: send Hello again",
    "reused": "server nonce already used",
    "busy": "too many authenticated handshakes within the nonce lifetime: retry shortly",
}
#: Requests ZMQ queues per peer connection (ZMQ_RCVHWM; ZMQ's default is 1000). A client has one request outstanding
#: at a time; a peer that sends more without reading replies is held back by TCP. With 1000, rounds of 50 peers each
#: sending 400 junk frames without reading took a server from 33 MiB to 84-125 MiB in three rounds, and a vLLM engine
#: core from 615 to 1,044 MiB in six (the queued frames, then the memory they had taken, kept by the allocator).
PEER_REQUEST_QUEUE = 4
#: Replies ZMQ queues per peer connection (ZMQ_SNDHWM): more for a peer that does not read are dropped, so it holds at
#: most this many replies of the server's memory. Not 4: ZMQ learns what a peer has read asynchronously, and at 4 it
#: dropped about one reply in 4,000 to a peer that read each reply before its next request (none in 60,000 at 64).
PEER_REPLY_QUEUE = 64
_MAX_REASON_CHARS = 200
_MAX_BATCH = 64  # messages handled per poll wake-up before checking for stop() again


class HandshakeServer:
    """Serves an engine's ``EngineMetadata`` to decode processes, in a daemon thread.

    ``engine`` is the metadata itself or a callable returning it (called for every ``GetMetadata``, so it
    may change over time). With ``secret`` set, requests must carry an HMAC over a single-use server
    nonce (valid ``nonce_ttl_s`` seconds; at most ``max_outstanding_nonces`` used ones remembered) and replies carry
    one back. ``on_release`` answers ``Release`` (version 2; without it a ``Release`` is refused as unexpected).
    ``protocol_version`` / ``supported_versions``: what this server speaks (other values only to test mixed
    versions). ``stats`` counts ``challenges``, ``served``, ``released``, ``refused``, ``malformed``,
    ``too_large``, ``internal`` and ``dropped`` (replies ZMQ could not queue); it is written by the serving thread
    only. ``metrics`` (default: the process's) counts refused frames by reason and refused nonces by why.
    ``offer_host``: name this host in challenges so that same-host clients can prove it and get the ranks' IPC
    sections (default: when ``engine`` is the metadata itself and a rank has one; a callable is not asked).
    """

    def __init__(
        self,
        engine: EngineMetadata | Callable[[], EngineMetadata],
        host: str = "127.0.0.1",
        port: int = 0,
        secret: bytes | str | None = None,
        nonce_ttl_s: float = 30.0,
        max_outstanding_nonces: int = 4096,
        *,
        poll_interval_s: float = 0.05,
        clock: Callable[[], float] = time.monotonic,
        on_release: ReleaseHandler | None = None,
        protocol_version: int = PROTOCOL_VERSION,
        supported_versions: frozenset[int] = SUPPORTED_VERSIONS,
        metrics: TransferMetrics | None = None,
        offer_host: bool | None = None,
    ) -> None:
        if not (0 <= port <= 65535):
            raise ValueError(f"port must be in 0..65535, got {port}")
        self._engine_source = engine
        self._engine_id = engine.engine_id if isinstance(engine, EngineMetadata) else "?"
        self.host = host
        self._requested_port = port
        self._secret = as_secret(secret)
        self._nonces = NonceBook(nonce_ttl_s, max_outstanding_nonces, clock)
        self._refusals = RefusalLog(
            logger, lambda: f"handshake server for engine {self._engine_id!r}: refusals", clock=clock
        )
        self._poll_ms = max(1, int(poll_interval_s * 1000))
        self._on_release = on_release
        self.protocol_version = protocol_version
        self.supported_versions = frozenset(supported_versions) | {protocol_version}
        self.metrics = metrics if metrics is not None else default_metrics()
        self.stats: dict[str, int] = dict.fromkeys(
            ("challenges", "served", "released", "refused", "malformed", "too_large", "internal", "dropped"), 0
        )
        self._port: int | None = None
        self._context: zmq.Context | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        if offer_host is None:
            offer_host = isinstance(engine, EngineMetadata) and any(_same_host_offer(rank) for rank in engine.ranks)
        self._offer_host = offer_host
        self._host_token: HostToken | None = None  # made on the first Hello, if offered

    # ------------------------------------------------------------------ lifecycle

    @property
    def port(self) -> int:
        """The bound TCP port (after ``start()``)."""
        if self._port is None:
            raise RuntimeError("the handshake server is not started")
        return self._port

    @property
    def address(self) -> str:
        """``tcp://host:port`` (after ``start()``)."""
        return tcp_endpoint(self.host, self.port)

    @property
    def used_nonces(self) -> int:
        """Used server nonces remembered now (each until it expires; at most ``max_outstanding_nonces``). Any thread
        may read it."""
        return len(self._nonces)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> HandshakeServer:
        """Bind (port 0 picks a free port) and start serving in a daemon thread."""
        if self._context is not None:
            raise RuntimeError("the handshake server was already started")
        context = zmq.Context()
        socket = context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        socket.setsockopt(zmq.RCVHWM, PEER_REQUEST_QUEUE)
        socket.setsockopt(zmq.SNDHWM, PEER_REPLY_QUEUE)
        socket.setsockopt(zmq.ROUTER_MANDATORY, 0)
        if is_ipv6(self.host):
            socket.setsockopt(zmq.IPV6, 1)
        endpoint = tcp_endpoint(self.host, self._requested_port or "*")
        try:
            socket.bind(endpoint)
        except zmq.ZMQError as exc:
            socket.close(linger=0)
            context.term()
            raise OSError(f"handshake server for engine {self._engine_id!r} cannot bind {endpoint}: {exc}") from exc
        last = socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._port = int(last.rsplit(":", 1)[1])
        self._context = context
        self._thread = threading.Thread(
            target=self._serve, args=(socket,), name=f"handshake-server-{self._port}", daemon=True
        )
        self._thread.start()
        if isinstance(self._engine_source, EngineMetadata):
            self.metrics.describe(info_labels(self._engine_source.fingerprint, self.protocol_version))
        logger.info("handshake server for engine %r listening on %s", self._engine_id, self.address)
        return self

    def stop(self, timeout_s: float = 1.0) -> None:
        """Stop serving and close the socket; returns within about one poll interval (50 ms by default)."""
        if self._thread is None:
            return
        self._stopping.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("handshake server on port %s did not stop within %.3f s", self._port, timeout_s)
            return
        if self._context is not None:
            self._context.term()
            self._context = None
        if self._host_token is not None:
            self._host_token.close()
        logger.info("handshake server for engine %r on port %s stopped", self._engine_id, self._port)

    def __enter__(self) -> HandshakeServer:
        if self._context is None:
            self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # ------------------------------------------------------------------ serving loop

    def _serve(self, socket: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)
        try:
            while not self._stopping.is_set():
                if not poller.poll(self._poll_ms):
                    continue
                for _ in range(_MAX_BATCH):
                    try:
                        frames = socket.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    try:
                        self._handle(socket, frames)
                    except zmq.ContextTerminated:
                        raise
                    except Exception:  # never let one message end the loop
                        self.stats["internal"] += 1
                        logger.exception("handshake server for engine %r: failed handling a message", self._engine_id)
        except zmq.ContextTerminated:
            pass
        except Exception:  # a ZMQ failure outside any one message: nothing left to serve with
            logger.exception("handshake server on port %s: serving loop failed", self._port)
        finally:
            socket.close(linger=0)

    def _handle(self, socket: zmq.Socket, frames: list[zmq.Frame]) -> None:
        identity = frames[0].bytes
        peer = _peer_label(identity, frames)
        try:
            reply = self._answer(frames[1:], peer)
            payload = encode(reply)
            if len(payload) > MAX_FRAME_BYTES:
                raise ValueError(f"reply of {len(payload)} bytes exceeds MAX_FRAME_BYTES={MAX_FRAME_BYTES}")
        except Exception:
            logger.exception("handshake server for engine %r: internal error answering %s", self._engine_id, peer)
            self.stats["internal"] += 1
            reply = ErrorReply("internal", f"engine {self._engine_id!r} failed to answer; see its log")
            payload = encode(reply)
        try:
            socket.send_multipart([identity, payload], zmq.NOBLOCK)
        except zmq.Again:
            self.stats["dropped"] += 1
            self._refusals.log(
                logging.WARNING,
                "handshake server for engine %r: reply to %s dropped (not reading)",
                self._engine_id,
                peer,
            )
        except zmq.ContextTerminated:
            raise
        except zmq.ZMQError as exc:
            self.stats["dropped"] += 1
            logger.warning("handshake server for engine %r: reply to %s failed: %s", self._engine_id, peer, exc)

    # ------------------------------------------------------------------ protocol

    def _answer(self, frames: list[zmq.Frame], peer: str) -> Reply:
        if len(frames) != 1:
            return self._malformed(peer, f"expected 1 payload frame, got {len(frames)}")
        data = frames[0].bytes
        if not data:
            return self._malformed(peer, "empty frame")
        if len(data) > MAX_REQUEST_BYTES:  # ZMQ_MAXMSGSIZE normally drops these first
            self.stats["too_large"] += 1
            self._count_rejected("too_large")
            return ErrorReply("too_large", f"frame of {len(data)} bytes exceeds {MAX_REQUEST_BYTES}")
        try:
            message = decode(data)
        except Exception as exc:  # anything that does not decode is the peer's fault, never ours
            return self._malformed(peer, f"undecodable frame: {exc}")
        if isinstance(message, Hello):
            return self._on_hello(message, peer)
        if isinstance(message, GetMetadata):
            return self._on_get_metadata(message, peer)
        if isinstance(message, Release) and self._on_release is not None:
            return self._on_release_message(message, peer)
        return self._refuse(peer, "unexpected_message", f"a server does not answer {type(message).__name__}")

    def _on_hello(self, hello: Hello, peer: str) -> Reply:
        """A ``Challenge`` in the version this server will speak with the peer: the peer's own, or this server's
        when the peer is newer (the peer then decides whether it speaks that one too)."""
        version = min(hello.protocol_version, self.protocol_version)
        refusal = self._check_version(version, peer, asked=hello.protocol_version)
        if refusal is not None:
            return refusal
        host = self._host_identity()
        # checked with a secret, or with a host proof
        nonce = self._nonces.issue() if self._secret is not None or host is not None else new_nonce()
        self.stats["challenges"] += 1
        logger.debug(
            "handshake server for engine %r: challenge (version %d) sent to %s", self._engine_id, version, peer
        )
        return Challenge(
            protocol_version=version, server_nonce=nonce, auth_required=self._secret is not None, host=host
        )

    def _host_identity(self) -> HostIdentity | None:
        """The host token's identity when offered (the token is made the first time), else None."""
        if self._host_token is None:
            if not self._offer_host:
                return None
            try:
                self._host_token = HostToken()
            except OSError as error:
                self._offer_host = False
                logger.warning(
                    "engine %r: no host token (%s): same-host IPC is not offered, decodes read with NIXL",
                    self._engine_id,
                    error,
                )
                return None
        return self._host_token.identity

    def _host_proven(self, request: GetMetadata, peer: str) -> bool:
        """Whether ``request`` proves its sender reads our host token, under a fresh nonce of ours (used up here
        when there is no secret: with one, authentication uses it up next)."""
        token = self._host_token
        if token is None or not request.host_proof:
            return False
        if self._nonces.check(request.server_nonce) != "ok":
            return False
        if not token.verify(request.host_proof, request.server_nonce, request.client_nonce):
            self._refusals.log(
                logging.WARNING,
                "handshake server for engine %r: host proof of %s does not verify",
                self._engine_id,
                peer,
            )
            return False
        return self._secret is not None or self._nonces.consume(request.server_nonce) == "ok"

    def _on_get_metadata(self, request: GetMetadata, peer: str) -> Reply:
        refusal = self._check_version(request.protocol_version, peer)
        if refusal is not None:
            return refusal
        same_host = self._host_proven(request, peer)
        if self._secret is not None:
            refusal = self._authenticate(request, self._secret, peer)
            if refusal is not None:
                return refusal

        engine = self._current_engine()
        fields = fingerprint_fields_differing(engine.fingerprint, request.fingerprint)
        if fields:
            detail = "; ".join(engine.fingerprint.differences(request.fingerprint))
            message = f"engine {engine.engine_id!r} serves a different model (server != client): {detail}"
            return self._refuse(peer, "incompatible", message, fields=fields)

        by_rank = {rank.tp_rank: rank for rank in engine.ranks}
        wanted = sorted(by_rank) if request.tp_ranks is None else sorted(set(request.tp_ranks))
        missing = [tp_rank for tp_rank in wanted if tp_rank not in by_rank]
        if missing:
            shown = f"{missing[:8]}{f' and {len(missing) - 8} more' if len(missing) > 8 else ''}"
            message = f"engine {engine.engine_id!r} does not serve TP rank(s) {shown}; it serves {sorted(by_rank)}"
            return self._refuse(peer, "unknown_rank", message)

        ranks = [by_rank[tp_rank] for tp_rank in wanted]
        if not same_host:
            ranks = [rank.without_same_host() for rank in ranks]
        elif any(_same_host_offer(rank) for rank in ranks):
            logger.info("engine %r: same-host offers of ranks %s sent to %s", engine.engine_id, wanted, peer)
        ranks = [rank.for_version(request.protocol_version) for rank in ranks]
        served = msgspec.structs.replace(engine, ranks=ranks)
        mac = reply_mac(self._secret, request.client_nonce, encode_engine(served)) if self._secret else b""
        self.stats["served"] += 1
        logger.debug("handshake server for engine %r: ranks %s sent to %s", engine.engine_id, wanted, peer)
        return Metadata(protocol_version=request.protocol_version, engine=served, mac=mac)

    def _on_release_message(self, request: Release, peer: str) -> Reply:
        """End the lease of ``request.request_id`` through ``on_release``, after the same checks as a
        ``GetMetadata`` (version, MAC over a fresh nonce) and that it names the engine served here."""
        refusal = self._check_version(request.protocol_version, peer, minimum=RELEASE_VERSION)
        if refusal is None and self._secret is not None:
            refusal = self._authenticate(request, self._secret, peer)
        if refusal is not None:
            return refusal
        engine_id = self._current_engine().engine_id
        if request.engine_id != engine_id:
            message = f"this side channel serves engine {engine_id!r}, not {_shown(request.engine_id)}"
            return self._refuse(peer, "unknown_engine", message)
        assert self._on_release is not None
        outcome: ReleaseOutcome = (
            "releasing" if self._on_release(request.request_id, request.read_possible) else "not_held"
        )
        self.stats["released"] += 1
        logger.info(
            "engine %r: release of request %s asked by %s: %s", engine_id, _shown(request.request_id), peer, outcome
        )
        return ReleaseReply(protocol_version=request.protocol_version, request_id=request.request_id, outcome=outcome)

    def _authenticate(self, request: GetMetadata | Release, secret: bytes, peer: str) -> ErrorReply | None:
        """Refuse a request without a valid MAC over a nonce of ours that is fresh and unused. The MAC is checked
        before the nonce is marked used, so a peer without the secret cannot use up anyone's nonce."""
        if not request.mac:
            message = f"engine {self._engine_id!r} requires authentication: configure the shared handshake secret"
            return self._refuse(peer, "auth_required", message)
        if self._nonces.check(request.server_nonce) == "ok" and not verify(
            signed_request_mac(secret, request), request.mac
        ):
            return self._refuse(peer, "auth_failed", "request MAC does not verify (different shared secret?)")
        outcome = self._nonces.consume(request.server_nonce)
        if outcome != "ok":
            self.metrics.nonces_refused.labels(outcome).inc()
            return self._refuse(peer, "auth_failed", _NONCE_REFUSALS[outcome])
        return None

    def _current_engine(self) -> EngineMetadata:
        source = self._engine_source
        engine = source if isinstance(source, EngineMetadata) else source()
        if not isinstance(engine, EngineMetadata):
            raise TypeError(f"the engine callable returned {type(engine).__name__}, not EngineMetadata")
        self._engine_id = engine.engine_id
        return engine

    def _check_version(
        self, version: int, peer: str, *, asked: int | None = None, minimum: int = 0
    ) -> ErrorReply | None:
        """Refuse ``version`` (the peer asked for ``asked``, default ``version``) unless this server speaks it, naming
        both sides' versions."""
        if version in self.supported_versions and version >= minimum:
            return None
        message = (
            f"engine {self._engine_id!r} does not support handshake protocol version"
            f" {version if asked is None else asked}{' for this message' if version < minimum else ''};"
            f" it speaks {self.protocol_version} (supported: {sorted(self.supported_versions)})"
        )
        return self._refuse(peer, "unsupported_version", message)

    def _count_rejected(self, reason: str) -> None:
        self.metrics.side_channel_rejected.labels(reason).inc()

    def _refuse(self, peer: str, code: ErrorCode, message: str, fields: list[str] | None = None) -> ErrorReply:
        self.stats["refused"] += 1
        self._count_rejected(code)
        self._refusals.log(
            logging.WARNING, "handshake server for engine %r: refused %s (%s): %s", self._engine_id, peer, code, message
        )
        return ErrorReply(code=code, message=message, fields=fields or [])

    def _malformed(self, peer: str, reason: str) -> ErrorReply:
        self.stats["malformed"] += 1
        self._count_rejected("malformed")
        reason = reason[:_MAX_REASON_CHARS]
        self._refusals.log(
            logging.INFO, "handshake server for engine %r: malformed message from %s: %s", self._engine_id, peer, reason
        )
        return ErrorReply(code="malformed", message=reason)


def _shown(text: str) -> str:
    """Peer-supplied text for a reply or a log line: quoted, and cut to ``_MAX_REASON_CHARS``."""
    return repr(text[:_MAX_REASON_CHARS]) + ("..." if len(text) > _MAX_REASON_CHARS else "")


def _peer_label(identity: bytes, frames: list[zmq.Frame]) -> str:
    """The peer's TCP address when ZMQ knows it, and its ROUTER identity."""
    address = "?"
    if len(frames) > 1:
        try:
            address = str(frames[1].get("Peer-Address"))
        except Exception:  # only a log label: never fail over it
            pass
    return f"{address} (identity {identity.hex()})"


def _same_host_offer(rank: RankMetadata) -> bool:
    """Whether ``rank`` offers anything for decodes on its host only."""
    return rank.ipc is not None or rank != rank.without_same_host()
