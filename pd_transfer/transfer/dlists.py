"""Descriptor lists as an agent prepares them, and the byte spans its registrations cover."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from pd_transfer.spec import HOST, KVRegion, MemoryPlace

from .errors import TransferError


def merged_spans(regions: Sequence[KVRegion]) -> list[tuple[int, int]]:
    """(start, end) byte ranges covering every region, overlapping or touching ranges merged."""
    spans = sorted((r.base_address, r.base_address + r.span_bytes) for r in regions if r.span_bytes > 0)
    merged: list[tuple[int, int]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


class ReleasableList(Protocol):
    """A descriptor list as a transfer checks it: whose rows it names, and whether it was released."""

    @property
    def peer(self) -> str: ...

    @property
    def released(self) -> bool: ...


def nothing_to_move(
    agent: str, local: ReleasableList, local_indices: np.ndarray, remote: ReleasableList, remote_indices: np.ndarray
) -> bool:
    """Check a transfer's arguments before anything is posted: a released list raises ``TransferError`` (naming
    ``agent`` and the peer), rows of unequal count ``ValueError``. Returns True when no rows are asked for."""
    if remote.released or local.released:
        raise TransferError(f"agent {agent}: descriptor list for {remote.peer} was released")
    if len(local_indices) != len(remote_indices):
        raise ValueError(f"{len(local_indices)} local rows but {len(remote_indices)} remote rows")
    return len(local_indices) == 0


class DescriptorListOwner(Protocol):
    """What prepared a descriptor list (:class:`~.agent.TransferAgent`), and releases it."""

    def release_dlist(self, dlist: DescriptorList) -> None:
        """Release ``dlist`` (and its copies on read lanes); idempotent."""


class DescriptorList:
    """A prepared NIXL descriptor list (one side of reads): rows of (address, length, device) as ``owner`` prepared
    them for ``peer`` (``""``: its own memory), in memory at ``place``; ``handle`` is NIXL's."""

    def __init__(
        self, owner: DescriptorListOwner, handle: object, peer: str, rows: np.ndarray, place: MemoryPlace = HOST
    ) -> None:
        self._owner = owner
        self.handle = handle
        self.peer = peer  # "" for the local side
        self.place = place
        self.num_rows = int(rows.shape[0])
        self.row_lengths = rows[:, 1].astype(np.int64, copy=True)
        self.rows = rows  # kept to mirror the list on read lanes made later
        self.lane_lists: list[DescriptorList] = []  # the same rows prepared on each read lane
        self.released = False

    def release(self) -> None:
        """Release this list (:meth:`DescriptorListOwner.release_dlist`); idempotent."""
        self._owner.release_dlist(self)
