"""Rows given by their byte addresses in a cache's tensors, gathered into or scattered from one contiguous buffer,
packed back to back, by the row mover.

A pushed request's rows come as the plan's grid rows, addresses in the prefill's (or the decode's) cache; staging
them through a buffer needs them packed back to back: row ``i`` at byte ``i * row_bytes`` of the buffer.
:class:`AddressedRows` does that for the memory of a list of tensors of one device, by
:func:`~.mover.move_rows`: one kernel launch a call where the kernel runs (a CUDA device and Triton, or asked for on
CPU tensors: its interpreter), else torch's gather or scatter per storage the rows lie in. On a CUDA device the work
is queued on the current stream; on the CPU it is done when the call returns.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .addresses import RowAddresses
from .memory import RowCopy, RowMemory
from .mover import move_rows, upload_to, use_kernel


class AddressedRows:
    """The memory of ``tensors`` (all on one device, host or a CUDA GPU), addressed by byte. ``one_kernel``: copy by
    the row kernel (None: where :func:`~.mover.kernel_available`; True on CPU tensors: under Triton's interpreter);
    else by torch. ``ValueError`` for no tensors, tensors of several devices, or the kernel asked for where it cannot
    run."""

    def __init__(self, tensors: Sequence[torch.Tensor], *, one_kernel: bool | None = None) -> None:
        self.memory = RowMemory(tensors)
        self.device = self.memory.device
        self.one_kernel = use_kernel(self.device, one_kernel)
        self._upload = upload_to(self.device)
        #: Copy calls queued so far: kernel launches, or torch calls (at least one per storage the rows lie in).
        self.calls = 0

    def gather(self, addresses: np.ndarray, row_bytes: int, into: torch.Tensor) -> None:
        """Copy the ``row_bytes`` bytes at each of ``addresses`` (int64, inside the tensors) to byte ``i *
        row_bytes`` of ``into`` (1-D uint8, contiguous, on this device, at least ``len(addresses) * row_bytes``
        long). ``ValueError`` for a row outside the tensors or a buffer too short."""
        self._copy(np.asarray(addresses, dtype=np.int64), row_bytes, into, to_buffer=True)

    def scatter(self, addresses: np.ndarray, row_bytes: int, source: torch.Tensor) -> None:
        """The mirror of :meth:`gather`: byte ``i * row_bytes`` of ``source`` onwards to ``addresses[i]``."""
        self._copy(np.asarray(addresses, dtype=np.int64), row_bytes, source, to_buffer=False)

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
        self.memory.locate(addresses, row_bytes)  # every row inside the tensors, or RowsOutside (a ValueError)
        packed = buffer.data_ptr() + np.arange(rows, dtype=np.int64) * row_bytes
        pairs = RowAddresses(addresses, packed, row_bytes) if to_buffer else RowAddresses(packed, addresses, row_bytes)
        copy = RowCopy(pairs, self.memory.including(buffer))
        self.calls += move_rows([copy], self._upload, one_kernel=self.one_kernel)
