"""An in-process stand-in for :class:`pd_transfer.transfer.agent.TransferAgent`: an
:class:`~pd_transfer.transfer.agent_protocol.Agent` without NIXL.

For unit tests of the connector's logic (plans, read indices, leases, confirmations, push) with the prefill and the
decode in one process: reads and writes copy bytes between registered host memory with ``ctypes.memmove``, and
notifications reach the peer's handler on its own delivery thread, as the real agent's poller hands them out. What
the fake checks, it checks as NIXL does: descriptor rows must lie inside registered memory (the local agent's, or the
spans the peer's metadata named when it was added), and still inside registered memory of both agents when a read or
write copies them (a deregistered region is refused, not read: a test that freed memory after preparing rows of it
fails loudly instead of copying freed bytes), a remote row and its local row must be of one length, a peer must
be added before rows of it are prepared, and a peer whose agent is closed is disconnected
(:class:`~pd_transfer.transfer.PeerDisconnected`).

Agents find each other in a :class:`FakeFabric` by the name their metadata carries (``DEFAULT_FABRIC`` unless one is
given). Tests hand a fabric's :meth:`FakeFabric.new_agent` to what makes the connector's agents, as its
``agent_factory`` (an :class:`~pd_transfer.transfer.agent_protocol.AgentFactory`, which mypy checks here:
:data:`DEFAULT_FAKE_AGENTS`; pyproject's ``tool.mypy`` names this file beside ``pd_transfer``). Only the tests use it:
it lives with them.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

import msgspec
import numpy as np

from pd_transfer.settings import DEFAULTS, Settings
from pd_transfer.spec import HOST, KVRegion, MemoryPlace, memory_of
from pd_transfer.transfer import PeerDisconnected, ReadStats, TransferError, UnknownPeer
from pd_transfer.transfer.agent_protocol import AgentFactory, NotificationHandler
from pd_transfer.transfer.dlists import DescriptorList, nothing_to_move
from pd_transfer.transfer.lanes import LaneRead

logger = logging.getLogger(__name__)

T = TypeVar("T")
Spans = list[tuple[int, int]]  # (start, end) byte addresses, sorted, merged


class _Metadata(msgspec.Struct, frozen=True, tag="pd-transfer-fake-agent"):
    """What a fake agent's metadata carries: its name and the memory a peer may read and write."""

    name: str
    spans: list[tuple[int, int]]


def _merged(spans: Sequence[tuple[int, int]]) -> Spans:
    """``spans`` sorted, touching and overlapping ones merged, empty ones dropped."""
    merged: Spans = []
    for start, end in sorted((s, e) for s, e in spans if e > s):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _outside(rows: np.ndarray, spans: Spans) -> int:
    """How many rows (N x 3: address, length, device) do not lie whole inside one of ``spans``."""
    if not spans:
        return int(rows.shape[0])
    starts = np.array([start for start, _ in spans], dtype=np.uint64)
    ends = np.array([end for _, end in spans], dtype=np.uint64)
    addresses, lengths = rows[:, 0], rows[:, 1]
    index = np.searchsorted(starts, addresses, side="right").astype(np.int64) - 1
    inside = (index >= 0) & (addresses + lengths <= ends[np.maximum(index, 0)])
    return int((~inside).sum())


class FakeFabric:
    """The fake agents that can reach each other, by name. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._agents: dict[str, FakeAgent] = {}

    def join(self, agent: FakeAgent) -> None:
        with self._lock:
            if agent.name in self._agents:
                raise TransferError(f"fake fabric: an agent named {agent.name!r} is up already")
            self._agents[agent.name] = agent

    def leave(self, agent: FakeAgent) -> None:
        with self._lock:
            if self._agents.get(agent.name) is agent:
                del self._agents[agent.name]

    def find(self, name: str) -> FakeAgent | None:
        with self._lock:
            return self._agents.get(name)

    def new_agent(
        self,
        name: str,
        *,
        on_notification: NotificationHandler | None = None,
        read_lanes: int = 1,
        serves_reads: bool = False,
        settings: Settings = DEFAULTS,
    ) -> FakeAgent:
        """A :class:`FakeAgent` on this fabric, made as an agent factory makes one (read lanes and serving are
        accepted and ignored): what tests hand in as ``agent_factory``."""
        return FakeAgent(
            name,
            on_notification=on_notification,
            read_lanes=read_lanes,
            serves_reads=serves_reads,
            settings=settings,
            fabric=self,
        )


DEFAULT_FABRIC = FakeFabric()


class FakeAgent:
    """The agent interface (``Agent``) over plain memory copies. The constructor takes ``TransferAgent``'s arguments
    (read lanes, polling and serving settings are accepted and ignored) and a ``fabric`` to join."""

    def __init__(
        self,
        name: str,
        *,
        on_notification: NotificationHandler | None = None,
        idle_poll_interval_s: float = 0.02,
        read_lanes: int = 1,
        split_min_bytes: int = 0,
        serves_reads: bool = False,
        settings: Settings = DEFAULTS,
        fabric: FakeFabric | None = None,
    ) -> None:
        self.name = name
        self.settings = settings  # read by the agent's users (push sizes, TLS); the fake itself ignores them
        self.fabric = fabric if fabric is not None else DEFAULT_FABRIC
        self.native_progress_ms = 0
        self.notifications_received = 0
        self.lanes = None
        self.lane_count = 1  # every read is this agent's own
        self.max_lane_jobs = 1
        self.lanes_ready = threading.Event()
        self.lanes_ready.set()
        self._on_notification = on_notification
        self._lock = threading.RLock()
        self._registrations: dict[int, Spans] = {}  # registration id -> its spans
        self._next_registration = 0
        self._peers: dict[str, Spans] = {}  # peer name -> the memory its metadata named
        self._dlists: list[DescriptorList] = []
        self._inbox: deque[tuple[str, bytes]] = deque()
        self._arrived = threading.Condition()
        self._delivering = threading.Lock()  # one delivery at a time, in order of arrival
        self._polls = 0
        self._closed = False
        self.fabric.join(self)
        self._delivery = threading.Thread(target=self._deliver_forever, name=f"{name}-fake-poller", daemon=True)
        self._delivery.start()

    # ------------------------------------------------------------------ memory
    def register_regions(self, regions: Sequence[KVRegion]) -> object:
        """Register the memory behind ``regions`` (host memory only); returns the registration."""
        spans = [(r.base_address, r.base_address + r.span_bytes) for r in regions]
        return self.register_spans(spans, place=memory_of(list(regions)))

    def register_spans(
        self, spans: Sequence[tuple[int, int]], *, huge_pages: bool | None = None, place: MemoryPlace = HOST
    ) -> object:
        """Register host memory given as (start, end) byte addresses; returns the registration (an int). A fake
        agent copies with the CPU: device memory is refused (``TransferError``)."""
        _host_only(self.name, place)
        merged = _merged(spans)
        if not merged:
            raise ValueError("no memory to register: every span is empty")
        with self._lock:
            self._next_registration += 1
            self._registrations[self._next_registration] = merged
            return self._next_registration

    def deregister(self, registration: object) -> None:
        with self._lock:
            if isinstance(registration, int):
                self._registrations.pop(registration, None)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (peers then see it as disconnected)."""
        return self._closed

    def registered_spans(self) -> Spans:
        """The byte spans of every registration, merged."""
        with self._lock:
            return _merged([span for spans in self._registrations.values() for span in spans])

    @property
    def metadata(self) -> bytes:
        """This agent's name and registered memory, for the side channel."""
        return msgspec.msgpack.encode(_Metadata(self.name, self.registered_spans()))

    @property
    def connection_metadata(self) -> bytes:
        """This agent's name without any memory: enough for a peer to notify it, not to read it."""
        return msgspec.msgpack.encode(_Metadata(self.name, []))

    # ------------------------------------------------------------------ peers
    def add_peer(self, agent_metadata: bytes) -> str:
        """Load a peer's metadata; returns its name. Re-adding a known peer refreshes the memory it names."""
        try:
            peer = msgspec.msgpack.decode(agent_metadata, type=_Metadata)
        except msgspec.ValidationError as error:
            raise TransferError(f"agent {self.name}: adding a remote agent failed: {error}") from error
        with self._lock:
            self._peers[peer.name] = _merged(peer.spans)
        return peer.name

    def remove_peer(self, peer: str) -> None:
        """Forget a peer and release every descriptor list prepared for it."""
        with self._lock:
            for dlist in [d for d in self._dlists if d.peer == peer]:
                self.release_dlist(dlist)
            self._peers.pop(peer, None)

    def has_peer(self, peer: str) -> bool:
        with self._lock:
            return peer in self._peers

    # ------------------------------------------------------------------ descriptor lists
    def prepare_local(self, rows: np.ndarray, place: MemoryPlace = HOST) -> DescriptorList:
        """Prepare local rows (N x 3 uint64: address, length, 0) inside registered host memory."""
        _host_only(self.name, place)
        return self._prepare("", rows, self.registered_spans())

    def prepare_remote(self, peer: str, rows: np.ndarray, place: MemoryPlace = HOST) -> DescriptorList:
        """Prepare rows of a peer's host memory (as its metadata named it)."""
        _host_only(self.name, place)
        with self._lock:
            spans = self._peers.get(peer)
        if spans is None:
            raise UnknownPeer(f"agent {self.name}: no peer {peer!r}; add it first")
        return self._prepare(peer, rows, spans)

    def _prepare(self, peer: str, rows: np.ndarray, spans: Spans) -> DescriptorList:
        rows = np.ascontiguousarray(rows, dtype=np.uint64)
        if rows.ndim != 2 or rows.shape[1] != 3 or rows.shape[0] == 0:
            raise ValueError(f"descriptor rows must be a non-empty N x 3 array, got shape {rows.shape}")
        outside = _outside(rows, spans)
        if outside:
            where = f"peer {peer}" if peer else "local memory"
            raise TransferError(
                f"agent {self.name}: preparing {rows.shape[0]} descriptors of {where} failed: {outside} rows lie"
                " outside registered memory"
            )
        dlist = DescriptorList(self, None, peer, rows)  # no NIXL handle: the fake copies by the rows
        with self._lock:
            self._dlists.append(dlist)
        return dlist

    def release_dlist(self, dlist: DescriptorList) -> None:
        with self._lock:
            dlist.released = True
            if dlist in self._dlists:
                self._dlists.remove(dlist)

    # ------------------------------------------------------------------ reads and writes
    def read(
        self,
        local: DescriptorList,
        local_indices: np.ndarray,
        remote: DescriptorList,
        remote_indices: np.ndarray,
        *,
        notification: bytes = b"",
        timeout_s: float = 30.0,
    ) -> ReadStats:
        """Copy ``remote[remote_indices[i]]`` into ``local[local_indices[i]]`` for every i, then notify the peer
        (``notification``, if any). Raises as ``TransferAgent.read``."""
        return self._transfer("read", local, local_indices, remote, remote_indices, notification)

    def read_whole(
        self,
        local: DescriptorList,
        local_indices: np.ndarray,
        remote: DescriptorList,
        remote_indices: np.ndarray,
        notification: bytes,
        timeout_s: float,
    ) -> ReadStats:
        """:meth:`read` (a fake agent never splits a read)."""
        return self._transfer("read", local, local_indices, remote, remote_indices, notification)

    def lanes_for(self, lists: Iterable[DescriptorList]) -> int:
        """1: no list is read on lanes."""
        return 1

    def run_on_lanes(
        self, jobs: Sequence[Callable[[LaneRead], T]], timeout_s: float, *, lanes: int | None = None
    ) -> list[T]:
        """The one job of ``jobs``, on this thread, reading with :meth:`read_whole` (``ValueError`` for more)."""
        if len(jobs) != 1:
            raise ValueError(f"{len(jobs)} jobs, but fake agent {self.name} has no read lanes")

        def read(
            local: DescriptorList,
            mine: np.ndarray,
            remote: DescriptorList,
            theirs: np.ndarray,
            timeout_s: float,
        ) -> ReadStats:
            return self.read_whole(local, mine, remote, theirs, b"", timeout_s)

        return [jobs[0](read)]

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
        """Copy ``local[local_indices[i]]`` into ``remote[remote_indices[i]]`` for every i, then notify the peer."""
        return self._transfer("write", local, local_indices, remote, remote_indices, notification)

    def _transfer(
        self,
        verb: str,
        local: DescriptorList,
        local_indices: np.ndarray,
        remote: DescriptorList,
        remote_indices: np.ndarray,
        notification: bytes,
    ) -> ReadStats:
        started = time.perf_counter()
        if nothing_to_move(self.name, local, local_indices, remote, remote_indices):
            return ReadStats(bytes=0, descriptors=0, post_seconds=0.0, seconds=0.0)
        ours = local.rows[np.asarray(local_indices, dtype=np.int64)]
        theirs = remote.rows[np.asarray(remote_indices, dtype=np.int64)]
        if not np.array_equal(ours[:, 1], theirs[:, 1]):
            raise TransferError(f"agent {self.name}: a {verb} with {remote.peer} pairs rows of different lengths")
        target = self._live_peer(remote.peer, verb)
        for side, rows, owner in (("its", theirs, target), ("our", ours, self)):
            outside = _outside(rows, owner.registered_spans())
            if outside:  # rows were inside when prepared: the memory was deregistered (or freed) since
                raise TransferError(
                    f"agent {self.name}: a {verb} with {remote.peer}: {outside} of {len(rows)} rows of {side} memory"
                    " are no longer registered (deregistered or freed since they were prepared)"
                )
        source, destination = (theirs, ours) if verb == "read" else (ours, theirs)
        for (to, length, _), (start, _, _) in zip(destination.tolist(), source.tolist(), strict=True):
            ctypes.memmove(to, start, length)
        posted = time.perf_counter()
        if notification:
            target.deliver(self.name, notification)
        return ReadStats(
            bytes=int(ours[:, 1].sum()), descriptors=len(ours), post_seconds=posted - started, seconds=posted - started
        )

    def _live_peer(self, peer: str, what: str) -> FakeAgent:
        """The agent ``peer`` names, if it is still up (else ``PeerDisconnected``)."""
        with self._lock:
            if peer not in self._peers:
                raise UnknownPeer(f"agent {self.name}: no peer {peer!r}; add it first")
        target = self.fabric.find(peer)
        if target is None or target.closed:
            raise PeerDisconnected(f"agent {self.name}: {what} with {peer}: peer disconnected (its agent is closed)")
        return target

    @property
    def unreleased_transfers(self) -> int:
        """Always 0: a fake transfer is done when its call returns."""
        return 0

    # ------------------------------------------------------------------ notifications
    def notify(self, peer: str, payload: bytes) -> None:
        """Send a notification to a peer (added before, as NIXL requires)."""
        self._live_peer(peer, "notifying").deliver(self.name, bytes(payload))

    def deliver(self, sender: str, payload: bytes) -> None:
        """A notification from ``sender`` arrives (handed to the handler on the delivery thread, or by ``poll``)."""
        with self._arrived:
            self._inbox.append((sender, payload))
            self._arrived.notify()

    def wake(self) -> None:
        """Nothing to do: notifications are delivered as they arrive."""

    def set_expecting_reads(self, expecting: bool) -> None:
        """Nothing to do: a fake agent does not poll."""

    def expecting_traffic(self) -> contextlib.AbstractContextManager[None]:
        """A block during which a peer writes to us (nothing to do for a fake agent)."""
        return contextlib.nullcontext()

    def poll(self) -> bool:
        """Deliver the notifications that arrived, on this thread; True if any came."""
        return self._deliver_pending()

    @property
    def poll_count(self) -> int:
        return self._polls

    def _deliver_pending(self) -> bool:
        delivered = False
        with self._delivering:
            self._polls += 1
            while True:
                with self._arrived:
                    if not self._inbox or self._closed:
                        return delivered
                    sender, payload = self._inbox.popleft()
                delivered = True
                self.notifications_received += 1
                self._handle(sender, payload)

    def _handle(self, sender: str, payload: bytes) -> None:
        if self._on_notification is None:
            logger.debug("agent %s: notification from %s dropped (no handler)", self.name, sender)
            return
        try:
            self._on_notification(sender, payload)
        except Exception:
            logger.exception("agent %s: notification handler failed for %s", self.name, sender)

    def _deliver_forever(self) -> None:
        """The delivery thread: hands each notification to the handler as it arrives, until :meth:`close`."""
        while True:
            with self._arrived:
                self._arrived.wait_for(lambda: bool(self._inbox) or self._closed)
                if self._closed:
                    return
            self._deliver_pending()

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Leave the fabric (peers reading from us now get ``PeerDisconnected``), stop delivering. Idempotent."""
        with self._arrived:
            if self._closed:
                return
            self._closed = True
            self._arrived.notify_all()
        self.fabric.leave(self)
        if threading.current_thread() is not self._delivery:
            self._delivery.join(5.0)
        with self._lock:
            self._dlists.clear()
            self._registrations.clear()
            self._peers.clear()

    def __enter__(self) -> FakeAgent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _host_only(agent: str, place: MemoryPlace) -> None:
    """A fake agent moves host memory with ``ctypes.memmove``: anything else is refused, naming it."""
    if place != HOST:
        raise TransferError(f"agent {agent}: a fake agent moves host memory only, not {place}")


#: Fake agents of :data:`DEFAULT_FABRIC`, as an agent factory: where mypy checks that :class:`FakeAgent` is an
#: :class:`~pd_transfer.transfer.agent_protocol.Agent` (and the factory's arguments are the connector's).
DEFAULT_FAKE_AGENTS: AgentFactory = DEFAULT_FABRIC.new_agent
