"""The proxy's HTTP answers of its own: JSON and OpenAI-style errors, relayed backend answers, error texts."""

from __future__ import annotations

import socket
from collections.abc import Mapping
from typing import Any

import msgspec
from aiohttp import web

from pd_transfer.proxy import flow

REQUEST_ID = "X-Request-Id"


class HopError(Exception):
    """A hop failed on the backend side: the client gets ``status`` (502 by default) naming the ``hop`` and the
    ``backend`` (its URL; None when no backend was tried); ``answered``: the status the backend answered, when the
    failure is its answer."""

    def __init__(
        self,
        hop: str,
        backend: str | None,
        kind: str,
        message: str,
        status: int = 502,
        answered: int | None = None,
    ) -> None:
        super().__init__(message)
        self.hop = hop
        self.backend = backend
        self.kind = kind
        self.status = status
        self.answered = answered
        self.counted = False  # in the errors metric already (failed attempts are counted as they fail)


class Passthrough(Exception):
    """A backend's 4xx answer, handed to the client as it is (the request is at fault, not the backend)."""

    def __init__(self, response: web.Response) -> None:
        super().__init__(response.status)
        self.response = response


class ClientGone(Exception):
    def __init__(self, response: web.StreamResponse) -> None:
        super().__init__("client disconnected")
        self.response = response


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket on ``host:port`` (0: a free port), reusable right after a restart."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def json_response(body: Any, status: int, rid: str | None = None) -> web.Response:
    headers = {"Content-Type": "application/json"}
    if rid is not None:
        headers[REQUEST_ID] = rid
    return web.Response(body=msgspec.json.encode(body), status=status, headers=headers)


def error_response(status: int, message: str, type_: str, rid: str, **extra: Any) -> web.Response:
    return json_response(flow.error_body(message, type_, code=status, **extra), status, rid)


def relayed_response(status: int, headers: Mapping[str, str], raw: bytes, rid: str) -> web.Response:
    """A backend's answer (``status``, its ``headers``, body ``raw``) to the client: its body and content type, the
    request id."""
    return web.Response(
        body=raw,
        status=status,
        headers={"Content-Type": headers.get("Content-Type", "application/json"), REQUEST_ID: rid},
    )


def snippet(raw: bytes, limit: int = 200) -> str:
    text = raw.decode("utf-8", "replace").strip()
    return text if len(text) <= limit else text[:limit] + "..."


def describe_error(error: BaseException) -> str:
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
