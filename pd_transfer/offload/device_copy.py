"""Copies engine blocks between an engine's cache tensors on a device and host rows, on a stream of its own.

The engine's cache is a list of tensors, each ``(num_blocks, page_bytes[i])`` uint8 on one device (rows may lie
further apart than their length); a host row is a block's pages back to back (``(num_rows, block_bytes)`` uint8,
the host tier's layout). A job's blocks go through a staging buffer on the device, a chunk of rows at a time: to the
host, one ``index_select`` per cache tensor gathers the chunk's blocks into the staging rows and one copy moves the
rows out; from the host, one copy moves the rows in and one ``index_copy_`` per tensor scatters them. A chunk is a
run of consecutive host rows, at most the staging buffer's rows; a fresh pool hands out consecutive rows, so a job
is a few large copies, never one per block.

Jobs queue their copies one at a time (they share the staging buffer), so on a device a copy runs behind the
ones queued before it. On a CUDA device everything runs on the copier's own stream, after an event the caller
recorded on its stream (:meth:`BlockCopier.mark_ready`: a store copies only what the engine's kernels finished
writing, a load writes blocks only after the kernels queued before it), host copies are ``non_blocking``
(asynchronous with a pinned host buffer), and a copy returns an event that completes with it: the caller waits for
that event, never the device.
On the CPU the same calls are plain copies, done when they return (no stream, no event): that is how CI runs them.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence

import torch

from .errors import OffloadInputError

#: Bytes of the device staging buffer (a chunk of rows moves through it at once); at least one block's
DEFAULT_STAGING_BYTES = 64 * 2**20


class BlockCopier:
    """Moves blocks of ``caches`` (one device) to and from host rows; see the module docstring."""

    def __init__(self, caches: Sequence[torch.Tensor], *, staging_bytes: int = DEFAULT_STAGING_BYTES) -> None:
        """Raises :class:`OffloadInputError` unless ``caches`` are 2-D uint8/int8 tensors of one device and block
        count, each row contiguous."""
        if not caches:
            raise OffloadInputError("no cache tensors to copy from")
        self.device = caches[0].device
        for index, cache in enumerate(caches):
            if cache.dim() != 2 or cache.dtype not in (torch.uint8, torch.int8) or cache.stride(1) != 1:
                raise OffloadInputError(f"cache tensor {index}: need 2-D uint8/int8 rows, got {cache.dtype}")
            if cache.device != self.device or cache.shape[0] != caches[0].shape[0]:
                raise OffloadInputError(f"cache tensor {index} differs from the first in device or block count")
        self.caches = [cache.view(torch.uint8) for cache in caches]
        widths = [int(cache.shape[1]) for cache in caches]
        starts = [sum(widths[:index]) for index in range(len(widths))]
        self._columns = [(start, start + width) for start, width in zip(starts, widths, strict=True)]
        self.block_bytes = sum(widths)
        self._cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self._cuda else None
        self.chunk_rows = max(1, staging_bytes // self.block_bytes)
        self._lock = threading.Lock()  # one job's copies are queued at a time: they share the staging buffer
        with self._on_stream(None):
            self._staging = torch.empty((self.chunk_rows, self.block_bytes), dtype=torch.uint8, device=self.device)

    @property
    def asynchronous(self) -> bool:
        """Whether copies run on a device stream (complete with their event) rather than on return."""
        return self._cuda

    def mark_ready(self) -> torch.cuda.Event | None:
        """An event on the calling thread's current stream of the device: copies started after it (``after``) run
        only once the work queued there before this call is done. None on the CPU."""
        if not self._cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def to_host(
        self, block_ids: Sequence[int], rows: Sequence[int], host: torch.Tensor, after: torch.cuda.Event | None = None
    ) -> torch.cuda.Event | None:
        """Copy engine block ``block_ids[i]`` into ``host[rows[i]]`` (``host``: ``(num_rows, block_bytes)`` uint8 on
        the CPU, pinned for the copy to be asynchronous), after ``after``. Returns the event that completes when the
        bytes are in ``host`` (None: they are already)."""
        with self._on_stream(after):
            index = self._device_index(block_ids)
            for start, row, count in self._chunks(rows):
                staging = self._staging[:count]
                chunk = index[start : start + count]
                for cache, (low, high) in zip(self.caches, self._columns, strict=True):
                    staging[:, low:high] = cache.index_select(0, chunk)
                host[row : row + count].copy_(staging, non_blocking=self._cuda)
            return self._done()

    def from_host(
        self, rows: Sequence[int], block_ids: Sequence[int], host: torch.Tensor, after: torch.cuda.Event | None = None
    ) -> torch.cuda.Event | None:
        """Copy ``host[rows[i]]`` into engine block ``block_ids[i]``, after ``after``. Returns the event that completes
        when the blocks hold the bytes (None: they do already)."""
        with self._on_stream(after):
            index = self._device_index(block_ids)
            for start, row, count in self._chunks(rows):
                staging = self._staging[:count]
                staging.copy_(host[row : row + count], non_blocking=self._cuda)
                chunk = index[start : start + count]
                for cache, (low, high) in zip(self.caches, self._columns, strict=True):
                    cache.index_copy_(0, chunk, staging[:, low:high])
            return self._done()

    # ------------------------------------------------------------------ internals
    @contextlib.contextmanager
    def _on_stream(self, after: torch.cuda.Event | None) -> Iterator[None]:
        """Queue under the copier's lock, on its stream after ``after`` (on the CPU: under the lock)."""
        with self._lock:
            if self._stream is None:
                yield
                return
            with torch.cuda.stream(self._stream):
                if after is not None:
                    self._stream.wait_event(after)
                yield

    def _device_index(self, block_ids: Sequence[int]) -> torch.Tensor:
        """The block ids as an int64 tensor on the device, copied from pinned memory without blocking."""
        index = torch.tensor([int(block) for block in block_ids], dtype=torch.int64)
        if not self._cuda:
            return index
        return index.pin_memory().to(self.device, non_blocking=True)

    def _chunks(self, rows: Sequence[int]) -> Iterator[tuple[int, int, int]]:
        """``(position in rows, first row, count)`` of each run of consecutive rows, at most :attr:`chunk_rows`."""
        start = 0
        for end in range(1, len(rows) + 1):
            if end == len(rows) or rows[end] != rows[end - 1] + 1 or end - start == self.chunk_rows:
                yield start, int(rows[start]), end - start
                start = end

    def _done(self) -> torch.cuda.Event | None:
        if self._stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self._stream)
        return event
