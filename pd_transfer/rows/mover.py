"""The row mover: rows of bytes moved by address inside one device's memory, by one Triton kernel launch per row size
on a CUDA device where Triton imports, else by torch by the widest element (:mod:`.by_torch`).

Its callers hand it :class:`~.memory.RowCopy` lists: a pull's rows out of a prefill's memory opened through IPC (the
IPC engine), an offload chunk's pages to and from a staging buffer (the offload copier), a push's rows gathered into
or landed from a buffer (:class:`~.packed.AddressedRows`, for the push stager). With the kernel
(:func:`launch_rows`) a call is one launch per row size (one, for every plan of one cache) whatever the number of
rows, planes or storages, and each row lands at its final place (a block-size regroup's head slices, a TP head
slice, a layout change's token rows alike), so no restage pass follows. Which one runs is the device's: the kernel
on CUDA (:func:`kernel_available`), torch elsewhere; a caller may ask for the kernel on CPU tensors
(:func:`use_kernel`), where it runs under Triton's interpreter (:mod:`.kernel`): that is how CI runs the kernel itself.
On a CUDA device the work is queued on the current stream; on the CPU it is done when the call returns.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Iterable, Sequence
from types import ModuleType

import numpy as np
import torch

from .addresses import RowAddresses
from .by_torch import move_by_torch
from .memory import RowCopy

#: Elements a kernel program copies (of the widest integer type the rows' alignment allows): 8 KiB of int64.
BLOCK_ELEMENTS = 1024


@functools.cache
def kernel_module() -> ModuleType | None:
    """:mod:`.kernel` (the Triton kernel and its launch), or None where Triton cannot be imported."""
    try:
        return importlib.import_module("pd_transfer.rows.kernel")
    except ImportError:
        return None


def kernel_available(device: torch.device) -> bool:
    """Whether rows of memory on ``device`` move by the kernel unless told otherwise: a CUDA device and Triton
    importable."""
    return device.type == "cuda" and kernel_module() is not None


def use_kernel(device: torch.device, asked: bool | None) -> bool:
    """Whether rows of memory on ``device`` move by the kernel: ``asked`` None, where :func:`kernel_available`;
    True on CPU tensors, under Triton's interpreter (slow: for tests). ``ValueError`` where it is asked for and cannot
    run (no Triton, or memory neither on a CUDA device nor on the CPU)."""
    if asked is None:
        return kernel_available(device)
    if asked and device.type not in ("cuda", "cpu"):
        raise ValueError(f"no row kernel for memory on {device}")
    if asked and kernel_module() is None:
        raise ValueError("the row kernel needs Triton, which cannot be imported here")
    return asked


def upload_to(device: torch.device) -> Callable[[np.ndarray], torch.Tensor]:
    """An ``upload`` for :func:`move_rows`: int64 values on ``device``, on a GPU by a ``non_blocking`` copy from
    pinned memory on the current stream."""

    def upload(values: np.ndarray) -> torch.Tensor:
        host = torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64))
        if device.type != "cuda":
            return host
        return host.pin_memory().to(device, non_blocking=True)

    return upload


def move_rows(copies: Sequence[RowCopy], upload: Callable[[np.ndarray], torch.Tensor], *, one_kernel: bool) -> int:
    """Queue the copy of every row of ``copies`` on the current stream (on the CPU: do it); returns the calls made
    (kernel launches, or torch calls). ``one_kernel``: by the kernel, the rows of every copy together, one launch per
    row size (:func:`launch_rows`; see :func:`use_kernel`); else by torch (:func:`~.by_torch.move_by_torch`).
    ``upload`` puts an int64 array on the memory's device; it is called at most once."""
    if one_kernel:
        return launch_rows(by_row_size(copy.addresses for copy in copies), upload)
    return move_by_torch(copies, upload)


def by_row_size(lists: Iterable[RowAddresses]) -> list[RowAddresses]:
    """The rows of ``lists`` as one list per row size, in the order each size first comes: what the kernel copies in
    one launch each."""
    sizes: dict[int, list[RowAddresses]] = {}
    for rows in lists:
        sizes.setdefault(rows.row_bytes, []).append(rows)
    return [RowAddresses.concat(parts) for parts in sizes.values()]


def kernel_upload(lists: Sequence[RowAddresses]) -> np.ndarray:
    """The addresses :func:`launch_rows` uploads for ``lists`` (those with rows): each list's sources then its
    targets, list after list, as int64."""
    parts = [part for rows in lists if rows.rows for part in (rows.sources, rows.targets)]
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)


def launch_rows(lists: Sequence[RowAddresses], upload: Callable[[np.ndarray], torch.Tensor]) -> int:
    """Queue one kernel launch per list of ``lists`` that has rows (each list of one row size), their addresses put
    on the device by one ``upload`` (:func:`kernel_upload`); returns the launches made. ``RuntimeError`` where Triton
    cannot be imported."""
    lists = [rows for rows in lists if rows.rows]
    if not lists:
        return 0
    module = kernel_module()
    if module is None:
        raise RuntimeError("the row kernel needs Triton, which cannot be imported here")
    addresses = upload(kernel_upload(lists))
    at = 0
    for rows in lists:
        element = rows.element_bytes()
        sources, targets = addresses[at : at + rows.rows], addresses[at + rows.rows : at + 2 * rows.rows]
        module.launch(sources, targets, rows.rows, rows.row_bytes // element, BLOCK_ELEMENTS, element)
        at += 2 * rows.rows
    return len(lists)
