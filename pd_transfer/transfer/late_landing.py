"""Memory a timed-out read may still land in: kept allocated and registered for the life of the process.

A READ that timed out is not over: NIXL may refuse to release its handle
(:meth:`.session.NixlSession.release_transfer`), and over UCX's TCP transport the bytes come in whenever the
connection resumes (a network cut healed, say) and are copied to the read's local address then. Scratch memory freed
after such a read (the warm-up reads of a new peer) was written into after the heal: the heap was corrupted and the
decode aborted (``malloc(): invalid size``; issue 42, tests/process/test_network_cut.py). What such a read targets is
handed to :func:`keep` instead of being freed or deregistered: a few hundred bytes to a few KiB per timed-out
warm-up.
"""

from __future__ import annotations

import threading

_KEPT: list[object] = []
_LOCK = threading.Lock()


def keep(*things: object) -> None:
    """Keep ``things`` (a buffer, its registration, its descriptor list) alive until the process exits."""
    with _LOCK:
        _KEPT.extend(things)


def kept() -> int:
    """How many things :func:`keep` holds."""
    with _LOCK:
        return len(_KEPT)
