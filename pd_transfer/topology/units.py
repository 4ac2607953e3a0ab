"""Descriptor units: the pieces of a plane block that one NIXL descriptor row moves.

A plane block is a logical ``(heads, tokens, head_size)`` array stored in ``HND`` or ``NHD`` order. A *unit*
is a box of ``heads`` consecutive heads x ``tokens`` consecutive token slots x the whole head, aligned to its
own size, whose bytes are one contiguous run in the remote block. All offsets here are in **elements** from
the start of a plane block; callers multiply by the element size.

* **direct**: the unit is also one contiguous run at its final place in the local block, in the same order.
* **staged**: the unit is written to the next free place of the local block ("segments" laid end to end in
  remote order) and a postprocess permutes the block into the local layout afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pd_transfer.spec import KVCacheLayout, KVLayout


@dataclass(frozen=True, slots=True)
class BlockGeometry:
    """One side's plane block: heads ``[first_head, first_head + num_heads)`` x ``block_size`` tokens."""

    layout: KVLayout
    num_heads: int
    first_head: int  # global index of the block's first head
    block_size: int  # tokens
    head_size: int  # elements
    element_size: int  # bytes

    @classmethod
    def of(cls, layout: KVCacheLayout) -> BlockGeometry:
        return cls(
            layout=layout.layout,
            num_heads=layout.num_local_heads,
            first_head=layout.first_global_head,
            block_size=layout.block_size,
            head_size=layout.fingerprint.head_size,
            element_size=layout.element_size,
        )

    @property
    def elements(self) -> int:
        """Elements in one plane block."""
        return self.num_heads * self.block_size * self.head_size

    @property
    def head_stride(self) -> int:
        """Elements between the same token of consecutive heads."""
        return self.block_size * self.head_size if self.layout == "HND" else self.head_size

    @property
    def token_stride(self) -> int:
        """Elements between consecutive tokens of the same head."""
        return self.head_size if self.layout == "HND" else self.num_heads * self.head_size

    def offset(self, global_head: np.ndarray | int, slot: np.ndarray | int) -> np.ndarray:
        """Element offset of ``(global_head, slot, 0)`` in the block; broadcasts, int64."""
        head = np.asarray(global_head, dtype=np.int64) - self.first_head
        return head * self.head_stride + np.asarray(slot, dtype=np.int64) * self.token_stride


@dataclass(frozen=True, slots=True)
class UnitShape:
    """A unit box: ``heads`` x ``tokens`` x ``head_size`` elements."""

    heads: int
    tokens: int
    head_size: int

    @property
    def elements(self) -> int:
        return self.heads * self.tokens * self.head_size


def _merge(extents: dict[str, int], strides: list[dict[str, int]], head_size: int) -> dict[str, int]:
    """Greedily grow a unit from one head vector: add a whole dimension while it continues the run on every
    side (its stride equals the unit's current size). Returns the unit extent per dimension."""
    taken = {name: 1 for name in extents}
    size = head_size
    grown = True
    while grown:
        grown = False
        for name, extent in extents.items():
            if taken[name] == extent:
                continue
            if extent == 1 or all(side[name] == size for side in strides):
                taken[name] = extent
                size *= extent
                grown = True
    return taken


def piece_tokens(remote: BlockGeometry, local: BlockGeometry) -> int:
    """Tokens of the largest token range that lies inside one block on both sides."""
    return min(remote.block_size, local.block_size)


def direct_unit(remote: BlockGeometry, local: BlockGeometry, num_heads: int) -> UnitShape:
    """Largest unit over ``num_heads`` heads contiguous in both blocks, in the same element order."""
    extents = {"tokens": piece_tokens(remote, local), "heads": num_heads}
    strides = [
        {"tokens": remote.token_stride, "heads": remote.head_stride},
        {"tokens": local.token_stride, "heads": local.head_stride},
    ]
    taken = _merge(extents, strides, remote.head_size)
    return UnitShape(taken["heads"], taken["tokens"], remote.head_size)


def staged_unit(remote: BlockGeometry, local: BlockGeometry, num_heads: int) -> UnitShape:
    """Largest unit over ``num_heads`` heads and one piece of tokens contiguous in the remote block."""
    extents = {"tokens": piece_tokens(remote, local), "heads": num_heads}
    taken = _merge(extents, [{"tokens": remote.token_stride, "heads": remote.head_stride}], remote.head_size)
    return UnitShape(taken["heads"], taken["tokens"], remote.head_size)


def unit_grid(side: BlockGeometry, unit: UnitShape, first_head: int, num_heads: int) -> tuple[np.ndarray, np.ndarray]:
    """Global head and slot of every unit of heads ``[first_head, first_head + num_heads)`` in a block of
    ``side``, in canonical order ``unit_in_block = head_unit * units_per_head + token_unit``; int64 arrays."""
    head_units = num_heads // unit.heads
    token_units = side.block_size // unit.tokens
    heads = first_head + np.repeat(np.arange(head_units, dtype=np.int64) * unit.heads, token_units)
    slots = np.tile(np.arange(token_units, dtype=np.int64) * unit.tokens, head_units)
    return heads, slots


def staged_offsets(
    remote: BlockGeometry, local: BlockGeometry, unit: UnitShape, first_head: int, num_heads: int
) -> np.ndarray:
    """Element offsets in a local block where staged units of heads ``[first_head, +num_heads)`` land, in
    :func:`unit_grid` order for ``local``.

    The source's region starts where its first head would start in an HND block (sources partition the
    local heads, so their regions partition the block). It holds ``local.block_size / piece`` pieces of
    ``num_heads x piece x head_size`` elements back to back, each in the remote layout's order.
    """
    piece = piece_tokens(remote, local)
    heads, slots = unit_grid(local, unit, first_head, num_heads)
    head_unit = (heads - first_head) // unit.heads
    piece_index, token_unit = np.divmod(slots, piece)
    token_unit //= unit.tokens
    head_units, token_units = num_heads // unit.heads, piece // unit.tokens
    if remote.layout == "HND":
        within = head_unit * token_units + token_unit
    else:
        within = token_unit * head_units + head_unit
    region = (first_head - local.first_head) * local.block_size * local.head_size
    offsets: np.ndarray = region + piece_index * (num_heads * piece * local.head_size) + within * unit.elements
    return offsets
