"""``PdOffloadConnector``: KV offloading (``pd_transfer.offload``) as a vLLM (0.31, 0.32) KV connector.

Enable it with::

    --kv-transfer-config '{"kv_connector": "PdOffloadConnector",
                           "kv_connector_module_path": "pd_transfer.integrations.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"offload_host_bytes": 1073741824,
                                                         "offload_dir": "/shared/kv",
                                                         "offload_dir_bytes": 10737418240}}'

Scheduler side (:mod:`.scheduler`): a request's full prompt blocks are looked up by chained key (host tier,
then the directory tier) and the hits reported as external tokens, loaded either in the step that computes the rest
of the prompt (before its forward: ``offload_load`` ``auto`` does this for hits all in memory, the host tier's or in
directory files the page cache holds whole) or asynchronously (vLLM's ``load_kv_async`` path: the request waits in
WAITING_FOR_REMOTE_KVS; ``auto`` for hits read from storage); the prompt blocks each step completes are stored into
every tier after that step's forward, and a finished request's blocks stay allocated until its stores are done. Worker
side (:mod:`.worker`): one :class:`~pd_transfer.offload.TransferWorker` per tier over canonical ``(num_blocks,
page_bytes)`` uint8 views of vLLM's cache tensors (each layer's blocks in memory order). A GPU engine's cache offloads
to host memory only: its host pool is pinned and its blocks move on a stream of their own, after the kernels that
wrote them (:mod:`pd_transfer.offload.device_copy`); the directory tier is refused at startup with such a cache. A
failed or damaged load is reported as invalid blocks (vLLM recomputes them; ``kv_load_failure_policy`` is set to
``recompute``) and the keys invalidated. Worker results reach the scheduler through vLLM's worker metadata hook. With
TP, every rank stores and loads its own share of each block (its own host pool of ``offload_host_bytes / TP`` bytes,
its own files, named by a page format that includes the rank), and the scheduler completes a job once all ranks
reported it. PP 1 and one KV cache group only (refused at startup otherwise).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)

from pd_transfer.integrations.vllm_cache_layouts import block_rows
from pd_transfer.offload import (
    DirectoryTier,
    HostPool,
    OffloadManager,
    OffloadMetrics,
    TransferResult,
    TransferWorker,
    chain_block_keys,
)
from pd_transfer.settings import read_settings

from ..compat import CacheHitSource
from ..connector import register_by_name
from ..logs import log_to_stderr
from .config import OffloadConfig, check_supported, layer_names, page_format, tp_size
from .events import OffloadEventNames
from .scheduler import OffloadScheduler, StepJobs
from .stats import OffloadStatsCollector, PdOffloadPromMetrics, PdOffloadStats
from .worker import OffloadWorkerSide, StepResults

if TYPE_CHECKING:
    import torch
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

_SOURCES = {"host": CacheHitSource.HOST, "disk": CacheHitSource.DISK}


class PdOffloadMetadata(KVConnectorMetadata):
    """One step's jobs, scheduler -> worker (pickled by vLLM)."""

    def __init__(self, step: StepJobs) -> None:
        self.step = step


@dataclass
class PdOffloadWorkerMetadata(KVConnectorWorkerMetadata):
    """Finished jobs, worker -> scheduler."""

    results: list[TransferResult] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, PdOffloadWorkerMetadata):
            self.results.extend(other.results)
        return self


class PdOffloadConnector(KVConnectorBase_V1):
    """vLLM KV connector that offloads full prompt blocks to host memory and/or a (shared) directory and loads
    them back for later requests with the same prefix. Configured by ``kv_connector_extra_config``
    (:class:`~.config.OffloadConfig`)."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        log_to_stderr(read_settings().log_level)  # this vLLM process is our edge
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None  # checked by the base class
        self.config = OffloadConfig.from_dict(dict(transfer.kv_connector_extra_config or {}))
        check_supported(vllm_config, kv_cache_config)
        transfer.kv_load_failure_policy = "recompute"  # failed loads are recomputed, never request errors
        self.block_size = int(vllm_config.cache_config.block_size)
        self.tp_size = tp_size(vllm_config)
        #: one page format per TP rank (a rank's share of a block); a worker uses its own rank's
        self.page_formats = [page_format(vllm_config, kv_cache_config, rank) for rank in range(self.tp_size)]
        self._layers = layer_names(kv_cache_config)
        self._metrics = OffloadMetrics()
        self._scheduler: OffloadScheduler | None = None
        self._worker: OffloadWorkerSide | None = None
        self._requests: dict[str, Request] = {}  # scheduler side: requests with offload state
        self._step_results = StepResults()
        self._event_names: OffloadEventNames | None = None
        self._stats = OffloadStatsCollector(self._metrics, self._tiers(), report_held=role == KVConnectorRole.SCHEDULER)
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = self._scheduler_side()

    def _tiers(self) -> tuple[str, ...]:
        return tuple(t for t, on in (("host", self.config.host_bytes > 0), ("disk", self.config.dir)) if on)

    def _scheduler_side(self) -> OffloadScheduler:
        """The managers size blocks as all ranks' shares together (a host pool row on every rank, a file per
        rank), so their row numbers hold on every rank's pool of ``offload_host_bytes / TP`` bytes."""
        fmt = self.page_formats[0]
        block_bytes = fmt.block_bytes * self.tp_size
        managers: dict[str, OffloadManager] = {}
        probes: list[DirectoryTier] = []  # one per rank's format: a block is there when every rank's share is
        if self.config.host_bytes:
            managers["host"] = OffloadManager("host", self.config.host_bytes, block_bytes, metrics=self._metrics)
        if self.config.dir:
            groups = self.config.group_blocks
            probes = [
                DirectoryTier(self.config.dir, f, max_bytes=self.config.dir_bytes, group_blocks=groups)
                for f in self.page_formats
            ]
            managers["disk"] = OffloadManager(
                "disk",
                self.config.dir_bytes,
                block_bytes,
                probe=lambda key, file: all(tier.exists(key, file) for tier in probes),
                metrics=self._metrics,
            )

        def keys_of(tokens: Any) -> list[bytes]:
            return chain_block_keys(fmt.fingerprint, tokens, self.block_size)

        self._event_names = OffloadEventNames(self.block_size, 2 * sum(m.capacity_blocks for m in managers.values()))
        logger.info(
            "pd-transfer offload scheduler: tiers %s, block %d tokens = %.2f MiB, host %.0f MiB, dir %s (%.0f MiB)",
            ",".join(managers),
            self.block_size,
            block_bytes / 2**20,
            self.config.host_bytes / 2**20,
            self.config.dir,
            self.config.dir_bytes / 2**20,
        )
        return OffloadScheduler(
            managers,
            self.block_size,
            keys_of,
            load_mode=self.config.load_mode,
            ranks=self.tp_size,
            group_blocks=self.config.group_blocks,
            disk_cached=lambda keys, files: all(tier.cached(keys, files) for tier in probes),
        )

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tp_group

        rank = get_tp_group().rank_in_group if self.tp_size > 1 else 0
        fmt = self.page_formats[rank]
        caches = [block_rows(kv_caches[name]) for name in self._layers]
        device = caches[0].device
        if device.type != "cpu" and self.config.dir:
            raise ValueError(
                f"PdOffloadConnector: the directory tier takes blocks from host memory, and this engine's KV cache is"
                f" on {device}: offload it to host memory (offload_host_bytes) without offload_dir"
            )
        workers: dict[str, TransferWorker] = {}
        queued = self.config.max_queued_jobs
        if self.config.host_bytes:
            pinned = device.type == "cuda"  # a GPU engine's copies to and from it run asynchronously
            pool = HostPool.create(fmt, self.config.host_bytes // self.tp_size, metrics=self._metrics, pinned=pinned)
            workers["host"] = TransferWorker(caches, pool, max_queued_jobs=queued, metrics=self._metrics)
        if self.config.dir:
            tier = DirectoryTier(
                self.config.dir,
                fmt,
                max_bytes=self.config.dir_bytes,
                fsync=self.config.fsync,
                metrics=self._metrics,
                group_blocks=self.config.group_blocks,
            )
            workers["disk"] = TransferWorker(caches, tier, max_queued_jobs=queued, metrics=self._metrics)
        self._worker = OffloadWorkerSide(workers)
        logger.info(
            "pd-transfer offload worker tp%d/%d: %d layer(s) x %d blocks on %s, %.2f MiB a block, tiers %s",
            rank,
            self.tp_size,
            len(caches),
            caches[0].shape[0],
            device,
            fmt.block_bytes / 2**20,
            ",".join(workers),
        )

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Run this step's in-step loads (before the forward reads them), then submit its asynchronous ones."""
        step, worker = self._step(), self._worker
        if worker is not None and step is not None:
            self._guard("loading in the step", lambda: worker.load_in_step(step))
            self._guard("starting loads", lambda: worker.start_loads(step))

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # in-step loads are done in start_load_kv; the others finish before their request runs

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        return None  # stores are whole blocks, submitted after the forward (wait_for_save)

    def wait_for_save(self) -> None:
        step = self._step()
        if self._worker is not None and step is not None:
            self._guard("starting stores", lambda: self._worker.start_stores(step) if self._worker else None)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if self._worker is not None and isinstance(kv_connector_metadata, PdOffloadMetadata):
            preempted = kv_connector_metadata.step.preempted
            if preempted:
                self._guard(
                    "waiting for stores", lambda: self._worker.wait_for_stores(preempted) if self._worker else None
                )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self._worker is None:
            return KVConnectorTransferResults()
        try:
            step = self._worker.collect(finished_req_ids)
        except Exception:
            logger.exception("pd-transfer offload worker: collecting results failed")
            return KVConnectorTransferResults()
        self._step_results.results.extend(step.results)
        self._step_results.invalid_block_ids |= step.invalid_block_ids
        return KVConnectorTransferResults(
            finished_sending=step.finished_sending, finished_recving=step.finished_recving
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self._step_results.invalid_block_ids = self._step_results.invalid_block_ids, set()
        return invalid

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        results, self._step_results.results = self._step_results.results, []
        return PdOffloadWorkerMetadata(results=results) if results else None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        try:
            return self._stats.collect()
        except Exception:
            logger.exception("pd-transfer offload: stats failed")
            return None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return PdOffloadStats(data=dict(data)) if data is not None else PdOffloadStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return PdOffloadPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._guard("shutdown", self._worker.close)
        self._worker = None

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Whole blocks past the local hit that the tiers hold, and whether they load asynchronously."""
        if self._scheduler is None:
            return 0, False
        try:
            tokens = self._scheduler.match(request.request_id, request.prompt_token_ids or [], num_computed_tokens)
        except Exception:
            logger.exception("pd-transfer offload: lookup of request %s failed", request.request_id)
            return 0, False
        self._requests[request.request_id] = request
        return tokens, tokens > 0 and not self._scheduler.loads_in_step(request.request_id)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if self._scheduler is None:
            return
        block_ids = blocks.get_block_ids()[0] if num_external_tokens > 0 else []
        scheduler = self._scheduler
        self._guard(
            "planning a load", lambda: scheduler.after_alloc(request.request_id, block_ids, num_external_tokens)
        )

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        if self._scheduler is None or num_external_tokens == 0:
            return {}
        blocks = self._scheduler.hit_sources(request.request_id)
        return {_SOURCES[tier]: count * self.block_size for tier, count in blocks.items() if count}

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if self._scheduler is not None:
            scheduler = self._scheduler
            self._guard("planning stores", lambda: self._plan_stores(scheduler, scheduler_output))
            return PdOffloadMetadata(scheduler.take_step())
        return PdOffloadMetadata(StepJobs())

    def _plan_stores(self, scheduler: OffloadScheduler, scheduler_output: SchedulerOutput) -> None:
        """Stores of the prompt blocks this step completes, for every scheduled request we track."""
        state = scheduler_output.kv_connector_block_state
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = self._requests.get(req_id)
            block_ids = state.get_block_ids(req_id) if state is not None else None
            if request is None or not block_ids:
                continue
            planned = scheduler.computed(req_id, int(request.num_computed_tokens) + int(num_tokens), block_ids[0])
            if planned is not None and self._event_names is not None:
                first, keys = planned
                self._event_names.remember(keys, first, request.block_hashes, request.all_token_ids)
        scheduler.preempted(sorted(scheduler_output.preempted_req_ids or ()))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        if self._scheduler is not None and isinstance(meta, PdOffloadWorkerMetadata):
            scheduler = self._scheduler
            self._guard("completing jobs", lambda: scheduler.on_results(meta.results))

    def take_events(self) -> Iterable[KVCacheEvent]:
        """The tiers' stored and evicted blocks since the last step, as vLLM KV events (``medium`` CPU or DISK,
        vLLM's block hashes); vLLM asks every step, which also keeps the managers' event lists short."""
        if self._scheduler is None or self._event_names is None:
            return ()
        events = [event for manager in self._scheduler.managers.values() for event in manager.take_events()]
        return self._event_names.translate(events) if events else ()

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Delay freeing the blocks of a request with stores (until the worker reports them done)."""
        self._requests.pop(request.request_id, None)
        if self._scheduler is None:
            return False, None
        return self._scheduler.finished(request.request_id), None

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        return None

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: KVTransferConfig) -> bool:
        """No: the workers copy blocks through views of vLLM's KV cache tensors taken at registration, which a
        sleep's remap would leave pointing at freed memory. (vLLM 0.33 asks; 0.31 and 0.32 never ask.)"""
        return False

    # ------------------------------------------------------------------ helpers
    def _step(self) -> StepJobs | None:
        if not self.has_connector_metadata():
            return None
        metadata = self._get_connector_metadata()
        if not isinstance(metadata, PdOffloadMetadata) or metadata.step.empty:
            return None
        return metadata.step

    @staticmethod
    def _guard(what: str, action: Any) -> None:
        """Run ``action``; log (never raise into the engine) what it raises."""
        try:
            action()
        except Exception:
            logger.exception("pd-transfer offload: %s failed", what)


register_by_name(PdOffloadConnector.__name__)  # for vLLM's MultiConnector (see register_by_name)
