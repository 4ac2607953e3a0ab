"""The KV stand-in's model: the shape of its KV cache, its tokenizer, and the KV each token gets (a pattern both
sides compute, so that a decode checks what it pulled against its own prompt).

Tokens: a prompt of token ids is used as is; text is split on whitespace and each word hashed (CRC-32).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

import msgspec
import torch

from pd_transfer.connector.cache import KVCache
from pd_transfer.sim.http_standin import prompt_text
from pd_transfer.sim.verify import logical, plane_tensors
from pd_transfer.spec import KVCacheLayout, ModelFingerprint


class KVModel(msgspec.Struct, frozen=True, kw_only=True):
    """The stand-in model's KV cache shape (both sides must agree, as with a real model)."""

    layers: int = 4
    kv_heads: int = 4
    head_size: int = 64
    dtype: str = "bfloat16"
    block_size: int = 16
    num_blocks: int = 1024

    def layout(self) -> KVCacheLayout:
        fingerprint = ModelFingerprint(
            model="kv-standin",
            dtype=self.dtype,
            num_layers=self.layers,
            total_num_kv_heads=self.kv_heads,
            head_size=self.head_size,
        )
        return KVCacheLayout(fingerprint=fingerprint, tp_size=1, tp_rank=0, block_size=self.block_size)


def prompt_tokens(body: dict[str, Any]) -> list[int]:
    """The prompt as token ids: a list of ints as is, text as the CRC-32 of each whitespace-separated word."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return [int(t) & 0x7FFFFFFF for t in prompt]
    return [zlib.crc32(word.encode()) & 0x7FFFFFFF for word in prompt_text(body).split()]


def kv_pattern(layout: KVCacheLayout, tokens: Sequence[int]) -> torch.Tensor:
    """The KV of ``tokens`` as int32 words, (planes, tokens, local heads, words per head): a hash of (token id,
    position, plane, global head, word), so a block of another request, position or head never matches."""
    planes = layout.fingerprint.num_layers * (1 if layout.fingerprint.use_mla else 2)
    words = layout.fingerprint.head_size * layout.element_size // 4
    first = layout.first_global_head
    ids = torch.tensor(list(tokens), dtype=torch.int64)
    mixed = (
        torch.arange(planes, dtype=torch.int64).view(-1, 1, 1, 1) * 0xC2B2AE3D
        + (ids * 0x9E3779B1 + torch.arange(len(ids), dtype=torch.int64) * 0x85EBCA77).view(1, -1, 1, 1)
        + torch.arange(first, first + layout.num_local_heads, dtype=torch.int64).view(1, 1, -1, 1) * 0x27D4EB2F
        + torch.arange(words, dtype=torch.int64).view(1, 1, 1, -1) * 0x165667B1
    )
    mixed ^= mixed >> 15
    return (mixed & 0xFFFFFFFF).to(torch.int32)


def write_pattern(cache: KVCache, block_ids: Sequence[int], pattern: torch.Tensor) -> None:
    """Write ``pattern`` (from :func:`kv_pattern`) into ``block_ids`` in token order; the tail of the last block
    is zeroed."""
    layout = cache.layout
    tokens = pattern.shape[1]
    slots = len(block_ids) * layout.block_size
    index = torch.tensor(list(block_ids), dtype=torch.long)
    for plane, values in zip(plane_tensors(cache), pattern, strict=True):
        words = plane.view(torch.int32)
        padded = torch.zeros((slots, *values.shape[1:]), dtype=torch.int32)
        padded[:tokens] = values
        blocks = padded.view(len(block_ids), layout.block_size, *values.shape[1:])
        words[index] = blocks.permute(0, 2, 1, 3) if layout.layout == "HND" else blocks


def holds_pattern(cache: KVCache, block_ids: Sequence[int], pattern: torch.Tensor) -> bool:
    """True when ``block_ids`` hold ``pattern`` bit for bit, read through the cache's own layout
    (:func:`pd_transfer.sim.verify.logical`, not the transfer plan)."""
    got = logical(cache, list(block_ids), pattern.shape[1]).contiguous().view(torch.int32)
    return torch.equal(got, pattern)
