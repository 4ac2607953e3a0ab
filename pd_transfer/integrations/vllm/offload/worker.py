"""The worker half of ``PdOffloadConnector``: submits the scheduler's jobs to one :class:`TransferWorker` per tier
and turns their results into what vLLM expects (finished loads and sends per request, invalid block ids), plus
the raw results for the scheduler. No vLLM here.

Rules shared with :mod:`.scheduler`: a request's loads are finished when all its load jobs are; a
request with any store job is reported in ``finished_sending`` once vLLM says it finished and all its
stores are done (never before: vLLM would free a running request's blocks).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from pd_transfer.offload import TransferJob, TransferResult, TransferWorker, brief

from .scheduler import StepJobs

logger = logging.getLogger(__name__)

PREEMPTION_WAIT_S = 30.0


@dataclass
class StepResults:
    """What one ``get_transfer_results`` call found."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)
    results: list[TransferResult] = field(default_factory=list)


class OffloadWorkerSide:
    """Job tracking over ``workers`` (tier name -> its :class:`TransferWorker`)."""

    def __init__(self, workers: Mapping[str, TransferWorker]) -> None:
        self.workers = dict(workers)
        self._jobs: dict[int, tuple[str, TransferJob]] = {}  # job id -> (request id, job)
        self._loads: dict[str, int] = {}  # request id -> load jobs in flight
        self._stores: dict[str, int] = {}  # request id -> store jobs in flight (0 once all done)
        self._finished: set[str] = set()  # requests vLLM finished whose stores are still in flight
        self._ready_recving: set[str] = set()
        self._invalid: set[int] = set()
        self._results: list[TransferResult] = []  # failed submissions, reported with the next results

    def start_loads(self, step: StepJobs) -> None:
        """Submit the step's loads (the requests wait in WAITING_FOR_REMOTE_KVS until they finish)."""
        for req_id, _job in step.loads:
            self._loads[req_id] = self._loads.get(req_id, 0) + 1
        for req_id, job in step.loads:
            self._submit(req_id, job)
        for req_id, blocks in step.doomed:
            self._invalid.update(blocks)
            if not self._loads.get(req_id):
                self._ready_recving.add(req_id)

    def load_in_step(self, step: StepJobs) -> None:
        """Run the step's synchronous loads now, on this thread (before the forward that reads them). Their
        requests are running, not waiting: blocks that failed become invalid block ids (vLLM recomputes them)
        and nothing is reported in ``finished_recving``."""
        for req_id, job in step.sync_loads:
            worker = self.workers.get(job.tier_blocks.tier)
            if worker is None:
                self._fail(req_id, job, f"no {job.tier_blocks.tier} tier on this worker")
                continue
            try:
                result = worker.run_now(job)
            except Exception as exc:  # a bad job is a failed load, never an engine error
                self._fail(req_id, job, brief(exc))
                continue
            self._results.append(result)
            self._invalid.update(_failed_blocks(job, result))
        for _req_id, blocks in step.sync_doomed:
            self._invalid.update(blocks)

    def start_stores(self, step: StepJobs) -> None:
        """Submit the step's stores (after the forward that computed their blocks)."""
        for req_id, job in step.stores:
            self._stores[req_id] = self._stores.get(req_id, 0) + 1
            self._submit(req_id, job)

    def wait_for_stores(self, req_ids: Iterable[str], timeout_s: float = PREEMPTION_WAIT_S) -> None:
        """Block (at most ``timeout_s``) until the stores of ``req_ids`` are done: vLLM is about to free their
        blocks (preemption)."""
        wanted = set(req_ids)
        deadline = time.monotonic() + timeout_s
        while any(self._stores.get(r) for r in wanted):
            left = deadline - time.monotonic()
            if left <= 0:
                logger.warning("offload: stores of preempted requests still running after %g s", timeout_s)
                return
            for worker in self.workers.values():
                self._absorb(worker.poll(timeout=min(left, 0.05)))

    def collect(self, finished_req_ids: Iterable[str]) -> StepResults:
        """Poll the tiers (never waits); ``finished_req_ids``: requests vLLM finished since the last step."""
        for worker in self.workers.values():
            self._absorb(worker.poll())
        for req_id in finished_req_ids:
            if req_id in self._stores:
                self._finished.add(req_id)
        out = StepResults(results=self._results, invalid_block_ids=self._invalid)
        out.finished_recving, self._ready_recving = self._ready_recving, set()
        self._results, self._invalid = [], set()
        for req_id in list(self._finished):
            if not self._stores.get(req_id):
                self._finished.discard(req_id)
                del self._stores[req_id]
                out.finished_sending.add(req_id)
        return out

    def close(self) -> None:
        """Finish the queued jobs, stop the threads and release the tiers (the host pool's memory)."""
        for worker in self.workers.values():
            worker.close()
            close = getattr(worker.tier, "close", None)
            if close is not None:
                close()

    # ------------------------------------------------------------------ internals
    def _submit(self, req_id: str, job: TransferJob) -> None:
        tier = job.tier_blocks.tier
        worker = self.workers.get(tier)
        error = f"no {tier} tier on this worker"
        if worker is not None:
            try:
                if worker.submit(job):
                    self._jobs[job.job_id] = (req_id, job)
                    return
                error = "queue full"
            except Exception as exc:  # a bad job is a failed job, never an engine error
                error = brief(exc)
        self._jobs[job.job_id] = (req_id, job)
        self._absorb([self._fail(req_id, job, error)])

    def _fail(self, req_id: str, job: TransferJob, error: str) -> TransferResult:
        """The result of a job that could not run; a synchronous load's is recorded here."""
        logger.warning("offload: %s job %d of request %s not run (%s)", job.direction, job.job_id, req_id, error)
        failed = TransferResult(
            job_id=job.job_id,
            direction=job.direction,
            ok=False,
            num_bytes=0,
            seconds=0.0,
            failed_keys=job.tier_blocks.keys,
            error=error,
        )
        if job.job_id not in self._jobs:  # not tracked: a synchronous load
            self._results.append(failed)
            self._invalid.update(job.block_ids)
        return failed

    def _absorb(self, results: Iterable[TransferResult]) -> None:
        for result in results:
            entry = self._jobs.pop(result.job_id, None)
            if entry is None:
                continue
            req_id, job = entry
            self._results.append(result)
            if job.direction == "load":
                self._load_done(req_id, job, result)
            else:
                self._stores[req_id] -= 1

    def _load_done(self, req_id: str, job: TransferJob, result: TransferResult) -> None:
        self._invalid.update(_failed_blocks(job, result))
        self._loads[req_id] -= 1
        if not self._loads[req_id]:
            del self._loads[req_id]
            self._ready_recving.add(req_id)


def _failed_blocks(job: TransferJob, result: TransferResult) -> list[int]:
    """The engine blocks of a load that did not receive their block (all of them when the job failed whole)."""
    failed = set(result.failed_keys) if result.failed_keys or result.ok else set(job.tier_blocks.keys)
    return [block for key, block in zip(job.tier_blocks.keys, job.block_ids, strict=True) if key in failed]
