"""Raw NIXL reads with no pd-transfer code in the loop: the yardstick for our read path's overhead.

The NIXL agent is the bare one :func:`pd_transfer.transfer.native.make_nixl_agent` makes (only
:mod:`pd_transfer.transfer` imports ``nixl``); this module drives it through the binding's own calls.
"""

from __future__ import annotations

import time
import uuid

import numpy as np

from pd_transfer.spec import HOST, MemoryPlace
from pd_transfer.transfer.native import make_nixl_agent
from pd_transfer.transfer.session import LOCAL, nixl_memory_type


class RawNixlReader:
    """A bare NIXL agent (no progress thread, no lock, no :class:`~pd_transfer.transfer.session.NixlSession`)
    reading prepared rows from one peer.

    The memory behind ``local_spans`` ((start, end) addresses, at ``local``) is registered again under this agent;
    the peer's rows are in its memory at ``remote`` (a GPU's: "VRAM", rows carrying the device index). UCX is
    configured as for our agents (the same process environment, :func:`pd_transfer.settings.apply_process_defaults`):
    the comparison is of the read path alone.
    """

    def __init__(
        self,
        local_spans: list[tuple[int, int]],
        peer_metadata: bytes,
        local_rows: np.ndarray,
        remote_rows: np.ndarray,
        *,
        local: MemoryPlace = HOST,
        remote: MemoryPlace = HOST,
    ) -> None:
        self._agent = make_nixl_agent(f"raw-{uuid.uuid4().hex[:8]}")  # no progress thread, native logs quiet
        self._registration = self._agent.register_memory(
            [(start, end - start, local.device_index, "") for start, end in local_spans], nixl_memory_type(local)
        )
        peer = self._agent.add_remote_agent(peer_metadata)
        self._peer = peer.decode() if isinstance(peer, bytes) else peer
        self._local = self._agent.prep_xfer_dlist(LOCAL, _rows(local_rows, local), nixl_memory_type(local))
        self._remote = self._agent.prep_xfer_dlist(self._peer, _rows(remote_rows, remote), nixl_memory_type(remote))

    def read_seconds(self, local_indices: np.ndarray, remote_indices: np.ndarray, *, operation: str = "READ") -> float:
        """One READ of the given rows (or, with ``operation="WRITE"``, the local rows written into the remote ones:
        the other direction over the same descriptors), make to release; returns post-to-DONE seconds."""
        local_indices = np.asarray(local_indices, dtype=np.int32)
        remote_indices = np.asarray(remote_indices, dtype=np.int32)
        started = time.perf_counter()
        handle = self._agent.make_prepped_xfer(operation, self._local, local_indices, self._remote, remote_indices)
        state = self._agent.transfer(handle)
        while state == "PROC":
            state = self._agent.check_xfer_state(handle)
        elapsed = time.perf_counter() - started
        self._agent.release_xfer_handle(handle)
        if state != "DONE":
            raise RuntimeError(f"raw NIXL {operation} ended in state {state}")
        return elapsed

    def close(self) -> None:
        self._agent.release_dlist_handle(self._local)
        self._agent.release_dlist_handle(self._remote)
        self._agent.remove_remote_agent(self._peer)
        self._agent.deregister_memory(self._registration)


def _rows(rows: np.ndarray, place: MemoryPlace) -> np.ndarray:
    """Descriptor rows (address, length, device) with the device column of ``place``."""
    rows = np.array(rows, dtype=np.uint64, copy=True)
    rows[:, 2] = place.device_index
    return rows
