"""vLLM's GPU KV cache tensors described as a pd-transfer :class:`KVCacheLayout` and :class:`KVCache`.

vLLM 0.31 and 0.32 give every GPU attention backend's layer the same logical view, ``[num_blocks, num_kv_heads,
block_size, content]`` (content: K then V of a (token, head), or MLA's latent), in the memory order of the engine's
``KVCacheLayout`` (``cache_config.kv_cache_layout``, resolved by the engine core before the caches exist). The
format is therefore named explicitly (``"paged"``), the order is taken from vLLM's layout and checked against the
strides, and the work is done by :func:`~pd_transfer.integrations.vllm_cache_layouts.describe_cache_layout`, which
needs neither vLLM nor a GPU. This module only reads vLLM's config; it is the adapter's only GPU-specific code
besides the step event (:mod:`.connector`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pd_transfer.connector.cache import KVCache
from pd_transfer.integrations.vllm_cache_layouts import CacheGeometry, describe_cache_layout, order_of_vllm_layout
from pd_transfer.spec import KVCacheLayout

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig


def describe_gpu_cache(
    kv_caches: dict[str, torch.Tensor], vllm_config: VllmConfig, *, block_size: int, tp_size: int, tp_rank: int
) -> tuple[KVCacheLayout, KVCache]:
    """The layout and cache of one TP rank's GPU ``kv_caches`` (layer name -> the layer's cache view, as vLLM hands
    them to ``register_kv_caches``). Raises ``ValueError`` for tensors that are not vLLM's paged views of this
    model's heads, block size and head size, or whose memory order is not the engine's ``kv_cache_layout``."""
    model = vllm_config.model_config
    geometry = CacheGeometry(
        model=str(model.model),
        total_num_kv_heads=int(model.get_total_num_kv_heads()),
        head_size=int(model.get_head_size()),  # MLA: kv_lora_rank + rope dim
        use_mla=bool(model.use_mla),
        block_size=block_size,
        tp_size=tp_size,
        tp_rank=tp_rank,
    )
    order = order_of_vllm_layout(getattr(vllm_config.cache_config, "kv_cache_layout", None))
    return describe_cache_layout(kv_caches, geometry, cache_format="paged", order=order)
