"""Read lanes: one large read split over several NIXL agents, each part read on its own thread.

On one host UCX reads with CMA: ``process_vm_readv`` inside ``transfer()``, one call per descriptor on the calling
thread, the kernel pinning the source pages as it copies. One thread copies that way at well under an in-process
``memcpy`` on hosts with fast memory, and the other core stays idle. A NIXL agent serialises its calls (and
pd-transfer's agent holds a lock around them), so concurrency needs more agents: each lane is a
:class:`~.agent.TransferAgent` of its own (its own UCX context and worker; what it offers: :class:`LaneAgent`) that
mirrors the owner's registered memory, peers and descriptor lists. A read of at least ``split_min_bytes`` is cut into
byte-balanced runs of rows: the first is read by the owner on the calling thread, one per lane on the lane's thread;
the owner sends the read's notification once every part is done, so the peer hears of the read only after all of
its bytes landed. Work that must follow a part on its own thread (a fix-up of what it read, while it is still in
that core's cache) runs as lane jobs instead (:meth:`ReadLanes.run`): job ``k`` on lane ``k``'s thread, reading
through lane ``k``'s agent.

Lanes are made in the background (a NIXL agent takes about 0.4 s to start): until they are up, and whenever a
read is small, reads go as one READ. Idle lanes cost no CPU (their threads block, each agent's poller backs off
to 20 ms) and about one NIXL agent's memory each.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Protocol, TypeVar

import numpy as np

from pd_transfer.affinity import CpuSet, unpinning
from pd_transfer.spec import HOST, MemoryPlace

from . import late_landing
from .dlists import DescriptorList
from .errors import PeerDisconnected, TransferError, TransferTimeout
from .read_stats import ReadStats

logger = logging.getLogger(__name__)

#: Reads smaller than this (bytes) are not split: one READ's fixed cost is a few microseconds.
DEFAULT_SPLIT_MIN_BYTES = 4 * 2**20
#: The most jobs :meth:`ReadLanes.run` runs at once, per lane and for the owner: a lane can serve several threads
#: that read in turn (its agent serialises the reads) and do other work in between.
MAX_JOBS_PER_LANE = 4
_WARM_UP_TIMEOUT_S = 5.0
_JOIN_GRACE_S = 5.0  # past a read's own timeout, how long to wait for a lane's part to return


#: One part of a split read: (lane index, 0 for the owner; rows of the read) -> what it moved.
ReadPart = Callable[[int, slice], "ReadStats"]
#: One READ on one lane, of the owner's lists: (local list, local rows, remote list, remote rows, timeout_s) -> what
#: it moved; a lane reads through its mirrors of the lists, the owner (lane 0) as one READ without a notification.
LaneRead = Callable[[DescriptorList, np.ndarray, DescriptorList, np.ndarray, float], "ReadStats"]
T = TypeVar("T")


class LaneAgent(Protocol):
    """What the lanes need of an agent (each lane, and their owner, is a :class:`~.agent.TransferAgent`): a lane
    mirrors the owner and reads a part; the owner reads the first part itself, as one READ (``read_whole``), and
    notifies the peer once every part is done. The agent interface the connector uses,
    :class:`~.agent_protocol.Agent`, extends it."""

    @property
    def name(self) -> str:
        """The agent's name, as its peers know it."""

    def register_spans(
        self, spans: Sequence[tuple[int, int]], *, huge_pages: bool | None = None, place: MemoryPlace = HOST
    ) -> object:
        """Register memory at ``place`` given as (start, end) byte addresses; returns the registration."""

    def deregister(self, registration: object) -> None:
        """Release a registration ``register_spans`` returned."""

    def add_peer(self, agent_metadata: bytes) -> str:
        """Load a peer's metadata; returns its name. Re-adding a known peer refreshes it."""

    def remove_peer(self, peer: str) -> None:
        """Forget a peer and release every descriptor list prepared for it."""

    def prepare_local(self, rows: np.ndarray, place: MemoryPlace = HOST) -> DescriptorList:
        """Prepare local rows (N x 3 uint64: address, length, device) inside registered memory at ``place``."""

    def prepare_remote(self, peer: str, rows: np.ndarray, place: MemoryPlace = HOST) -> DescriptorList:
        """Prepare rows of an added peer's registered memory at ``place`` (``UnknownPeer`` for one not added)."""

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
        """Pull ``remote[remote_indices[i]]`` into ``local[local_indices[i]]`` for every i; blocks until done, then
        ``notification`` reaches the peer. Raises ``TransferTimeout`` past ``timeout_s``, ``PeerDisconnected``
        when the peer is gone, ``TransferError`` otherwise."""

    def read_whole(
        self,
        local: DescriptorList,
        local_indices: np.ndarray,
        remote: DescriptorList,
        remote_indices: np.ndarray,
        notification: bytes,
        timeout_s: float,
    ) -> ReadStats:
        """``read`` as one READ on this agent, never split over lanes."""

    def notify(self, peer: str, payload: bytes) -> None:
        """Send ``payload`` to an added peer (not bound to a transfer)."""

    def close(self) -> None:
        """Release everything the agent holds; idempotent."""


def split_rows(lengths: np.ndarray, parts: int) -> list[slice]:
    """Cut rows of ``lengths`` bytes (in order) into at most ``parts`` consecutive non-empty runs of near-equal
    bytes."""
    count = len(lengths)
    parts = max(1, min(parts, count))
    ends = np.cumsum(np.asarray(lengths, dtype=np.int64))
    total = int(ends[-1]) if count else 0
    cuts = {0, count}
    for k in range(1, parts):
        cuts.add(min(count, int(np.searchsorted(ends, total * k / parts, side="left")) + 1))
    edges = sorted(cuts)
    return [slice(a, b) for a, b in itertools.pairwise(edges) if b > a]


class ReadLanes:
    """The lanes (extra agents) of the agent named ``owner``, and the threads that read on them (on ``thread_cpus``;
    None: the creator's). Every method but ``read`` is called under the owner's lock."""

    def __init__(
        self,
        owner: str,
        lanes: Sequence[LaneAgent],
        *,
        split_min_bytes: int,
        thread_cpus: CpuSet = None,
        drain_s: float = 0.0,
    ) -> None:
        self.owner = owner
        self.lanes = list(lanes)
        self.split_min_bytes = split_min_bytes
        self.drain_s = drain_s  # how long a lane's read past its timeout is drained (settings.drain_s)
        self._registrations: dict[int, list[object]] = {}  # id(owner's registration) -> the lanes'
        self._warm: set[str] = set()  # peers every lane has read from
        self.max_jobs = MAX_JOBS_PER_LANE * (len(self.lanes) + 1)
        self._pool = ThreadPoolExecutor(  # threads are made as jobs need them
            max_workers=self.max_jobs - 1,
            thread_name_prefix=f"pd-transfer-lane-{owner}",
            initializer=unpinning(thread_cpus),
        )
        self.split_reads = 0

    @classmethod
    def make(
        cls,
        owner: str,
        count: int,
        split_min_bytes: int,
        new_agent: Callable[[str], LaneAgent],
        thread_cpus: CpuSet = None,
        drain_s: float = 0.0,
    ) -> ReadLanes:
        """``count`` lanes made with ``new_agent(name)`` (closed again if one fails to start)."""
        made: list[LaneAgent] = []
        try:
            for k in range(count):
                made.append(new_agent(f"{owner}-lane{k + 1}"))
        except Exception:
            for lane in made:
                lane.close()
            raise
        return cls(owner, made, split_min_bytes=split_min_bytes, thread_cpus=thread_cpus, drain_s=drain_s)

    # ------------------------------------------------------------------ mirroring the owner
    def replay(
        self,
        spans: Iterable[tuple[object, Sequence[tuple[int, int]]]],
        peers: Iterable[bytes],
        dlists: Iterable[DescriptorList],
    ) -> None:
        """Mirror what the owner has so far: registrations, peers (their metadata), descriptor lists."""
        for registration, registered in spans:
            self.register(registration, registered)
        for metadata in peers:
            self.add_peer(metadata)
        for dlist in dlists:
            self.mirror(dlist, dlist.rows)

    def register(self, registration: object, spans: Sequence[tuple[int, int]]) -> None:
        self._registrations[id(registration)] = [lane.register_spans(spans, huge_pages=False) for lane in self.lanes]

    def deregister(self, registration: object) -> None:
        for lane, mirrored in zip(self.lanes, self._registrations.pop(id(registration), []), strict=False):
            lane.deregister(mirrored)

    def add_peer(self, metadata: bytes) -> None:
        for lane in self.lanes:
            lane.add_peer(metadata)

    def remove_peer(self, peer: str) -> None:
        self._warm.discard(peer)
        for lane in self.lanes:
            lane.remove_peer(peer)

    def mirror(self, dlist: DescriptorList, rows: np.ndarray) -> None:
        """Prepare ``dlist``'s rows on every lane (they become ``dlist.lane_lists``); a lane reading from a peer
        for the first time warms the connection up with a 64-byte read (the first read pays 25-36 ms)."""
        if not dlist.peer:
            dlist.lane_lists = [lane.prepare_local(rows) for lane in self.lanes]
            return
        dlist.lane_lists = [lane.prepare_remote(dlist.peer, rows) for lane in self.lanes]
        if dlist.peer not in self._warm:
            for lane in self.lanes:
                _warm_up(lane, dlist.peer, int(rows[0, 0]), min(64, int(rows[0, 1])))
            self._warm.add(dlist.peer)

    # ------------------------------------------------------------------ reading
    def wants_split(self, local: DescriptorList, remote: DescriptorList, local_indices: np.ndarray) -> bool:
        """Whether a read of these rows is split: big enough, and both lists mirrored on every lane."""
        lanes = len(self.lanes)
        if len(local_indices) < 2 or len(local.lane_lists) != lanes or len(remote.lane_lists) != lanes:
            return False
        return int(local.row_lengths[local_indices].sum()) >= self.split_min_bytes

    def split_read(
        self,
        owner: LaneAgent,
        local: DescriptorList,
        local_indices: np.ndarray,
        remote: DescriptorList,
        remote_indices: np.ndarray,
        notification: bytes,
        timeout_s: float,
    ) -> ReadStats:
        """``owner.read`` as byte-balanced parts, one per lane, at once; the notification once all are done."""
        if len(local_indices) != len(remote_indices):
            raise ValueError(f"{len(local_indices)} local rows but {len(remote_indices)} remote rows")
        local_indices = np.asarray(local_indices, dtype=np.int32)
        remote_indices = np.asarray(remote_indices, dtype=np.int32)
        started = time.perf_counter()

        def part(lane: int, rows: slice) -> ReadStats:
            read = self.lane_read(owner, lane)
            return read(local, local_indices[rows], remote, remote_indices[rows], timeout_s)

        parts = self.read(part, local.row_lengths[local_indices], timeout_s)
        if notification:
            owner.notify(remote.peer, notification)
        return ReadStats(
            bytes=sum(p.bytes for p in parts),
            descriptors=sum(p.descriptors for p in parts),
            post_seconds=max(p.post_seconds for p in parts),
            seconds=time.perf_counter() - started,
        )

    def read(self, read_part: ReadPart, lengths: np.ndarray, timeout_s: float) -> list[ReadStats]:
        """Run ``read_part(lane, rows)`` for each byte-balanced part of rows of ``lengths`` bytes (lane 0, the
        owner, on this thread); returns their stats once every part returned, else raises the first failure (a
        disconnect before others). Each part is bounded by ``timeout_s`` itself."""
        parts = split_rows(lengths, len(self.lanes) + 1)
        results = self.run([_reading(read_part, rows) for rows in parts], timeout_s)
        self.split_reads += 1
        return results

    def lane_read(self, owner: LaneAgent, lane: int) -> LaneRead:
        """Lane ``lane``'s READ of the owner's lists (lane 0: ``owner`` itself, one READ)."""
        if lane == 0:
            return lambda local, mine, remote, theirs, timeout_s: owner.read_whole(
                local, mine, remote, theirs, b"", timeout_s
            )
        agent = self.lanes[lane - 1]

        def read(
            local: DescriptorList, mine: np.ndarray, remote: DescriptorList, theirs: np.ndarray, timeout_s: float
        ) -> ReadStats:
            if len(local.lane_lists) != len(self.lanes) or len(remote.lane_lists) != len(self.lanes):
                raise TransferError(f"agent {self.owner}: a descriptor list is not mirrored on lane {lane}")
            local_list, remote_list = local.lane_lists[lane - 1], remote.lane_lists[lane - 1]
            return agent.read(local_list, mine, remote_list, theirs, timeout_s=timeout_s)

        return read

    def run(self, jobs: Sequence[Callable[[int], T]], timeout_s: float) -> list[T]:
        """Run ``jobs[k](k)`` each on a thread of its own (``jobs[0]`` on this thread), at most :attr:`max_jobs`;
        returns their results (in order) once every job returned, else raises the first failure (a disconnect
        before others). Every job must end within ``timeout_s``: a job that has not by then (plus the drain of a read
        past its timeout, :attr:`drain_s`, and a grace) is reported as timed out, its thread left to finish."""
        if not 1 <= len(jobs) <= self.max_jobs:
            raise ValueError(f"{len(jobs)} jobs, at most {self.max_jobs} for {len(self.lanes)} lanes and their owner")
        futures: list[Future[T]] = [self._pool.submit(job, lane) for lane, job in enumerate(jobs[1:], start=1)]
        errors: list[Exception] = []
        results: list[T] = []
        try:
            results.append(jobs[0](0))
        except Exception as error:
            errors.append(error)
        for lane, future in enumerate(futures, start=1):  # every job ends before its memory can be reused
            try:
                results.append(future.result(timeout=timeout_s + self.drain_s + _JOIN_GRACE_S))
            except FutureTimeout:
                errors.append(TransferTimeout(f"agent {self.owner}: lane {lane} not done after {timeout_s:.3f} s"))
            except Exception as error:
                errors.append(error)
        if errors:
            raise next((e for e in errors if isinstance(e, PeerDisconnected)), errors[0])
        return results

    def close(self) -> None:
        """Stop the threads and close every lane agent."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        for lane in self.lanes:
            try:
                lane.close()
            except Exception as error:  # closing goes on for the others
                logger.warning("agent %s: closing a read lane failed: %s", self.owner, error)


def _reading(read_part: ReadPart, rows: slice) -> Callable[[int], ReadStats]:
    """A lane job that reads ``rows`` with ``read_part``."""
    return lambda lane: read_part(lane, rows)


def _warm_up(lane: LaneAgent, peer: str, address: int, nbytes: int) -> None:
    """Read ``nbytes`` at ``address`` of ``peer`` into scratch memory of ``lane`` (best effort: a failure shows
    again on the first real read). After a timeout the scratch memory is kept, never freed (:mod:`.late_landing`)."""
    scratch = np.zeros(max(nbytes, 1), dtype=np.uint8)
    start = scratch.ctypes.data
    try:
        registration = lane.register_spans([(start, start + scratch.nbytes)], huge_pages=False)
    except Exception as error:
        logger.info("agent %s: no warm-up read from %s: %s", lane.name, peer, error)
        return
    kept: list[object] = []  # what a timed-out read may still land in: never freed (late_landing)
    try:
        local = lane.prepare_local(np.array([[start, scratch.nbytes, 0]], dtype=np.uint64))
        remote = lane.prepare_remote(peer, np.array([[address, scratch.nbytes, 0]], dtype=np.uint64))
        zero = np.zeros(1, dtype=np.int32)
        try:
            lane.read(local, zero, remote, zero, timeout_s=_WARM_UP_TIMEOUT_S)
        except TransferTimeout:
            kept = [scratch, registration, local, remote]
            late_landing.keep(*kept)
            raise
        finally:
            if not kept:
                local.release()
                remote.release()
    except Exception as error:
        logger.info("agent %s: warm-up read from %s failed: %s", lane.name, peer, error)
    finally:
        if not kept:
            lane.deregister(registration)
