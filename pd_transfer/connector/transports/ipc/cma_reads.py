"""The read path of ``host_cma``, for host caches: a decode rank reads a request's rows straight out of a prefill
process's
memory with ``process_vm_readv`` (:mod:`pd_transfer.transfer.cma`), many rows a call, on several threads, instead of
NIXL (whose CMA transport makes one call per row, and whose block-size regroups are staged and fixed up after).

**Per request** (:meth:`CmaReader.read`), from an engine opened once
(:class:`~pd_transfer.same_host.cma_engine.CmaEngine`): the plan's rows as addresses, cut into calls (rows adjacent on a
side merged), run on the reader's threads; a process that exited before or during the read raises ``PeerDisconnected``
(its memory may then be another process's); the fix-up, if any; then each source rank hears ``ReadDone`` (the lease
protocol is unchanged).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from pd_transfer.same_host import CmaEngine, CmaSource, IpcUnavailable
from pd_transfer.transfer.cma import CmaPool
from pd_transfer.transfer.errors import PeerDisconnected

from ..requests import PullRequest, ReadTotals
from ..seam import Source


class CmaReader:
    """Reads requests of engines read in place into the cache whose plane views are ``planes``, on ``threads``
    threads, each request's calls bounded by ``timeout_s``; then sends each source rank its ``ReadDone``
    (``tell_read(sources, request_id)``); its threads are named after ``name``. ``close`` stops the threads."""

    def __init__(
        self,
        name: str,
        planes: list[torch.Tensor],
        *,
        threads: int,
        timeout_s: float,
        tell_read: Callable[[Sequence[Source], str], None],
    ) -> None:
        self.planes = planes
        self.timeout_s = timeout_s
        self._tell_read = tell_read
        self._pool = CmaPool(threads, name=f"{name}-cma")

    def read(self, opened: CmaEngine, told: Sequence[Source], request: PullRequest) -> ReadTotals:
        """Read ``request`` from ``opened`` (read in place), fix it up if its plan says so, tell the prefill ranks
        ``told`` (the calls keep to the reader's own timeout). Block ids that do not fit the plan raise ``ValueError``
        before anything moves; a closed engine ``IpcUnavailable``; a prefill process that exited ``PeerDisconnected``
        (the decode then looks for a new incarnation at its address); a failed call ``TransferError``."""
        engine, sources = self._opened(opened)
        planned = [
            source.calls(request.remote_block_ids, request.local_block_ids, request.num_tokens) for source in sources
        ]
        calls = [call for source_calls, _ in planned for call in source_calls]
        started = time.perf_counter()
        self._check_running(engine)
        self._pool.run(calls, self.timeout_s)
        self._check_running(engine)  # an exit during the read: what was read may be another process's
        read = time.perf_counter()
        postprocess = engine.plan.postprocess
        if postprocess is not None:
            postprocess.apply(self.planes, request.local_block_ids, request.num_tokens)
        done = time.perf_counter()
        self._tell_read(told, request.request_id)
        return ReadTotals(
            bytes=sum(call.nbytes for call in calls),
            descriptors=sum(rows for _, rows in planned),
            read_seconds=read - started,
            postprocess_seconds=done - read,
            postprocess_exposed_seconds=done - read,
        )

    @staticmethod
    def _opened(engine: CmaEngine) -> tuple[CmaEngine, list[CmaSource]]:
        """``engine`` and its sources, held (a close meanwhile drops only the engine's list)."""
        sources = engine.sources
        if not sources:
            raise IpcUnavailable(f"engine {engine.engine_id} is not read in place (any more)")
        return engine, sources

    @staticmethod
    def _check_running(engine: CmaEngine) -> None:
        if engine.owner_exited():
            raise PeerDisconnected(f"engine {engine.engine_id}: a prefill process read in place exited")

    def close(self) -> None:
        self._pool.close()
