"""The ``tcp`` transport's connection: its frames, its offer and its opening (a decode rank proves it knows the
side channel's secret; the prefill rank names itself).

A frame is a 4-byte big-endian length, then msgpack ``[kind, ...]``; a ``rows`` frame is followed by the rows' bytes,
nothing else. In order, on a new connection:

* prefill -> decode ``["challenge", nonce]`` (32 random bytes);
* decode -> prefill ``["hello", name, mac]``: the decode rank's name (its agent's: the lease protocol's reports are
  counted by it) and :func:`~pd_transfer.handshake.auth.connection_mac` over the nonce and the name (``b""`` without a
  secret); a prefill with a secret refuses a wrong one (``["refused", reason]``, then it closes);
* prefill -> decode ``["welcome", name]``: its rank's name, which the decode checks against the rank it meant to reach
  (a prefill restarted at the same port is another incarnation: its memory is not the one planned for).

Then, any number of times, either way round: decode -> prefill ``["read", read_id, rows]`` (``rows``: the prefill's
rows as :data:`~pd_transfer.transfer.cma.IOVEC` entries, each inside its cache) answered in order by ``["rows",
read_id, nbytes]`` and the bytes, or ``["refused", read_id, reason]``; ``["message", payload]`` (an encoded
:mod:`pd_transfer.connector.messages` message) either way. Digests (issue 42), asked only of a prefill whose offer
says ``digests``: a ``read`` may carry a fourth field, rows of the cache (some of those read) whose digest
(:func:`~pd_transfer.transfer.digests.rows_digest`, of the bytes as the cache holds them when it answers) then comes as
a fourth field of ``rows``, for the decode to compare with the same rows where they landed; unless a block holding
them changed since its request was held (:mod:`pd_transfer.connector.held_digests`): then ``["changed", read_id,
reason]`` answers instead, nothing sent, and the decode fails the read as a mismatch. Streams: :mod:`.stream_sender`.
"""

from __future__ import annotations

import socket
import struct
from typing import Any

import msgspec

#: A frame's length prefix.
_HEADER = struct.Struct("!I")
#: The longest frame taken (a read of 4M rows); longer ones end the connection.
MAX_FRAME = 64 * 2**20
#: Bytes read at a time while a frame comes in.
_CHUNK = 4 * 2**20


class TcpOffer(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """What a prefill rank publishes under ``tcp``: the port it listens on (at its side channel's host), and whether
    it answers a stream's ``verify`` (``digests``; a prefill before issue 42 names no such field: False)."""

    port: int
    digests: bool = False


class BadFrame(ValueError):
    """A frame that is too long, does not decode, or is no list starting with its kind."""


def encode_offer(port: int) -> bytes:
    return msgspec.msgpack.encode(TcpOffer(port=port, digests=True))


def decode_offer(payload: bytes) -> TcpOffer:
    """The offer in ``payload``; ``BadFrame`` for one that does not decode or names no port."""
    try:
        offer = msgspec.msgpack.decode(payload, type=TcpOffer)
    except (msgspec.DecodeError, msgspec.ValidationError) as error:
        raise BadFrame(f"a tcp offer that does not decode: {str(error)[:200]}") from None
    if not 0 < offer.port < 65536:
        raise BadFrame(f"a tcp offer of port {offer.port}")
    return offer


def send_frame(sock: socket.socket, frame: list[Any]) -> None:
    """Send ``frame`` (its sender holds the connection's send lock)."""
    payload = msgspec.msgpack.encode(frame)
    sock.sendall(_HEADER.pack(len(payload)) + payload)


def receive_frame(sock: socket.socket) -> list[Any] | None:
    """The next frame, or None once the peer closed; ``BadFrame`` for a malformed one."""
    header = _exactly(sock, _HEADER.size)
    if header is None:
        return None
    (length,) = _HEADER.unpack(header)
    if length > MAX_FRAME:
        raise BadFrame(f"a frame of {length} bytes (at most {MAX_FRAME})")
    payload = _exactly(sock, length)
    if payload is None:
        return None
    try:
        frame = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as error:
        raise BadFrame(f"a frame that does not decode: {str(error)[:200]}") from None
    if not isinstance(frame, list) or not frame or not isinstance(frame[0], str):
        raise BadFrame("a frame is a list that starts with its kind")
    return frame


def expect(frame: list[Any] | None, kind: str, *types: type) -> list[Any]:
    """``frame``'s fields after its kind, checked to be ``kind`` with fields of ``types``; ``BadFrame`` otherwise
    (None: the peer closed)."""
    if frame is None:
        raise BadFrame(f"the peer closed the connection where a {kind!r} frame was due")
    if frame[0] != kind:
        raise BadFrame(f"a {str(frame[0])[:40]!r} frame where a {kind!r} frame was due")
    return fields(frame, *types)


def fields(frame: list[Any], *types: type) -> list[Any]:
    """``frame``'s fields after its kind, checked against ``types``; ``BadFrame`` otherwise."""
    values = frame[1:]
    if len(values) != len(types) or not all(isinstance(v, t) for v, t in zip(values, types, strict=True)):
        raise BadFrame(f"a {str(frame[0])[:40]!r} frame with fields of the wrong number or kind")
    return values


def wake(sock: socket.socket) -> None:
    """Wake whatever waits on ``sock`` (``shutdown``: its calls return, its peer sees the end), leaving it open: only
    the thread that moves rows through it closes it (a number closed under a call the C library is making could be
    a new connection's by its next call)."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # not connected (a listener), or closed already


def shut(sock: socket.socket) -> None:
    """:func:`wake`, then close ``sock``: by the thread that owns it, or for a socket no other thread uses."""
    wake(sock)
    sock.close()


def _exactly(sock: socket.socket, count: int) -> bytes | None:
    buffer = bytearray(count)
    view = memoryview(buffer)
    got = 0
    while got < count:
        received = sock.recv_into(view[got:], min(count - got, _CHUNK))
        if not received:
            return None
        got += received
    return bytes(buffer)
