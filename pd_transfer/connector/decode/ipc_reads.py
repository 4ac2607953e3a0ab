"""The one-node fast path: a decode rank copies a request's rows straight out of a prefill's memory opened through
same-host IPC (:class:`~pd_transfer.same_host.ipc_engine.IpcEngine`, once per engine), instead of reading them with
NIXL.

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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from pd_transfer.connector.cache import KVCache
from pd_transfer.rows import kernel_available, move_rows
from pd_transfer.same_host import IpcSource, IpcUnavailable
from pd_transfer.spec import MemoryPlace
from pd_transfer.topology import PeerPlan
from pd_transfer.transfer.errors import PeerDisconnected

from .reads import ReadTotals
from .request import PullRequest

if TYPE_CHECKING:
    from pd_transfer.transfer.agent_protocol import Agent

    from .remote_engines import RemoteEngine, SourceRank


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
    """Reads requests of engines connected through IPC into ``cache`` (``planes``: its plane views), then sends each
    source rank its ``ReadDone`` (``tell_read(sources, request_id)``)."""

    def __init__(
        self,
        agent: Agent,
        cache: KVCache,
        planes: list[torch.Tensor],
        *,
        tell_read: Callable[[list[SourceRank], str], None],
    ) -> None:
        self.agent = agent
        self.cache = cache
        self.planes = planes
        self._tell_read = tell_read
        self.stream = CopyStream(cache.place)
        self.one_kernel = kernel_available(self.stream.device)  # all of a pull's rows in one launch (CUDA, Triton)

    def read(self, remote: RemoteEngine, request: PullRequest, deadline: float, *, pushed: bool = False) -> ReadTotals:
        """Copy ``request`` from ``remote`` (connected through IPC), fix it up, wait for it, tell the prefill ranks
        (a :class:`~.reader.Reader`; ``deadline`` and ``pushed`` unused: a copy is done when its event completes).
        Block ids that do not fit the plan raise ``ValueError`` before anything moves; a closed engine
        ``IpcUnavailable``; an engine one of whose processes exited ``PeerDisconnected`` (as a NIXL read of it
        would: the decode then looks for a new incarnation at its address)."""
        opened = self._opened(remote)
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
        self._tell_read(remote.sources, request.request_id)
        fixup = done - copied if stream.device.type == "cpu" else 0.0  # on a GPU both are queued, then waited for
        return ReadTotals(
            bytes=sum(copy.nbytes for copy in copies),
            descriptors=sum(len(local) for local, _ in rows),
            read_seconds=done - started - fixup,
            postprocess_seconds=fixup,
            postprocess_exposed_seconds=fixup,
        )

    def close(self) -> None:
        """Nothing to release: its stream and pinned buffer go with it (a :class:`~.reader.Reader`)."""

    @staticmethod
    def _opened(remote: RemoteEngine) -> _Opened:
        """``remote``'s opened sources and the plan they are read by (held by the caller: a forget meanwhile drops
        only the engine's list)."""
        ipc = remote.ipc
        sources = [] if ipc is None else ipc.sources
        if ipc is None or not sources:
            raise IpcUnavailable(f"engine {remote.engine.engine_id} is not connected through IPC (any more)")
        if ipc.owner_exited():
            raise PeerDisconnected(f"engine {remote.engine.engine_id}: a prefill process whose memory is open exited")
        return _Opened(sources, ipc.plan)


@dataclass(frozen=True)
class _Opened:
    """An IPC engine's opened sources and its plan, taken together."""

    sources: list[IpcSource]
    plan: PeerPlan
