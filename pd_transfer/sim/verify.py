"""Independent checks of what a decode rank received: both caches seen as logical (token, head) arrays (on any
device; compared on the CPU).

This does not use the transfer plan: it reads each side's cache through its own block size, layout and
head share, so a wrong plan cannot hide its own mistakes.
"""

from __future__ import annotations

import torch

from pd_transfer.connector.cache import KVCache
from pd_transfer.spec import planes_of


def plane_tensors(cache: KVCache) -> list[torch.Tensor]:
    """Each plane as a (num_blocks, *block_shape) tensor view, in ``planes_of`` order."""
    views: list[tuple[tuple[int, int], torch.Tensor]] = []
    order = {"k": 0, "v": 1, "latent": 2}
    for tensor, region in zip(cache.tensors, cache.regions, strict=True):
        if len(region.kinds) == 1:
            views.append(((region.layer, order[region.kinds[0]]), tensor))
        else:
            for index, kind in enumerate(region.kinds):
                views.append(((region.layer, order[kind]), tensor[:, index]))
    views.sort(key=lambda item: item[0])
    assert len(views) == len(planes_of(cache.regions))
    return [view for _, view in views]


def logical(cache: KVCache, block_ids: list[int], num_tokens: int) -> torch.Tensor:
    """The request's KV as (planes, tokens, local_heads, head_size), whatever the cache's layout."""
    layout = cache.layout
    index = torch.tensor(block_ids, dtype=torch.long, device=cache.tensors[0].device)
    out = []
    for plane in plane_tensors(cache):
        blocks = plane.index_select(0, index.to(plane.device))  # (B, H, N, D) or (B, N, H, D)
        if layout.layout == "HND":
            blocks = blocks.permute(0, 2, 1, 3)
        out.append(blocks.reshape(-1, layout.num_local_heads, layout.fingerprint.head_size)[:num_tokens])
    return torch.stack(out)


def global_heads(prefill_caches: list[KVCache], block_ids: list[int], num_tokens: int) -> dict[int, torch.Tensor]:
    """Global head index -> (planes, tokens, head_size), from whichever prefill rank holds it first."""
    heads: dict[int, torch.Tensor] = {}
    for cache in prefill_caches:
        view = logical(cache, block_ids, num_tokens)
        first = cache.layout.first_global_head
        for local in range(cache.layout.num_local_heads):
            heads.setdefault(first + local, view[:, :, local])
    return heads


def received_correctly(
    decode_cache: KVCache,
    local_block_ids: list[int],
    prefill_caches: list[KVCache],
    remote_block_ids: list[int],
    num_tokens: int,
) -> bool:
    """True when every token of every head the decode rank holds equals the prefill's, bit for bit."""
    expected = global_heads(prefill_caches, remote_block_ids, num_tokens)
    got = logical(decode_cache, local_block_ids, num_tokens)
    first = decode_cache.layout.first_global_head
    for local in range(decode_cache.layout.num_local_heads):
        want = expected[first + local]
        have = got[:, :, local]
        if not torch.equal(_bits(have).cpu(), _bits(want).cpu()):  # the two caches may be on different devices
            return False
    return True


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The same elements as integers, so NaN bit patterns compare equal to themselves."""
    return tensor.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()])
