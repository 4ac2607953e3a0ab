"""The reader seam: the one interface through which a decode rank moves a request's bytes from a prefill engine,
whatever moves them (NIXL reads or pushes, CUDA IPC copies, reads in place), chosen once per engine at connect.

A :class:`~.remote_engines.RemoteEngine` names its ``transport`` when it is connected (``nixl``, ``cuda_ipc``,
``host_ipc``, ``host_cma``: :mod:`.transport_choice`; or the name of a reader added to the decode rank, whose
:data:`~.remote_engines.Claim` took the engine first); the decode rank holds one :class:`Reader` per transport, made
once, and hands every request of that engine to it. Nothing after the connect asks what kind of reader or engine it has.
Adding a transport: docs/architecture.md, "Adding a transport".
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from .reads import ReadTotals
    from .remote_engines import RemoteEngine
    from .request import PullRequest


class Reader(Protocol):
    """Moves requests' bytes from engines connected with its transport into the decode rank's cache."""

    def read(self, remote: RemoteEngine, request: PullRequest, deadline: float, *, pushed: bool) -> ReadTotals:
        """Move ``request`` from ``remote`` into the cache, fixed up into our layout, and tell its prefill ranks
        (``ReadDone``); ``deadline``: ``time.perf_counter`` time by which it must be done (a reader bounded by its
        own timeout may keep to that); ``pushed``: a reader that can ask the prefill to write may. Block ids that do
        not fit the plan raise ``ValueError`` before anything moves; a prefill process gone ``PeerDisconnected``;
        any other failure a ``TransferError``."""
        ...

    def close(self) -> None:
        """Release what the reader holds (threads, pools); requests in flight finish first."""
        ...
