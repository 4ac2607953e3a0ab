"""Copies engine blocks between an engine's cache tensors on a device and host rows, chunk by chunk through staging
buffers on the device, a chunk's gather (or scatter) overlapping the host copy of the one before it.

The engine's cache is a list of tensors, each ``(num_blocks, page_bytes[i])`` uint8 on one device (rows may lie
further apart than their length); a host row is a block's pages back to back (``(num_rows, block_bytes)`` uint8,
the host tier's layout). A job's blocks move a chunk at a time (at most :attr:`BlockCopier.chunk_rows` blocks)
through one of ``buffers`` staging buffers on the device, taken in turn:

* to the host (:meth:`BlockCopier.to_host`): the chunk's blocks are gathered from every cache tensor into the
  staging rows (block ``b`` of tensor ``t`` to staging row ``r`` at tensor ``t``'s column offset), then one copy per
  run of consecutive host rows moves the staging rows out;
* from the host (:meth:`BlockCopier.from_host`), the mirror: the host rows are copied into staging, then scattered.

The gather (scatter) of a chunk is one call of the row mover (:func:`~pd_transfer.rows.move_rows`: every (tensor,
block) page of the chunk given as a source and a target address): where its kernel runs (a CUDA device and Triton,
:func:`~pd_transfer.rows.kernel_available`) one launch per distinct page width (one, for a model whose layers' pages
are all one size); else torch's gather (scatter) per cache tensor. ``one_kernel=True`` on CPU tensors runs the very
kernel under Triton's interpreter, for tests.

On a CUDA device the gathers and scatters run on the copier's compute stream and the host copies on its copy stream,
so the PCIe copy of chunk ``i`` overlaps the gather of chunk ``i + 1`` (a load: the scatter of chunk ``i`` overlaps
the host copy of chunk ``i + 1``). Events order them: a host copy waits for its chunk's gather (a scatter for its
chunk's host copy), and a staging buffer is written again only after the event recorded when its last use (the
copy out, the scatter) was queued, across jobs too. Both streams first wait for the caller's ``after`` event
(:meth:`BlockCopier.mark_ready`: a store copies only what the engine's kernels finished writing, a load writes blocks
only after the kernels queued before it); host copies are ``non_blocking`` (asynchronous with a pinned host buffer);
and a job returns an event that completes once both streams finished its work: the caller waits for that event,
never the device, and nothing here blocks the host on the device. Jobs queue their copies one at a time (a lock:
they share the staging buffers), so on a device a job's copies run behind those queued before it.
On the CPU the same calls are plain copies in the same order, done when they return (no stream, no event): that is
how CI runs them.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pd_transfer.rows import (
    RowAddresses,
    RowCopy,
    RowMemory,
    by_row_size,
    kernel_upload,
    launch_rows,
    move_rows,
    upload_to,
    use_kernel,
)

from .errors import OffloadInputError

#: Bytes of all the device staging buffers together (each holds a chunk of rows; at least one block each).
DEFAULT_STAGING_BYTES = 64 * 2**20
#: Staging buffers a copier takes in turn: two let the gather of one chunk overlap the host copy of the other.
DEFAULT_STAGING_BUFFERS = 2


@dataclass(frozen=True)
class Chunk:
    """Blocks ``start .. start + count - 1`` of a job (positions in its lists), through staging buffer ``buffer``:
    position ``start + i`` is staging row ``i``; ``runs`` are ``(staging row, host row, rows)`` of each run of
    consecutive host rows (one host copy each)."""

    start: int
    count: int
    buffer: int
    runs: tuple[tuple[int, int, int], ...]


class _Uploaded:
    """:func:`~pd_transfer.rows.move_rows`' ``upload`` for one job: the array each chunk's launches will ask for,
    in their order, put on the device by one ``non_blocking`` copy from pinned memory when the job starts; each call
    hands out the next one (checked equal to what it is asked for)."""

    def __init__(self, arrays: Sequence[np.ndarray], device: torch.device) -> None:
        self._host = np.concatenate(arrays).astype(np.int64) if arrays else np.zeros(0, np.int64)
        self._ends = np.cumsum([len(array) for array in arrays]).tolist()
        self._taken = 0
        self._device = torch.from_numpy(self._host).pin_memory().to(device, non_blocking=True)

    def __call__(self, values: np.ndarray) -> torch.Tensor:
        start = self._ends[self._taken - 1] if self._taken else 0
        end = self._ends[self._taken]
        if not np.array_equal(values, self._host[start:end]):
            raise RuntimeError("row addresses asked for out of the order they were uploaded in")
        self._taken += 1
        return self._device[start:end]


class BlockCopier:
    """Moves blocks of ``caches`` (one device) to and from host rows; see the module docstring."""

    def __init__(
        self,
        caches: Sequence[torch.Tensor],
        *,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        buffers: int = DEFAULT_STAGING_BUFFERS,
        one_kernel: bool | None = None,
    ) -> None:
        """``staging_bytes``: all staging buffers together (``buffers`` of them, each at least one block);
        ``one_kernel``: gather and scatter a chunk by the row kernel (None: where the kernel is available; True on
        CPU tensors: under Triton's interpreter). Raises :class:`OffloadInputError` unless ``caches`` are
        2-D uint8/int8 tensors of one device and block count, each row contiguous, ``buffers`` is positive and the
        kernel asked for can run here."""
        if not caches:
            raise OffloadInputError("no cache tensors to copy from")
        if buffers <= 0:
            raise OffloadInputError(f"need at least one staging buffer, got {buffers}")
        self.device = caches[0].device
        for index, cache in enumerate(caches):
            if cache.dim() != 2 or cache.dtype not in (torch.uint8, torch.int8) or cache.stride(1) != 1:
                raise OffloadInputError(f"cache tensor {index}: need 2-D uint8/int8 rows, got {cache.dtype}")
            if cache.device != self.device or cache.shape[0] != caches[0].shape[0]:
                raise OffloadInputError(f"cache tensor {index} differs from the first in device or block count")
        self.caches = [cache.view(torch.uint8) for cache in caches]
        widths = [int(cache.shape[1]) for cache in caches]
        self._lows = [sum(widths[:index]) for index in range(len(widths))]  # each tensor's column in a staging row
        self.block_bytes = sum(widths)
        self._cuda = self.device.type == "cuda"
        try:
            self.one_kernel = use_kernel(self.device, one_kernel)
        except ValueError as error:
            raise OffloadInputError(str(error)) from error
        self._upload = upload_to(self.device)
        #: Gather and scatter calls queued so far: row-kernel launches, or torch calls (at least one per tensor and
        #: chunk).
        self.gather_calls = 0
        self._stream = torch.cuda.Stream(self.device) if self._cuda else None  # gathers and scatters
        self._copy_stream = torch.cuda.Stream(self.device) if self._cuda else None  # copies to and from the host
        self.chunk_rows = max(1, staging_bytes // (buffers * self.block_bytes))
        self._lock = threading.Lock()  # one job's copies are queued at a time: they share the staging buffers
        with self._on(self._stream, None):
            self._staging = [
                torch.empty((self.chunk_rows, self.block_bytes), dtype=torch.uint8, device=self.device)
                for _ in range(buffers)
            ]
        if self._copy_stream is not None:
            for staging in self._staging:
                staging.record_stream(self._copy_stream)  # freed (with the copier) only after its copies ran
        #: Per staging buffer, the event after which it may be written again (None: it may now).
        self._released: list[torch.cuda.Event | None] = [None] * buffers
        self._memory = RowMemory([*self.caches, *self._staging])  # what torch's gathers and scatters view
        if self.one_kernel:
            self._warm_up()

    @property
    def asynchronous(self) -> bool:
        """Whether copies run on device streams (complete with their event) rather than on return."""
        return self._cuda

    @property
    def buffers(self) -> int:
        """The number of staging buffers, taken in turn by a job's chunks."""
        return len(self._staging)

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
        with self._lock:
            chunks = self.chunks(rows, len(block_ids))
            self._start(after)
            gather = self._prepare(block_ids, chunks, to_staging=True)
            for chunk in chunks:
                staging = self._staging[chunk.buffer]
                with self._on(self._stream, self._released[chunk.buffer]):
                    gather(chunk)
                gathered = self._record(self._stream)
                with self._on(self._copy_stream, gathered):
                    for at, row, count in chunk.runs:
                        host[row : row + count].copy_(staging[at : at + count], non_blocking=self._cuda)
                self._released[chunk.buffer] = self._record(self._copy_stream)
            return self._finish()

    def from_host(
        self, rows: Sequence[int], block_ids: Sequence[int], host: torch.Tensor, after: torch.cuda.Event | None = None
    ) -> torch.cuda.Event | None:
        """Copy ``host[rows[i]]`` into engine block ``block_ids[i]``, after ``after``. Returns the event that completes
        when the blocks hold the bytes (None: they do already)."""
        with self._lock:
            chunks = self.chunks(rows, len(block_ids))
            self._start(after)
            scatter = self._prepare(block_ids, chunks, to_staging=False)
            for chunk in chunks:
                staging = self._staging[chunk.buffer]
                with self._on(self._copy_stream, self._released[chunk.buffer]):
                    for at, row, count in chunk.runs:
                        staging[at : at + count].copy_(host[row : row + count], non_blocking=self._cuda)
                filled = self._record(self._copy_stream)
                with self._on(self._stream, filled):
                    scatter(chunk)
                self._released[chunk.buffer] = self._record(self._stream)
            return self._finish()

    def chunks(self, rows: Sequence[int], count: int | None = None) -> list[Chunk]:
        """The chunks a job of host rows ``rows`` moves in: :attr:`chunk_rows` positions each (the last fewer),
        staging buffers in turn, each cut into runs of consecutive host rows. ``count``: the job's number of engine
        blocks, which must equal ``len(rows)`` (:class:`OffloadInputError`)."""
        if count is not None and count != len(rows):
            raise OffloadInputError(f"{count} engine blocks for {len(rows)} host rows")
        chunks = []
        for number, start in enumerate(range(0, len(rows), self.chunk_rows)):
            part = [int(row) for row in rows[start : start + self.chunk_rows]]
            runs: list[tuple[int, int, int]] = []
            first = 0
            for end in range(1, len(part) + 1):
                if end == len(part) or part[end] != part[end - 1] + 1:
                    runs.append((first, part[first], end - first))
                    first = end
            chunks.append(Chunk(start, len(part), number % self.buffers, tuple(runs)))
        return chunks

    def row_addresses(self, block_ids: Sequence[int], chunk: Chunk, *, to_staging: bool) -> list[RowAddresses]:
        """The rows the kernel copies for ``chunk`` of a job of ``block_ids``, one list per page width (one launch
        each): each block's page of each cache tensor of that width, and its place in the chunk's staging buffer
        (row ``i`` for position ``chunk.start + i``, at the tensor's column offset). ``to_staging``: cache to staging
        (a store's gather), else staging to cache (a load's scatter)."""
        return by_row_size(self._pages(block_ids, chunk, to_staging=to_staging))

    # ------------------------------------------------------------------ internals
    def _warm_up(self) -> None:
        """Launch the row kernel once per page width now (a page of a staging row copied onto itself; never the
        engine's cache, which its kernels may be writing), so that Triton compiles it while the copier is built, not
        in the first job (a job whose addresses allow only narrower elements compiles that variant then)."""
        base = self._staging[0].data_ptr()
        lows: dict[int, int] = {}  # page width -> the column of its first tensor
        for cache, low in zip(self.caches, self._lows, strict=True):
            lows.setdefault(int(cache.shape[1]), low)
        rows = [RowAddresses(np.array([base + low]), np.array([base + low]), width) for width, low in lows.items()]
        with self._on(self._stream, None):
            launch_rows(rows, self._upload)

    def _pages(self, block_ids: Sequence[int], chunk: Chunk, *, to_staging: bool) -> list[RowAddresses]:
        """The rows of ``chunk`` of a job of ``block_ids``, one list per cache tensor (see :meth:`row_addresses`)."""
        blocks = np.asarray(block_ids[chunk.start : chunk.start + chunk.count], dtype=np.int64)
        staging_rows = (
            self._staging[chunk.buffer].data_ptr() + np.arange(chunk.count, dtype=np.int64) * self.block_bytes
        )
        out = []
        for cache, low in zip(self.caches, self._lows, strict=True):
            in_cache = cache.data_ptr() + blocks * cache.stride(0)
            in_staging = staging_rows + low
            sources, targets = (in_cache, in_staging) if to_staging else (in_staging, in_cache)
            out.append(RowAddresses(sources, targets, int(cache.shape[1])))
        return out

    def _prepare(
        self, block_ids: Sequence[int], chunks: Sequence[Chunk], *, to_staging: bool
    ) -> Callable[[Chunk], None]:
        """What queues a chunk's gather (``to_staging``) or scatter on the current stream (on the CPU: does it) by
        the row mover; for the kernel on a device, the job's addresses go there now, on the compute stream, all in
        one copy."""
        copies = {
            chunk.start: [RowCopy(rows, self._memory) for rows in self._pages(block_ids, chunk, to_staging=to_staging)]
            for chunk in chunks
        }
        upload = self._upload
        if self.one_kernel and self._cuda:
            arrays = [kernel_upload(by_row_size(copy.addresses for copy in copies[c.start])) for c in chunks]
            with self._on(self._stream, None):
                upload = _Uploaded(arrays, self.device)

        def move(chunk: Chunk) -> None:
            self.gather_calls += move_rows(copies[chunk.start], upload, one_kernel=self.one_kernel)

        return move

    @contextlib.contextmanager
    def _on(self, stream: torch.cuda.Stream | None, after: torch.cuda.Event | None) -> Iterator[None]:
        """Queue on ``stream`` after ``after`` (None: now); on the CPU (no stream), just run."""
        if stream is None:
            yield
            return
        with torch.cuda.stream(stream):
            if after is not None:
                stream.wait_event(after)
            yield

    def _start(self, after: torch.cuda.Event | None) -> None:
        """Both streams wait for the caller's event before anything of the job."""
        if after is None:
            return
        for stream in (self._stream, self._copy_stream):
            if stream is not None:
                stream.wait_event(after)

    def _record(self, stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
        """An event after the work queued on ``stream`` so far (None on the CPU)."""
        if stream is None:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def _finish(self) -> torch.cuda.Event | None:
        """The job's event: recorded on the compute stream once it waited for the copy stream's work."""
        if self._stream is None or self._copy_stream is None:
            return None
        self._stream.wait_stream(self._copy_stream)
        return self._record(self._stream)
