"""HMAC-SHA256 over the handshake: the client proves it knows the secret, then the server does.

Each MAC covers a domain label (so a request MAC can never pass as a reply MAC), the length-prefixed
nonce, and the payload bytes. A request MAC covers the whole ``GetMetadata`` or ``Release`` encoded with ``mac=b""``
(the encoding starts with the message's tag, so one kind can never pass as the other).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

import msgspec

from .messages import GetMetadata, Release, encode

NONCE_BYTES = 32

_REQUEST_LABEL = b"pd-transfer/handshake/request\x00"
_REPLY_LABEL = b"pd-transfer/handshake/reply\x00"
_CONNECTION_LABEL = b"pd-transfer/connection/hello\x00"


def as_secret(secret: bytes | str | None) -> bytes | None:
    """Normalise a configured secret: ``str`` is UTF-8 encoded; ``None`` and empty mean no secret."""
    if secret is None:
        return None
    if isinstance(secret, str):
        secret = secret.encode("utf-8")
    if not isinstance(secret, bytes):
        raise TypeError(f"secret must be bytes or str, got {type(secret).__name__}")
    return secret or None


def new_nonce() -> bytes:
    """A fresh random nonce of ``NONCE_BYTES`` (32) bytes."""
    return secrets.token_bytes(NONCE_BYTES)


def _mac(secret: bytes | str, label: bytes, nonce: bytes, payload: bytes) -> bytes:
    key = as_secret(secret)
    if key is None:
        raise ValueError("a MAC needs a non-empty secret")
    mac = hmac.new(key, digestmod=hashlib.sha256)
    mac.update(label)
    mac.update(len(nonce).to_bytes(8, "big"))
    mac.update(nonce)
    mac.update(payload)
    return mac.digest()


def request_mac(secret: bytes | str, server_nonce: bytes, request_without_mac: bytes) -> bytes:
    """MAC of a ``GetMetadata``: ``request_without_mac`` is the request encoded with ``mac=b""``."""
    return _mac(secret, _REQUEST_LABEL, server_nonce, request_without_mac)


def reply_mac(secret: bytes | str, client_nonce: bytes, engine_bytes: bytes) -> bytes:
    """MAC of a ``Metadata`` reply: ``engine_bytes`` is ``encode_engine(engine)`` of the engine sent."""
    return _mac(secret, _REPLY_LABEL, client_nonce, engine_bytes)


def connection_mac(secret: bytes | str, server_nonce: bytes, client_name: bytes) -> bytes:
    """MAC of a transport connection's hello: the client (a decode rank, ``client_name``) answering the nonce the
    server (a prefill rank's listener) sent first."""
    return _mac(secret, _CONNECTION_LABEL, server_nonce, client_name)


def verify(expected: bytes, got: bytes) -> bool:
    """Constant-time comparison of two MACs."""
    return hmac.compare_digest(expected, got)


def get_metadata_mac(secret: bytes | str, request: GetMetadata | Release) -> bytes:
    """The MAC a ``GetMetadata`` (or a ``Release``) must carry: over the request with ``mac=b""`` and its server
    nonce."""
    unsigned = msgspec.structs.replace(request, mac=b"")
    return request_mac(secret, request.server_nonce, encode(unsigned))


signed_request_mac = get_metadata_mac
