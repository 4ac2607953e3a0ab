"""Errors raised by the handshake client (the server answers with ``ErrorReply`` instead of raising)."""

from __future__ import annotations


class HandshakeError(Exception):
    """Base of every handshake failure."""


class HandshakeTimeout(HandshakeError):
    """The peer did not answer in time, on every attempt."""

    def __init__(self, peer: str, attempts: int, timeout_s: float) -> None:
        self.peer = peer
        self.attempts = attempts
        self.timeout_s = timeout_s
        super().__init__(
            f"handshake with {peer} timed out: no answer after {attempts} attempt(s) of {timeout_s:g} s each"
        )


class HandshakeRefused(HandshakeError):
    """The peer answered with an ``ErrorReply``; ``code`` is its ``ErrorCode``, ``message`` its explanation."""

    def __init__(self, code: str, message: str, *, peer: str = "") -> None:
        self.code = code
        self.message = message
        self.peer = peer
        where = f" by {peer}" if peer else ""
        super().__init__(f"handshake refused{where} ({code}): {message}")


class IncompatiblePeer(HandshakeRefused):
    """The peer serves a different model fingerprint; ``fields`` names the differing fields."""

    def __init__(self, message: str, fields: list[str], *, peer: str = "") -> None:
        self.fields = list(fields)
        super().__init__("incompatible", message, peer=peer)


class AuthenticationError(HandshakeError):
    """A secret is missing on one side, the MACs do not verify, or the peer refused ours.

    ``code`` is the peer's ``ErrorCode`` when the peer refused us, else ``None`` (we rejected the peer).
    """

    def __init__(self, message: str, *, code: str | None = None) -> None:
        self.code = code
        super().__init__(message)
