"""The one-node fast path of ``cuda_ipc`` and ``host_ipc``: a decode rank copies a request's rows straight out of a
prefill's memory opened through same-host IPC (:class:`~pd_transfer.same_host.ipc_engine.IpcEngine`, once per engine),
instead of reading them with NIXL.

**Per request** (:meth:`IpcReader.read`): the rows of the engine's direct plan (every row lands in place: a
block-size regroup, a TP head slice or a layout change is done by the copy itself), copied by the row mover
(:func:`pd_transfer.rows.move_rows`): on a GPU with Triton one kernel launch for all of them, else torch's gathers
and scatters per pair of segments they touch. On a GPU all of it is
queued on the decode rank's own CUDA stream and an event recorded after it is waited for before anything else happens:
the prefill hears ``ReadDone`` (the lease protocol is unchanged) and the engine is told the blocks are loaded only once
the copy is complete. Host caches (in shareable memory) take the same path, synchronously: that is what CI runs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from pd_transfer.connector.cache import KVCache
from pd_transfer.rows import kernel_available, move_rows
from pd_transfer.same_host import IpcEngine, IpcSource, IpcUnavailable
from pd_transfer.spec import MemoryPlace
from pd_transfer.topology import PeerPlan
from pd_transfer.transfer.errors import PeerDisconnected

from ..requests import PullRequest, ReadTotals
from ..seam import Source


class CopyStream:
    """Where a rank's IPC copies run, one block of work at a time: for a GPU cache, a CUDA stream of its own (work
    queued on it, then an event recorded after it and waited for; indices go up through a pinned buffer); for host
    memory, the calling thread (everything is done when queued)."""

    def __init__(self, place: MemoryPlace) -> None:
        self.device = torch.device("cpu") if place.is_host else torch.device("cuda", place.device_index)
        self._stream: torch.cuda.Stream | None = None if place.is_host else torch.cuda.Stream(device=self.device)
        self._lock = threading.Lock()
        self._pinned = torch.empty(0, dtype=torch.int64)

    @contextmanager
    def running(self) -> Iterator[None]:
        """Queue the block's work on the stream; on leaving (also by an exception), wait until it completed."""
        with self._lock:
            stream = self._stream
            if stream is None:
                yield
                return
            with torch.cuda.stream(stream):
                try:
                    yield
                finally:
                    done = torch.cuda.Event()
                    done.record(stream)
                    done.synchronize()

    def upload(self, values: np.ndarray) -> torch.Tensor:
        """``values`` (int64) on the stream's device; inside :meth:`running` (the pinned buffer is reused once the
        block's work completed)."""
        host = torch.from_numpy(values)
        if self._stream is None:
            return host
        if self._pinned.numel() < len(values):
            self._pinned = torch.empty(max(len(values), 2 * self._pinned.numel()), dtype=torch.int64).pin_memory()
        staged = self._pinned[: len(values)]
        staged.copy_(host)
        return staged.to(self.device, non_blocking=True)


class IpcReader:
    """Reads requests of engines opened through IPC into ``cache`` (``planes``: its plane views), then sends each
    source rank its ``ReadDone`` (``tell_read(sources, request_id)``)."""

    def __init__(
        self,
        cache: KVCache,
        planes: list[torch.Tensor],
        *,
        tell_read: Callable[[Sequence[Source], str], None],
    ) -> None:
        self.cache = cache
        self.planes = planes
        self._tell_read = tell_read
        self.stream = CopyStream(cache.place)
        self.one_kernel = kernel_available(self.stream.device)  # all of a pull's rows in one launch (CUDA, Triton)

    def read(self, engine: IpcEngine, told: Sequence[Source], request: PullRequest) -> ReadTotals:
        """Copy ``request`` from ``engine`` (opened through IPC), fix it up, wait for it, tell the prefill ranks
        ``told`` (a copy is done when its event completes: no deadline). Block ids that do not fit the plan raise
        ``ValueError`` before anything moves; a closed engine ``IpcUnavailable``; an engine one of whose processes
        exited ``PeerDisconnected`` (as a NIXL read of it would: the decode then looks for a new incarnation at its
        address)."""
        opened = self._opened(engine)
        sources = opened.sources
        rows = [
            plan.indices(request.remote_block_ids, request.local_block_ids, request.num_tokens)
            for plan in opened.plan.sources
        ]
        stream = self.stream
        started = time.perf_counter()
        with stream.running():
            copies = [
                copy
                for source, (mine, theirs) in zip(sources, rows, strict=True)
                for copy in source.copies(mine, theirs)
            ]
            move_rows(copies, stream.upload, one_kernel=self.one_kernel)
            copied = time.perf_counter()
            postprocess = opened.plan.postprocess
            if postprocess is not None:
                postprocess.apply(self.planes, request.local_block_ids, request.num_tokens)
        done = time.perf_counter()
        self._tell_read(told, request.request_id)
        fixup = done - copied if stream.device.type == "cpu" else 0.0  # on a GPU both are queued, then waited for
        return ReadTotals(
            bytes=sum(copy.nbytes for copy in copies),
            descriptors=sum(len(local) for local, _ in rows),
            read_seconds=done - started - fixup,
            postprocess_seconds=fixup,
            postprocess_exposed_seconds=fixup,
        )

    @staticmethod
    def _opened(engine: IpcEngine) -> _Opened:
        """``engine``'s opened sources and the plan they are read by (held by the caller: a close meanwhile drops
        only the engine's list)."""
        sources = engine.sources
        if not sources:
            raise IpcUnavailable(f"engine {engine.engine_id} is not open through IPC (any more)")
        if engine.owner_exited():
            raise PeerDisconnected(f"engine {engine.engine_id}: a prefill process whose memory is open exited")
        return _Opened(sources, engine.plan)


@dataclass(frozen=True)
class _Opened:
    """An IPC engine's opened sources and its plan, taken together."""

    sources: list[IpcSource]
    plan: PeerPlan
