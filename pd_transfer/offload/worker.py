"""The worker side: moves blocks between an engine's cache and a tier on a background thread.

The engine's cache is a list of tensors, each seen canonically as ``(num_blocks, page_bytes[i])`` uint8
(or int8) with contiguous rows; block ``b`` of the engine is row ``b`` of every tensor. :meth:`submit`
never blocks (a full queue refuses the job: the caller keeps the blocks and may retry or give up the
store); :meth:`poll` returns the jobs finished since the last call, waiting up to ``timeout`` seconds for
one. Jobs run one at a time, in submission order.

Contract with the engine: the engine blocks of a job must stay allocated and unchanged (store) or unread
(load) until the job is returned by :meth:`poll`. A load that returns ``ok=False`` may have written some
of its engine blocks: they hold garbage and must be recomputed; ``failed_keys`` are the tier's misses (pass
them to :meth:`OffloadManager.invalidate`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np

from .errors import OffloadInputError, WorkerClosedError, brief
from .keys import BlockKey
from .metrics import OffloadMetrics
from .specs import PageFormat, TierBlocks, TransferJob, TransferResult

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


class Tier(Protocol):
    """What the worker needs of a tier (:class:`~.host.HostPool`, :class:`~.files.DirectoryTier`)."""

    name: str
    page_format: PageFormat

    def store_blocks(self, blocks: TierBlocks, block_ids: Sequence[int], caches: Sequence[np.ndarray]) -> int: ...

    def load_blocks(
        self, blocks: TierBlocks, block_ids: Sequence[int], caches: Sequence[np.ndarray]
    ) -> tuple[int, list[BlockKey]]: ...


def canonical_views(caches: Sequence[torch.Tensor], page_format: PageFormat) -> list[np.ndarray]:
    """NumPy views (sharing memory) of the engine's cache tensors, checked against ``page_format``."""
    import torch  # here, so processes that only touch a tier's files need not load torch

    if len(caches) != len(page_format.page_bytes):
        raise OffloadInputError(f"{len(caches)} cache tensors for a format of {len(page_format.page_bytes)} pages")
    views = []
    for index, (cache, page_bytes) in enumerate(zip(caches, page_format.page_bytes, strict=True)):
        if cache.device.type != "cpu" or cache.dtype not in (torch.uint8, torch.int8) or cache.dim() != 2:
            raise OffloadInputError(f"cache tensor {index}: need a 2-D uint8/int8 CPU tensor, got {cache.dtype}")
        if cache.shape[1] != page_bytes or cache.stride(1) != 1:
            raise OffloadInputError(f"cache tensor {index}: rows of {cache.shape[1]} bytes, format says {page_bytes}")
        views.append(cache.view(torch.uint8).numpy())
    if len({view.shape[0] for view in views}) != 1:
        raise OffloadInputError("cache tensors differ in their number of blocks")
    return views


class TransferWorker:
    """One background thread moving blocks between ``caches`` and ``tier``; at most ``max_queued_jobs``
    jobs wait (memory stays bounded: a job holds only its ids and keys, never a copy of the bytes)."""

    def __init__(
        self,
        caches: Sequence[torch.Tensor],
        tier: Tier,
        *,
        max_queued_jobs: int = 64,
        metrics: OffloadMetrics | None = None,
    ) -> None:
        if max_queued_jobs <= 0:
            raise OffloadInputError(f"max_queued_jobs must be positive, got {max_queued_jobs}")
        self.tier = tier
        self._caches = canonical_views(caches, tier.page_format)
        self.num_blocks = self._caches[0].shape[0]
        self._metrics = metrics
        self._jobs: queue.Queue[TransferJob | None] = queue.Queue(maxsize=max_queued_jobs)
        self._done = threading.Condition()
        self._results: list[TransferResult] = []
        self._in_flight = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"pd-offload-{tier.name}", daemon=True)
        self._thread.start()

    def submit(self, job: TransferJob) -> bool:
        """Queue a job; False (nothing queued) when ``max_queued_jobs`` are waiting. Raises
        :class:`OffloadInputError` for a job that does not fit this cache or tier."""
        if self._closed:
            raise WorkerClosedError("the offload worker is closed")
        self._check(job)
        with self._done:
            self._in_flight += 1
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            with self._done:
                self._in_flight -= 1
            return False
        return True

    def run_now(self, job: TransferJob) -> TransferResult:
        """Run ``job`` on the calling thread, beside (not behind) the queued jobs, and return its result (it is
        not returned by :meth:`poll`). For loads the engine needs before its next forward. The caller must not
        give a job whose engine blocks or tier rows a queued job touches. Raises like :meth:`submit`."""
        if self._closed:
            raise WorkerClosedError("the offload worker is closed")
        self._check(job)
        result = self._execute(job)
        self._observe(job, result)
        return result

    def poll(self, timeout: float = 0.0) -> list[TransferResult]:
        """Jobs finished since the last call; if none yet and jobs are in flight, waits up to ``timeout`` s."""
        with self._done:
            if not self._results and self._in_flight and timeout > 0:
                self._done.wait_for(lambda: bool(self._results), timeout=timeout)
            results, self._results = self._results, []
            return results

    @property
    def in_flight(self) -> int:
        """Jobs submitted and not yet returned by :meth:`poll`'s producer (queued or running)."""
        with self._done:
            return self._in_flight

    def close(self, timeout: float = 30.0) -> None:
        """Finish the queued jobs (up to ``timeout`` s) and stop the thread; results stay pollable."""
        if self._closed:
            return
        self._closed = True
        try:
            self._jobs.put(None, timeout=timeout)
        except queue.Full:
            logger.warning("offload worker: queue still full after %g s; thread left to finish", timeout)
            return
        self._thread.join(timeout)

    # ------------------------------------------------------------------ internals
    def _check(self, job: TransferJob) -> None:
        blocks = job.tier_blocks
        if blocks.tier != self.tier.name:
            raise OffloadInputError(f"a {blocks.tier!r} job given to the {self.tier.name!r} worker")
        if len(job.block_ids) != len(blocks.keys):
            raise OffloadInputError(f"{len(job.block_ids)} engine blocks for {len(blocks.keys)} keys")
        if job.block_ids and not (0 <= min(job.block_ids) and max(job.block_ids) < self.num_blocks):
            raise OffloadInputError(f"an engine block id is outside 0..{self.num_blocks - 1}")

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            result = self._execute(job)
            self._observe(job, result)
            with self._done:
                self._in_flight -= 1
                self._results.append(result)
                self._done.notify_all()

    def _observe(self, job: TransferJob, result: TransferResult) -> None:
        if self._metrics is not None and result.num_bytes:
            self._metrics.observe_transfer(self.tier.name, job.direction, result.num_bytes, result.seconds)

    def _execute(self, job: TransferJob) -> TransferResult:
        started = time.perf_counter()
        failed: list[BlockKey] = []
        try:
            if job.direction == "store":
                moved = self.tier.store_blocks(job.tier_blocks, job.block_ids, self._caches)
            else:
                moved, failed = self.tier.load_blocks(job.tier_blocks, job.block_ids, self._caches)
        except Exception as error:  # a failed job is reported, never raised in the engine
            logger.warning("offload %s job %d failed: %s", job.direction, job.job_id, brief(error))
            return TransferResult(
                job_id=job.job_id,
                direction=job.direction,
                ok=False,
                num_bytes=0,
                seconds=time.perf_counter() - started,
                failed_keys=job.tier_blocks.keys,
                error=brief(error),
            )
        return TransferResult(
            job_id=job.job_id,
            direction=job.direction,
            ok=not failed,
            num_bytes=moved,
            seconds=time.perf_counter() - started,
            failed_keys=tuple(failed),
        )
