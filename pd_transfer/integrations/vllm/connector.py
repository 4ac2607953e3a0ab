"""pd-transfer as a vLLM (0.32, CPU) KV connector: the only module that imports vLLM.

Load it with::

    --kv-transfer-config '{"kv_connector": "PdTransferConnector",
                           "kv_connector_module_path": "pd_transfer.integrations.vllm",
                           "kv_role": "kv_both", "kv_buffer_device": "cpu",
                           "kv_connector_extra_config": {"side_channel_host": "127.0.0.1",
                                                         "side_channel_port": 5600}}'

``kv_connector_extra_config`` is read by :class:`~pd_transfer.connector.config.ConnectorConfig` (unknown keys are
refused; ``VLLM_NIXL_SIDE_CHANNEL_HOST`` / ``_PORT`` are the fallbacks of the side channel's address).

vLLM makes one connector per role: ``SCHEDULER`` (in the engine core process) wraps a
:class:`~pd_transfer.connector.scheduler.SchedulerSide`, ``WORKER`` (one per TP rank) a
:class:`~pd_transfer.connector.worker.WorkerSide`. This module only translates: vLLM's ``Request``,
``KVCacheBlocks``, ``SchedulerOutput`` and ``KVConnectorOutput`` to the typed engine-agnostic calls and back.

Workers publish their rank (NIXL agent, cache regions, layout) to the scheduler through vLLM's handshake
metadata hook (``get_handshake_metadata`` -> ``set_xfer_handshake_metadata``); the scheduler then serves the
engine on the side channel. ``kv_transfer_params`` use the keys of vLLM's NixlConnector.

**CPU KV cache.** vLLM's ``CPU_ATTN`` backend gives each layer one tensor ``[num_blocks, num_kv_heads,
block_size, 2 * head_size]``: per (block, head), a K half then a V half, each packed in an order that depends
on the ISA and dtype. We describe it as one plane per layer (kind ``"k"``) in ``HND`` with an effective
head size of ``2 * head_size``, so whole (block, head) runs move byte for byte and head slicing (different TP
sizes) stays right, and name the packing in the layout (``vllm-cpu-attn:<isa>``). Across block sizes the
decode side reads whole remote (block, head) chunks into a staging area and regroups them element by element
(:class:`~pd_transfer.topology.packed.PackedRegroup`). Where each element sits is not hard-coded: it is
measured once per block size by running vLLM's own ``cpu_attn_reshape_and_cache`` kernel on numbered
vectors (:func:`measure_packing`). Engines of different ISAs are refused at the handshake, naming both.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.request import RequestStatus

from pd_transfer.connector.cache import KVCache
from pd_transfer.connector.config import ConnectorConfig
from pd_transfer.connector.metadata import StepMetadata
from pd_transfer.handshake.messages import RankMetadata
from pd_transfer.metrics import default_metrics
from pd_transfer.spec import KVCacheLayout, ModelFingerprint
from pd_transfer.topology.packed import PackedBlockFormat

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from pd_transfer.connector.scheduler import SchedulerSide
    from pd_transfer.connector.worker import WorkerSide

logger = logging.getLogger(__name__)

_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


def _log_to_stderr() -> None:
    """vLLM configures only its own loggers: show ours (INFO and up) in the server's log too."""
    package = logging.getLogger("pd_transfer")
    if not package.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [pd-transfer %(name)s] %(message)s"))
        package.addHandler(handler)
        package.setLevel(os.environ.get("PD_TRANSFER_LOG_LEVEL", "INFO").upper())
        package.propagate = False


# ---------------------------------------------------------------------------------------------- messages
class PdTransferMetadata(KVConnectorMetadata):
    """One step's :class:`StepMetadata`, from the scheduler connector to the workers (pickled by vLLM)."""

    def __init__(self, step: StepMetadata) -> None:
        self.step = step


@dataclass
class PdTransferHandshakeMetadata(KVConnectorHandshakeMetadata):
    """A worker's :class:`RankMetadata` (msgpack), collected by the engine core for the scheduler connector."""

    rank_metadata: bytes


#: Counters of the worker process's own pd-transfer metrics whose per-step increments go to vLLM's /metrics
_COUNTED = {
    "unconfirmed_reads": ("pd_transfer_unconfirmed_reads_total", {}),
    "leases_read": ("pd_transfer_leases_ended_total", {"reason": "read"}),
    "leases_expired": ("pd_transfer_leases_ended_total", {"reason": "expired"}),
    "leases_aborted": ("pd_transfer_leases_ended_total", {"reason": "aborted"}),
}


@dataclass
class PdTransferStats(KVConnectorStats):
    """What the workers did since their last report (plain data: it crosses processes).

    ``pulls``: one ``[seconds, bytes, descriptor rows, fix-up seconds after the last read]`` per loaded
    request; ``failed_loads``; and the increments of the counters in :data:`_COUNTED`.
    """

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {"pulls": [], "failed_loads": 0, **dict.fromkeys(_COUNTED, 0)}

    def is_empty(self) -> bool:
        return not self.data.get("pulls") and not any(self.data.get(key, 0) for key in ("failed_loads", *_COUNTED))

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            if isinstance(value, list):
                self.data.setdefault(key, []).extend(value)
            else:
                self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float | str]:
        pulls = self.data.get("pulls", [])
        seconds = sum(pull[0] for pull in pulls)
        return {
            "loads": len(pulls),
            "failed_loads": self.data.get("failed_loads", 0),
            "MiB loaded": round(sum(pull[1] for pull in pulls) / 2**20, 3),
            "avg load ms": round(seconds / len(pulls) * 1e3, 3) if pulls else 0.0,
            "unconfirmed_reads": self.data.get("unconfirmed_reads", 0),
            "leases read/expired/aborted": "/".join(
                str(self.data.get(key, 0)) for key in ("leases_read", "leases_expired", "leases_aborted")
            ),
        }


class PdTransferPromMetrics(KVConnectorPromMetrics):
    """pd-transfer's metrics on vLLM's ``/metrics`` (``vllm:pd_transfer_*``), per engine."""

    _SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
    _BYTES = tuple(2.0 ** (12 + 2 * i) for i in range(12))  # 4 KiB .. 16 GiB

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def per_engine(metric: Any, *extra: str) -> dict[int, Any]:
            return {engine: metric.labels(*values, *extra) for engine, values in per_engine_labelvalues.items()}

        def histogram(name: str, documentation: str, buckets: tuple[float, ...]) -> dict[int, Any]:
            metric = self._histogram_cls(
                name=name, documentation=documentation, buckets=list(buckets), labelnames=labelnames
            )
            return per_engine(metric)

        def counter(name: str, documentation: str) -> dict[int, Any]:
            return per_engine(self._counter_cls(name=name, documentation=documentation, labelnames=labelnames))

        self.pull_seconds = histogram(
            "vllm:pd_transfer_pull_seconds", "Seconds of a request's KV load, first read to usable KV", self._SECONDS
        )
        self.pull_bytes = histogram("vllm:pd_transfer_pull_bytes", "Bytes of KV loaded per request", self._BYTES)
        self.fixup_seconds = histogram(
            "vllm:pd_transfer_fixup_exposed_seconds",
            "Seconds the layout fix-up (block-size regroup) added after a load's last read",
            self._SECONDS,
        )
        self.pulled_bytes = counter("vllm:pd_transfer_pulled_bytes", "Bytes of KV loaded from prefill engines")
        self.failed_loads = counter(
            "vllm:pd_transfer_failed_loads", "KV loads that failed (the failure policy was applied)"
        )
        self.unconfirmed_reads = counter(
            "vllm:pd_transfer_unconfirmed_reads",
            "Reads the prefill did not confirm as covered by its lease: discarded, never used as KV",
        )
        leases = self._counter_cls(
            name="vllm:pd_transfer_leases_ended",
            documentation="Blocks held for decode readers, by how the hold ended: read, expired, aborted",
            labelnames=[*labelnames, "reason"],
        )
        self.leases = {reason: per_engine(leases, reason) for reason in ("read", "expired", "aborted")}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        data = transfer_stats_data
        for seconds, num_bytes, _rows, fixup in data.get("pulls", []):
            self.pull_seconds[engine_idx].observe(seconds)
            self.pull_bytes[engine_idx].observe(num_bytes)
            self.fixup_seconds[engine_idx].observe(fixup)
            self.pulled_bytes[engine_idx].inc(num_bytes)
        for key, metric in (("failed_loads", self.failed_loads), ("unconfirmed_reads", self.unconfirmed_reads)):
            if data.get(key):
                metric[engine_idx].inc(data[key])
        for reason, metric in self.leases.items():
            if data.get(f"leases_{reason}"):
                metric[engine_idx].inc(data[f"leases_{reason}"])


# ---------------------------------------------------------------------------------------------- helpers
def _dtype_name(dtype: object) -> str:
    return str(dtype).removeprefix("torch.")


def _attention_isa(dtype: torch.dtype, block_size: int, head_size: int, cache_dtype: str | None) -> str:
    """The CPU attention backend's packing of K and V inside a block (decides whether bytes are portable)."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        return str(_get_attn_isa(dtype, block_size, head_size, cache_dtype))
    except Exception as error:  # private helper: keep working if it moves, but say so
        logger.warning("could not determine the CPU attention ISA (%s); fingerprint says 'unknown'", error)
        return "unknown"


#: digits of the numbers written into probe vectors: exact in every float type the CPU cache uses
_PROBE_BASE = 64


def measure_packing(isa: str, dtype: torch.dtype, block_size: int, head_size: int) -> PackedBlockFormat:
    """Where vLLM's CPU attention kernel puts each K and V element of a (block, head) of ``block_size``
    tokens, measured: numbered vectors go through ``cpu_attn_reshape_and_cache`` into a one-block cache
    (a digit in base 64 per pass, so the numbers stay exact in bfloat16), and their positions are read back."""
    from vllm import _custom_ops as ops

    elements = block_size * head_size
    offsets = []
    for half in (0, 1):  # K, then V
        number_at = torch.zeros(elements, dtype=torch.int64)
        passes = 1
        while _PROBE_BASE**passes < elements:
            passes += 1
        for digit in range(passes):
            numbers = ((torch.arange(elements) // _PROBE_BASE**digit) % _PROBE_BASE).to(dtype)
            probe = numbers.view(block_size, 1, head_size)
            zero = torch.zeros_like(probe)
            cache = torch.full((1, 1, 2 * block_size, head_size), -1, dtype=dtype)
            key_cache, value_cache = cache.chunk(2, dim=2)
            key, value = (probe, zero) if half == 0 else (zero, probe)
            ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, torch.arange(block_size), isa)
            written = cache.view(-1)[half * elements : (half + 1) * elements].to(torch.int64)
            if bool((written < 0).any()):
                raise RuntimeError(f"the {isa} kernel left parts of a {block_size}-token block unwritten")
            number_at += written * _PROBE_BASE**digit
        position = torch.empty(elements, dtype=torch.int64)
        position[number_at] = torch.arange(elements) + half * elements
        offsets.append(position.view(block_size, head_size))
    return PackedBlockFormat(block_size, head_size, offsets[0], offsets[1])


def _layer_index(name: str, fallback: int) -> int:
    numbers = re.findall(r"\.(\d+)\.", f".{name}.")
    return int(numbers[0]) if numbers else fallback


def _finish_reason(request: Request) -> str:
    return _FINISH_REASONS.get(request.status, request.status.name.lower().removeprefix("finished_"))


def _prompt_len(request: Request) -> int:
    return int(request.num_prompt_tokens)


# ---------------------------------------------------------------------------------------------- connector
BUSY_POLL_MS = 1  # after our spin limit and within vLLM's busy window: sleep-poll in slices this long


def limit_engine_spin(spin_s: float) -> None:
    """Make this process's vLLM shared-memory queue readers spin at most ``spin_s`` seconds after a read.

    vLLM's engine core and workers wait for each other's messages in ``SpinCondition.wait``: for 1 s after a read
    it calls ``os.sched_yield`` in a loop, releasing the GIL for the call and taking it straight back. CPython only
    forces a GIL hand-over when a waiting thread saw no switch for 5 ms, and each of these re-takes counts as a
    switch, so our threads in the same process (side-channel server, NIXL progress, loads, confirmations) get the
    GIL only when they win a race against the spinning thread. An engine that steps while blocks are held or loads
    are in flight re-arms the window every step. Measured on 2 cores with a TP 2 side: handshakes unanswered for
    over 5 s and first reads stalled up to 30 s.

    Past ``spin_s`` and until vLLM's own window ends (1 s, kept per reader), the reader waits on its
    notification socket in slices of ``BUSY_POLL_MS`` (no GIL, no CPU while it waits) and checks the queue
    between slices: it does not rely on the writer's notification there, which vLLM's publisher (send high-water
    mark 1) can drop under load; a dropped one cost a 5 s recheck interval when we let readers block outright.
    After the window the reader blocks as vLLM's does.

    Wraps ``SpinCondition.wait`` once per process; a later call changes the limit.
    """
    try:
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    except ImportError:  # another vLLM layout: leave it alone
        logger.info("vLLM's SpinCondition not found; its readers' busy window is left as it is")
        return
    original = getattr(SpinCondition.wait, "_pd_transfer_original", None)
    if original is None:
        original = SpinCondition.wait

    def wait(self: Any, timeout_ms: int | None = None) -> None:
        window = self.__dict__.get("_pd_transfer_window_s")
        if window is None:  # first wait of this reader: keep vLLM's window, spin only for our limit
            window = self._pd_transfer_window_s = getattr(self, "busy_loop_s", 0.0)
        self.busy_loop_s = min(window, wait._pd_transfer_spin_s)  # type: ignore[attr-defined]
        if time.monotonic() - getattr(self, "last_read", 0.0) < window:
            timeout_ms = BUSY_POLL_MS if timeout_ms is None else min(timeout_ms, BUSY_POLL_MS)
        return original(self, timeout_ms)

    wait._pd_transfer_original = original  # type: ignore[attr-defined]
    wait._pd_transfer_spin_s = spin_s  # type: ignore[attr-defined]
    SpinCondition.wait = wait


class PdTransferConnector(KVConnectorBase_V1):
    """vLLM KV connector backed by pd-transfer (pull over NIXL, typed side channel, leases)."""

    _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _log_to_stderr()
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None  # checked by the base class
        self.config = ConnectorConfig.from_dict(dict(transfer.kv_connector_extra_config or {}))
        self.engine_id = str(transfer.engine_id)
        if transfer.kv_load_failure_policy != self.config.failure_policy:
            # vLLM's scheduler must act on what our workers report: "recompute" reports the blocks to
            # recompute (vLLM's "fail" would turn them into errors), "fail" reports failed requests
            # (vLLM's "recompute" would recompute them). Ours (kv_connector_extra_config) decides.
            if role == KVConnectorRole.SCHEDULER:
                logger.warning(
                    "kv_load_failure_policy %r set to %r to match the connector's failure_policy",
                    transfer.kv_load_failure_policy,
                    self.config.failure_policy,
                )
            transfer.kv_load_failure_policy = self.config.failure_policy
        if self.config.engine_spin_s is not None:
            limit_engine_spin(self.config.engine_spin_s)
        self.block_size = int(vllm_config.cache_config.block_size)
        parallel = vllm_config.parallel_config
        self.tp_size = int(parallel.tensor_parallel_size)
        if int(parallel.pipeline_parallel_size) != 1:
            raise ValueError("PdTransferConnector supports pipeline_parallel_size 1 only")
        groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
        if len(groups) > 1:
            raise ValueError(f"PdTransferConnector supports one KV cache group, the model has {len(groups)}")
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._local_hits: dict[str, int] = {}  # request id -> locally cached tokens at the last match
        self._last_outcome: object | None = None
        self._counted: dict[str, float] = {}  # last values of the _COUNTED counters
        if role == KVConnectorRole.SCHEDULER:
            from pd_transfer.connector.scheduler import SchedulerSide

            self._scheduler = SchedulerSide(
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

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tp_group

        from pd_transfer.connector.worker import WorkerSide

        layout, cache = self._describe_cache(kv_caches, get_tp_group().rank_in_group)
        isa = (layout.packing or "").removeprefix("vllm-cpu-attn:")
        dtype = cache.tensors[0].dtype
        head_size = layout.fingerprint.head_size // 2

        @functools.cache
        def packed_formats(block_size: int) -> PackedBlockFormat:
            return measure_packing(isa, dtype, block_size, head_size)

        if self._vllm_config.cache_config.cache_dtype not in (None, "auto"):
            packed_formats = None  # type: ignore[assignment]  # quantised caches: equal block sizes only
        self._worker = WorkerSide(self.engine_id, cache, self.config, packed_formats=packed_formats)
        logger.info(
            "pd-transfer worker tp%d/%d: %d layer(s) x %d blocks registered (%.0f MiB), fingerprint %s",
            layout.tp_rank,
            layout.tp_size,
            len(cache.regions),
            cache.num_blocks,
            cache.nbytes / 2**20,
            layout.fingerprint,
        )

    def _describe_cache(self, kv_caches: dict[str, torch.Tensor], tp_rank: int) -> tuple[KVCacheLayout, KVCache]:
        model = self._vllm_config.model_config
        if not kv_caches:
            raise ValueError("no KV cache tensors to register")
        names = list(kv_caches)
        layers = [_layer_index(name, index) for index, name in enumerate(names)]
        if len(set(layers)) != len(layers):
            layers = list(range(len(names)))
        tensors = [kv_caches[name] for name in names]
        first = tensors[0]
        head_size = int(model.get_head_size())
        if first.dim() != 4 or first.shape[2] != self.block_size or first.shape[3] != 2 * head_size:
            raise ValueError(
                f"unexpected KV cache tensor {tuple(first.shape)} for layer {names[0]}: PdTransferConnector expects"
                f" vLLM CPU's [num_blocks, num_kv_heads, block_size={self.block_size}, 2*head_size={2 * head_size}]"
            )
        for name, tensor in zip(names, tensors, strict=True):
            if tensor.shape != first.shape or tensor.dtype != first.dtype or tensor.device.type != "cpu":
                raise ValueError(f"KV cache of layer {name} differs from {names[0]}: {tensor.shape} {tensor.dtype}")
        isa = _attention_isa(first.dtype, self.block_size, head_size, self._vllm_config.cache_config.cache_dtype)
        fingerprint = ModelFingerprint(
            model=str(model.model),
            dtype=_dtype_name(first.dtype),
            num_layers=len(tensors),
            total_num_kv_heads=int(model.get_total_num_kv_heads()),
            head_size=2 * head_size,  # K half + V half of a (block, head), moved as one
        )
        layout = KVCacheLayout(
            fingerprint=fingerprint,
            tp_size=self.tp_size,
            tp_rank=tp_rank,
            block_size=self.block_size,
            layout="HND",
            packing=f"vllm-cpu-attn:{isa}",  # both sides must pack alike; block sizes may differ
        )
        if first.shape[1] != layout.num_local_heads:
            raise ValueError(
                f"KV cache holds {first.shape[1]} KV heads per rank, expected {layout.num_local_heads}"
                f" ({fingerprint.total_num_kv_heads} heads over TP {self.tp_size})"
            )
        order = sorted(range(len(tensors)), key=lambda i: layers[i])
        cache = KVCache.from_tensors(
            layout, [tensors[i] for i in order], [("k",)] * len(order), [layers[i] for i in order]
        )
        return layout, cache

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
        return None  # pull: decodes read the prefill's blocks where they are

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
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
        if self._worker is None:
            return None
        try:
            stats = PdTransferStats()
            for outcome in self._fresh_outcomes():
                pulled = outcome.stats
                logger.debug(
                    "request %s: load %s in %.2f ms%s",
                    outcome.request_id,
                    "ok" if outcome.ok else f"failed ({outcome.error})",
                    outcome.seconds * 1e3,
                    ""
                    if pulled is None
                    else f" ({pulled.bytes / 2**20:.2f} MiB, {pulled.descriptors} descriptors,"
                    f" read {pulled.read_seconds * 1e3:.2f} ms)",
                )
                if not outcome.ok:
                    stats.data["failed_loads"] += 1
                elif pulled is not None:
                    stats.data["pulls"].append(
                        [outcome.seconds, pulled.bytes, pulled.descriptors, pulled.postprocess_exposed_seconds]
                    )
            registry = default_metrics().registry
            for key, (sample, labels) in _COUNTED.items():
                value = registry.get_sample_value(sample, labels) or 0.0
                stats.data[key] = int(value - self._counted.get(key, 0.0))
                self._counted[key] = value
            return None if stats.is_empty() else stats
        except Exception:
            logger.exception("pd-transfer worker: stats failed")
            return None

    def _fresh_outcomes(self) -> list[Any]:
        """The worker's load outcomes since the last call, oldest first."""
        assert self._worker is not None
        outcomes = list(self._worker.outcomes)  # bounded, newest last
        fresh = []
        for outcome in reversed(outcomes):
            if outcome is self._last_outcome:
                break
            fresh.append(outcome)
        if outcomes:
            self._last_outcome = outcomes[-1]
        return fresh[::-1]

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
        if self._scheduler is not None:
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
        return None  # the CPU backend has one layout; we describe what it gives us
