"""``PdTransferConnector``: pd-transfer as a vLLM (0.31, 0.32) KV connector.

vLLM makes one connector per role: ``SCHEDULER`` (in the engine core process) wraps a
:class:`~pd_transfer.connector.scheduler.SchedulerSide`, ``WORKER`` (one per TP rank) a
:class:`~pd_transfer.connector.worker.WorkerSide`. This module only translates: vLLM's ``Request``,
``KVCacheBlocks``, ``SchedulerOutput`` and ``KVConnectorOutput`` to the typed engine-agnostic calls and back.
Nothing raised by pd-transfer during a step reaches the engine: it is logged and the step goes on.

Workers publish their rank (NIXL agent, cache regions, layout) to the scheduler through vLLM's handshake
metadata hook (``get_handshake_metadata`` -> ``set_xfer_handshake_metadata``); the scheduler then serves the
engine on the side channel. ``kv_transfer_params`` use the keys of vLLM's NixlConnector.

The worker side describes vLLM's cache by its device: a CPU cache with :func:`.cpu_cache.describe_cpu_cache` (and,
across block sizes, regroups blocks with the packing :mod:`.cpu_packing` measures), a GPU cache with
:func:`.gpu_cache.describe_gpu_cache`. On a GPU the step's kernels run asynchronously: ``wait_for_save``, at the end
of each step, records an event on the current stream after them and hands it to the worker side
(``step_computed``): blocks held after it are offered to readers only once it completed.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.v1.request import RequestStatus

from pd_transfer.connector.config import ConnectorConfig, FailurePolicy
from pd_transfer.connector.metadata import StepMetadata
from pd_transfer.handshake.messages import RankMetadata
from pd_transfer.integrations.vllm_cache_layouts import layer_indices
from pd_transfer.settings import Settings, apply_process_defaults, environment

from .compat import CacheHitSource
from .cpu_cache import describe_cpu_cache
from .cpu_packing import packed_format_source
from .engine_spin import limit_engine_spin
from .logs import log_to_stderr
from .stats import PdTransferPromMetrics, PdTransferStats, SchedulerStatsCollector, WorkerStatsCollector

if TYPE_CHECKING:
    import torch
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from pd_transfer.connector.contract import SchedulerContract, WorkerContract
    from pd_transfer.connector.scheduler import SchedulerSide

logger = logging.getLogger(__name__)

_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class PdTransferMetadata(KVConnectorMetadata):
    """One step's :class:`StepMetadata`, from the scheduler connector to the workers (pickled by vLLM)."""

    def __init__(self, step: StepMetadata) -> None:
        self.step = step


@dataclass
class PdTransferHandshakeMetadata(KVConnectorHandshakeMetadata):
    """A worker's :class:`RankMetadata` (msgpack), collected by the engine core for the scheduler connector."""

    rank_metadata: bytes


class PdTransferConnector(KVConnectorBase_V1):
    """vLLM KV connector backed by pd-transfer (pull over NIXL, typed side channel, leases).

    Configured by ``kv_connector_extra_config`` (:class:`~pd_transfer.connector.config.ConnectorConfig`);
    supports pipeline parallel size 1 and one KV cache group. vLLM's ``kv_load_failure_policy`` is set to the
    connector's ``failure_policy``.
    """

    _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        environ = environment()  # this vLLM process is our edge: its environment is read here, once
        self.settings = apply_process_defaults(Settings.from_environ(environ))  # before a worker makes its agents
        log_to_stderr(self.settings.log_level)
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None  # checked by the base class
        extra = dict(transfer.kv_connector_extra_config or {})
        self.config = ConnectorConfig.from_dict(extra, settings=self.settings, env=environ)
        self.engine_id = str(transfer.engine_id)
        _align_failure_policy(transfer, self.config.failure_policy, role)
        if self.config.engine_spin_s is not None:
            limit_engine_spin(self.config.engine_spin_s)
        self.block_size = int(vllm_config.cache_config.block_size)
        self.tp_size = _supported_tp_size(vllm_config, kv_cache_config)
        self._scheduler: SchedulerContract | None = None  # the engine-agnostic halves, driven per step
        self._worker: WorkerContract | None = None
        self._cuda_device: torch.device | None = None  # where the registered cache lives, if on a CUDA device
        self._local_hits: dict[str, int] = {}  # request id -> locally cached tokens at the last match
        self._layers_through: dict[str, int] = {}  # worker: layer name -> layers written once it saved (1-based)
        self._stats = WorkerStatsCollector()
        self._scheduler_stats = SchedulerStatsCollector()
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = self._scheduler_side()

    def _scheduler_side(self) -> SchedulerSide:
        """This engine's scheduler half (its side channel starts once the workers' metadata is in)."""
        from pd_transfer.connector.scheduler import SchedulerSide

        scheduler = SchedulerSide(
            self.config, engine_id=self.engine_id, block_size=self.block_size, tp_size=self.tp_size
        )
        logger.info(
            "pd-transfer scheduler connector: engine %s, block %d, TP %d, side channel %s:%d, policy %s",
            self.engine_id,
            self.block_size,
            self.tp_size,
            self.config.side_channel_host,
            self.config.side_channel_port,
            self.config.failure_policy,
        )
        return scheduler

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tp_group

        from pd_transfer.connector.worker import WorkerSide

        cache_dtype = self._vllm_config.cache_config.cache_dtype
        tp_rank = get_tp_group().rank_in_group
        device = next(iter(kv_caches.values())).device if kv_caches else None
        if device is not None and device.type not in ("cpu", "cuda"):
            raise ValueError(f"PdTransferConnector takes a KV cache on the CPU or a CUDA device, not on {device}")
        if device is not None and device.type == "cuda":
            from .gpu_cache import describe_gpu_cache

            layout, cache = describe_gpu_cache(
                kv_caches, self._vllm_config, block_size=self.block_size, tp_size=self.tp_size, tp_rank=tp_rank
            )
            packed_formats = None  # vLLM's GPU backends keep K and V plain in a (token, head)'s content
            self._cuda_device = device
            self.settings = apply_process_defaults(self.settings, vram=True)  # before WorkerSide makes the agents
        else:
            layout, cache = describe_cpu_cache(
                kv_caches,
                self._vllm_config.model_config,
                block_size=self.block_size,
                tp_size=self.tp_size,
                tp_rank=tp_rank,
                cache_dtype=cache_dtype,
            )
            packed_formats = packed_format_source(layout, cache.tensors[0].dtype, cache_dtype)
        self._worker = WorkerSide(
            self.engine_id, cache, self.config, packed_formats=packed_formats, settings=self.settings
        )
        layers = layer_indices(list(kv_caches))
        ordered = sorted(set(layers))
        self._layers_through = {name: ordered.index(layer) + 1 for name, layer in zip(kv_caches, layers, strict=True)}
        logger.info(
            "pd-transfer worker tp%d/%d: %d region(s) x %d blocks registered on %s (%.0f MiB, %s), fingerprint %s",
            layout.tp_rank,
            layout.tp_size,
            len(cache.regions),
            cache.num_blocks,
            device,
            cache.nbytes / 2**20,
            layout.layout,
            layout.fingerprint,
        )

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        if self._worker is None:
            return None
        return PdTransferHandshakeMetadata(rank_metadata=msgspec.msgpack.encode(self._worker.rank_metadata))

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self._worker is None or not self.has_connector_metadata():
            return
        metadata = self._get_connector_metadata()
        if not isinstance(metadata, PdTransferMetadata):
            logger.error("unexpected connector metadata %s ignored", type(metadata).__name__)
            return
        if metadata.step.empty:
            return
        try:
            self._worker.start_load(metadata.step)
        except Exception:  # never into the engine
            logger.exception("pd-transfer worker: starting this step's transfers failed")

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads are asynchronous: requests wait in WAITING_FOR_REMOTE_KVS until finished_recving

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        """A layer's attention wrote its KV: on a host cache, the step's streamed requests offer their layers up to
        this one (decodes read the rest of the prefill's blocks where they are, once held)."""
        if self._worker is None or self._cuda_device is not None:
            return
        layers = self._layers_through.get(layer_name)
        if layers is None or not self.has_connector_metadata():
            return
        try:
            metadata = self._get_connector_metadata()
            if isinstance(metadata, PdTransferMetadata):
                self._worker.streams_computing(metadata.step)  # vLLM calls start_load_kv after the forward
            self._worker.layers_saved(layers)
        except Exception:  # never into the engine
            logger.exception("pd-transfer worker: offering layer %s of streamed requests failed", layer_name)

    def wait_for_save(self) -> None:
        """The step's forward is launched: on a CUDA cache, record an event after its kernels on the current stream
        for the worker side, which holds blocks for readers only once it completed (nothing to record on a CPU)."""
        if self._worker is None:
            return
        try:
            event = _step_event(self._cuda_device)
            if event is not None:
                self._worker.step_computed(event)
        except Exception:  # never into the engine
            logger.exception("pd-transfer worker: recording the step's event failed")

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """This rank's finished sends and loads since the last step; failed loads are also in ``finished_recving``."""
        if self._worker is None:
            return KVConnectorTransferResults()
        try:
            sending, recving = self._worker.get_finished()
            failed = self._worker.get_failed_requests()
        except Exception:
            logger.exception("pd-transfer worker: collecting finished transfers failed")
            return KVConnectorTransferResults()
        # a failed load is staged by the same get_finished call that reports it finished: failed <= recving
        return KVConnectorTransferResults(
            finished_sending=set(sending), finished_recving=set(recving) | set(failed), failed_recving=set(failed)
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self._worker is None:
            return set()
        try:
            return set(self._worker.get_block_ids_with_load_errors())
        except Exception:
            logger.exception("pd-transfer worker: collecting load errors failed")
            return set()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This rank's :class:`PdTransferStats` since the last call (the scheduler's: its side channel's and
        waiting requests'), ``None`` when there is nothing new."""
        try:
            if self._worker is None:
                return self._scheduler_stats.collect_scheduler() if self._scheduler is not None else None
            return self._stats.collect(self._worker.outcomes)
        except Exception:
            logger.exception("pd-transfer worker: stats failed")
            return None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return PdTransferStats(data=dict(data)) if data is not None else PdTransferStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return PdTransferPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        for closer in (self._worker, self._scheduler):
            if closer is None:
                continue
            try:
                closer.close()
            except Exception:
                logger.exception("pd-transfer: shutdown failed")
        self._worker = None
        self._scheduler = None

    # ------------------------------------------------------------------ scheduler side
    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        if self._scheduler is None:
            return
        ranks = []
        for tp_rank, item in sorted(metadata.items()):
            if not isinstance(item, PdTransferHandshakeMetadata):
                raise TypeError(f"worker tp{tp_rank} sent {type(item).__name__}, not PdTransferHandshakeMetadata")
            ranks.append(msgspec.msgpack.decode(item.rank_metadata, type=RankMetadata))
        if len(ranks) != self.tp_size:
            raise ValueError(f"got the metadata of {len(ranks)} worker(s) for TP {self.tp_size}")
        port = self._scheduler.start_side_channel(ranks)
        logger.info(
            "pd-transfer engine %s: side channel on %s:%d (%d rank(s))",
            self.engine_id,
            self.config.side_channel_host,
            port,
            len(ranks),
        )

    def on_new_request(self, request: Request) -> None:
        if self._scheduler is not None:
            # vLLM's cleanup copy of a request rejected before the engine (``abort_immediately``) has a dummy
            # prompt: do not check the params against it, so that its request_finished frees the prefill
            dummy = bool(getattr(request, "abort_immediately", False))
            self._scheduler.on_new_request(
                request.request_id, request.kv_transfer_params, prompt_len=None if dummy else _prompt_len(request)
            )

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens to load from the prefill beyond the ``num_computed_tokens`` cached locally, and whether the load
        is asynchronous (only when there are tokens to load)."""
        if self._scheduler is None:
            return 0, False
        params = request.kv_transfer_params
        if not params:
            return 0, False
        self._local_hits[request.request_id] = num_computed_tokens
        tokens, load = self._scheduler.get_num_new_matched_tokens(
            request.request_id, _prompt_len(request), num_computed_tokens, params
        )
        return tokens, load and tokens > 0

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Hand the scheduler side the request's allocated block ids past its local hit (group 0)."""
        if self._scheduler is None or not request.kv_transfer_params:
            return
        try:
            block_ids = blocks.get_block_ids()[0] if num_external_tokens > 0 else []
            skip = self._local_hits.get(request.request_id, 0) // self.block_size
            local = [int(b) for b in block_ids[skip:]]
        except Exception:
            logger.exception("request %s: reading its blocks failed", request.request_id)
            local, num_external_tokens = [], 0
        self._scheduler.update_state_after_alloc(request.request_id, local, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if self._scheduler is None:
            return PdTransferMetadata(StepMetadata())
        try:
            for new in scheduler_output.scheduled_new_reqs:  # a prompt computed in one step: streamed as it runs
                prompt = len(new.prompt_token_ids or ())
                scheduled = scheduler_output.num_scheduled_tokens.get(new.req_id, 0)
                if prompt and new.num_computed_tokens + scheduled >= prompt and new.block_ids:
                    self._scheduler.computing(new.req_id, new.block_ids[0])
            metadata = PdTransferMetadata(self._scheduler.build_step_metadata())
            if (
                self.config.idle_step_sleep_s > 0
                and scheduler_output.total_num_scheduled_tokens == 0
                and metadata.step.empty
                and self._scheduler.waiting_on_transfers
            ):
                # vLLM steps back to back while requests wait on us (held blocks, loads): a core spent
                # polling, taken from the transfers themselves on a small machine. Pace such idle steps.
                time.sleep(self.config.idle_step_sleep_s)
            return metadata
        except Exception:
            logger.exception("pd-transfer: building the step's metadata failed")
            return PdTransferMetadata(StepMetadata())

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._scheduler is None:
            return
        self._scheduler.update_connector_output(
            finished_sending=connector_output.finished_sending or (),
            finished_recving=connector_output.finished_recving or (),
            load_error_block_ids=connector_output.invalid_block_ids or (),
            failed_requests=connector_output.failed_recving or (),
        )

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Whether the connector keeps ``block_ids`` (those holding computed tokens) for decode readers, and the
        ``kv_transfer_params`` to return to the client, with ``remote_blocks_expiry_time`` (Unix seconds)."""
        self._local_hits.pop(request.request_id, None)
        if self._scheduler is None:
            return False, None
        params = request.kv_transfer_params
        if not params:
            return False, None
        computed = int(request.num_computed_tokens)
        blocks = [int(b) for b in block_ids]
        if computed > 0:
            blocks = blocks[: -(-computed // self.block_size)]
        delay, out = self._scheduler.request_finished(
            request.request_id, blocks, _finish_reason(request), params, num_computed_tokens=computed or None
        )
        if out is not None:
            out["remote_blocks_expiry_time"] = time.time() + self.config.lease_seconds
        return delay, out

    def get_kv_connector_kv_cache_events(self) -> None:
        return None

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        return None  # we describe whichever layout the backends chose (NHD or HND, read from the tensors)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: KVTransferConfig) -> bool:
        """No: the workers registered vLLM's KV cache memory with NIXL and peers read it there; a sleep's remap
        would leave them reading freed memory. (vLLM 0.33 asks, and refuses ``--enable-sleep-mode`` with this
        connector; 0.31 and 0.32 never ask.)"""
        return False


# ---------------------------------------------------------------------------------------------- helpers
def register_by_name(name: str) -> None:
    """Register connector class ``name`` of this package with vLLM's factory (once). vLLM's ``MultiConnector``
    rebuilds its children's stats in the API server by registered name (``build_kv_connector_stats``); a
    connector loaded only by ``kv_connector_module_path`` is not registered, and the server's stats logger
    raises on the first step report. The API server imports this package when it builds the Prometheus metrics,
    before any report."""
    try:
        KVConnectorFactory.register_connector(name, "pd_transfer.integrations.vllm", name)
    except ValueError:
        pass  # registered already (by this process, or vLLM knows the name)


def _align_failure_policy(transfer: KVTransferConfig, failure_policy: FailurePolicy, role: KVConnectorRole) -> None:
    """Set vLLM's ``kv_load_failure_policy`` to the connector's ``failure_policy`` (warning once, from the
    scheduler role, if they differed).

    vLLM's scheduler must act on what our workers report: ``"recompute"`` reports the blocks to recompute
    (vLLM's ``"fail"`` would turn them into errors), ``"fail"`` reports failed requests (vLLM's ``"recompute"``
    would recompute them). Ours (``kv_connector_extra_config``) decides.
    """
    if transfer.kv_load_failure_policy == failure_policy:
        return
    if role == KVConnectorRole.SCHEDULER:
        logger.warning(
            "kv_load_failure_policy %r set to %r to match the connector's failure_policy",
            transfer.kv_load_failure_policy,
            failure_policy,
        )
    transfer.kv_load_failure_policy = failure_policy


def _supported_tp_size(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> int:
    """The engine's tensor parallel size; raises ``ValueError`` for pipeline parallelism or more than one KV
    cache group, which the connector does not support."""
    parallel = vllm_config.parallel_config
    tp_size = int(parallel.tensor_parallel_size)
    if int(parallel.pipeline_parallel_size) != 1:
        raise ValueError("PdTransferConnector supports pipeline_parallel_size 1 only")
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    if len(groups) > 1:
        raise ValueError(f"PdTransferConnector supports one KV cache group, the model has {len(groups)}")
    return tp_size


def _step_event(device: torch.device | None) -> torch.cuda.Event | None:
    """An event recorded on ``device``'s current stream (after the kernels launched on it so far), or None for no
    device (a CPU cache: its blocks are written when the step returns)."""
    if device is None:
        return None
    import torch

    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def _finish_reason(request: Request) -> str:
    """The request's finish reason as the engine-agnostic side names it (``stop``, ``length``, ``abort``, ...)."""
    return _FINISH_REASONS.get(request.status, request.status.name.lower().removeprefix("finished_"))


def _prompt_len(request: Request) -> int:
    """The request's prompt length in tokens."""
    return int(request.num_prompt_tokens)


register_by_name(PdTransferConnector.__name__)
