"""The memory rows may lie in: the storages behind tensors of one device, found by address (:class:`RowMemory`),
the lookup of rows among address ranges (:func:`locate`), and rows paired with their memory (:class:`RowCopy`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .addresses import RowAddresses


class RowsOutside(ValueError):
    """A row does not lie whole inside the memory it is said to be in."""


def locate(
    addresses: np.ndarray, row_bytes: int, starts: Sequence[int], sizes: Sequence[int], where: str = "the memory"
) -> tuple[np.ndarray, np.ndarray]:
    """(range index, byte offset in that range) of each row of ``row_bytes`` bytes at ``addresses``, among the byte
    ranges ``[starts[r], starts[r] + sizes[r])`` (not overlapping, in any order); :class:`RowsOutside` naming the first
    row that lies in none of them whole (``where`` names the ranges in its message)."""
    order = np.argsort(np.asarray(starts, dtype=np.int64), kind="stable")
    first = np.asarray(starts, dtype=np.int64)[order]
    ends = first + np.asarray(sizes, dtype=np.int64)[order]
    rows = np.asarray(addresses).astype(np.int64)
    position = np.searchsorted(first, rows, side="right") - 1
    clipped = np.maximum(position, 0)
    inside = (position >= 0) & (rows + row_bytes <= ends[clipped]) if len(first) else np.zeros(rows.shape, bool)
    if not inside.all():
        bad = int(np.flatnonzero(~inside)[0])
        raise RowsOutside(f"row {bad} ({row_bytes} bytes at {int(rows[bad]):#x}) lies outside {where}")
    return order[clipped].astype(np.int64), rows - first[clipped]


def storages(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The storages behind ``tensors``, each once (in the order first met), as 1-D uint8 tensors of all their
    bytes."""
    found: dict[int, torch.Tensor] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in found:
            whole = torch.empty(0, dtype=torch.uint8, device=tensor.device)
            found[storage.data_ptr()] = whole.set_(storage, 0, (storage.nbytes(),), (1,))
    return list(found.values())


class RowMemory:
    """The storages behind ``tensors`` (all on one device: host memory or one GPU), each as a 1-D uint8 tensor of
    all its bytes (:attr:`storages`), found by byte address. ``ValueError`` for no tensors or several devices."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        if not tensors:
            raise ValueError("no tensors to address")
        self.device = tensors[0].device
        if any(tensor.device != self.device for tensor in tensors):
            raise ValueError("the tensors lie on more than one device")
        self.storages = storages(tensors)
        self._starts = [storage.data_ptr() for storage in self.storages]
        self._sizes = [storage.numel() for storage in self.storages]

    def including(self, *tensors: torch.Tensor) -> RowMemory:
        """This memory and the storages of ``tensors`` (a buffer rows are copied through, say)."""
        return RowMemory([*self.storages, *tensors])

    def locate(self, addresses: np.ndarray, row_bytes: int) -> tuple[np.ndarray, np.ndarray]:
        """(index in :attr:`storages`, byte offset in it) of each row of ``row_bytes`` at ``addresses``;
        :class:`RowsOutside` naming the first row that lies outside every storage."""
        return locate(addresses, row_bytes, self._starts, self._sizes, "the tensors' memory")


@dataclass(frozen=True)
class RowCopy:
    """Rows to copy (:class:`~.addresses.RowAddresses`) and the memory both their sides lie in (what torch views
    them through where the kernel does not run)."""

    addresses: RowAddresses
    memory: RowMemory

    @property
    def nbytes(self) -> int:
        return self.addresses.nbytes
