"""Side-channel messages: typed msgspec structs, one tagged union, msgpack on the wire; never pickle.

A decode process asks a prefill process for its metadata in two round trips::

    client -> server   Hello(protocol_version, client_nonce)
    server -> client   Challenge(server_nonce, auth_required)
    client -> server   GetMetadata(..., server_nonce, mac)      mac = HMAC(secret, server_nonce | request)
    server -> client   Metadata(engine, mac) | ErrorReply(code, message)

Without a configured secret, ``mac`` fields are empty and ignored.
"""

from __future__ import annotations

from typing import Literal, Union

import msgspec

from pd_transfer.spec import KVCacheLayout, KVRegion, ModelFingerprint

from .versions import PROTOCOL_VERSION

#: Largest frame the server or the client will try to decode (bytes).
MAX_FRAME_BYTES = 16 * 1024 * 1024

ErrorCode = Literal[
    "malformed",  # the frame did not decode as a message
    "too_large",  # the frame exceeded MAX_FRAME_BYTES
    "unsupported_version",  # the protocol versions do not overlap
    "unexpected_message",  # a valid message the server does not answer
    "auth_required",  # the server has a secret and the request carried no valid MAC
    "auth_failed",  # the MAC did not verify, or the nonce was unknown or reused
    "incompatible",  # the fingerprints differ; the message names the fields
    "unknown_rank",  # a requested TP rank is not served here
    "internal",  # the server failed; it keeps serving
]


class RankMetadata(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One TP rank of an engine: its NIXL agent and where its cache lives in its process."""

    tp_rank: int
    agent_name: str
    agent_metadata: bytes  # nixl_agent.get_agent_metadata()
    layout: KVCacheLayout
    regions: list[KVRegion]


class EngineMetadata(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Everything a decode process needs to read from a prefill engine."""

    engine_id: str
    fingerprint: ModelFingerprint
    tp_size: int
    ranks: list[RankMetadata]  # only the ranks asked for, ordered by tp_rank


class Hello(msgspec.Struct, tag="hello", frozen=True, forbid_unknown_fields=True):
    protocol_version: int = PROTOCOL_VERSION
    client_nonce: bytes = b""


class Challenge(msgspec.Struct, tag="challenge", frozen=True, forbid_unknown_fields=True):
    protocol_version: int
    server_nonce: bytes
    auth_required: bool


class GetMetadata(msgspec.Struct, tag="get_metadata", frozen=True, forbid_unknown_fields=True):
    protocol_version: int
    fingerprint: ModelFingerprint
    tp_ranks: list[int] | None  # None: every rank the server holds
    client_nonce: bytes
    server_nonce: bytes
    mac: bytes = b""


class Metadata(msgspec.Struct, tag="metadata", frozen=True, forbid_unknown_fields=True):
    protocol_version: int
    engine: EngineMetadata
    mac: bytes = b""  # HMAC(secret, client_nonce | encoded engine): the server proves it knows the secret


class ErrorReply(msgspec.Struct, tag="error", frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    code: ErrorCode
    message: str
    fields: list[str] = []  # "incompatible": the fingerprint fields that differ (omitted on the wire when empty)


Message = Union[Hello, Challenge, GetMetadata, Metadata, ErrorReply]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)
_engine_encoder = msgspec.msgpack.Encoder()


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode(frame: bytes) -> Message:
    """Decode one frame; raises ``msgspec.DecodeError`` / ``ValueError`` on anything malformed."""
    if len(frame) > MAX_FRAME_BYTES:
        raise ValueError(f"frame of {len(frame)} bytes exceeds the limit of {MAX_FRAME_BYTES}")
    return _decoder.decode(frame)


def encode_engine(engine: EngineMetadata) -> bytes:
    """Canonical bytes of an engine's metadata (what the reply MAC covers)."""
    return _engine_encoder.encode(engine)
