"""One kernel per pull: a request's rows, each a (source address, target address) pair of one row size, copied in a
single launch on a CUDA device where Triton is importable.

A pull's rows come as :class:`RowAddresses` (host int64 arrays, from the plan's rows located in the opened segments);
:func:`copy_rows` uploads them once and launches :mod:`.triton_rows`' kernel on the current stream: one launch per
row size (one, for every plan of one cache), whatever the number of rows, planes or segments, and each row lands at
its final place (a block-size regroup's head slices, a TP head slice, a layout change's token rows alike), so no
restage pass follows. Where the kernel is not available (:func:`kernel_available`: CPU tensors, no Triton) the
callers use torch's gather and scatter per pair of segments (:func:`pd_transfer.same_host.ipc_engine.run_copies`).
:func:`copy_rows_on_host` is the kernel's element-level reference: the same addresses, copied row by row with
``memmove`` in host memory (tests check the addresses with it on CPU, and the kernel against torch on a GPU).
"""

from __future__ import annotations

import ctypes
import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch

#: Elements a kernel program copies (of the widest integer type the rows' alignment allows): 8 KiB of int64.
BLOCK_ELEMENTS = 1024
_ELEMENT_NAMES = {8: "int64", 4: "int32", 2: "int16", 1: "int8"}


@dataclass(frozen=True)
class RowAddresses:
    """Rows of ``row_bytes`` bytes to copy: ``sources[i]`` to ``targets[i]`` (int64 addresses in this process,
    device addresses for CUDA memory), all in memory that stays alive and mapped until the copy completed."""

    sources: np.ndarray
    targets: np.ndarray
    row_bytes: int

    def __post_init__(self) -> None:
        if self.sources.shape != self.targets.shape or self.sources.ndim != 1:
            raise ValueError(f"sources {self.sources.shape} and targets {self.targets.shape}: one address per row")
        if self.row_bytes <= 0:
            raise ValueError(f"row_bytes must be positive, got {self.row_bytes}")

    @property
    def rows(self) -> int:
        return len(self.sources)

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes

    def element_bytes(self) -> int:
        """The widest element (8, 4, 2 or 1 bytes) dividing the row size and every address."""
        every = np.bitwise_or.reduce(np.concatenate([self.sources, self.targets]).astype(np.int64)) if self.rows else 0
        alignment = int(every) | self.row_bytes
        return next(size for size in (8, 4, 2, 1) if alignment % size == 0)

    @classmethod
    def concat(cls, parts: list[RowAddresses]) -> RowAddresses:
        """One list of the rows of ``parts`` (all of one row size)."""
        sizes = {part.row_bytes for part in parts}
        if len(sizes) != 1:
            raise ValueError(f"rows of one size only, got {sorted(sizes)}")
        return cls(np.concatenate([p.sources for p in parts]), np.concatenate([p.targets for p in parts]), sizes.pop())


@functools.cache
def _triton_rows() -> ModuleType | None:
    """:mod:`.triton_rows`, or None where Triton cannot be imported."""
    try:
        return importlib.import_module("pd_transfer.topology.triton_rows")
    except ImportError:
        return None


def kernel_available(device: torch.device) -> bool:
    """Whether :func:`copy_rows` can run for memory on ``device``: a CUDA device and Triton importable."""
    return device.type == "cuda" and _triton_rows() is not None


def copy_rows(rows: RowAddresses, upload: Callable[[np.ndarray], torch.Tensor]) -> int:
    """Queue the copy of every row of ``rows`` on the current CUDA stream, in one launch; ``upload`` puts an int64
    array on the device (once, both address lists in one). Returns the launches made (1; 0 for no rows).
    ``RuntimeError`` where the kernel is not available (see :func:`kernel_available`)."""
    if rows.rows == 0:
        return 0
    module = _triton_rows()
    if module is None:
        raise RuntimeError("the row kernel needs Triton, which cannot be imported here")
    element = rows.element_bytes()
    addresses = upload(np.concatenate([rows.sources, rows.targets]).astype(np.int64))
    sources, targets = addresses[: rows.rows], addresses[rows.rows :]
    module.launch(sources, targets, rows.rows, rows.row_bytes // element, BLOCK_ELEMENTS, _ELEMENT_NAMES[element])
    return 1


def copy_rows_on_host(rows: RowAddresses) -> None:
    """The kernel's reference on host memory: each row copied with ``memmove`` from its source to its target address,
    in order (slow: for tests)."""
    for source, target in zip(rows.sources.tolist(), rows.targets.tolist(), strict=True):
        ctypes.memmove(target, source, rows.row_bytes)
