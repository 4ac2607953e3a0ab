"""The scheduler half of ``PdOffloadConnector``, in plain terms (request ids, token ids, block ids): no vLLM here.

Per request it keeps the chained keys of the prompt's full blocks, the load it planned (which tier serves
which leading blocks), and how many blocks it has handed to stores. Loads: :meth:`OffloadScheduler.match`
looks up the host tier, then the directory tier for the blocks after the host's hits, and decides whether the
load runs in the step (``sync``: the worker copies before that step's forward, the request computes its tail in
the same step) or asynchronously (the request waits in vLLM's WAITING_FOR_REMOTE_KVS until the worker reports
it); :meth:`~OffloadScheduler.after_alloc` pins the blocks and queues one load job per tier. Stores: each step,
:meth:`~OffloadScheduler.step_jobs` queues the prompt's blocks that this step completes (a job per tier; the
worker submits them after the forward). Results come back from the worker (:meth:`~OffloadScheduler.on_results`)
and complete, or invalidate, the blocks in the managers.

Freeing: a request that had any store job keeps its blocks after it finishes until the worker says its
stores are done (the worker uses the same rule, so the two sides agree without asking each other).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgspec

from pd_transfer.offload import (
    DEFAULT_GROUP_BLOCKS,
    BlockKey,
    OffloadManager,
    OffloadStateError,
    TierBlocks,
    TransferJob,
    TransferResult,
    file_keys,
)

logger = logging.getLogger(__name__)

TIER_ORDER = ("host", "disk")

#: ``offload_load`` modes: ``auto`` loads in the step when every planned block is in host memory (a copy of
#: well under a millisecond per thousand tokens here) or in directory files the page cache holds whole (a copy
#: and a checksum), and asynchronously when any must come from storage (a cold read would hold up every request
#: in the step); ``sync`` and ``async`` force one way.
LOAD_MODES = ("auto", "sync", "async")

#: ``disk_cached(keys, files)``: whether the directory tier's files holding these blocks are in the page cache
DiskCached = Callable[[Sequence[BlockKey], Sequence[BlockKey]], bool]


@dataclass
class StepJobs:
    """What the scheduler asks the worker to do this step (pickled into vLLM's connector metadata)."""

    loads: list[tuple[str, TransferJob]] = field(default_factory=list)
    #: loads to finish before this step's forward (their requests are scheduled in this step)
    sync_loads: list[tuple[str, TransferJob]] = field(default_factory=list)
    stores: list[tuple[str, TransferJob]] = field(default_factory=list)
    #: loads that could not be prepared: the worker reports these blocks invalid (and an asynchronous
    #: request loaded)
    doomed: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)
    sync_doomed: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.loads or self.sync_loads or self.stores or self.doomed or self.preempted)


@dataclass
class _Request:
    keys: list[BlockKey]  # keys of the prompt's full blocks
    files: tuple[BlockKey, ...]  # the disk tier's file of each (file_keys)
    prompt_len: int
    skip: int = 0  # blocks computed locally at the last match
    plan: list[tuple[str, int]] = field(default_factory=list)  # (tier, blocks) of the planned load, in order
    sync: bool = False  # the planned load runs in the step
    loaded: list[tuple[str, int]] = field(default_factory=list)  # the plan after_alloc queued
    stored_upto: int = 0  # prompt blocks handed to stores (or found held)
    store_jobs: int = 0


class OffloadScheduler:
    """One engine's offload bookkeeping; ``managers`` by tier name (``host`` then ``disk``, either optional)."""

    def __init__(
        self,
        managers: dict[str, OffloadManager],
        block_size: int,
        keys_of: Callable[[Sequence[int]], list[BlockKey]],
        load_mode: str = "auto",
        ranks: int = 1,
        group_blocks: int = DEFAULT_GROUP_BLOCKS,
        disk_cached: DiskCached | None = None,
    ) -> None:
        """``ranks``: the TP ranks whose workers each report every job (a job is done when all have);
        ``group_blocks``: the directory tier's blocks per group file (its workers' setting); ``disk_cached``:
        whether a directory hit's files are in the page cache (every rank's; None: never, so ``auto`` loads
        directory hits asynchronously)."""
        if load_mode not in LOAD_MODES:
            raise ValueError(f"load mode must be one of {LOAD_MODES}, got {load_mode!r}")
        self.load_mode = load_mode
        self.managers = {tier: managers[tier] for tier in TIER_ORDER if tier in managers}
        self.block_size = block_size
        self.group_blocks = group_blocks
        self._disk_cached = disk_cached
        self._keys_of = keys_of
        self._requests: dict[str, _Request] = {}
        self._jobs: dict[int, tuple[str, TierBlocks]] = {}  # job id -> (direction, blocks)
        self.ranks = ranks
        self._partial: dict[int, list[TransferResult]] = {}  # job id -> results of the ranks that reported
        self._ids = itertools.count(1)
        self._pending = StepJobs()

    # ------------------------------------------------------------------ loads
    def match(self, req_id: str, prompt: Sequence[int], num_computed_tokens: int) -> int:
        """Tokens the tiers can supply after the ``num_computed_tokens`` computed locally (whole blocks;
        never the prompt's last token, which vLLM recomputes anyway)."""
        request = self._requests.get(req_id)
        if request is None:
            keys = self._keys_of(prompt)
            files = file_keys(keys, self.group_blocks)
            request = self._requests[req_id] = _Request(keys=keys, files=files, prompt_len=len(prompt))
        request.skip = num_computed_tokens // self.block_size
        request.plan = []
        usable = min(len(request.keys), (request.prompt_len - 1) // self.block_size)
        at = request.skip
        for tier, manager in self.managers.items():
            if at >= usable:
                break
            hits = manager.lookup(request.keys[at:usable], request.files[at:usable] if tier == "disk" else ())
            if hits:
                request.plan.append((tier, hits))
                at += hits
        request.sync = self.load_mode == "sync" or (self.load_mode == "auto" and self._in_memory(request))
        return (at - request.skip) * self.block_size

    def _in_memory(self, request: _Request) -> bool:
        """Whether every block of the planned load is in memory: the host tier's, or in directory files the page
        cache holds whole."""
        at = request.skip
        for tier, count in request.plan:
            if tier == "disk":
                cached = self._disk_cached
                if cached is None or not cached(request.keys[at : at + count], request.files[at : at + count]):
                    return False
            at += count
        return True

    def loads_in_step(self, req_id: str) -> bool:
        """Whether the load :meth:`match` planned for the request runs in the step (vLLM's ``load_kv_async``
        is the opposite)."""
        request = self._requests.get(req_id)
        return request is not None and request.sync

    def after_alloc(self, req_id: str, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """Pin the planned blocks and queue their loads into ``block_ids`` (the request's blocks, group 0)."""
        request = self._requests.get(req_id)
        if request is None or num_external_tokens <= 0 or not request.plan:
            return
        plan, request.plan = request.plan, []
        request.loaded = plan
        at = request.skip
        for tier, count in plan:
            keys = request.keys[at : at + count]
            engine_blocks = tuple(int(b) for b in block_ids[at : at + count])
            files = request.files[at : at + count]
            at += count
            try:
                blocks = self._with_files(self.managers[tier].prepare_load(keys), dict(zip(keys, files, strict=True)))
            except OffloadStateError as error:  # evicted since the match: recompute these blocks
                logger.warning("offload: load of request %s from %s not prepared: %s", req_id, tier, error)
                (self._pending.sync_doomed if request.sync else self._pending.doomed).append((req_id, engine_blocks))
                continue
            job = TransferJob(job_id=next(self._ids), direction="load", block_ids=engine_blocks, tier_blocks=blocks)
            self._jobs[job.job_id] = ("load", blocks)
            (self._pending.sync_loads if request.sync else self._pending.loads).append((req_id, job))
        request.stored_upto = max(request.stored_upto, at)  # loaded blocks are in a tier already

    def hit_sources(self, req_id: str) -> dict[str, int]:
        """Blocks per tier of the load :meth:`after_alloc` queued for the request."""
        request = self._requests.get(req_id)
        return dict(request.loaded) if request is not None else {}

    # ------------------------------------------------------------------ stores
    def computed(
        self, req_id: str, num_computed_after_step: int, block_ids: Sequence[int]
    ) -> tuple[int, list[BlockKey]] | None:
        """The request will have ``num_computed_after_step`` tokens computed after this step: queue stores of
        the prompt blocks that step completes (``block_ids``: the request's blocks, group 0). Returns the index
        of the first such block and their keys (None: no new block)."""
        request = self._requests.get(req_id)
        if request is None:
            return None
        full = min(num_computed_after_step, request.prompt_len) // self.block_size
        full = min(full, len(request.keys), len(block_ids))
        if full <= request.stored_upto:
            return None
        start, request.stored_upto = request.stored_upto, full
        keys = request.keys[start:full]
        where = {key: int(block_ids[start + i]) for i, key in enumerate(keys)}
        file_of = dict(zip(keys, request.files[start:full], strict=True))
        for manager in self.managers.values():
            plan = manager.prepare_store(keys)
            if plan is None or not plan.blocks.keys:
                continue
            blocks = self._with_files(plan.blocks, file_of)
            job = TransferJob(
                job_id=next(self._ids),
                direction="store",
                block_ids=tuple(where[key] for key in blocks.keys),
                tier_blocks=blocks,
            )
            self._jobs[job.job_id] = ("store", blocks)
            self._pending.stores.append((req_id, job))
            request.store_jobs += 1
        return start, keys

    @staticmethod
    def _with_files(blocks: TierBlocks, file_of: dict[BlockKey, BlockKey]) -> TierBlocks:
        """Disk-tier blocks with the file of each key (its group file or its own), so the worker writes whole
        groups to one file and finds them again."""
        if blocks.tier != "disk":
            return blocks
        return msgspec.structs.replace(blocks, files=tuple(file_of[key] for key in blocks.keys))

    def preempted(self, req_ids: Sequence[str]) -> None:
        """Requests whose blocks vLLM frees this step: the worker waits for their stores first."""
        self._pending.preempted.extend(r for r in req_ids if r in self._requests)

    def take_step(self) -> StepJobs:
        """This step's jobs (each returned once)."""
        step, self._pending = self._pending, StepJobs()
        return step

    # ------------------------------------------------------------------ results and the end of a request
    def on_results(self, results: Sequence[TransferResult]) -> None:
        """The workers' finished jobs: complete (or, for failed keys, invalidate) their blocks once every rank
        reported a job (with TP, a block is stored or loaded only when all ranks' shares are)."""
        for result in self._whole(results):
            entry = self._jobs.pop(result.job_id, None)
            if entry is None:
                logger.warning("offload: result of unknown job %d ignored", result.job_id)
                continue
            direction, blocks = entry
            manager = self.managers[blocks.tier]
            if direction == "load":
                manager.complete_load(blocks.keys)
                if result.failed_keys:
                    manager.invalidate(result.failed_keys)
            else:
                manager.complete_store(blocks.keys, success=result.ok)

    def _whole(self, results: Sequence[TransferResult]) -> list[TransferResult]:
        """The jobs all ``ranks`` have reported, each as one result (ok if every rank's was; failed keys of all)."""
        if self.ranks == 1:
            return list(results)
        whole = []
        for result in results:
            reported = self._partial.setdefault(result.job_id, [])
            reported.append(result)
            if len(reported) < self.ranks:
                continue
            del self._partial[result.job_id]
            failed = tuple(dict.fromkeys(key for r in reported for key in r.failed_keys))
            whole.append(
                TransferResult(
                    job_id=result.job_id,
                    direction=result.direction,
                    ok=all(r.ok for r in reported),
                    num_bytes=sum(r.num_bytes for r in reported),
                    seconds=max(r.seconds for r in reported),
                    failed_keys=failed,
                    error=next((r.error for r in reported if r.error), ""),
                )
            )
        return whole

    def finished(self, req_id: str) -> bool:
        """Forget the request; True when its blocks must stay allocated until the worker's ``finished_sending``."""
        request = self._requests.pop(req_id, None)
        return request is not None and request.store_jobs > 0

    @property
    def jobs_in_flight(self) -> int:
        return len(self._jobs)
