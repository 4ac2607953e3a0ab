"""The rows a decode's plan reads from one prefill rank, as that prefill rank finds them in its own cache: what it
needs to digest exactly the bytes a decode read, given only the shape of the decode's units (read checks, issue 42).

A decode's :class:`~pd_transfer.topology.plan.SourcePlan` reads heads ``[first_global_head, +num_heads)`` of a prefill
rank in units of :class:`~pd_transfer.topology.units.UnitShape` (``heads`` x ``tokens`` x the head); its remote rows,
in :meth:`SourcePlan.indices` order (plane, token unit, head unit), depend on nothing else of the decode's side. The
prefill computes them here from its own layout and regions, without any grid sent to it: a decode names a shape, never
an address. Shapes that do not fit the rank (heads it does not hold, units that do not divide its blocks, rows that
would leave a plane's block) raise :class:`~pd_transfer.topology.mapping.TopologyError`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pd_transfer.spec import KVCacheLayout, KVRegion, planes_of

from .grids import BlockIds, block_ids_array, check_num_tokens
from .mapping import TopologyError
from .units import BlockGeometry, UnitShape, unit_grid


class OwnRows:
    """Where the units of one shape lie in a rank's own cache (``layout`` at ``regions``): made once a shape, then
    :meth:`addresses` per request. Raises :class:`TopologyError` for a shape that does not fit the rank."""

    def __init__(
        self,
        layout: KVCacheLayout,
        regions: Sequence[KVRegion],
        *,
        first_global_head: int,
        num_heads: int,
        unit: UnitShape,
    ) -> None:
        geometry = BlockGeometry.of(layout)
        _check_shape(geometry, first_global_head, num_heads, unit)
        planes = planes_of(list(regions))
        if not planes:
            raise TopologyError("the rank has no KV planes")
        self.unit_bytes = unit.elements * geometry.element_size
        heads, slots = unit_grid(geometry, unit, first_global_head, num_heads)
        offsets = geometry.offset(heads, slots) * geometry.element_size  # bytes into a plane's block, canonical order
        if int(offsets.max()) + self.unit_bytes > min(plane.block_len for plane in planes):
            raise TopologyError(f"units of {unit} at heads {first_global_head}+{num_heads} leave the rank's blocks")
        self.num_blocks = min(plane.num_blocks for plane in planes)
        self._geometry, self._unit, self._num_heads = geometry, unit, num_heads
        self._offsets = offsets
        self._bases = np.array([plane.base_address for plane in planes], dtype=np.int64)
        self._strides = np.array([plane.block_stride for plane in planes], dtype=np.int64)

    def addresses(self, block_ids: BlockIds, num_tokens: int) -> np.ndarray:
        """uint64 addresses of the units of ``num_tokens`` tokens held in ``block_ids`` (this rank's, in token order),
        ``unit_bytes`` each, in :meth:`SourcePlan.indices` order: what a decode's plan reads for that request from
        this rank. ``ValueError`` for block ids that do not fit."""
        check_num_tokens(num_tokens)
        geometry, unit = self._geometry, self._unit
        ids = block_ids_array("block_ids", block_ids, num_tokens, geometry.block_size, self.num_blocks, False)
        starts = np.arange(-(-num_tokens // unit.tokens), dtype=np.int64) * unit.tokens  # each token unit's first
        block, slot = np.divmod(starts, geometry.block_size)
        head_units = np.arange(self._num_heads // unit.heads, dtype=np.int64)
        in_block = (slot // unit.tokens)[:, None] + (head_units * (geometry.block_size // unit.tokens))[None, :]
        blocks = ids[block]
        starts_of = self._bases[:, None] + blocks[None, :] * self._strides[:, None]  # (planes, token units)
        addresses = starts_of[:, :, None] + self._offsets[in_block][None, :, :]
        return addresses.ravel().astype(np.uint64)


def _check_shape(geometry: BlockGeometry, first_global_head: int, num_heads: int, unit: UnitShape) -> None:
    """:class:`TopologyError` unless units of ``unit`` tile heads ``[first_global_head, +num_heads)`` of blocks of
    ``geometry``."""
    for name, value in (("num_heads", num_heads), ("unit heads", unit.heads), ("unit tokens", unit.tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise TopologyError(f"{name} must be a positive integer, got {value!r}")
    if unit.head_size != geometry.head_size:
        raise TopologyError(f"units of head size {unit.head_size}; the rank's heads have {geometry.head_size}")
    held = range(geometry.first_head, geometry.first_head + geometry.num_heads)
    if first_global_head not in held or first_global_head + num_heads - 1 not in held:
        raise TopologyError(f"heads {first_global_head}+{num_heads} are not all the rank's ({held.start}..{held.stop})")
    if num_heads % unit.heads or geometry.block_size % unit.tokens:
        raise TopologyError(
            f"units of {unit.heads} heads x {unit.tokens} tokens do not tile {num_heads} heads x {geometry.block_size}"
            " tokens"
        )
