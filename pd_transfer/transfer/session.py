"""One NIXL agent object behind a lock: the raw calls (memory, peers, descriptor lists, transfers, notifications) that
the transfer layer makes, each typed and each holding the lock once (making and posting a transfer: one hold, the
read path's first step).

NIXL is not guaranteed thread-safe, so nothing else calls the native agent. :attr:`NixlSession.lock` is re-entrant:
an owner that keeps its own records in step with NIXL's (:class:`~.agent.TransferAgent`'s registrations, peers and
descriptor lists) holds it around both, and the session's own calls re-enter it. NIXL's exceptions pass through as
NIXL raised them (their class tells a dead peer from other failures, :mod:`.probe`); the caller wraps them into
:mod:`.errors`. Transfer handles NIXL refused to release (a transfer still running after a timeout) are kept and
released again by :meth:`NixlSession.retry_releases`.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Literal

import numpy as np

from pd_transfer.settings import Settings
from pd_transfer.spec import HOST, MemoryPlace

from . import sever
from .native import NixlRegDList, make_nixl_agent

#: The name NIXL prepares local memory under (a descriptor list of this agent's own registered memory).
LOCAL = "NIXL_INIT_AGENT"

NixlMemoryType = Literal["DRAM", "VRAM"]


def nixl_memory_type(place: MemoryPlace) -> NixlMemoryType:
    """NIXL's name of the memory at ``place``: "DRAM" (host), "VRAM" (a GPU; rows then carry its device index)."""
    return "DRAM" if place.is_host else "VRAM"


class NixlSession:
    """The NIXL agent ``name`` (UCX backend) and the lock every call into it holds.

    ``progress_thread_wait_ms`` > 0 runs NIXL's progress thread with that longest wait (an agent that serves reads);
    0 runs none and :meth:`notifications` progresses the agent (:func:`.native.make_nixl_agent`). Handles (a
    registration, a prepared descriptor list, a transfer) are NIXL's opaque objects, passed back as they came.
    ``settings``: the CPUs of NIXL's progress thread, whether NIXL's Python logger is quieted.
    """

    def __init__(self, name: str, *, settings: Settings, progress_thread_wait_ms: int = 0) -> None:
        self.name = name
        self.lock = threading.RLock()
        with sever.noting_listeners():  # UCX's TCP listeners: peers' connections to them may be severed
            self._agent = make_nixl_agent(
                name,
                progress_thread_wait_ms=progress_thread_wait_ms,
                thread_cpus=settings.thread_cpu_set,
                quiet_logs=settings.nixl_log_level is None,
            )
        self._unreleased: list[object] = []  # transfer handles NIXL could not release yet

    # ------------------------------------------------------------------ memory
    def register_memory(self, spans: Sequence[tuple[int, int]], place: MemoryPlace = HOST) -> object:
        """Register memory at ``place`` (host: "DRAM"; a GPU: "VRAM" with its device index) given as non-empty
        (start, end) byte addresses; returns the registration."""
        rows = [(start, end - start, place.device_index, "") for start, end in spans]
        with self.lock:
            return self._agent.register_memory(rows, nixl_memory_type(place))

    def deregister_memory(self, registration: object) -> None:
        with self.lock:
            self._agent.deregister_memory(registration)

    def metadata(self) -> bytes:
        """This agent's metadata with its registered memory: what a peer loads to read it."""
        with self.lock:
            return bytes(self._agent.get_agent_metadata())

    def connection_metadata(self) -> bytes:
        """This agent's metadata without memory (about 300 bytes): enough to send it notifications, not to read
        it. Raises what NIXL raises where it cannot make one."""
        with self.lock:
            no_memory = NixlRegDList(self._agent.nixl_mems["DRAM"], [])
            return bytes(self._agent.get_partial_agent_metadata(no_memory, True, ["UCX"]))

    # ------------------------------------------------------------------ peers
    def add_remote_agent(self, metadata: bytes) -> str:
        """Load a remote agent's metadata; returns its name."""
        with self.lock:
            name = self._agent.add_remote_agent(metadata)
        return name.decode() if isinstance(name, bytes) else str(name)

    def remove_remote_agent(self, peer: str) -> None:
        with self.lock:
            self._agent.remove_remote_agent(peer)

    # ------------------------------------------------------------------ descriptor lists
    def prepare_dlist(self, peer: str, rows: np.ndarray, memory_type: NixlMemoryType = "DRAM") -> object:
        """Prepare rows (N x 3 uint64: address, length, device index) of ``peer``'s registered memory of
        ``memory_type`` (:data:`LOCAL`: ours); returns the prepared list's handle."""
        with self.lock:
            return self._agent.prep_xfer_dlist(peer, rows, memory_type)

    def release_dlist(self, handle: object) -> None:
        with self.lock:
            self._agent.release_dlist_handle(handle)

    # ------------------------------------------------------------------ transfers
    def start_transfer(
        self,
        operation: str,
        local: object,
        local_indices: np.ndarray,
        remote: object,
        remote_indices: np.ndarray,
        notification: bytes = b"",
    ) -> tuple[object, str, Exception | None]:
        """Make a "READ" or "WRITE" between rows ``local_indices`` (int32) of the prepared list ``local`` and
        ``remote_indices`` of ``remote`` and post it, under one hold of the lock; ``notification`` reaches the peer
        after it is done. Raises what NIXL raises while making it (there is no handle then). Returns (handle, state,
        None), state being "DONE", "PROC" (in flight) or "ERR", or (handle, "ERR", error) when posting raised
        ``error``. Release the handle in every case (:meth:`release_transfer`)."""
        with self.lock:
            handle = self._agent.make_prepped_xfer(
                operation, local, local_indices, remote, remote_indices, notif_msg=notification
            )
            try:
                return handle, self._agent.transfer(handle), None
            except Exception as error:
                return handle, "ERR", error

    def state(self, handle: object) -> str:
        """A posted transfer's state: "DONE", "PROC" or "ERR"."""
        with self.lock:
            return self._agent.check_xfer_state(handle)

    def release_transfer(self, handle: object) -> bool:
        """Release a transfer's handle; False when NIXL refused (the transfer is still running): the handle is then
        kept and released by a later :meth:`retry_releases`."""
        with self.lock:
            try:
                self._agent.release_xfer_handle(handle)
                return True
            except Exception:
                self._unreleased.append(handle)
                return False

    def retry_releases(self) -> None:
        """Release again the handles NIXL refused before; those it still refuses stay kept."""
        with self.lock:
            if not self._unreleased:
                return
            still = []
            for handle in self._unreleased:
                try:
                    self._agent.release_xfer_handle(handle)
                except Exception:
                    still.append(handle)
            self._unreleased = still

    @property
    def unreleased_transfers(self) -> int:
        """Transfer handles NIXL has not let go of yet (their local buffers may still change)."""
        return len(self._unreleased)

    # ------------------------------------------------------------------ notifications
    def send_notification(self, peer: str, payload: bytes) -> None:
        with self.lock:
            self._agent.send_notif(peer, payload)

    def notifications(self) -> list[tuple[str, bytes]]:
        """(peer name, payload) of every notification that arrived since the last call, in arrival order per peer.
        Progresses the agent (UCX) until it is idle first, unless NIXL's progress thread does."""
        with self.lock:
            arrived = self._agent.get_new_notifs()
        if not arrived:
            return []
        return [
            (peer.decode() if isinstance(peer, bytes) else str(peer), bytes(payload))
            for peer, payloads in arrived.items()
            for payload in payloads
        ]
