"""Typed errors of the offload package: bad input from the caller, never a crash deep inside."""

from __future__ import annotations


class OffloadError(Exception):
    """Base class of every error the offload package raises on purpose."""


class OffloadInputError(OffloadError, ValueError):
    """An argument is malformed: wrong key length, block ids out of range, shapes that disagree, bad sizes."""


class OffloadStateError(OffloadError):
    """An operation does not fit the block's state: loading a block that is not stored, completing a store
    that was never prepared. The manager is unchanged when this is raised."""


class WorkerClosedError(OffloadError):
    """A transfer was submitted to a worker that has been closed."""


def brief(error: BaseException) -> str:
    """The error's type and the first 200 characters of its message (never a whole, possibly untrusted,
    string in a log line or a result)."""
    return f"{type(error).__name__}: {str(error)[:200]}"
