"""Block-size regrouping for *packed* KV blocks, whose bytes follow neither HND nor NHD.

Some engines pack each (block, head) of their KV cache in an order of their own: vLLM's CPU attention
backend, for instance, keeps per (block, head) a K half then a V half of ``block_size * head_size`` elements
each, K transposed (``[head_size][block_size]``) for float32 and tiled for AMX in bfloat16. Whole (block,
head) chunks can be copied byte for byte between caches of the same packing and block size (the ordinary
plans do that), but a block-size change must move every element on its own.

A :class:`PackedBlockFormat` says where each (token, element) of K and V sits inside one chunk of
``2 * block_size * head_size`` elements. :class:`PackedRegroup` turns chunks of one format into chunks of
another: the received (remote) chunks sit in a staging area, one row of ``heads`` chunks per remote block,
and are written into the local blocks with one gather per group of ``lcm(block sizes)`` tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

#: Integer types of the same width as the KV elements: the regroup moves bits, never float values.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True, eq=False)
class PackedBlockFormat:
    """Where the elements of one (block, head) chunk of ``2 * block_size * head_size`` elements sit.

    ``key_offsets[t, d]`` and ``value_offsets[t, d]`` (int64, ``(block_size, head_size)``) are the element
    offsets of token ``t``'s K and V element ``d`` inside the chunk; together they cover the chunk exactly once.
    """

    block_size: int  # tokens
    head_size: int  # elements of one K (or V) vector
    key_offsets: torch.Tensor
    value_offsets: torch.Tensor

    def __post_init__(self) -> None:
        shape = (self.block_size, self.head_size)
        for name in ("key_offsets", "value_offsets"):
            table = getattr(self, name)
            if tuple(table.shape) != shape or table.dtype != torch.int64:
                raise ValueError(f"{name} must be int64 of shape {shape}, got {table.dtype} {tuple(table.shape)}")
        both = torch.cat([self.key_offsets.reshape(-1), self.value_offsets.reshape(-1)])
        if not torch.equal(torch.sort(both).values, torch.arange(self.chunk_elements)):
            raise ValueError("key_offsets and value_offsets must cover the chunk's elements exactly once")

    @property
    def chunk_elements(self) -> int:
        """Elements of one (block, head) chunk: K and V."""
        return 2 * self.block_size * self.head_size

    @classmethod
    def token_major(cls, block_size: int, head_size: int) -> PackedBlockFormat:
        """K then V, each ``[block_size][head_size]``: a plain layout, for tests and references."""
        tokens = torch.arange(block_size)[:, None]
        elements = torch.arange(head_size)[None, :]
        key = tokens * head_size + elements
        return cls(block_size, head_size, key, key + block_size * head_size)

    @classmethod
    def key_transposed(cls, block_size: int, head_size: int) -> PackedBlockFormat:
        """K ``[head_size][block_size]`` then V ``[block_size][head_size]`` (vLLM CPU, float32, ISA ``vec``)."""
        tokens = torch.arange(block_size)[:, None]
        elements = torch.arange(head_size)[None, :]
        key = elements * block_size + tokens
        value = block_size * head_size + tokens * head_size + elements
        return cls(block_size, head_size, key, value)


class PackedRegroup:
    """Writes chunks of ``remote`` format (received into a staging area) into local blocks of ``local``
    format, for caches whose block sizes differ (either way) and whose block sizes nest or not.

    Tokens are handled in groups of ``group_tokens = lcm(remote.block_size, local.block_size)``: a group is
    ``remote_blocks_per_group`` remote blocks and ``local_blocks_per_group`` local blocks.
    """

    def __init__(self, remote: PackedBlockFormat, local: PackedBlockFormat) -> None:
        if remote.head_size != local.head_size:
            raise ValueError(f"head sizes differ: remote {remote.head_size}, local {local.head_size}")
        self.remote = remote
        self.local = local
        self.group_tokens = math.lcm(remote.block_size, local.block_size)
        self.remote_blocks_per_group = self.group_tokens // remote.block_size
        self.local_blocks_per_group = self.group_tokens // local.block_size
        self._index = self._group_index()
        self._index_on: dict[torch.device, torch.Tensor] = {self._index.device: self._index}

    def _group_index(self) -> torch.Tensor:
        """For each element of a group's local chunks (one head, local blocks back to back), the element of
        the group's remote chunks (one head, remote blocks back to back) it comes from."""
        tokens = torch.arange(self.group_tokens)
        remote_block, remote_slot = tokens // self.remote.block_size, tokens % self.remote.block_size
        local_block, local_slot = tokens // self.local.block_size, tokens % self.local.block_size
        index = torch.empty(self.local_blocks_per_group * self.local.chunk_elements, dtype=torch.int64)
        for local_table, remote_table in (
            (self.local.key_offsets, self.remote.key_offsets),
            (self.local.value_offsets, self.remote.value_offsets),
        ):
            destination = local_block[:, None] * self.local.chunk_elements + local_table[local_slot]
            source = remote_block[:, None] * self.remote.chunk_elements + remote_table[remote_slot]
            index[destination.reshape(-1)] = source.reshape(-1)
        return index

    def _group_index_on(self, device: torch.device) -> torch.Tensor:
        """The group index on ``device`` (copied there once)."""
        index = self._index_on.get(device)
        if index is None:
            index = self._index_on[device] = self._index.to(device)
        return index

    def groups(self, num_tokens: int) -> int:
        """Token groups a request of ``num_tokens`` tokens spans."""
        return -(-num_tokens // self.group_tokens)

    def apply(
        self,
        staged: torch.Tensor,
        local_plane: torch.Tensor,
        local_block_ids: torch.Tensor,
        num_tokens: int,
    ) -> None:
        """Write ``num_tokens`` tokens from ``staged`` into blocks ``local_block_ids`` of ``local_plane``.

        ``staged``: (slots, heads, remote chunk elements), remote block ``i`` of the request in row ``i``;
        rows past the request's remote blocks (up to a whole group) may hold anything. ``local_plane``:
        (num_blocks, heads, local chunk elements), on ``staged``'s device. ``local_block_ids``: int64,
        ``ceil(num_tokens / local.block_size)`` distinct ids, on that device too. Slots of the last local block past
        ``num_tokens`` are overwritten with whatever the staging held there.
        """
        groups = self.groups(num_tokens)
        remote_rows = groups * self.remote_blocks_per_group
        local_count = -(-num_tokens // self.local.block_size)
        heads = local_plane.shape[1]
        if staged.dim() != 3 or staged.shape[0] < remote_rows or staged.shape[2] != self.remote.chunk_elements:
            raise ValueError(
                f"staged must be (>= {remote_rows}, heads, {self.remote.chunk_elements}), got {tuple(staged.shape)}"
            )
        if local_plane.dim() != 3 or local_plane.shape[2] != self.local.chunk_elements or staged.shape[1] != heads:
            raise ValueError(
                f"local plane must be (num_blocks, {staged.shape[1]}, {self.local.chunk_elements}), got"
                f" {tuple(local_plane.shape)}"
            )
        if local_block_ids.numel() != local_count:
            raise ValueError(f"{num_tokens} tokens need {local_count} local blocks, got {local_block_ids.numel()}")
        if groups == 0:
            return
        bits = _BITS[staged.element_size()]
        source = staged[:remote_rows].view(bits)
        source = source.view(groups, self.remote_blocks_per_group, heads, -1).transpose(1, 2)
        source = source.reshape(groups, heads, -1)  # (group, head, remote chunks of the group back to back)
        regrouped = torch.index_select(source, 2, self._group_index_on(staged.device))
        regrouped = regrouped.view(groups, heads, self.local_blocks_per_group, -1).transpose(1, 2)
        regrouped = regrouped.reshape(groups * self.local_blocks_per_group, heads, -1)[:local_count]
        local_plane.view(bits).index_copy_(0, local_block_ids, regrouped)
