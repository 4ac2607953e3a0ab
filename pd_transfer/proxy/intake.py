"""Taking a client's request in: media type, size, read deadline, memory held by bodies, and JSON decoding.

Every way a body can be unusable ends in :class:`Rejected` with a 4xx (or 503 when the proxy is full) and a reason
that names no more than 80 characters of what the client sent; nothing here raises anything else for bad input.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web

from pd_transfer.spec import clipped

#: Reasons a request is refused before routing, the ``reason`` label of ``pd_proxy_rejected_total``.
REASONS = ("media_type", "too_large", "body_timeout", "busy", "invalid_json")


class Rejected(Exception):
    """The request is refused before any backend sees it: ``status`` and ``message`` go to the client, ``reason``
    (one of :data:`REASONS`) to the metrics."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason


class BodyBudget:
    """Bytes of request bodies the proxy holds at once, over all requests in flight (single event loop).

    A request reserves its ``Content-Length`` (or the per-body limit when it sends none) before its body is read
    and releases it when the request ends, so bodies in flight never hold more than ``limit_bytes``.
    """

    def __init__(self, limit_bytes: int) -> None:
        if limit_bytes < 1:
            raise ValueError(f"the in-flight body limit must be positive, got {limit_bytes}")
        self.limit_bytes = limit_bytes
        self.held_bytes = 0

    def try_reserve(self, size: int) -> bool:
        if self.held_bytes + size > self.limit_bytes:
            return False
        self.held_bytes += size
        return True

    def release(self, size: int) -> None:
        self.held_bytes -= size


@dataclass(frozen=True)
class IntakeLimits:
    max_body_bytes: int  # one request's body
    body_timeout_s: float  # from the handler's start until the whole body has arrived


def check_media_type(request: web.Request) -> None:
    """JSON bodies only: ``application/json`` or a ``+json`` type (a request without the header is read as JSON)."""
    declared = request.headers.get("Content-Type")
    if declared is None or declared == "application/json":  # the common cases, without parsing the header
        return
    mimetype = request.content_type.lower()
    if mimetype != "application/json" and not mimetype.endswith("+json"):
        raise Rejected(415, "media_type", f"the body must be application/json, not {clipped(mimetype)}")


def reservation(request: web.Request, limits: IntakeLimits) -> int:
    """Bytes to reserve for this request's body; 413 when its declared length is over the limit."""
    declared = request.content_length
    if declared is None:
        return limits.max_body_bytes
    if declared > limits.max_body_bytes:
        raise Rejected(413, "too_large", f"the request body of {declared} bytes exceeds {limits.max_body_bytes}")
    return declared


async def read_body(request: web.Request, limits: IntakeLimits) -> bytes:
    """The whole body within ``body_timeout_s`` (408 otherwise) and ``max_body_bytes`` (413 otherwise)."""
    try:
        if request.content.is_eof():  # all of it came with the headers (a small body): nothing to wait for
            return await request.read()
        async with asyncio.timeout(limits.body_timeout_s):
            return await request.read()
    except TimeoutError:
        raise Rejected(
            408, "body_timeout", f"the request body did not arrive within {limits.body_timeout_s} s"
        ) from None
    except web.HTTPRequestEntityTooLarge:
        raise Rejected(413, "too_large", f"the request body exceeds {limits.max_body_bytes} bytes") from None


def decode_json(raw: bytes) -> Any:
    """The body as JSON values; 400 naming why for anything that is not UTF-8 JSON of sane nesting."""
    try:
        return msgspec.json.decode(raw)
    except RecursionError:
        raise Rejected(400, "invalid_json", "the request body is nested too deeply") from None
    except UnicodeDecodeError as e:
        raise not_utf8(e) from None
    except (msgspec.DecodeError, ValueError) as e:
        try:  # msgspec 0.22 raises UnicodeDecodeError for bad UTF-8, later ones a DecodeError: name it the same
            raw.decode("utf-8")
        except UnicodeDecodeError as bad:
            raise not_utf8(bad) from None
        raise Rejected(400, "invalid_json", f"the request body is not valid JSON: {clipped(str(e), 120)}") from None


def not_utf8(e: UnicodeDecodeError) -> Rejected:
    """The 400 for a body that is not UTF-8, naming the first bad byte's offset."""
    return Rejected(400, "invalid_json", f"the request body is not valid UTF-8 (byte {e.start})")
