"""The worker side: moves blocks between an engine's cache and a tier on a background thread.

The engine's cache is a list of tensors, each seen canonically as ``(num_blocks, page_bytes[i])`` uint8
(or int8) with contiguous rows; block ``b`` of the engine is row ``b`` of every tensor. :meth:`submit`
never blocks (a full queue refuses the job: the caller keeps the blocks and may retry or give up the
store); :meth:`poll` returns the jobs finished since the last call, waiting up to ``timeout`` seconds for
one. Jobs run one at a time, in submission order.

A cache on a device (a GPU engine's) moves through a :class:`~.device_copy.BlockCopier` instead (only to and from
the host tier, whose pool should then be pinned): :meth:`submit` and :meth:`run_now` record an event on the calling
thread's stream of the device, the job's copies run after it on the copier's streams (a store copies what the
engine's kernels queued before the submit wrote), and the job is done once its copies' event completed.
``device_copies=True`` runs that path on CPU tensors (plain copies), as CI does.

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

    from .device_copy import BlockCopier

logger = logging.getLogger(__name__)


class Tier(Protocol):
    """What the worker needs of a tier (:class:`~.host.HostPool`, :class:`~.files.DirectoryTier`)."""

    name: str
    page_format: PageFormat

    def store_blocks(self, blocks: TierBlocks, block_ids: Sequence[int], caches: Sequence[np.ndarray]) -> int: ...

    def load_blocks(
        self, blocks: TierBlocks, block_ids: Sequence[int], caches: Sequence[np.ndarray]
    ) -> tuple[int, list[BlockKey]]: ...


class DeviceTier(Tier, Protocol):
    """A tier that also takes blocks from and gives them to a device cache (:class:`~.host.HostPool`)."""

    def store_device(
        self, blocks: TierBlocks, block_ids: Sequence[int], copier: BlockCopier, after: torch.cuda.Event | None
    ) -> int: ...

    def load_device(
        self, blocks: TierBlocks, block_ids: Sequence[int], copier: BlockCopier, after: torch.cuda.Event | None
    ) -> tuple[int, list[BlockKey]]: ...


def canonical_views(caches: Sequence[torch.Tensor], page_format: PageFormat) -> list[np.ndarray]:
    """NumPy views (sharing memory) of the engine's cache tensors, checked against ``page_format``."""
    import torch  # here, so processes that only touch a tier's files need not load torch

    _check_caches(caches, page_format)
    for index, cache in enumerate(caches):
        if cache.device.type != "cpu":
            raise OffloadInputError(f"cache tensor {index}: need a CPU tensor, got one on {cache.device}")
    return [cache.view(torch.uint8).numpy() for cache in caches]


def _check_caches(caches: Sequence[torch.Tensor], page_format: PageFormat) -> None:
    """Raise :class:`OffloadInputError` unless ``caches`` are 2-D uint8/int8 rows of ``page_format``'s pages (row
    ``i`` of each contiguous), all of one block count."""
    import torch  # here, so processes that only touch a tier's files need not load torch

    if len(caches) != len(page_format.page_bytes):
        raise OffloadInputError(f"{len(caches)} cache tensors for a format of {len(page_format.page_bytes)} pages")
    for index, (cache, page_bytes) in enumerate(zip(caches, page_format.page_bytes, strict=True)):
        if cache.dtype not in (torch.uint8, torch.int8) or cache.dim() != 2:
            raise OffloadInputError(f"cache tensor {index}: need a 2-D uint8/int8 tensor, got {cache.dtype}")
        if cache.shape[1] != page_bytes or cache.stride(1) != 1:
            raise OffloadInputError(f"cache tensor {index}: rows of {cache.shape[1]} bytes, format says {page_bytes}")
    if len({cache.shape[0] for cache in caches}) != 1:
        raise OffloadInputError("cache tensors differ in their number of blocks")


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
        device_copies: bool | None = None,
        staging_bytes: int | None = None,
    ) -> None:
        """``device_copies``: move blocks with a :class:`~.device_copy.BlockCopier` (None: when the caches are not
        on the CPU); ``staging_bytes``: its staging buffers on the device, all together (None: its default)."""
        if max_queued_jobs <= 0:
            raise OffloadInputError(f"max_queued_jobs must be positive, got {max_queued_jobs}")
        self.tier = tier
        self._copier: BlockCopier | None = None
        self._caches: list[np.ndarray] = []
        if device_copies if device_copies is not None else bool(caches) and caches[0].device.type != "cpu":
            _check_caches(caches, tier.page_format)
            if not hasattr(tier, "store_device"):
                raise OffloadInputError(f"the {tier.name} tier takes blocks from host memory only, not from a device")
            from .device_copy import DEFAULT_STAGING_BYTES, BlockCopier

            self._copier = BlockCopier(caches, staging_bytes=staging_bytes or DEFAULT_STAGING_BYTES)
        else:
            self._caches = canonical_views(caches, tier.page_format)
        self.num_blocks = int(caches[0].shape[0])
        self._metrics = metrics
        self._jobs: queue.Queue[tuple[TransferJob, torch.cuda.Event | None] | None] = queue.Queue(
            maxsize=max_queued_jobs
        )
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
            self._jobs.put_nowait((job, self._ready()))
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
        result = self._execute(job, self._ready())
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

    def _ready(self) -> torch.cuda.Event | None:
        """An event after the work the calling thread queued on the cache's device (None: nothing to wait for)."""
        return self._copier.mark_ready() if self._copier is not None else None

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, ready = item
            result = self._execute(job, ready)
            self._observe(job, result)
            with self._done:
                self._in_flight -= 1
                self._results.append(result)
                self._done.notify_all()

    def _observe(self, job: TransferJob, result: TransferResult) -> None:
        if self._metrics is not None and result.num_bytes:
            self._metrics.observe_transfer(self.tier.name, job.direction, result.num_bytes, result.seconds)

    def _execute(self, job: TransferJob, ready: torch.cuda.Event | None) -> TransferResult:
        started = time.perf_counter()
        failed: list[BlockKey] = []
        try:
            if self._copier is not None:
                moved, failed = self._execute_on_device(job, self._copier, ready)
            elif job.direction == "store":
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

    def _execute_on_device(
        self, job: TransferJob, copier: BlockCopier, ready: torch.cuda.Event | None
    ) -> tuple[int, list[BlockKey]]:
        tier: DeviceTier = self.tier  # type: ignore[assignment]  # checked in __init__
        if job.direction == "store":
            return tier.store_device(job.tier_blocks, job.block_ids, copier, ready), []
        return tier.load_device(job.tier_blocks, job.block_ids, copier, ready)
