"""Side channel: a decode process fetches a prefill engine's KV cache metadata over ZMQ (msgpack, HMAC)."""

from .client import HandshakeClient
from .errors import (
    AuthenticationError,
    HandshakeBackoff,
    HandshakeError,
    HandshakeRefused,
    HandshakeTimeout,
    IncompatiblePeer,
)
from .messages import (
    MAX_FRAME_BYTES,
    Challenge,
    EngineMetadata,
    ErrorReply,
    GetMetadata,
    Hello,
    Metadata,
    RankMetadata,
    decode,
    encode,
    encode_engine,
)
from .server import HandshakeServer
from .versions import PROTOCOL_VERSION, SUPPORTED_VERSIONS

__all__ = [
    "MAX_FRAME_BYTES",
    "PROTOCOL_VERSION",
    "SUPPORTED_VERSIONS",
    "AuthenticationError",
    "Challenge",
    "EngineMetadata",
    "ErrorReply",
    "GetMetadata",
    "HandshakeBackoff",
    "HandshakeClient",
    "HandshakeError",
    "HandshakeRefused",
    "HandshakeServer",
    "HandshakeTimeout",
    "Hello",
    "IncompatiblePeer",
    "Metadata",
    "RankMetadata",
    "decode",
    "encode",
    "encode_engine",
]
