"""Errors raised by the handshake client (the server answers with ``ErrorReply`` instead of raising)."""

from __future__ import annotations


class HandshakeError(Exception):
    """Base of every handshake failure."""


class HandshakeTimeout(HandshakeError):
    """The peer could not be reached on any attempt: no answer in time, or the connection refused or dropped.

    ``reasons`` says what happened on each attempt (e.g. ``"connection refused"``, ``"no Challenge in 2 s"``).
    """

    def __init__(self, peer: str, attempts: int, timeout_s: float, reasons: list[str] | None = None) -> None:
        self.peer = peer
        self.attempts = attempts
        self.timeout_s = timeout_s
        self.reasons = list(reasons or [])
        timed_out = all(reason.startswith("no ") for reason in self.reasons)
        if timed_out:
            message = f"handshake with {peer} timed out: no answer after {attempts} attempt(s) of {timeout_s:g} s each"
        else:
            message = f"handshake with {peer} failed: {attempts} attempt(s) of up to {timeout_s:g} s each"
        if self.reasons:
            message += f" ({_summary(self.reasons)})"
        super().__init__(message)

    @property
    def refused(self) -> bool:
        """Whether the last attempt's connection was refused (nothing listens at the endpoint)."""
        return bool(self.reasons) and self.reasons[-1] == "connection refused"


class HandshakeBackoff(HandshakeTimeout):
    """Not attempted: a handshake with this endpoint failed at the connection level moments ago.

    ``cause`` is that failure; ``failures`` how many in a row; ``retry_in_s`` how long until the next attempt
    is allowed (a success or ``HandshakeClient.forget()`` clears the record at once).
    """

    def __init__(self, peer: str, cause: HandshakeTimeout, failures: int, failed_ago_s: float, retry_in_s: float):
        self.cause = cause
        self.failures = failures
        self.retry_in_s = retry_in_s
        self.peer = peer
        self.attempts = 0
        self.timeout_s = cause.timeout_s
        self.reasons = list(cause.reasons)
        HandshakeError.__init__(
            self,
            f"handshake with {peer} not attempted: it failed {failed_ago_s:.1f} s ago ({cause});"
            f" next attempt in {retry_in_s:.1f} s ({failures} failure(s) in a row)",
        )


def _summary(reasons: list[str]) -> str:
    """``["a", "a", "b"]`` -> ``"a x2; b"``, in order of first appearance."""
    counts: dict[str, int] = {}
    for reason in reasons:
        counts[reason] = counts.get(reason, 0) + 1
    return "; ".join(reason if count == 1 else f"{reason} x{count}" for reason, count in counts.items())


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
