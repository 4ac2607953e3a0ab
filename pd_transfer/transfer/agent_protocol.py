"""The agent interface, written once: what the layers above ``transfer/`` use of an agent, and how they get one.

:class:`Agent` is that surface: memory, peers, descriptor lists, reads and writes (on read lanes too),
notifications, polling, closing. It extends :class:`~.lanes.LaneAgent`, the part the read lanes use of each lane
and of their owner. :class:`~.agent.TransferAgent` (NIXL) satisfies it, and so does
the tests' ``FakeAgent`` (``tests/support/fake_agent.py``: memory copies, for unit tests): mypy checks both, where
each is defined, through :class:`AgentFactory`.

Whatever makes agents (the connector's ranks) takes an :class:`AgentFactory` handed in at the edge where it is
made: the engine's integration, the CLI and the stand-ins' engines use the default, :data:`~.agent.NIXL_AGENTS`;
unit tests hand in a fake fabric's factory.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Protocol, TypeVar

import numpy as np

from pd_transfer.settings import Settings
from pd_transfer.spec import KVRegion

from .dlists import DescriptorList
from .lanes import LaneAgent, LaneRead, ReadLanes
from .read_stats import ReadStats

#: Called for every notification that arrives: (the sending peer's name, the payload).
NotificationHandler = Callable[[str, bytes], None]
T = TypeVar("T")


class Agent(LaneAgent, Protocol):
    """An agent as the connector uses it (beyond :class:`~.lanes.LaneAgent`'s registrations, peers, descriptor
    lists, reads and notifications). Raises ``TransferError`` (``PeerDisconnected``, ``TransferTimeout``,
    ``UnknownPeer``) where the transfer layer fails, ``ValueError`` for arguments no agent could take."""

    @property
    def settings(self) -> Settings:
        """The settings the agent was made with (read by its users too: push sizes, TLS, thread CPUs)."""

    @property
    def metadata(self) -> bytes:
        """This agent's metadata with its registered memory: a peer that adds it may read and write that memory."""

    @property
    def connection_metadata(self) -> bytes:
        """This agent's metadata without memory: a peer that adds it may notify this agent, not read it."""

    @property
    def notifications_received(self) -> int:
        """Notifications that arrived so far (handled or dropped)."""

    def register_regions(self, regions: Sequence[KVRegion]) -> object:
        """Register the memory behind ``regions`` (all in one memory); returns the registration."""

    def has_peer(self, peer: str) -> bool:
        """Whether ``peer`` was added (and not removed since)."""

    def write(
        self,
        local: DescriptorList,
        local_indices: np.ndarray,
        remote: DescriptorList,
        remote_indices: np.ndarray,
        *,
        notification: bytes = b"",
        timeout_s: float = 30.0,
    ) -> ReadStats:
        """Push ``local[local_indices[i]]`` into ``remote[remote_indices[i]]`` for every i; blocks until done.
        ``notification`` reaches the peer after the data landed. Raises as ``read``."""

    # ------------------------------------------------------------------ read lanes
    @property
    def lanes(self) -> ReadLanes | None:
        """The read lanes, once up (None without them)."""

    @property
    def lanes_ready(self) -> threading.Event:
        """Set once the read lanes asked for are up, or failed to start (at once without lanes)."""

    @property
    def lane_count(self) -> int:
        """How many threads a read can run on now: the lanes that are up, and this agent."""

    @property
    def max_lane_jobs(self) -> int:
        """The most jobs ``run_on_lanes`` takes now."""

    def lanes_for(self, lists: Iterable[DescriptorList]) -> int:
        """How many lanes can read ``lists`` now (1: this agent alone)."""

    def run_on_lanes(
        self, jobs: Sequence[Callable[[LaneRead], T]], timeout_s: float, *, lanes: int | None = None
    ) -> list[T]:
        """Run each job on a thread of its own (``jobs[0]`` on the calling one), job ``k`` given the READ of lane
        ``k % lanes`` (default :attr:`lane_count`); returns their results in order once all returned, else raises
        the first failure (a disconnect before others), ``TransferTimeout`` for a job not done in ``timeout_s``.
        At most :attr:`max_lane_jobs` jobs. The peers get no notification: send it with ``notify``."""

    # ------------------------------------------------------------------ notifications
    def set_expecting_reads(self, expecting: bool) -> None:
        """Poll fast while peers are expected to read from us (or answer us), slowly again once False."""

    def expecting_traffic(self) -> AbstractContextManager[None]:
        """Poll fast while inside this block (a peer writes to us); nested blocks count."""

    def poll(self) -> bool:
        """Deliver what arrived now, on the calling thread; True if anything came."""


class AgentFactory(Protocol):
    """Makes an agent as the connector asks for one: ``name`` (unique among the agents that may meet),
    ``on_notification`` called for every notification that arrives (on the agent's delivery thread: keep it
    short), ``read_lanes`` agents and threads a large read may be split over, ``serves_reads``: peers read from
    this agent (a prefill rank's), ``settings`` the agent's."""

    def __call__(
        self,
        name: str,
        *,
        on_notification: NotificationHandler | None = None,
        read_lanes: int = 1,
        serves_reads: bool = False,
        settings: Settings,
    ) -> Agent: ...
