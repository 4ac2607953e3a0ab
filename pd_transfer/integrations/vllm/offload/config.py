"""``PdOffloadConnector``'s configuration and how it names vLLM's KV cache for the offload tiers.

``kv_connector_extra_config`` keys (unknown keys are refused, at least one tier must be given):

* ``offload_host_bytes``: size of the host-memory tier (a pool outside vLLM's cache), 0 for none;
* ``offload_dir``: a directory tier (shareable between servers and machines), with ``offload_dir_bytes``
  its size bound (required with ``offload_dir``), ``offload_fsync`` (default false) and
  ``offload_dir_group_blocks``: blocks per group file (default :data:`~pd_transfer.offload.DEFAULT_GROUP_BLOCKS`;
  1: a file per block);
* ``offload_max_queued_jobs``: jobs a tier's worker thread may have waiting (default 64);
* ``offload_load``: when hits are loaded: ``auto`` (default: in the step that computes the rest of the prompt
  when every hit block is in host memory or in directory files the page cache holds whole, asynchronously when any
  must be read from storage), ``sync``, ``async``.

Both the scheduler and the worker build the same :class:`PageFormat` from vLLM's ``KVCacheConfig`` (one page
per layer, ``page_size_bytes`` each, in the order of the KV cache group's layer names), so the scheduler can
probe the directory tier and size its managers without seeing the tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pd_transfer.offload import DEFAULT_GROUP_BLOCKS, OffloadInputError, PageFormat
from pd_transfer.offload.file_format import check_group_blocks
from pd_transfer.spec import ModelFingerprint

from ..cpu_packing import PACKING_PREFIX, attention_isa

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

_KEYS = {
    "offload_host_bytes",
    "offload_dir",
    "offload_dir_bytes",
    "offload_fsync",
    "offload_dir_group_blocks",
    "offload_max_queued_jobs",
    "offload_load",
}
_LOAD_MODES = ("auto", "sync", "async")


@dataclass(frozen=True)
class OffloadConfig:
    """The tiers ``PdOffloadConnector`` uses (see the module docstring for the keys)."""

    host_bytes: int = 0
    dir: str | None = None
    dir_bytes: int = 0
    fsync: bool = False
    group_blocks: int = DEFAULT_GROUP_BLOCKS
    max_queued_jobs: int = 64
    load_mode: str = "auto"

    @classmethod
    def from_dict(cls, extra: dict[str, Any]) -> OffloadConfig:
        """Read ``kv_connector_extra_config``; raises ``ValueError`` on unknown keys or bad values."""
        unknown = sorted(set(extra) - _KEYS)
        if unknown:
            raise ValueError(f"PdOffloadConnector: unknown kv_connector_extra_config keys {unknown}")
        config = cls(
            host_bytes=_size(extra, "offload_host_bytes"),
            dir=str(extra["offload_dir"]) if extra.get("offload_dir") else None,
            dir_bytes=_size(extra, "offload_dir_bytes"),
            fsync=bool(extra.get("offload_fsync", False)),
            group_blocks=_group_blocks(extra),
            max_queued_jobs=_size(extra, "offload_max_queued_jobs") or 64,
            load_mode=str(extra.get("offload_load", "auto")),
        )
        if config.load_mode not in _LOAD_MODES:
            raise ValueError(f"PdOffloadConnector: offload_load must be one of {_LOAD_MODES}, got {config.load_mode!r}")
        if config.dir is not None and config.dir_bytes <= 0:
            raise ValueError("PdOffloadConnector: offload_dir needs offload_dir_bytes > 0")
        if config.host_bytes <= 0 and config.dir is None:
            raise ValueError("PdOffloadConnector: set offload_host_bytes and/or offload_dir (+ offload_dir_bytes)")
        return config


def _group_blocks(extra: dict[str, Any]) -> int:
    """``offload_dir_group_blocks`` (default :data:`DEFAULT_GROUP_BLOCKS`)."""
    try:
        return check_group_blocks(extra.get("offload_dir_group_blocks", DEFAULT_GROUP_BLOCKS))
    except OffloadInputError as error:
        raise ValueError(f"PdOffloadConnector: offload_dir_{error}") from None


def _size(extra: dict[str, Any], key: str) -> int:
    """A non-negative integer setting (0 when absent)."""
    value = extra.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"PdOffloadConnector: {key} must be a non-negative integer, got {value!r}")
    return value


def check_supported(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> None:
    """Raise ``ValueError`` unless PP 1 and one KV cache group (what this connector supports today)."""
    parallel = vllm_config.parallel_config
    if int(parallel.pipeline_parallel_size) != 1:
        raise ValueError(
            f"PdOffloadConnector supports pipeline_parallel_size 1 only, got PP {parallel.pipeline_parallel_size}"
        )
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if len(groups) != 1:
        raise ValueError(f"PdOffloadConnector supports one KV cache group, the model has {len(groups)}")


def layer_names(kv_cache_config: KVCacheConfig) -> list[str]:
    """The layers of the (single) KV cache group, in the order pages are laid out in a tier block."""
    return list(kv_cache_config.kv_cache_groups[0].layer_names)


def tp_size(vllm_config: VllmConfig) -> int:
    return int(vllm_config.parallel_config.tensor_parallel_size)


def page_format(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, tp_rank: int = 0) -> PageFormat:
    """The page format of TP rank ``tp_rank``'s share of this engine's blocks: one page of ``page_size_bytes``
    (one rank's cache) per layer, the model's fingerprint (as the P/D connector names it), the TP size and
    rank (ranks hold different heads: their blocks never mix) and in ``layout`` the CPU attention packing, or on
    another device the device type and vLLM's KV cache layout (its blocks' bytes differ from a CPU engine's)."""
    spec: Any = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    model = vllm_config.model_config
    names = layer_names(kv_cache_config)
    block_size = int(vllm_config.cache_config.block_size)
    head_size = int(model.get_head_size())
    fingerprint = ModelFingerprint(
        model=str(model.model),
        dtype=str(spec.dtype).removeprefix("torch."),
        num_layers=len(names),
        total_num_kv_heads=int(model.get_total_num_kv_heads()),
        head_size=2 * head_size,
    )
    return PageFormat(
        fingerprint=fingerprint,
        page_bytes=(int(spec.page_size_bytes),) * len(names),
        block_size=block_size,
        tp_size=tp_size(vllm_config),
        tp_rank=tp_rank,
        layout=_bytes_layout(vllm_config, spec.dtype, block_size, head_size),
    )


def _bytes_layout(vllm_config: VllmConfig, dtype: Any, block_size: int, head_size: int) -> str:
    """What fixes the bytes of a block besides the model and the rank: the CPU attention backend's packing, or a
    device's type and vLLM's ``kv_cache_layout`` (``vllm-cuda:LBNHC``)."""
    device = str(getattr(vllm_config.device_config, "device_type", "cpu") or "cpu")
    if device == "cpu":
        return f"{PACKING_PREFIX}{attention_isa(dtype, block_size, head_size, vllm_config.cache_config.cache_dtype)}"
    return f"vllm-{device}:{getattr(vllm_config.cache_config, 'kv_cache_layout', None) or 'auto'}"
