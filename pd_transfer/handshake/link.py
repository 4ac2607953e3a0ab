"""One side-channel attempt's connection: a DEALER socket watched by a ZMQ socket monitor, so that a refused or
dropped connection ends the attempt at once instead of at its deadline. Shared by the metadata handshake
(:mod:`.client`) and the release (:mod:`.release`)."""

from __future__ import annotations

import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from .endpoints import is_ipv6, tcp_endpoint
from .errors import AuthenticationError, HandshakeError, HandshakeRefused, IncompatiblePeer
from .messages import MAX_FRAME_BYTES, Challenge, ErrorReply, Hello, Message, decode, encode

MONITORED = zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_DISCONNECTED


class AttemptFailed(Exception):
    """One attempt failed at the connection level (internal: turned into a retry or ``HandshakeTimeout``).

    ``retry``: whether another attempt may help (not after an attempt that never connected in its whole timeout).
    """

    def __init__(self, reason: str, *, retry: bool = True) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry = retry


class Link:
    """One attempt's DEALER socket and its monitor: waits for a reply while watching the TCP connection."""

    def __init__(self, socket: zmq.Socket, monitor: zmq.Socket) -> None:
        self.socket = socket
        self.monitor = monitor
        self.connected = False
        self._poller = zmq.Poller()
        self._poller.register(socket, zmq.POLLIN)
        self._poller.register(monitor, zmq.POLLIN)

    def receive(self, deadline: float, waiting_for: str, timeout_s: float) -> list[bytes]:
        """The next reply's frames; ``AttemptFailed`` when the connection is refused or dropped, or at the
        deadline."""
        while True:
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0:
                if not self.connected:
                    raise AttemptFailed(f"no TCP connection in {timeout_s:g} s", retry=False)
                raise AttemptFailed(f"no {waiting_for} in {timeout_s:g} s")
            ready = dict(self._poller.poll(remaining_ms))
            if self.socket in ready:
                return self.socket.recv_multipart(zmq.NOBLOCK)
            if self.monitor in ready:
                self._event(recv_monitor_message(self.monitor, zmq.NOBLOCK)["event"])

    def _event(self, event: int) -> None:
        if event == zmq.EVENT_CONNECTED:
            self.connected = True
        elif event == zmq.EVENT_CONNECT_RETRIED and not self.connected:
            raise AttemptFailed("connection refused")
        elif event == zmq.EVENT_DISCONNECTED:
            raise AttemptFailed("connection closed by the peer")

    def send(self, message: Message, deadline: float) -> None:
        """Queue ``message``; ``AttemptFailed`` when there is no time or room left before ``deadline``."""
        remaining_ms = int((deadline - time.monotonic()) * 1000)
        if remaining_ms <= 0:
            raise AttemptFailed(f"no time left to send {type(message).__name__}")
        self.socket.setsockopt(zmq.SNDTIMEO, remaining_ms)
        try:
            self.socket.send(encode(message))
        except zmq.Again as exc:
            raise AttemptFailed(f"no room to send {type(message).__name__}") from exc

    def close(self) -> None:
        """Stop monitoring and close both sockets (idempotent)."""
        try:
            self.socket.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(linger=0)
        self.socket.close(linger=0)


def open_link(context: zmq.Context, host: str, port: int) -> Link:
    """A DEALER socket connecting to ``host:port`` (bounded frames, no linger) with its monitor."""
    socket = context.socket(zmq.DEALER)
    try:
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        if is_ipv6(host):
            socket.setsockopt(zmq.IPV6, 1)
        monitor = socket.get_monitor_socket(MONITORED)
    except BaseException:
        socket.close(linger=0)
        raise
    link = Link(socket, monitor)
    try:
        socket.connect(tcp_endpoint(host, port))
    except BaseException:
        link.close()
        raise
    return link


def receive(link: Link, peer: str, deadline: float, waiting_for: str, timeout_s: float) -> Message:
    """The next reply of ``peer``, decoded; ``HandshakeError`` for anything but one decodable frame."""
    frames = link.receive(deadline, waiting_for, timeout_s)
    if len(frames) != 1:
        raise HandshakeError(f"handshake server {peer} sent {len(frames)} frames, expected 1")
    try:
        return decode(frames[0])
    except Exception as exc:
        raise HandshakeError(f"handshake server {peer} sent an undecodable reply: {str(exc)[:200]}") from exc


def greet(
    link: Link,
    peer: str,
    deadline: float,
    timeout_s: float,
    *,
    version: int,
    accepted: frozenset[int],
    client_nonce: bytes,
    has_secret: bool,
) -> Challenge:
    """``Hello`` -> ``Challenge``, checked: the version the server answers in must be one this client accepts, and
    both sides must agree on whether there is a secret. A server refusing ``version`` (releases before version 2
    refuse rather than answer in their own) is asked again in each older accepted version. Raises
    ``HandshakeRefused`` (code ``unsupported_version``, naming both sides' versions), ``AuthenticationError``,
    ``HandshakeError`` or ``AttemptFailed``."""
    asked = version
    while True:
        link.send(Hello(protocol_version=asked, client_nonce=client_nonce), deadline)
        challenge = receive(link, peer, deadline, "Challenge", timeout_s)
        older = [v for v in accepted if v < asked]
        if isinstance(challenge, ErrorReply) and challenge.code == "unsupported_version" and older:
            asked = max(older)  # a server of an older release, which refuses rather than answering in its version
            continue
        if not isinstance(challenge, Challenge):
            raise unexpected(peer, challenge, "Challenge", version)
        break
    if challenge.protocol_version not in accepted or challenge.protocol_version > asked:
        raise HandshakeRefused(
            "unsupported_version",
            f"handshake server {peer} speaks protocol version {challenge.protocol_version}; this client speaks"
            f" {version} (accepts {sorted(accepted)})",
            peer=peer,
        )
    if challenge.auth_required and not has_secret:
        raise AuthenticationError(
            f"handshake server {peer} requires a shared secret and this client has none: "
            "configure the same handshake secret on both sides"
        )
    if has_secret and not challenge.auth_required:
        raise AuthenticationError(
            f"handshake server {peer} does not authenticate, but this client has a secret: "
            "configure the same handshake secret on both sides"
        )
    return challenge


def unexpected(peer: str, message: Message, waiting_for: str, version: int) -> HandshakeError:
    """The error for a reply other than ``waiting_for``: the peer's refusal as a typed error, or a protocol error."""
    if isinstance(message, ErrorReply):
        if message.code in ("auth_required", "auth_failed"):
            return AuthenticationError(
                f"handshake server {peer} refused our credentials ({message.code}): {message.message}",
                code=message.code,
            )
        if message.code == "incompatible":
            return IncompatiblePeer(message.message, message.fields, peer=peer)
        if message.code == "unsupported_version":
            return HandshakeRefused(message.code, f"{message.message}; this client speaks {version}", peer=peer)
        return HandshakeRefused(message.code, message.message, peer=peer)
    return HandshakeError(f"handshake server {peer} sent {type(message).__name__}, expected {waiting_for}")
