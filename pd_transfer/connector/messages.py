"""Messages between a decode reader and a prefill sender, carried as NIXL notifications.

Tagged msgspec structs, msgpack on the wire; anything that does not decode is dropped and counted.
"""

from __future__ import annotations

from typing import Union

import msgspec

#: Largest notification payload we decode (bytes).
MAX_NOTIFICATION_BYTES = 64 * 1024


class ReadDone(msgspec.Struct, tag="read_done", frozen=True, forbid_unknown_fields=True):
    """A decode rank finished reading a request's blocks from this prefill rank."""

    request_id: str
    reader_engine_id: str
    reader_rank: int
    expected_readers: int  # decode ranks that read from this prefill rank for this request


class ReadFailed(msgspec.Struct, tag="read_failed", frozen=True, forbid_unknown_fields=True):
    """A decode rank gave up on a request's blocks (it counts as done for freeing)."""

    request_id: str
    reader_engine_id: str
    reader_rank: int
    expected_readers: int
    reason: str


PeerMessage = Union[ReadDone, ReadFailed]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(PeerMessage)


def encode(message: PeerMessage) -> bytes:
    return _encoder.encode(message)


def decode(payload: bytes) -> PeerMessage:
    """Raises ``msgspec.DecodeError`` or ``ValueError`` on anything malformed."""
    if len(payload) > MAX_NOTIFICATION_BYTES:
        raise ValueError(f"notification of {len(payload)} bytes exceeds {MAX_NOTIFICATION_BYTES}")
    return _decoder.decode(payload)
