"""One NIXL agent (UCX backend) that reads and writes KV blocks: its registered cache, its peers, its descriptor lists.

The agent calls NIXL only through its :class:`~.session.NixlSession` (``self.session``; :mod:`.native` is the one
module that imports ``nixl``). Memory is host memory ("DRAM") or a GPU's ("VRAM", rows carrying its device index),
as its :class:`~pd_transfer.spec.MemoryPlace` says; huge-page advice and read lanes (with their warm-up reads) apply
to host memory only. Every NIXL call holds the session's lock; the agent holds the same lock around a call
and its own records of it (registrations, peers, descriptor lists, their mirrors on read lanes). The progress poller
takes the lock for each poll, and reads hold it only while posting or checking a transfer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from typing import TypeVar

import numpy as np

from pd_transfer.settings import Settings
from pd_transfer.spec import HOST, KVRegion, MemoryPlace, memory_of

from . import sever
from .agent_protocol import AgentFactory, NotificationHandler
from .dlists import DescriptorList, merged_spans, nothing_to_move
from .errors import TransferError, TransferTimeout, UnknownPeer
from .huge_pages import HugePageCollapser
from .lanes import DEFAULT_SPLIT_MIN_BYTES, LaneRead, ReadLanes
from .probe import transfer_error, wrapped_error
from .progress import AdaptivePoller
from .read_stats import ReadStats
from .session import LOCAL, NixlSession, nixl_memory_type

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Seconds between state checks of a transfer drained after its timeout (:meth:`TransferAgent._drained`).
_DRAIN_POLL_S = 0.005


class TransferAgent:
    """A NIXL agent without NIXL's busy progress thread (an :class:`~.agent_protocol.Agent`).

    ``serves_reads``: peers read from this agent (a prefill rank's); it then runs NIXL's progress thread woken by
    UCX's events (``native_progress_ms``: its longest wait, 0 when off; see :mod:`.progress`), which serves reads
    over TCP as they arrive. ``on_notification(peer_name, payload)`` is called on the poller thread for every
    notification that arrives (keep it short: hand work to another thread). ``read_lanes`` > 1 splits reads of at least
    ``split_min_bytes`` over that many agents and threads (see :mod:`.lanes`), once the extra agents are up.
    ``settings`` (kept as ``self.settings``, handed to the lanes): the native thread's wait, the poller's and the
    reads' timings, huge pages for registrations, the CPUs of every thread the agent starts, NIXL's log level.
    """

    def __init__(
        self,
        name: str,
        *,
        on_notification: NotificationHandler | None = None,
        idle_poll_interval_s: float = 0.02,
        read_lanes: int = 1,
        split_min_bytes: int = DEFAULT_SPLIT_MIN_BYTES,
        serves_reads: bool = False,
        settings: Settings,
    ) -> None:
        self.name = name
        self.settings = settings
        self._on_notification = on_notification
        self.native_progress_ms = settings.native_progress_ms if serves_reads else 0
        started = time.perf_counter()
        self.session = NixlSession(name, progress_thread_wait_ms=self.native_progress_ms, settings=settings)
        self._lock = self.session.lock  # held around a NIXL call and this agent's records of it
        waits = f"{self.native_progress_ms} ms" if self.native_progress_ms else "off"
        logger.info(
            "NIXL agent %s ready in %.0f ms (native progress: %s)", name, (time.perf_counter() - started) * 1e3, waits
        )
        self._registrations: list[object] = []
        self._peers: set[str] = set()
        self._dlists: list[DescriptorList] = []
        self._closed = False
        self.notifications_received = 0
        self.abandoned_transfers = 0  # timed out and still in flight after the drain (see _drained)
        self._busy_poll_s = settings.busy_poll_s
        self._read_wait_s = settings.read_wait_s
        self._poller = AdaptivePoller(
            name, self._poll_once, idle_interval_s=idle_poll_interval_s, thread_cpus=settings.thread_cpu_set
        )
        self._poller.start()
        self._spans: list[tuple[object, list[tuple[int, int]]]] = []  # registrations, to mirror on lanes
        self.huge_pages = HugePageCollapser(f"agent {name}")
        self._peer_metadata: dict[str, bytes] = {}
        self.lanes: ReadLanes | None = None
        self.lanes_ready = threading.Event()
        if read_lanes > 1:
            threading.Thread(
                target=self._start_lanes, args=(read_lanes - 1, split_min_bytes), name=f"{name}-lanes", daemon=True
            ).start()
        else:
            self.lanes_ready.set()

    def _start_lanes(self, count: int, split_min_bytes: int) -> None:
        """Make ``count`` lane agents (slow: outside the lock), then mirror everything onto them."""
        try:
            lanes = ReadLanes.make(
                self.name,
                count,
                split_min_bytes,
                lambda lane: TransferAgent(lane, settings=self.settings),
                thread_cpus=self.settings.thread_cpu_set,
                drain_s=self.settings.drain_s,
            )
            with self._lock:
                if self._closed:
                    lanes.close()
                    return
                lanes.replay(self._spans, self._peer_metadata.values(), [d for d in self._dlists if d.place.is_host])
                self.lanes = lanes
            logger.info("agent %s: %d read lane(s) up", self.name, count)
        except Exception as error:
            logger.warning("agent %s: no read lanes (reads stay on one thread): %s", self.name, error)
        finally:
            self.lanes_ready.set()

    # ------------------------------------------------------------------ memory
    def register_regions(self, regions: Sequence[KVRegion]) -> object:
        """Register the memory behind ``regions`` (all in one memory: host DRAM, or one GPU's VRAM), once per cache;
        returns the registration."""
        place = memory_of(list(regions))
        registration = self.register_spans(merged_spans(regions), place=place)
        logger.info("agent %s registered %d regions in %s memory", self.name, len(regions), place)
        return registration

    def register_spans(
        self, spans: Sequence[tuple[int, int]], *, huge_pages: bool | None = None, place: MemoryPlace = HOST
    ) -> object:
        """Register memory at ``place`` given as (start, end) byte addresses; returns the registration. Host memory
        with ``huge_pages`` (default: the settings' ``PD_TRANSFER_HUGE_PAGES=all``) is advised to use huge pages
        and collapsed into them in the background (``self.huge_pages``, :mod:`.huge_pages`), and mirrored on the
        read lanes."""
        if huge_pages is None:
            huge_pages = self.settings.registered_huge_pages
        filled = [(start, end) for start, end in spans if end > start]
        if not filled:
            raise ValueError("no memory to register: every span is empty")
        if huge_pages and place.is_host:
            self.huge_pages.submit(filled)
        with self._lock:
            try:
                registration = self.session.register_memory(filled, place)
            except Exception as error:
                raise TransferError(
                    f"agent {self.name}: registering {len(filled)} spans of {place} memory failed: {error}"
                ) from error
            self._registrations.append(registration)
            if place.is_host:  # GPU memory is not read on lanes
                self._spans.append((registration, filled))
                if self.lanes is not None:
                    self.lanes.register(registration, filled)
        logger.debug(
            "agent %s registered %.1f MiB of %s memory", self.name, sum(e - s for s, e in filled) / 2**20, place
        )
        return registration

    def deregister(self, registration: object) -> None:
        with self._lock:
            if registration in self._registrations:
                self._registrations.remove(registration)
                self._spans = [(r, spans) for r, spans in self._spans if r is not registration]
                if self.lanes is not None:
                    self.lanes.deregister(registration)
                try:
                    self.session.deregister_memory(registration)
                except Exception as error:
                    logger.warning("agent %s: deregistering memory failed: %s", self.name, error)

    @property
    def metadata(self) -> bytes:
        """This agent's NIXL metadata, for the side channel."""
        return self.session.metadata()

    @property
    def connection_metadata(self) -> bytes:
        """This agent's NIXL metadata without any memory (about 300 bytes): enough for a peer that loads it
        with ``add_peer`` to send us notifications, not to read our memory. Falls back to ``metadata``."""
        try:
            return self.session.connection_metadata()
        except Exception as error:
            logger.info("agent %s: no connection-only metadata (%s); using the full metadata", self.name, error)
            return self.session.metadata()

    # ------------------------------------------------------------------ peers
    def add_peer(self, agent_metadata: bytes) -> str:
        """Load a remote agent's metadata; returns its name. Re-adding a known peer refreshes it."""
        with self._lock:
            try:
                peer = self.session.add_remote_agent(agent_metadata)
            except Exception as error:
                raise TransferError(f"agent {self.name}: adding a remote agent failed: {error}") from error
            self._peers.add(peer)
            self._peer_metadata[peer] = agent_metadata
            if self.lanes is not None:
                self.lanes.add_peer(agent_metadata)
        logger.info("agent %s added peer %s", self.name, peer)
        return peer

    def remove_peer(self, peer: str) -> None:
        """Forget a remote agent and release every descriptor list prepared for it."""
        with self._lock:
            for dlist in [d for d in self._dlists if d.peer == peer]:
                self.release_dlist(dlist)
            self._peer_metadata.pop(peer, None)
            if self.lanes is not None:
                self.lanes.remove_peer(peer)
            sever.forget_peer(peer)
            if peer in self._peers:
                self._peers.discard(peer)
                try:
                    self.session.remove_remote_agent(peer)
                except Exception as error:
                    logger.warning("agent %s: removing peer %s failed: %s", self.name, peer, error)

    def has_peer(self, peer: str) -> bool:
        return peer in self._peers

    # ------------------------------------------------------------------ descriptor lists
    def prepare_local(self, rows: np.ndarray, place: MemoryPlace = HOST) -> DescriptorList:
        """Prepare local rows (N x 3 uint64: address, length, 0) inside registered memory at ``place`` (a GPU's
        rows get its device index)."""
        return self._prepare(LOCAL, rows, place)

    def prepare_remote(self, peer: str, rows: np.ndarray, place: MemoryPlace = HOST) -> DescriptorList:
        """Prepare rows of a remote peer's registered memory at ``place`` (the device index as the peer numbers its
        GPUs)."""
        if peer not in self._peers:
            raise UnknownPeer(f"agent {self.name}: no peer {peer!r}; add it first")
        return self._prepare(peer, rows, place)

    def _prepare(self, peer: str, rows: np.ndarray, place: MemoryPlace) -> DescriptorList:
        rows = np.ascontiguousarray(rows, dtype=np.uint64)
        if rows.ndim != 2 or rows.shape[1] != 3 or rows.shape[0] == 0:
            raise ValueError(f"descriptor rows must be a non-empty N x 3 array, got shape {rows.shape}")
        if not place.is_host:
            rows = rows.copy()
            rows[:, 2] = place.device_index
        started = time.perf_counter()
        with self._lock:
            try:
                handle = self.session.prepare_dlist(peer, rows, nixl_memory_type(place))
            except Exception as error:
                where = "local memory" if peer == LOCAL else f"peer {peer}"
                raise TransferError(
                    f"agent {self.name}: preparing {rows.shape[0]} descriptors of {where} failed"
                    f" (outside registered memory?): {error}"
                ) from error
            dlist = DescriptorList(self, handle, "" if peer == LOCAL else peer, rows, place)
            self._dlists.append(dlist)
            if self.lanes is not None and place.is_host:
                self.lanes.mirror(dlist, rows)
        logger.debug(
            "agent %s prepared %d rows for %s in %.2f ms",
            self.name,
            rows.shape[0],
            peer,
            (time.perf_counter() - started) * 1e3,
        )
        return dlist

    def release_dlist(self, dlist: DescriptorList) -> None:
        """Release a descriptor list this agent prepared (and its copies on the read lanes); idempotent. What
        :meth:`DescriptorList.release` calls."""
        with self._lock:
            if dlist.released:
                return
            dlist.released = True
            if dlist in self._dlists:
                self._dlists.remove(dlist)
            for mirrored in dlist.lane_lists:
                mirrored.release()
            try:
                self.session.release_dlist(dlist.handle)
            except Exception as error:
                logger.warning("agent %s: releasing a descriptor list failed: %s", self.name, error)

    # ------------------------------------------------------------------ reads
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
        """Pull ``remote[remote_indices[i]]`` into ``local[local_indices[i]]`` for every i; blocks until
        done. NIXL merges rows adjacent on both sides into single descriptors. ``notification`` reaches
        the remote agent after the data has been read.

        Raises ``TransferTimeout`` past ``timeout_s``, once the transfer ended (its peer's host severed, the
        transfer drained: :meth:`_drained`), ``PeerDisconnected`` when the peer is gone, ``TransferError``
        otherwise. With read lanes up, a large read is split over them (the notification then follows the
        last part).
        """
        lanes = self.lanes
        if lanes is not None and lanes.wants_split(local, remote, np.asarray(local_indices)):
            return lanes.split_read(self, local, local_indices, remote, remote_indices, notification, timeout_s)
        return self.read_whole(local, local_indices, remote, remote_indices, notification, timeout_s)

    def read_whole(
        self,
        local: DescriptorList,
        local_indices: np.ndarray,
        remote: DescriptorList,
        remote_indices: np.ndarray,
        notification: bytes,
        timeout_s: float,
    ) -> ReadStats:
        """:meth:`read` as one READ, never split."""
        return self._transfer("READ", local, local_indices, remote, remote_indices, notification, timeout_s)

    @property
    def lane_count(self) -> int:
        """How many threads a read can run on now: the read lanes that are up, and this agent."""
        lanes = self.lanes
        return 1 if lanes is None else len(lanes.lanes) + 1

    @property
    def max_lane_jobs(self) -> int:
        """The most jobs :meth:`run_on_lanes` takes now: one without read lanes, ``MAX_JOBS_PER_LANE`` per lane and
        for this agent with them."""
        lanes = self.lanes
        return 1 if lanes is None else lanes.max_jobs

    def lanes_for(self, lists: Iterable[DescriptorList]) -> int:
        """How many lanes can read ``lists`` now (``lanes`` of :meth:`run_on_lanes`): :attr:`lane_count` when every
        list is mirrored on the read lanes, else 1, this agent alone (GPU memory is not read on lanes)."""
        lanes = self.lanes
        if lanes is None:
            return 1
        count = len(lanes.lanes)
        return count + 1 if all(len(dlist.lane_lists) == count for dlist in lists) else 1

    def run_on_lanes(
        self, jobs: Sequence[Callable[[LaneRead], T]], timeout_s: float, *, lanes: int | None = None
    ) -> list[T]:
        """Run each of ``jobs`` on a thread of its own (``jobs[0]`` on this one), job ``k`` given the READ of lane
        ``k % lanes`` (:data:`~.lanes.LaneRead`, of this agent's lists; lane 0 reads as this agent; ``lanes``
        defaults to :attr:`lane_count`, and 1 keeps every read on this agent: :meth:`lanes_for`): reads, and
        whatever must follow them on the same thread. Jobs that share a lane read in turn (its agent serialises
        them) and do their other work meanwhile. At most :attr:`max_lane_jobs` jobs (lanes that came up meanwhile
        are not used before the next call).
        Returns their results once every job returned, else raises the first failure (a disconnect before others);
        a job not done within ``timeout_s`` (plus a grace) raises ``TransferTimeout``. The peers get no
        notification: send it with :meth:`notify` once the reads are done."""
        read_lanes = self.lanes
        if read_lanes is None:
            if len(jobs) != 1:
                raise ValueError(f"{len(jobs)} jobs, but agent {self.name} has no read lanes up")
            return [jobs[0](self._whole_read)]
        count = len(read_lanes.lanes) + 1 if lanes is None else max(1, min(lanes, len(read_lanes.lanes) + 1))

        def on_lane(job: Callable[[LaneRead], T]) -> Callable[[int], T]:
            return lambda k: job(read_lanes.lane_read(self, k % count))

        return read_lanes.run([on_lane(job) for job in jobs], timeout_s)

    def _whole_read(
        self,
        local: DescriptorList,
        local_indices: np.ndarray,
        remote: DescriptorList,
        remote_indices: np.ndarray,
        timeout_s: float,
    ) -> ReadStats:
        return self.read_whole(local, local_indices, remote, remote_indices, b"", timeout_s)

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
        """Push ``local[local_indices[i]]`` into ``remote[remote_indices[i]]`` for every i, as one WRITE; blocks
        until done. ``notification`` reaches the remote agent after the data has landed. Raises as :meth:`read`."""
        return self._transfer("WRITE", local, local_indices, remote, remote_indices, notification, timeout_s)

    def _transfer(
        self,
        operation: str,
        local: DescriptorList,
        local_indices: np.ndarray,
        remote: DescriptorList,
        remote_indices: np.ndarray,
        notification: bytes,
        timeout_s: float,
    ) -> ReadStats:
        """One READ or WRITE between ``local`` and ``remote`` rows, posted and waited for."""
        verb = operation.lower()
        if nothing_to_move(self.name, local, local_indices, remote, remote_indices):
            return ReadStats(bytes=0, descriptors=0, post_seconds=0.0, seconds=0.0)
        local_indices = np.asarray(local_indices, dtype=np.int32)
        remote_indices = np.asarray(remote_indices, dtype=np.int32)
        peer = remote.peer
        started = time.perf_counter()
        deadline = started + timeout_s
        probe = (int(local_indices[0]), int(remote_indices[0]))  # rows for a liveness probe after an error
        session = self.session
        try:  # made and posted under one hold of the lock
            handle, state, failure = session.start_transfer(
                operation, local.handle, local_indices, remote.handle, remote_indices, notification
            )
        except Exception as error:
            raise wrapped_error(
                self.name, error, f"preparing a {verb} of {len(local_indices)} rows with {peer}"
            ) from error
        try:
            if failure is not None:  # probed outside the lock: the poller and other reads go on meanwhile
                what = f"posting a {verb} with {peer}"
                raise self._failure(operation, failure, what, local, remote, probe) from failure
            posted = time.perf_counter()
            spins = 0
            while state == "PROC":
                now = time.perf_counter()
                if now >= deadline:
                    raise self._drained(verb, peer, timeout_s, handle)
                spins += 1
                if spins > 64:  # tcp-emulated reads progress slowly: stop spinning, keep latency bounded
                    time.sleep(min(self._read_wait_s, deadline - now))
                try:
                    state = session.state(handle)
                except Exception as error:
                    failure = error
                if failure is not None:
                    raise self._failure(operation, failure, f"a {verb} with {peer}", local, remote, probe) from failure
            if state != "DONE":
                raise self._failure(operation, None, f"{verb} with {peer} ended in state {state}", local, remote, probe)
            finished = time.perf_counter()
            num_bytes = int(local.row_lengths[local_indices].sum())
            return ReadStats(
                bytes=num_bytes,
                descriptors=len(local_indices),
                post_seconds=posted - started,
                seconds=finished - started,
            )
        finally:
            if not session.release_transfer(handle):
                logger.warning("agent %s: %s with %s still owned by NIXL; releasing it later", self.name, verb, peer)

    def _drained(self, verb: str, peer: str, timeout_s: float, handle: object) -> TransferTimeout:
        """The error for a transfer not done within ``timeout_s``, raised only once NIXL ended it (DONE or ERR), at
        most ``settings.drain_s`` later; first, with ``settings.sever_stalled``, this process's connections to the
        peer's host are shut down (:mod:`.sever`: UCX fails the endpoint, the transfer ends at once).

        Why wait: a transfer past its deadline is not over. Over UCX's TCP transport its bytes wait in a connection a
        network cut stalled and land (a READ's in our memory, a WRITE's in the peer's) whenever it resumes, maybe
        seconds after the cut healed, when the caller has given that memory to another request: wrong KV (issue 42,
        tests/process/test_network_cut.py). NIXL ends it once the bytes landed or UCX failed the endpoint (its
        connection closed: nothing lands after). Past ``drain_s`` the transfer is abandoned (counted in
        :attr:`abandoned_transfers`, logged): its bytes may still land."""
        started = time.perf_counter()
        severed = sever.sever_peer(peer) if self.settings.sever_stalled else 0
        drained_by = started + self.settings.drain_s
        state = "PROC"
        while state == "PROC" and time.perf_counter() < drained_by:
            time.sleep(_DRAIN_POLL_S)
            try:
                state = self.session.state(handle)
            except Exception:  # NIXL ended it with an error: the endpoint failed
                state = "ERR"
        waited = time.perf_counter() - started
        if state == "PROC":
            self.abandoned_transfers += 1
            logger.error(
                "agent %s: a %s with %s still in flight %.1f s after its timeout: abandoned, its bytes may still land",
                self.name,
                verb,
                peer,
                waited,
            )
            return TransferTimeout(
                f"agent {self.name}: {verb} with {peer} not done after {timeout_s:.3f} s, nor {waited:.1f} s later"
            )
        logger.warning(
            "agent %s: a %s with %s not done after %.3f s ended %s %.2f s later (%d connections to its host severed)",
            self.name,
            verb,
            peer,
            timeout_s,
            state,
            waited,
            severed,
        )
        return TransferTimeout(
            f"agent {self.name}: {verb} with {peer} not done after {timeout_s:.3f} s (it ended {waited:.2f} s later)"
        )

    @property
    def unreleased_transfers(self) -> int:
        """Transfers that timed out and that NIXL has not let go of yet (their local buffers may still change)."""
        return self.session.unreleased_transfers

    def _failure(
        self,
        operation: str,
        error: Exception | None,
        what: str,
        local: DescriptorList,
        remote: DescriptorList,
        probe_rows: tuple[int, int],
    ) -> TransferError:
        """The error to raise for a failed transfer (:func:`.probe.transfer_error`; only a READ is probed: the probe
        reads into ``local``, which a failed WRITE did not own)."""
        return transfer_error(self, error, what, local, remote, probe_rows, probe=operation == "READ")

    # ------------------------------------------------------------------ notifications
    def notify(self, peer: str, payload: bytes) -> None:
        """Send a notification to a peer (not bound to a transfer)."""
        try:
            self.session.send_notification(peer, payload)
        except Exception as error:
            raise wrapped_error(self.name, error, f"notifying {peer}") from error

    def wake(self) -> None:
        """Poll fast for a while (traffic is expected)."""
        self._poller.wake()

    def set_expecting_reads(self, expecting: bool) -> None:
        """Poll fast while peers are expected to read from us (blocks are held for them)."""
        self._poller.set_expecting(expecting)

    def expecting_traffic(self) -> AbstractContextManager[None]:
        """Poll fast while inside this block (a peer is writing to us); callers count, they do not undo each other."""
        return self._poller.fast()

    def poll(self) -> bool:
        """Progress the agent and deliver its notifications now, on this thread; True if anything came."""
        return self._poll_once()

    def stop_polling(self) -> None:
        """Stop the poller thread for good (``close`` does too): only :meth:`poll` and NIXL's own progress thread,
        if the agent runs one, progress the agent then."""
        self._poller.stop()

    def _poll_once(self) -> bool:
        with self._lock:
            if self._closed:
                return False
            self.session.retry_releases()
            started = time.perf_counter()
            notifications = self.session.notifications()  # progresses UCX till idle, unless NIXL's thread does
            # a long poll moved data; only counted while reads are expected (idle, it is a preempted thread), and
            # never with NIXL's thread, which moves the data itself (a long poll is then always a preempted thread)
            busy = (
                self._poller.expecting
                and not self.native_progress_ms
                and time.perf_counter() - started > self._busy_poll_s
            )
        if not notifications:
            return busy
        for peer, payload in notifications:
            self.notifications_received += 1
            if self._on_notification is None:
                logger.debug("agent %s: notification from %s dropped (no handler)", self.name, peer)
                continue
            try:
                self._on_notification(peer, payload)
            except Exception:
                logger.exception("agent %s: notification handler failed for %s", self.name, peer)
        return True

    # ------------------------------------------------------------------ lifecycle
    @property
    def poll_count(self) -> int:
        return self._poller.polls

    def close(self) -> None:
        """Stop polling, release every descriptor list and registration. Idempotent."""
        if self._closed:
            return
        self._poller.stop()
        with self._lock:
            self._closed = True
            if self.lanes is not None:
                self.lanes.close()
                self.lanes = None
            for dlist in list(self._dlists):
                self.release_dlist(dlist)
            for peer in list(self._peers):
                try:
                    self.session.remove_remote_agent(peer)
                except Exception:
                    pass
            self._peers.clear()
            for registration in self._registrations:
                try:
                    self.session.deregister_memory(registration)
                except Exception as error:
                    logger.warning("agent %s: deregistering memory failed: %s", self.name, error)
            self._registrations.clear()

    def __enter__(self) -> TransferAgent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: The agents of production: what the connector's ranks make their agents with unless handed another factory.
#: Typed as an :class:`~.agent_protocol.AgentFactory`, so that mypy checks :class:`TransferAgent` against the
#: agent interface here.
NIXL_AGENTS: AgentFactory = TransferAgent
