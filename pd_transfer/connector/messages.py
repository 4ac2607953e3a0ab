"""Messages between a decode reader and a prefill sender, carried as NIXL notifications.

Tagged msgspec structs, msgpack on the wire; anything that does not decode is dropped and counted.

Decode -> prefill: ``ReadDone`` (attached to the last read; carries ``reply_to`` when the reader wants a
``LeaseConfirm``), ``ReadFailed`` (gave up, or will never read), ``ReleaseUnread`` (no decode rank reads
this prefill rank's copy), ``LeaseHeartbeat`` (still coming: extend the lease).
Prefill -> decode: ``LeaseConfirm`` (were the blocks still held when the ``ReadDone`` arrived?).
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
    # the reader's NIXL connection metadata (no memory): when set, the prefill answers with LeaseConfirm
    reply_to: bytes = b""


class ReadFailed(msgspec.Struct, tag="read_failed", frozen=True, forbid_unknown_fields=True):
    """A decode rank gave up on a request's blocks (it counts as done for freeing)."""

    request_id: str
    reader_engine_id: str
    reader_rank: int
    expected_readers: int
    reason: str


class ReleaseUnread(msgspec.Struct, tag="release_unread", frozen=True, forbid_unknown_fields=True):
    """No decode rank reads this prefill rank's copy of a request (its heads are read from another rank
    holding the same ones: replicated KV heads, MLA): free it now. Sent by decode rank 0."""

    request_id: str
    reader_engine_id: str


class LeaseHeartbeat(msgspec.Struct, tag="lease_heartbeat", frozen=True, forbid_unknown_fields=True):
    """A decode still means to read a request (it is queued): extend the request's lease."""

    request_id: str
    reader_engine_id: str
    reader_rank: int


class LeaseConfirm(msgspec.Struct, tag="lease_confirm", frozen=True, forbid_unknown_fields=True):
    """The prefill's answer to a ``ReadDone`` carrying ``reply_to``: ``ok`` only if the request's blocks
    were still held (not expired, freed or unknown) when the ``ReadDone`` arrived. The prefill never frees
    held blocks before their readers report or the lease ends, so ``ok`` proves the read saw live blocks."""

    request_id: str
    ok: bool
    reason: str


#: What a reader reports about a request (counted towards freeing it).
ReaderReport = Union[ReadDone, ReadFailed, ReleaseUnread]
PeerMessage = Union[ReadDone, ReadFailed, ReleaseUnread, LeaseHeartbeat, LeaseConfirm]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(PeerMessage)


def encode(message: PeerMessage) -> bytes:
    return _encoder.encode(message)


def decode(payload: bytes) -> PeerMessage:
    """Raises ``msgspec.DecodeError`` or ``ValueError`` on anything malformed."""
    if len(payload) > MAX_NOTIFICATION_BYTES:
        raise ValueError(f"notification of {len(payload)} bytes exceeds {MAX_NOTIFICATION_BYTES}")
    return _decoder.decode(payload)
