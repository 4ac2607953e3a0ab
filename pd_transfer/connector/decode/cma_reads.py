"""The same-host read path for host caches: a decode rank reads a request's rows straight out of a prefill process's
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
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from pd_transfer.same_host import CmaEngine, CmaSource, IpcUnavailable
from pd_transfer.transfer.cma import CmaPool
from pd_transfer.transfer.errors import PeerDisconnected

from .reads import ReadTotals
from .request import PullRequest

if TYPE_CHECKING:
    from pd_transfer.transfer.agent_protocol import Agent

    from .remote_engines import RemoteEngine, SourceRank


class CmaReader:
    """Reads requests of engines read in place into the cache whose plane views are ``planes``, on ``threads``
    threads, each request's calls bounded by ``timeout_s``; then sends each source rank its ``ReadDone``
    (``tell_read(sources, request_id)``). ``close`` stops the threads."""

    def __init__(
        self,
        agent: Agent,
        planes: list[torch.Tensor],
        *,
        threads: int,
        timeout_s: float,
        tell_read: Callable[[list[SourceRank], str], None],
    ) -> None:
        self.agent = agent
        self.planes = planes
        self.timeout_s = timeout_s
        self._tell_read = tell_read
        self._pool = CmaPool(threads, name=f"{agent.name}-cma")

    def read(self, remote: RemoteEngine, request: PullRequest, deadline: float, *, pushed: bool = False) -> ReadTotals:
        """Read ``request`` from ``remote`` (read in place), fix it up if its plan says so, tell the prefill ranks
        (a :class:`~.reader.Reader`: the calls keep to the reader's own timeout, ``deadline`` and ``pushed`` unused).
        Block ids that do not fit the plan raise ``ValueError`` before anything moves; a closed engine
        ``IpcUnavailable``; a prefill process that exited ``PeerDisconnected`` (the decode then looks for a new
        incarnation at its address); a failed call ``TransferError``."""
        engine, sources = self._opened(remote)
        planned = [
            source.calls(request.remote_block_ids, request.local_block_ids, request.num_tokens) for source in sources
        ]
        calls = [call for source_calls, _ in planned for call in source_calls]
        started = time.perf_counter()
        self._check_running(remote, engine)
        self._pool.run(calls, self.timeout_s)
        self._check_running(remote, engine)  # an exit during the read: what was read may be another process's
        read = time.perf_counter()
        postprocess = engine.plan.postprocess
        if postprocess is not None:
            postprocess.apply(self.planes, request.local_block_ids, request.num_tokens)
        done = time.perf_counter()
        self._tell_read(remote.sources, request.request_id)
        return ReadTotals(
            bytes=sum(call.nbytes for call in calls),
            descriptors=sum(rows for _, rows in planned),
            read_seconds=read - started,
            postprocess_seconds=done - read,
            postprocess_exposed_seconds=done - read,
        )

    @staticmethod
    def _opened(remote: RemoteEngine) -> tuple[CmaEngine, list[CmaSource]]:
        """``remote``'s engine and its sources, held (a forget meanwhile drops only the engine's list)."""
        engine = remote.cma
        sources = [] if engine is None else engine.sources
        if engine is None or not sources:
            raise IpcUnavailable(f"engine {remote.engine.engine_id} is not read in place (any more)")
        return engine, sources

    @staticmethod
    def _check_running(remote: RemoteEngine, engine: CmaEngine) -> None:
        if engine.owner_exited():
            raise PeerDisconnected(f"engine {remote.engine.engine_id}: a prefill process read in place exited")

    def close(self) -> None:
        self._pool.close()
