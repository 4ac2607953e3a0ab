"""vLLM KV cache events for ``PdOffloadConnector``: what the tiers stored and evicted, named by vLLM's block hashes.

The offload managers name blocks by our chained keys (:func:`~pd_transfer.offload.chain_block_keys`); a router
that follows vLLM's KV events (``--kv-events-config``) knows vLLM's block hashes. When the scheduler plans a store,
:meth:`OffloadEventNames.remember` keeps, per key, the vLLM hash of that block, its parent's hash and its tokens;
:meth:`~OffloadEventNames.translate` turns the managers' ``BlocksStored`` / ``BlocksEvicted`` into vLLM's
``BlockStored`` / ``BlockRemoved`` with ``medium`` ``CPU`` (host tier) or ``DISK`` (directory). Each stored block
is its own event (it names its own parent), so events of different requests may interleave freely.

Memory is bounded: a key's names are kept while some tier holds (or is storing) the block, and at most
``max_keys`` keys (the tiers' capacity in blocks); past that the oldest are dropped and their later events are
not published (a router then learns of them from vLLM's own eviction of the engine copy instead).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from pd_transfer.offload import BlockKey, BlocksEvicted, BlocksStored, OffloadEvent

MEDIUM = {"host": "CPU", "disk": "DISK"}


@dataclass(frozen=True)
class _Names:
    block_hash: Any  # vLLM's ExternalBlockHash (bytes, or int with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)
    parent_hash: Any
    token_ids: tuple[int, ...]


class OffloadEventNames:
    """Our block keys -> vLLM's block hashes, for the events of the tiers (scheduler side, one thread)."""

    def __init__(self, block_size: int, max_keys: int) -> None:
        self.block_size = block_size
        self.max_keys = max(1, max_keys)
        self._names: OrderedDict[BlockKey, _Names] = OrderedDict()
        self._tiers: dict[BlockKey, set[str]] = {}

    def remember(
        self, keys: Sequence[BlockKey], first_block: int, block_hashes: Sequence[Any], token_ids: Sequence[int]
    ) -> None:
        """``keys[i]`` is the request's block ``first_block + i``; ``block_hashes`` are vLLM's hashes of the
        request's blocks (``Request.block_hashes``) and ``token_ids`` its tokens."""
        for offset, key in enumerate(keys):
            index = first_block + offset
            if index >= len(block_hashes) or key in self._names:
                continue
            parent = maybe_convert_block_hash(block_hashes[index - 1]) if index > 0 else None
            tokens = tuple(int(t) for t in token_ids[index * self.block_size : (index + 1) * self.block_size])
            self._names[key] = _Names(maybe_convert_block_hash(block_hashes[index]), parent, tokens)
        while len(self._names) > self.max_keys:
            key, _ = self._names.popitem(last=False)
            self._tiers.pop(key, None)

    def translate(self, events: Iterable[OffloadEvent]) -> list[KVCacheEvent]:
        """vLLM events for the managers' events, in order; keys without names are skipped."""
        out: list[KVCacheEvent] = []
        for event in events:
            medium = MEDIUM.get(event.tier, event.tier.upper())
            if isinstance(event, BlocksStored):
                out.extend(self._stored(event.tier, medium, event.keys))
            elif isinstance(event, BlocksEvicted):
                removed = self._removed(event.tier, event.keys)
                if removed:
                    out.append(BlockRemoved(block_hashes=removed, medium=medium))
        return out

    def _stored(self, tier: str, medium: str, keys: Sequence[BlockKey]) -> Iterable[KVCacheEvent]:
        for key in keys:
            names = self._names.get(key)
            if names is None:
                continue
            self._tiers.setdefault(key, set()).add(tier)
            yield BlockStored(
                block_hashes=[names.block_hash],
                parent_block_hash=names.parent_hash,
                token_ids=list(names.token_ids),
                block_size=self.block_size,
                lora_id=None,
                medium=medium,
                lora_name=None,
            )

    def _removed(self, tier: str, keys: Sequence[BlockKey]) -> list[Any]:
        hashes = []
        for key in keys:
            names, tiers = self._names.get(key), self._tiers.get(key)
            if names is None or tiers is None or tier not in tiers:
                continue
            hashes.append(names.block_hash)
            tiers.discard(tier)
            if not tiers:
                del self._tiers[key], self._names[key]
        return hashes
