"""Test helpers: KV cache tensors as vLLM's GPU attention backends make them (on any device), engines of them
described by ``integrations/vllm_cache_layouts.py``, and a plan's reads carried out with tensor copies on the
caches' own device (for CUDA caches, where ``topology_sim``'s ``memmove`` cannot reach).

Used by tests/unit/test_vllm_gpu_layouts.py (CPU tensors) and tests/gpu/test_gpu_layouts.py (CUDA tensors).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pd_transfer.connector.cache import KVCache
from pd_transfer.integrations.vllm_cache_layouts import CacheGeometry, describe_cache_layout
from pd_transfer.sim.peer import fill_pattern
from pd_transfer.sim.verify import received_correctly
from pd_transfer.spec import KVRegion
from pd_transfer.topology import PeerPlan, plane_views

HEADS, HEAD_SIZE, LAYERS = 4, 8, 2
TOKENS = 150


def geometry(block: int = 16, tp: int = 1, rank: int = 0, mla: bool = False) -> CacheGeometry:
    return CacheGeometry("tiny", 1 if mla else HEADS, 24 if mla else HEAD_SIZE, mla, block, tp, rank)


def layer_caches(
    fmt: str,
    order: str,
    blocks: int,
    g: CacheGeometry,
    dtype: torch.dtype = torch.float32,
    vllm_layout: str = "LB",
    device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """``LAYERS`` tensors as the engine makes them: allocated in memory order, viewed in the format's logical order.
    ``vllm_layout`` (paged only): ``LB`` one allocation a layer, ``BL`` layers interleaved inside each block,
    ``BH`` heads outermost inside a block (vLLM's BHLNC). Names come out of layer order on purpose."""
    n, h, d = g.block_size, g.local_heads, g.head_size
    hnd = order == "HND"

    def zeros(*shape: int) -> torch.Tensor:
        return torch.zeros(*shape, dtype=dtype, device=device)

    if fmt == "paged":
        c = d if g.use_mla else 2 * d
        if vllm_layout == "BL":
            raw = zeros(blocks, LAYERS, *((h, n) if hnd else (n, h)), c)
            views = [raw[:, layer] for layer in range(LAYERS)]
        elif vllm_layout == "BH":
            raw = zeros(blocks, h, LAYERS, n, c)
            return {f"model.layers.{layer}.attn": raw[:, :, layer] for layer in range(LAYERS)}
        else:
            views = [zeros(blocks, *((h, n) if hnd else (n, h)), c) for _ in range(LAYERS)]
        logical = [v if hnd else v.permute(0, 2, 1, 3) for v in views]  # [B, H, N, C]
    elif fmt in ("flash-attn", "flashinfer"):
        lead = (2, blocks) if fmt == "flash-attn" else (blocks, 2)
        logical = [
            zeros(*lead, h, n, d).permute(0, 1, 3, 2, 4) if hnd else zeros(*lead, n, h, d) for _ in range(LAYERS)
        ]
    else:
        logical = [zeros(blocks, n, d) for _ in range(LAYERS)]
    return {f"model.layers.{layer}.self_attn.attn": logical[layer] for layer in reversed(range(LAYERS))}


@dataclass(frozen=True)
class Side:
    """One engine: format, memory order, TP size, block size."""

    fmt: str
    order: str = "NHD"
    tp: int = 1
    block: int = 16
    vllm_layout: str = "LB"
    mla: bool = False


#: prefill -> decode pairs: TP 1 <-> 2, block 16 <-> 64, HND <-> NHD, K and V apart <-> together, MLA
PAIRS = {
    "flash_attn_tp1_to_tp2": (Side("flash-attn"), Side("flash-attn", tp=2)),
    "flash_attn_tp2_to_tp1": (Side("flash-attn", tp=2), Side("flash-attn")),
    "paged_block16_to_64": (Side("paged"), Side("paged", block=64)),
    "paged_block64_to_16": (Side("paged", block=64), Side("paged")),
    "paged_hnd_to_nhd": (Side("paged", "HND"), Side("paged", "NHD")),
    "paged_nhd_to_hnd_tp2": (Side("paged", "NHD", vllm_layout="BL"), Side("paged", "HND", tp=2)),
    "flashinfer_to_flash_attn_hnd_block64": (Side("flashinfer"), Side("flash-attn", "HND", block=64)),
    "flash_attn_hnd_tp2_block64_to_flashinfer_16": (Side("flash-attn", "HND", tp=2, block=64), Side("flashinfer")),
    "mla_latent_block16_to_64_tp2": (Side("mla-latent", mla=True), Side("mla-latent", tp=2, block=64, mla=True)),
    "paged_mla_block64_to_16": (Side("paged", block=64, mla=True), Side("paged", mla=True)),
}


def engine(side: Side, blocks: int, dtype: torch.dtype, device: str | torch.device = "cpu") -> list[KVCache]:
    """Every rank's cache of ``side``, described as the adapter describes it."""
    caches = []
    for rank in range(side.tp):
        g = geometry(side.block, side.tp, rank, side.mla)
        tensors = layer_caches(side.fmt, side.order, blocks, g, dtype, side.vllm_layout, device)
        caches.append(describe_cache_layout(tensors, g, cache_format=side.fmt)[1])  # type: ignore[arg-type]
    return caches


@dataclass
class Described:
    """A described cache as ``topology_sim.simulate_reads`` takes it."""

    cache: KVCache

    @property
    def regions(self) -> list[KVRegion]:
        return self.cache.regions

    def planes(self) -> list[torch.Tensor]:
        return plane_views(self.cache.tensors, self.cache.regions)


def check_pair(pair: str, dtype: torch.dtype, device: str | torch.device, reads: str = "device") -> None:
    """Fill the prefill engine of ``PAIRS[pair]``, plan every decode rank's reads of a ``TOKENS``-token request,
    carry them out (``reads``: ``device`` tensor copies, or ``memmove`` with topology_sim's checks, CPU only), run
    the plan's postprocess, and assert through ``sim.verify`` that each decode rank holds the prefill's tokens."""
    prefill, decode = PAIRS[pair]
    rng = np.random.default_rng(len(pair))
    remote_blocks, local_blocks = -(-TOKENS // prefill.block), -(-TOKENS // decode.block)
    remote_ids = [int(i) for i in rng.permutation(remote_blocks + 3)[:remote_blocks]]
    remote = engine(prefill, remote_blocks + 3, dtype, device)
    for cache in remote:
        fill_pattern(cache, seed=5)
    for local in engine(decode, local_blocks + 3, dtype, device):
        local_ids = [int(i) for i in rng.permutation(local_blocks + 3)[:local_blocks]]
        plan = PeerPlan.build(
            local.layout,
            local.regions,
            {c.layout.tp_rank: c.layout for c in remote},
            {c.layout.tp_rank: c.regions for c in remote},
        )
        if reads == "memmove":
            from topology_sim import simulate_reads

            simulate_reads(
                plan, dict(enumerate(map(Described, remote))), Described(local), remote_ids, local_ids, TOKENS
            )
        else:
            device_reads(plan, {c.layout.tp_rank: c for c in remote}, local, remote_ids, local_ids)
        assert received_correctly(local, local_ids, remote, remote_ids, TOKENS), pair


def device_reads(
    plan: PeerPlan, remote: dict[int, KVCache], local: KVCache, remote_ids: Sequence[int], local_ids: Sequence[int]
) -> None:
    """The plan's reads for one request as byte-range copies between the caches' storages (on their device), then
    its postprocess."""
    local_bytes = _storages([local])
    for source, (local_rows, remote_rows) in zip(
        plan.sources, plan.indices(remote_ids, local_ids, TOKENS), strict=True
    ):
        remote_bytes = _storages([remote[source.remote_rank]])
        length = source.unit_bytes
        pairs = zip(source.local_grid[local_rows, 0].tolist(), source.remote_grid[remote_rows, 0].tolist(), strict=True)
        for to, origin in pairs:
            _span(local_bytes, to, length).copy_(_span(remote_bytes, origin, length))
    if plan.postprocess is not None:
        plan.postprocess.apply(plane_views(local.tensors, local.regions), list(local_ids), TOKENS)


def _storages(caches: list[KVCache]) -> list[tuple[int, torch.Tensor]]:
    """(first address, every byte as a uint8 tensor) of each storage under the caches' tensors."""
    out = []
    for cache in caches:
        for tensor in cache.tensors:
            storage = tensor.untyped_storage()
            raw = torch.empty(0, dtype=torch.uint8, device=tensor.device)
            out.append((storage.data_ptr(), raw.set_(storage, 0, (storage.nbytes(),), (1,))))
    return out


def _span(storages: list[tuple[int, torch.Tensor]], address: int, length: int) -> torch.Tensor:
    for start, raw in storages:
        if start <= address and address + length <= start + raw.numel():
            return raw[address - start : address - start + length]
    raise AssertionError(f"bytes {address:#x}+{length} lie in no cache storage")
