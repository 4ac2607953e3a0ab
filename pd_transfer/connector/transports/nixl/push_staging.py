"""Push through host memory, for caches on a GPU (or where asked, host caches): the prefill's rows gathered chunk by
chunk into a host staging pool and written from there, and the decode's landing area copied into its cache after.

Over TCP, NIXL reaches GPU memory only through an emulated path (0.5 GB/s); a WRITE from host memory into host
memory runs at the stream's rate. So:

* the **prefill** (:class:`PushStager`) gathers a request's rows (the reader's plan's rows of its cache, in the
  order of the order's rows) a chunk of ``chunk_bytes`` at a time into one of ``slots`` slots of a host pool
  registered with its writing agent, and hands each chunk to ``send`` (which WRITEs it) as soon as its bytes are
  there. On a GPU a chunk is gathered into a device buffer of its slot by the row kernel
  (:class:`~pd_transfer.rows.AddressedRows`; torch where the kernel is not available) on the
  stager's compute stream, then copied into the slot's pinned host memory on its copy stream; the first ``slots``
  chunks are queued at once, so chunk ``i + 1`` is gathered and copied out while chunk ``i`` is written, and a
  slot's next chunk is queued only once its write returned. Events order the streams: a copy out waits for its
  gather, a gather into a device buffer for the copy out that last read it. On the CPU the same calls gather straight
  into the slot, done when they return.
* the **decode** (:class:`LandingArea`) offers a host landing area, registered with its agent, as the target of the
  write (split in equal parts between the sources of an engine); the prefill writes the request's rows back to back
  into a source's part, and once its ``PushOutcome(ok)`` arrived :meth:`LandingArea.land` copies them into the cache
  (on a GPU: host to device on a copy stream into device buffers taken in turn, then scattered by the row kernel on
  a compute stream, the next chunk's copy overlapping this one's scatter), before the pull returns.

Every wait on the device is bounded: the host polls the chunk's event until the push's deadline
(:class:`~pd_transfer.transfer.errors.TransferTimeout` after). Host buffers are pinned where the cache is on a GPU.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pd_transfer.connector.options import DEFAULT_LANDING_BYTES, DEFAULT_PUSH_CHUNK_BYTES
from pd_transfer.rows import AddressedRows
from pd_transfer.transfer.errors import TransferTimeout

#: Slots of a prefill's pool: chunks gathered and copied out ahead of the one being written, plus that one.
DEFAULT_PUSH_SLOTS = 3
#: Device buffers a decode lands through (the copy of one overlapping the scatter of the other).
LANDING_BUFFERS = 2
#: Seconds between polls of a device event the host waits for.
EVENT_POLL_S = 50e-6
#: A landing part starts at a multiple of this many bytes (the widest element the row kernel copies, and more).
_ALIGN = 256


def host_buffer(nbytes: int, *, pinned: bool) -> torch.Tensor:
    """A zeroed 1-D uint8 host tensor of ``nbytes``; page-locked (``pinned``: copies with a GPU then run
    asynchronously) where asked."""
    return torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pinned)


def wait_event(event: torch.cuda.Event | None, deadline: float, what: str) -> None:
    """Return once ``event`` completed (None: at once), polling it every :data:`EVENT_POLL_S`; ``TransferTimeout``
    at ``deadline`` (``time.perf_counter`` time) naming ``what``."""
    if event is None:
        return
    while not event.query():
        if time.perf_counter() >= deadline:
            raise TransferTimeout(f"{what} not done on the device by the deadline")
        time.sleep(EVENT_POLL_S)


@dataclass(frozen=True)
class StagedChunk:
    """Rows ``start .. end - 1`` of a push (positions in its list), staged in the pool: ``pool_rows`` are their rows
    in :meth:`PushStager.pool_rows` (for the chunk's row size), ``last`` says it is the push's last chunk."""

    start: int
    end: int
    pool_rows: np.ndarray
    last: bool


class _Streams:
    """A compute stream and a copy stream on ``device`` (none on the CPU: work is then done when queued)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.compute = torch.cuda.Stream(device) if self.cuda else None
        self.copy = torch.cuda.Stream(device) if self.cuda else None

    @staticmethod
    @contextlib.contextmanager
    def on(stream: torch.cuda.Stream | None, after: torch.cuda.Event | None) -> Iterator[None]:
        """Queue on ``stream`` after ``after`` (None: now); on the CPU (no stream), just run."""
        if stream is None:
            yield
            return
        with torch.cuda.stream(stream):
            if after is not None:
                stream.wait_event(after)
            yield

    @staticmethod
    def record(stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
        """An event after the work queued on ``stream`` so far (None on the CPU)."""
        if stream is None:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event


class PushStager:
    """The prefill side: pushes of the rows of ``tensors`` (a cache, on one device) through ``slots`` slots of
    ``chunk_bytes`` of host memory; see the module docstring. ``one_kernel`` as
    :class:`~pd_transfer.rows.AddressedRows`. The buffers are made on first use
    (:meth:`pool_span`), so a prefill that is never asked to push holds none. One push at a time (a lock)."""

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        *,
        chunk_bytes: int = DEFAULT_PUSH_CHUNK_BYTES,
        slots: int = DEFAULT_PUSH_SLOTS,
        one_kernel: bool | None = None,
    ) -> None:
        if chunk_bytes <= 0 or slots <= 0:
            raise ValueError(f"need positive chunk bytes and slots, got {chunk_bytes} and {slots}")
        self.rows = AddressedRows(tensors, one_kernel=one_kernel)
        self.device = self.rows.device
        self.chunk_bytes = chunk_bytes
        self.slots = slots
        self._lock = threading.Lock()
        self._pool: torch.Tensor | None = None  # host: slot s is bytes [s * chunk_bytes, (s + 1) * chunk_bytes)
        self._device_slots: list[torch.Tensor] = []  # on a GPU: one buffer per slot
        self._streams: _Streams | None = None
        self._copied: list[torch.cuda.Event | None] = [None] * slots  # per device buffer: its last copy out
        self.chunks = 0  # chunks staged so far

    @property
    def pool(self) -> torch.Tensor:
        """The host pool (1-D uint8; made now if not yet): slot ``s`` is bytes ``[s * chunk_bytes, (s + 1) *
        chunk_bytes)``."""
        return self._buffers()

    def pool_span(self) -> tuple[int, int]:
        """The pool's (start, end) byte addresses, for the writing agent to register (made now if not yet)."""
        pool = self._buffers()
        return pool.data_ptr(), pool.data_ptr() + pool.numel()

    def rows_per_chunk(self, row_bytes: int) -> int:
        """Rows of ``row_bytes`` a slot holds; ``ValueError`` when not even one."""
        rows = self.chunk_bytes // row_bytes
        if rows <= 0:
            raise ValueError(f"a row of {row_bytes} bytes does not fit a push chunk of {self.chunk_bytes}")
        return rows

    def pool_rows(self, row_bytes: int) -> np.ndarray:
        """Descriptor rows (N x 3 uint64: address, ``row_bytes``, 0) of the pool for rows of ``row_bytes``: row ``r``
        of slot ``s`` is row ``s * rows_per_chunk + r``."""
        start, _ = self.pool_span()
        per = self.rows_per_chunk(row_bytes)
        slot_starts = start + np.arange(self.slots, dtype=np.int64) * self.chunk_bytes
        grid = np.zeros((self.slots * per, 3), dtype=np.uint64)
        grid[:, 0] = (slot_starts[:, None] + np.arange(per, dtype=np.int64)[None, :] * row_bytes).reshape(-1)
        grid[:, 1] = row_bytes
        return grid

    def push(self, sources: np.ndarray, row_bytes: int, deadline: float, send: Callable[[StagedChunk], None]) -> int:
        """Stage the rows of ``row_bytes`` at ``sources`` (int64 addresses in the tensors) chunk by chunk and call
        ``send`` with each staged chunk, in order, once its bytes are in the pool (the slot is rewritten only after
        ``send`` returned). Returns the chunks sent. ``TransferTimeout`` when a chunk is not staged by ``deadline``
        (``time.perf_counter`` time); ``ValueError`` for rows outside the tensors; what ``send`` raises, raised."""
        sources = np.asarray(sources, dtype=np.int64)
        per = self.rows_per_chunk(row_bytes)
        spans = [(start, min(start + per, len(sources))) for start in range(0, len(sources), per)]
        with self._lock:
            pool = self._buffers()
            staged: list[torch.cuda.Event | None] = []
            for number in range(min(self.slots, len(spans))):
                staged.append(self._stage(pool, sources, row_bytes, spans[number], number % self.slots))
            for number, (start, end) in enumerate(spans):
                slot = number % self.slots
                wait_event(staged[number], deadline, f"push chunk {number} (rows {start}-{end})")
                rows = slot * per + np.arange(end - start, dtype=np.int64)
                send(StagedChunk(start, end, rows, number == len(spans) - 1))
                self.chunks += 1
                ahead = number + self.slots
                if ahead < len(spans):
                    staged.append(self._stage(pool, sources, row_bytes, spans[ahead], slot))
        return len(spans)

    # ------------------------------------------------------------------ internals
    def _buffers(self) -> torch.Tensor:
        """The host pool (and on a GPU the device buffers and streams), made once."""
        if self._pool is None:
            cuda = self.device.type == "cuda"
            self._streams = _Streams(self.device)
            with _Streams.on(self._streams.compute, None):
                if cuda:
                    self._device_slots = [
                        torch.empty(self.chunk_bytes, dtype=torch.uint8, device=self.device) for _ in range(self.slots)
                    ]
            self._pool = host_buffer(self.slots * self.chunk_bytes, pinned=cuda)
        return self._pool

    def _stage(
        self, pool: torch.Tensor, sources: np.ndarray, row_bytes: int, span: tuple[int, int], slot: int
    ) -> torch.cuda.Event | None:
        """Queue the gather of rows ``span`` into ``slot`` (on the CPU: do it); returns the event after which the
        bytes are in the pool (None: they are already)."""
        start, end = span
        nbytes = (end - start) * row_bytes
        host = pool[slot * self.chunk_bytes : slot * self.chunk_bytes + nbytes]
        streams = self._streams
        assert streams is not None
        if not streams.cuda:
            self.rows.gather(sources[start:end], row_bytes, host)
            return None
        device = self._device_slots[slot]
        with _Streams.on(streams.compute, self._copied[slot]):
            self.rows.gather(sources[start:end], row_bytes, device)
        gathered = _Streams.record(streams.compute)
        with _Streams.on(streams.copy, gathered):
            host.copy_(device[:nbytes], non_blocking=True)
        self._copied[slot] = _Streams.record(streams.copy)
        return self._copied[slot]


class LandingArea:
    """The decode side: a host area of ``landing_bytes`` (pinned where ``tensors``, the cache, are on a GPU) that
    prefill ranks write a request's rows into, and what copies them from there into the cache; see the module
    docstring. On a GPU the rows go through :data:`LANDING_BUFFERS` device buffers of ``chunk_bytes``. One landing at
    a time (a lock; a decode rank pulls one request at a time)."""

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        *,
        landing_bytes: int = DEFAULT_LANDING_BYTES,
        chunk_bytes: int = DEFAULT_PUSH_CHUNK_BYTES,
        one_kernel: bool | None = None,
    ) -> None:
        if landing_bytes < _ALIGN or chunk_bytes <= 0:
            raise ValueError(f"a landing area of {landing_bytes} bytes through chunks of {chunk_bytes}")
        self.rows = AddressedRows(tensors, one_kernel=one_kernel)
        self.device = self.rows.device
        self.chunk_bytes = chunk_bytes
        self._streams = _Streams(self.device)
        self._area = host_buffer(landing_bytes, pinned=self._streams.cuda)
        self._device_buffers: list[torch.Tensor] = []
        if self._streams.cuda:
            with _Streams.on(self._streams.compute, None):
                self._device_buffers = [
                    torch.empty(chunk_bytes, dtype=torch.uint8, device=self.device) for _ in range(LANDING_BUFFERS)
                ]
        self._scattered: list[torch.cuda.Event | None] = [None] * LANDING_BUFFERS  # per buffer: its last scatter
        self._lock = threading.Lock()
        self.landed_rows = 0

    @property
    def area(self) -> torch.Tensor:
        """The landing area (1-D uint8 host memory)."""
        return self._area

    @property
    def span(self) -> tuple[int, int]:
        """The area's (start, end) byte addresses, for the decode's agent to register."""
        start = self._area.data_ptr()
        return start, start + self._area.numel()

    def part(self, index: int, parts: int, row_bytes: int) -> tuple[int, int]:
        """Part ``index`` of ``parts`` equal parts of the area (the ``index``-th source of an engine read from
        ``parts`` sources): its start address and the rows of ``row_bytes`` it holds (0 when not even one)."""
        if not 0 <= index < parts:
            raise ValueError(f"part {index} of {parts}")
        size = self._area.numel() // parts // _ALIGN * _ALIGN
        return self._area.data_ptr() + index * size, size // row_bytes

    def land(self, at: int, targets: np.ndarray, row_bytes: int, deadline: float) -> None:
        """Copy the rows of ``row_bytes`` written back to back from address ``at`` (inside the area) to ``targets``
        (int64 addresses in the cache), all done when this returns; ``TransferTimeout`` past ``deadline``
        (``time.perf_counter`` time), ``ValueError`` for rows outside the area or the cache."""
        targets = np.asarray(targets, dtype=np.int64)
        start, end = self.span
        nbytes = len(targets) * row_bytes
        if not start <= at <= end - nbytes:
            raise ValueError(f"{len(targets)} rows of {row_bytes} bytes at {at:#x} are not inside the landing area")
        landed = self._area[at - start : at - start + nbytes]
        with self._lock:
            if not self._streams.cuda:
                self.rows.scatter(targets, row_bytes, landed)
                self.landed_rows += len(targets)
                return
            wait_event(self._queue_on_device(landed, targets, row_bytes), deadline, "landing a push")
            self.landed_rows += len(targets)

    def _queue_on_device(self, landed: torch.Tensor, targets: np.ndarray, row_bytes: int) -> torch.cuda.Event | None:
        """Queue the copy of ``landed`` into the cache through the device buffers in turn; returns the event after
        which every row is in place."""
        compute, copy = self._streams.compute, self._streams.copy
        per = self.chunk_bytes // row_bytes
        if per <= 0:
            raise ValueError(f"a row of {row_bytes} bytes does not fit a landing chunk of {self.chunk_bytes}")
        for number, first in enumerate(range(0, len(targets), per)):
            buffer = number % LANDING_BUFFERS
            last = min(first + per, len(targets))
            nbytes = (last - first) * row_bytes
            device = self._device_buffers[buffer]
            with _Streams.on(copy, self._scattered[buffer]):
                device[:nbytes].copy_(landed[first * row_bytes : last * row_bytes], non_blocking=True)
            filled = _Streams.record(copy)
            with _Streams.on(compute, filled):
                self.rows.scatter(targets[first:last], row_bytes, device[:nbytes])
            self._scattered[buffer] = _Streams.record(compute)
        if compute is not None and copy is not None:
            compute.wait_stream(copy)
        return _Streams.record(compute)
