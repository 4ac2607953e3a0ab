"""vLLM's CPU KV cache tensors described as a pd-transfer :class:`KVCacheLayout` and :class:`KVCache`.

vLLM's ``CPU_ATTN`` backend gives each layer one tensor ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``
(contiguous, model dtype): per (block, head), a K half then a V half, each packed in an order that depends on
the ISA and dtype (:mod:`.cpu_packing`). It is described as one plane per layer (kind ``"k"``) in ``HND`` with an
effective head size of ``2 * head_size``, so whole (block, head) runs move byte for byte and head slicing
(different TP sizes) stays right; the layout names the packing (``vllm-cpu-attn:<isa>``) so that engines that
pack differently are refused at the handshake.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pd_transfer.connector.cache import KVCache
from pd_transfer.integrations.vllm_cache_layouts import dtype_name, layer_indices
from pd_transfer.spec import KVCacheLayout, ModelFingerprint

from .cpu_packing import PACKING_PREFIX, attention_isa

if TYPE_CHECKING:
    from vllm.config import ModelConfig


def describe_cpu_cache(
    kv_caches: dict[str, torch.Tensor],
    model: ModelConfig,
    *,
    block_size: int,
    tp_size: int,
    tp_rank: int,
    cache_dtype: str | None,
) -> tuple[KVCacheLayout, KVCache]:
    """The layout and cache of one TP rank's ``kv_caches`` (layer name -> the layer's CPU cache tensor, as
    vLLM hands them to ``register_kv_caches``), regions ordered by layer index.

    Layer indices come from the first ``.<number>.`` in each name (registration order if that does not give
    distinct indices). Raises ``ValueError`` if there are no tensors, if a tensor is not
    ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` on the CPU like the first one, or if the number
    of KV heads does not match the model's over ``tp_size``.
    """
    if not kv_caches:
        raise ValueError("no KV cache tensors to register")
    names = list(kv_caches)
    layers = layer_indices(names)
    tensors = [kv_caches[name] for name in names]
    _check_tensors(names, tensors, block_size, int(model.get_head_size()))
    layout = _layout(model, tensors[0], len(tensors), block_size, tp_size, tp_rank, cache_dtype)
    order = sorted(range(len(tensors)), key=lambda i: layers[i])
    cache = KVCache.from_tensors(layout, [tensors[i] for i in order], [("k",)] * len(order), [layers[i] for i in order])
    return layout, cache


def _layout(
    model: ModelConfig,
    first: torch.Tensor,
    num_layers: int,
    block_size: int,
    tp_size: int,
    tp_rank: int,
    cache_dtype: str | None,
) -> KVCacheLayout:
    """The layout of a rank of ``num_layers`` layers all like ``first`` (checked by :func:`_check_tensors`):
    one HND plane per layer of head size ``2 * head_size``, packing named after the attention ISA. Raises
    ``ValueError`` if ``first`` holds other than the model's KV heads divided over ``tp_size``."""
    head_size = int(model.get_head_size())
    isa = attention_isa(first.dtype, block_size, head_size, cache_dtype)
    fingerprint = ModelFingerprint(
        model=str(model.model),
        dtype=dtype_name(first.dtype),
        num_layers=num_layers,
        total_num_kv_heads=int(model.get_total_num_kv_heads()),
        head_size=2 * head_size,  # K half + V half of a (block, head), moved as one
    )
    layout = KVCacheLayout(
        fingerprint=fingerprint,
        tp_size=tp_size,
        tp_rank=tp_rank,
        block_size=block_size,
        layout="HND",
        packing=f"{PACKING_PREFIX}{isa}",  # both sides must pack alike; block sizes may differ
    )
    if first.shape[1] != layout.num_local_heads:
        raise ValueError(
            f"KV cache holds {first.shape[1]} KV heads per rank, expected {layout.num_local_heads}"
            f" ({fingerprint.total_num_kv_heads} heads over TP {tp_size})"
        )
    return layout


def _check_tensors(names: list[str], tensors: list[torch.Tensor], block_size: int, head_size: int) -> None:
    """Raise ``ValueError`` unless the first tensor is vLLM CPU's 4-d layer cache for ``block_size`` and
    ``head_size`` and every other one has its shape and dtype, on the CPU."""
    first = tensors[0]
    if first.dim() != 4 or first.shape[2] != block_size or first.shape[3] != 2 * head_size:
        raise ValueError(
            f"unexpected KV cache tensor {tuple(first.shape)} for layer {names[0]}: PdTransferConnector expects"
            f" vLLM CPU's [num_blocks, num_kv_heads, block_size={block_size}, 2*head_size={2 * head_size}]"
        )
    for name, tensor in zip(names, tensors, strict=True):
        if tensor.shape != first.shape or tensor.dtype != first.dtype or tensor.device.type != "cpu":
            raise ValueError(f"KV cache of layer {name} differs from {names[0]}: {tensor.shape} {tensor.dtype}")
