"""Rows given by their byte addresses in a cache's tensors, gathered into or scattered from one contiguous buffer: the
row kernel where it runs, else torch by the tensors' storages (the same calls on host tensors).

A pushed request's rows come as the plan's grid rows, addresses in the prefill's (or the decode's) cache; staging
them through a buffer needs them packed back to back: row ``i`` at byte ``i * row_bytes`` of the buffer.
:class:`AddressedRows` does that for the memory of a list of tensors of one device. With the row kernel
(:func:`~.row_copy.copy_rows`, a CUDA device and Triton; or its host reference
:func:`~.row_copy.copy_rows_on_host` when asked for on CPU tensors, for tests) a call is one launch whatever the rows;
with torch it is an ``index_select`` (``index_copy_``) per storage the rows lie in, by element indices of the widest
integer type the rows' alignment allows (the index costs 8 bytes per element moved: a fallback). On a CUDA device the
work is queued on the current stream; on the CPU it is done when the call returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .row_copy import RowAddresses, copy_rows, copy_rows_on_host, kernel_available

_ELEMENT_TYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


@dataclass(frozen=True)
class _Group:
    """The rows (``positions`` in the call's list) of one storage, as element indices of that storage viewed as
    elements of ``element`` bytes."""

    storage: int  # index into AddressedRows._storages
    positions: np.ndarray  # int64, ascending
    elements: np.ndarray  # int64, row by row: (positions.size * row_bytes / element)
    element: int
    in_order: bool  # positions == arange(n): every row of the call, in order


class AddressedRows:
    """The memory of ``tensors`` (all on one device, host or a CUDA GPU), addressed by byte. ``one_kernel``: copy by
    the row kernel's addresses (None: where :func:`~.row_copy.kernel_available`; True on CPU tensors: through its host
    reference); else by torch. ``ValueError`` for no tensors, tensors of several devices, or the kernel asked for
    where it cannot run."""

    def __init__(self, tensors: Sequence[torch.Tensor], *, one_kernel: bool | None = None) -> None:
        if not tensors:
            raise ValueError("no tensors to address")
        self.device = tensors[0].device
        if any(tensor.device != self.device for tensor in tensors):
            raise ValueError("the tensors lie on more than one device")
        self.one_kernel = kernel_available(self.device) if one_kernel is None else one_kernel
        if self.one_kernel and self.device.type == "cuda" and not kernel_available(self.device):
            raise ValueError("the row kernel needs Triton, which cannot be imported here")
        if self.one_kernel and self.device.type not in ("cuda", "cpu"):
            raise ValueError(f"no row kernel for memory on {self.device}")
        flats: dict[int, torch.Tensor] = {}
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in flats:
                flats[storage.data_ptr()] = torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage)
        starts = sorted(flats)
        self._storages = [flats[start] for start in starts]  # flat uint8 views of every storage, by address
        self._starts = np.array(starts, dtype=np.int64)
        self._ends = np.array([start + flats[start].numel() for start in starts], dtype=np.int64)
        #: Copy calls queued so far: kernel launches (or host-reference calls), or torch calls (one per storage).
        self.calls = 0

    def gather(self, addresses: np.ndarray, row_bytes: int, into: torch.Tensor) -> None:
        """Copy the ``row_bytes`` bytes at each of ``addresses`` (int64, inside the tensors) to byte ``i *
        row_bytes`` of ``into`` (1-D uint8, contiguous, on this device, at least ``len(addresses) * row_bytes``
        long). ``ValueError`` for a row outside the tensors or a buffer too short."""
        self._copy(np.asarray(addresses, dtype=np.int64), row_bytes, into, to_buffer=True)

    def scatter(self, addresses: np.ndarray, row_bytes: int, source: torch.Tensor) -> None:
        """The mirror of :meth:`gather`: byte ``i * row_bytes`` of ``source`` onwards to ``addresses[i]``."""
        self._copy(np.asarray(addresses, dtype=np.int64), row_bytes, source, to_buffer=False)

    # ------------------------------------------------------------------ internals
    def _copy(self, addresses: np.ndarray, row_bytes: int, buffer: torch.Tensor, *, to_buffer: bool) -> None:
        rows = len(addresses)
        if row_bytes <= 0:
            raise ValueError(f"row_bytes must be positive, got {row_bytes}")
        if buffer.dim() != 1 or buffer.dtype != torch.uint8 or not buffer.is_contiguous():
            raise ValueError("the buffer must be a contiguous 1-D uint8 tensor")
        if buffer.device != self.device:
            raise ValueError(f"the buffer is on {buffer.device}, the rows on {self.device}")
        if buffer.numel() < rows * row_bytes:
            raise ValueError(f"a buffer of {buffer.numel()} bytes for {rows} rows of {row_bytes}")
        if rows == 0:
            return
        groups = self._groups(addresses, row_bytes, buffer.data_ptr())  # checks every row lies inside a storage
        if self.one_kernel:
            at = buffer.data_ptr() + np.arange(rows, dtype=np.int64) * row_bytes
            pairs = RowAddresses(addresses, at, row_bytes) if to_buffer else RowAddresses(at, addresses, row_bytes)
            if self.device.type == "cuda":
                self.calls += copy_rows(pairs, self._upload)
            else:
                copy_rows_on_host(pairs)
                self.calls += 1
            return
        for group in groups:
            element_type = _ELEMENT_TYPES[group.element]
            flat = self._storages[group.storage].view(element_type)
            index = self._upload(group.elements)
            row_elements = row_bytes // group.element
            packed = buffer[: rows * row_bytes].view(element_type)
            if group.in_order:
                if to_buffer:
                    torch.index_select(flat, 0, index, out=packed)
                else:
                    flat.index_copy_(0, index, packed)
            else:
                positions = self._upload(group.positions)
                packed_rows = packed.view(rows, row_elements)
                if to_buffer:
                    packed_rows.index_copy_(0, positions, flat.index_select(0, index).view(-1, row_elements))
                else:
                    flat.index_copy_(0, index, packed_rows.index_select(0, positions).view(-1))
            self.calls += 1

    def _groups(self, addresses: np.ndarray, row_bytes: int, buffer_address: int) -> list[_Group]:
        """The rows by storage, each storage's elements as wide as the rows, the storage and the buffer (at
        ``buffer_address``) are aligned; ``ValueError`` naming the first row that lies outside every storage."""
        which = np.searchsorted(self._starts, addresses, side="right") - 1
        clipped = np.clip(which, 0, len(self._starts) - 1)
        inside = (which >= 0) & (addresses + row_bytes <= self._ends[clipped])
        if not np.all(inside):
            first = int(np.argmin(inside))
            raise ValueError(f"row {first} at {int(addresses[first]):#x} lies outside the tensors' memory")
        if self.one_kernel:
            return []
        groups = []
        for storage in np.unique(which).tolist():
            positions = np.flatnonzero(which == storage).astype(np.int64)
            offsets = addresses[positions] - self._starts[storage]
            size = int(self._ends[storage] - self._starts[storage])
            common = int(np.bitwise_or.reduce(offsets)) | row_bytes | int(self._starts[storage]) | size | buffer_address
            element = next(width for width in (8, 4, 2, 1) if common % width == 0)
            per_row = row_bytes // element
            elements = ((offsets // element)[:, None] + np.arange(per_row, dtype=np.int64)[None, :]).reshape(-1)
            in_order = len(positions) == len(addresses)  # positions are ascending: all of them means in order
            groups.append(_Group(storage, positions, elements, element, in_order))
        return groups

    def _upload(self, values: np.ndarray) -> torch.Tensor:
        """``values`` (int64) on this device: on a GPU by a ``non_blocking`` copy from pinned memory on the current
        stream."""
        host = torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64))
        if self.device.type != "cuda":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)
