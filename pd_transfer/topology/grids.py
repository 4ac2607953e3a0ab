"""Descriptor grids (every unit of every plane block, prepared once) and a request's row indices into them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pd_transfer.spec import Plane

#: What callers may pass as a list of block ids.
BlockIds = Sequence[int] | np.ndarray


def build_grid(planes: Sequence[Plane], unit_offsets: np.ndarray, unit_bytes: int) -> np.ndarray:
    """Descriptor rows ``(address, unit_bytes, 0)`` (uint64, shape ``(planes * blocks * units, 3)``).

    ``unit_offsets`` (bytes from a plane block's start, one per unit of a block) gives the in-block order:
    row ``(plane_index * num_blocks + block_id) * len(unit_offsets) + unit_in_block``. All planes must have
    the same number of blocks.
    """
    num_blocks = planes[0].num_blocks if planes else 0
    if any(plane.num_blocks != num_blocks for plane in planes):
        raise ValueError("every plane of a cache must have the same number of blocks")
    offsets = np.asarray(unit_offsets, dtype=np.uint64)
    bases = np.array([plane.base_address for plane in planes], dtype=np.uint64)[:, None]
    strides = np.array([plane.block_stride for plane in planes], dtype=np.uint64)[:, None]
    block_starts = bases + np.arange(num_blocks, dtype=np.uint64)[None, :] * strides  # (planes, blocks)
    grid = np.zeros((len(planes), num_blocks, offsets.size, 3), dtype=np.uint64)
    np.add(block_starts[:, :, None], offsets[None, None, :], out=grid[..., 0])
    grid[..., 1] = unit_bytes
    return grid.reshape(-1, 3)


@dataclass(frozen=True)
class GridAddresses:
    """The addresses of a grid as :func:`build_grid` lays it out: row ``(plane * blocks + block) * units + unit`` at
    ``bases[plane] + block * strides[plane] + offsets[unit]`` (int64 bytes)."""

    bases: np.ndarray  # (planes,)
    strides: np.ndarray  # (planes,)
    offsets: np.ndarray  # (units,), from a block's start

    @classmethod
    def of(cls, grid: np.ndarray, planes: int, blocks: int, units: int) -> GridAddresses | None:
        """``grid``'s addresses in that form, or None where they are not (checked against every row)."""
        if planes * blocks * units != len(grid) or not len(grid):
            return None
        rows = grid[:, 0].astype(np.int64).reshape(planes, blocks, units)
        offsets = rows[0, 0] - rows[0, 0, 0]
        bases = rows[:, 0, 0].copy()
        strides = rows[:, 1, 0] - bases if blocks > 1 else np.zeros(planes, dtype=np.int64)
        found = cls(bases, strides, offsets)
        expected = bases[:, None, None] + np.arange(blocks)[None, :, None] * strides[:, None, None] + offsets
        return found if np.array_equal(expected, rows) else None

    def at(self, blocks: np.ndarray, in_block: np.ndarray) -> np.ndarray:
        """uint64 addresses, in every plane, of the units ``in_block[t, h]`` of the blocks ``blocks[t]``: ordered by
        (plane, t, h)."""
        starts = self.bases[:, None] + blocks[None, :] * self.strides[:, None]  # (planes, t)
        addresses: np.ndarray = starts[:, :, None] + self.offsets[in_block][None, :, :]
        return addresses.ravel().astype(np.uint64)


def block_ids_array(
    name: str, ids: BlockIds, num_tokens: int, block_size: int, num_blocks: int, distinct: bool
) -> np.ndarray:
    """``ids`` as int64 after checking it has ``ceil(num_tokens / block_size)`` entries in ``[0, num_blocks)``
    (and no repeats when ``distinct``); raises ``ValueError`` naming ``name`` otherwise."""
    array = np.asarray(ids)
    if array.ndim != 1:
        raise ValueError(f"{name} must be a flat list of block ids, got shape {array.shape}")
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"{name} must hold integers, got dtype {array.dtype}")
    array = array.astype(np.int64, copy=False)
    needed = -(-num_tokens // block_size)
    if array.size != needed:
        raise ValueError(
            f"{name}: {num_tokens} tokens in blocks of {block_size} tokens need {needed} block ids, got {array.size}"
        )
    if array.size:
        low, high = int(array.min()), int(array.max())
        if low < 0:
            raise ValueError(f"{name}: block id {low} is negative")
        if high >= num_blocks:
            raise ValueError(f"{name}: block id {high} is out of range for a cache of {num_blocks} blocks")
        if distinct and np.unique(array).size != array.size:
            raise ValueError(f"{name}: block ids repeat; each block may hold only one range of the request's tokens")
    return array


def check_num_tokens(num_tokens: int) -> None:
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int | np.integer) or num_tokens < 0:
        raise ValueError(f"num_tokens must be a non-negative integer, got {num_tokens!r}")
