"""The transfer plan of one decode (local) rank reading from one prefill (remote) engine.

Built once per (local rank, remote engine) by :meth:`PeerPlan.build`. For each :class:`HeadSource` a
:class:`SourcePlan` holds two descriptor grids that are prepared once with NIXL (every unit of every plane
block, local and remote) and, per request, :meth:`SourcePlan.indices` lists which remote row goes to which
local row. With the staged strategy the received blocks are not yet in the local layout and
:attr:`PeerPlan.postprocess` must be applied once every source's reads have completed.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from pd_transfer.spec import KVCacheLayout, KVRegion, Plane, planes_of

from .grids import BlockIds, GridAddresses, block_ids_array, build_grid, check_num_tokens
from .mapping import HeadSource, TopologyError, check_compatible, expected_readers, head_sources
from .postprocess import Restage, StagedSource, index_on, restage_blocks
from .units import BlockGeometry, UnitShape, direct_unit, staged_offsets, staged_unit, unit_grid

Strategy = Literal["direct", "staged"]

#: Default of ``PeerPlan.build(min_direct_run_bytes=...)``: direct runs at least this long are kept even if
#: staging would need fewer descriptors.
DEFAULT_MIN_DIRECT_RUN_BYTES = 16384

_KIND_ORDER = {"k": 0, "v": 1, "latent": 2}


@dataclass(frozen=True, eq=False)
class SourcePlan:
    """Reads of global heads ``[first_global_head, +num_heads)`` from ``remote_rank``.

    A unit is ``unit.heads`` heads x ``unit.tokens`` token slots x the head (``unit_bytes`` bytes), one
    contiguous run in the remote block. ``local_grid`` (R_l x 3) and ``remote_grid`` (R_r x 3) are uint64 rows
    ``(address, unit_bytes, 0)`` listing every unit of this source's heads in every plane block of each side:
    row ``(plane_index * num_blocks + block_id) * units_per_block + unit_in_block`` with ``unit_in_block =
    head_unit * (block_size / unit.tokens) + token_unit`` (``num_blocks`` and ``block_size`` of that side).
    Local addresses are final positions (direct strategy) or staging positions (staged strategy).
    """

    remote_rank: int
    first_global_head: int
    num_heads: int
    unit: UnitShape  # heads x tokens x head_size elements moved by one row
    unit_bytes: int
    local_grid: np.ndarray
    remote_grid: np.ndarray
    num_planes: int
    local_block_size: int  # tokens
    remote_block_size: int  # tokens
    local_num_blocks: int
    remote_num_blocks: int

    @property
    def local_units_per_block(self) -> int:
        return (self.num_heads // self.unit.heads) * (self.local_block_size // self.unit.tokens)

    @property
    def remote_units_per_block(self) -> int:
        return (self.num_heads // self.unit.heads) * (self.remote_block_size // self.unit.tokens)

    def rows_for(self, num_tokens: int) -> int:
        """Descriptor rows one request of ``num_tokens`` tokens reads from this source."""
        return self.num_planes * (self.num_heads // self.unit.heads) * -(-num_tokens // self.unit.tokens)

    def indices(
        self, remote_block_ids: BlockIds, local_block_ids: BlockIds, num_tokens: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """(local_rows, remote_rows): int64 arrays of equal length, one pair per unit to read, ordered by
        (plane, token, head). Only units holding tokens ``< num_tokens`` are listed; ``remote_block_ids`` has
        ``ceil(num_tokens / remote_block_size)`` entries, ``local_block_ids`` ``ceil(num_tokens /
        local_block_size)`` distinct ones. Raises ``ValueError`` on malformed block ids."""
        local, remote = self.request_units(remote_block_ids, local_block_ids, num_tokens)
        planes = np.arange(self.num_planes, dtype=np.int64)

        def rows(units: RequestUnits, num_blocks: int, per_block: int) -> np.ndarray:
            plane_start = planes * (num_blocks * per_block)
            grid: np.ndarray = plane_start[:, None, None] + (units.blocks * per_block)[None, :, None]
            grid = grid + units.in_block[None, :, :]
            return grid.ravel()

        local_rows = rows(local, self.local_num_blocks, self.local_units_per_block)
        remote_rows = rows(remote, self.remote_num_blocks, self.remote_units_per_block)
        return local_rows, remote_rows

    def addresses(
        self, remote_block_ids: BlockIds, local_block_ids: BlockIds, num_tokens: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """(local, remote): uint64 addresses of the rows :meth:`indices` lists, in its order (what its grids hold at
        those rows), computed from the block ids rather than gathered from the grids."""
        local, remote = self.request_units(remote_block_ids, local_block_ids, num_tokens)
        return self._local_addresses.at(local.blocks, local.in_block), self._remote_addresses.at(
            remote.blocks, remote.in_block
        )

    @functools.cached_property
    def _local_addresses(self) -> _Addresses:
        return _addresses(self.local_grid, self.num_planes, self.local_num_blocks, self.local_units_per_block)

    @functools.cached_property
    def _remote_addresses(self) -> _Addresses:
        return _addresses(self.remote_grid, self.num_planes, self.remote_num_blocks, self.remote_units_per_block)

    def request_units(
        self, remote_block_ids: BlockIds, local_block_ids: BlockIds, num_tokens: int
    ) -> tuple[RequestUnits, RequestUnits]:
        """(local, remote): where a request's units lie on each side, before the planes multiply them (what
        :meth:`indices` turns into rows; validated as it says)."""
        check_num_tokens(num_tokens)
        remote = block_ids_array(
            "remote_block_ids", remote_block_ids, num_tokens, self.remote_block_size, self.remote_num_blocks, False
        )
        local = block_ids_array(
            "local_block_ids", local_block_ids, num_tokens, self.local_block_size, self.local_num_blocks, True
        )
        unit_tokens = self.unit.tokens
        starts = np.arange(-(-num_tokens // unit_tokens), dtype=np.int64) * unit_tokens  # first token of units
        head_units = np.arange(self.num_heads // self.unit.heads, dtype=np.int64)

        def units(ids: np.ndarray, block_size: int) -> RequestUnits:
            block, slot = np.divmod(starts, block_size)
            in_block = (slot // unit_tokens)[:, None] + (head_units * (block_size // unit_tokens))[None, :]
            return RequestUnits(ids[block], in_block)

        return units(local, self.local_block_size), units(remote, self.remote_block_size)


class _Gathered:
    """Addresses of a grid not laid out as :class:`GridAddresses` says: gathered from it row by row."""

    def __init__(self, grid: np.ndarray, planes: int, blocks: int, units: int) -> None:
        self.rows = np.ascontiguousarray(grid[:, 0])
        self.planes, self.blocks, self.units = planes, blocks, units

    def at(self, blocks: np.ndarray, in_block: np.ndarray) -> np.ndarray:
        plane_start = np.arange(self.planes, dtype=np.int64) * (self.blocks * self.units)
        rows = plane_start[:, None, None] + (blocks * self.units)[None, :, None] + in_block[None, :, :]
        gathered: np.ndarray = self.rows[rows.ravel()]
        return gathered


_Addresses = GridAddresses | _Gathered


def _addresses(grid: np.ndarray, planes: int, blocks: int, units: int) -> _Addresses:
    found = GridAddresses.of(grid, planes, blocks, units)
    return found if found is not None else _Gathered(grid, planes, blocks, units)


@dataclass(frozen=True)
class RequestUnits:
    """One side of a request's units, the same in every plane: ``blocks[t]``, the block holding token unit ``t``, and
    ``in_block[t, h]``, the unit (in the grid's in-block order) of head unit ``h`` of token unit ``t`` in it."""

    blocks: np.ndarray  # int64 (token units,)
    in_block: np.ndarray  # int64 (token units, head units)


@dataclass(frozen=True, slots=True)
class SourceStats:
    """Descriptor counts of one source for one request."""

    remote_rank: int
    unit_bytes: int
    rows: int  # descriptors read
    bytes: int  # rows * unit_bytes
    local_grid_rows: int
    remote_grid_rows: int


@dataclass(frozen=True, eq=False)
class Postprocess:
    """Rewrites staged local blocks into the local layout, in place (see :mod:`.postprocess`)."""

    restage: Restage
    num_planes: int
    num_blocks: int  # of the local cache
    element_size: int  # bytes
    chunk_bytes: int | None = None  # bytes of blocks restaged at a time; None: per-device default

    def apply(
        self,
        local_planes: Sequence[torch.Tensor],
        local_block_ids: BlockIds | torch.Tensor,
        num_tokens: int,
        planes: range | None = None,
    ) -> None:
        """Restage the request's local blocks (only those) of every plane, in place. ``local_planes[i]`` is
        plane ``i``'s tensor (num_blocks, plane_block_elements) or (num_blocks, *block_shape), e.g. from
        :func:`plane_views`; ``local_block_ids`` as given to :meth:`SourcePlan.indices` (host values: a CPU tensor
        at most). Call once all reads of the request (from every source of this plan) have completed, before the
        blocks are used. ``planes`` limits the work to those plane indices (all by default), so plane groups can be
        fixed up as their reads land: then take the ids to the device once (:meth:`block_ids_on`) and call
        :meth:`apply_on` per group."""
        if len(local_planes) != self.num_planes:
            raise ValueError(f"expected {self.num_planes} local planes, got {len(local_planes)}")
        device = local_planes[0].device if local_planes else torch.device("cpu")
        self.apply_on(local_planes, self.block_ids_on(local_block_ids, num_tokens, device), planes)

    def block_ids_on(
        self, local_block_ids: BlockIds | torch.Tensor, num_tokens: int, device: torch.device
    ) -> torch.Tensor:
        """The request's local block ids, validated (``ValueError``), as int64 on ``device``: one copy, queued
        on the current stream of an accelerator (:func:`~.postprocess.index_on`). Host values only: ids already on
        an accelerator would need a copy back to be validated."""
        check_num_tokens(num_tokens)
        if isinstance(local_block_ids, torch.Tensor):
            if local_block_ids.device.type != "cpu":
                raise ValueError(f"local_block_ids must be host values, got a tensor on {local_block_ids.device}")
            local_block_ids = local_block_ids.numpy()
        ids = block_ids_array(
            "local_block_ids", local_block_ids, num_tokens, self.restage.block_size, self.num_blocks, True
        )
        return index_on(ids, device)

    def apply_on(
        self, local_planes: Sequence[torch.Tensor], block_ids: torch.Tensor, planes: range | None = None
    ) -> None:
        """:meth:`apply` with ``block_ids`` from :meth:`block_ids_on` (on the planes' device)."""
        if len(local_planes) != self.num_planes:
            raise ValueError(f"expected {self.num_planes} local planes, got {len(local_planes)}")
        if not block_ids.numel():
            return
        elements = self.restage.block_elements
        for index in planes if planes is not None else range(len(local_planes)):
            plane = local_planes[index]
            if plane.shape[0] != self.num_blocks or plane.element_size() != self.element_size:
                raise ValueError(
                    f"local plane {index}: expected {self.num_blocks} blocks of {self.element_size}-byte elements, "
                    f"got shape {tuple(plane.shape)} of {plane.dtype}"
                )
            try:
                flat = plane.view(plane.shape[0], -1)
            except RuntimeError:
                raise ValueError(f"local plane {index}: blocks are not contiguous (strides {plane.stride()})") from None
            if flat.shape[1] != elements:
                raise ValueError(f"local plane {index}: expected {elements} elements per block, got {flat.shape[1]}")
            restage_blocks(flat, block_ids, self.restage, self.chunk_bytes)


@dataclass(frozen=True, eq=False)
class PeerPlan:
    """Everything a decode rank needs to read any request from one prefill engine."""

    local_layout: KVCacheLayout
    remote_tp_size: int
    strategy: Strategy
    sources: tuple[SourcePlan, ...]
    postprocess: Postprocess | None
    #: remote rank -> how many decode ranks of this decode engine read it (what the prefill waits for)
    readers_hint: dict[int, int] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        local_layout: KVCacheLayout,
        local_regions: list[KVRegion],
        remote_layouts: Mapping[int, KVCacheLayout],
        remote_regions: Mapping[int, list[KVRegion]],
        *,
        min_direct_run_bytes: int = DEFAULT_MIN_DIRECT_RUN_BYTES,
        strategy: Literal["auto", "direct", "staged"] = "auto",
        postprocess_chunk_bytes: int | None = None,
    ) -> PeerPlan:
        """Plan the reads of local rank ``local_layout`` from the remote engine described by its ranks'
        layouts and regions (keyed by remote TP rank; only the ranks :func:`head_sources` names are needed).

        ``strategy="auto"`` picks DIRECT when its shortest run is at least ``min_direct_run_bytes`` or it
        needs no more descriptors than STAGED, else STAGED; ``"direct"``/``"staged"`` force one (for tests).
        Raises :class:`TopologyError` when the caches cannot be paired.
        """
        remote_tp = _remote_tp_size(remote_layouts)
        sources = head_sources(local_layout, remote_tp)
        local_planes = _checked_planes(local_layout, local_regions, "decode")
        keys = tuple((plane.layer, plane.kind) for plane in local_planes)
        local_geometry = BlockGeometry.of(local_layout)
        remote_planes: dict[int, list[Plane]] = {}
        remote_geometry: dict[int, BlockGeometry] = {}
        for source in sources:
            rank = source.remote_rank
            if rank in remote_planes:
                continue
            if rank not in remote_layouts or rank not in remote_regions:
                raise TopologyError(f"decode rank {local_layout.tp_rank} reads prefill rank {rank}, which is missing")
            layout = remote_layouts[rank]
            if layout.tp_rank != rank:
                raise TopologyError(f"the layout given for prefill rank {rank} says it is rank {layout.tp_rank}")
            check_compatible(local_layout, layout)
            planes = _checked_planes(layout, remote_regions[rank], f"prefill rank {rank}")
            theirs = tuple((plane.layer, plane.kind) for plane in planes)
            if theirs != keys:
                raise TopologyError(
                    f"planes differ: decode has {_describe(keys)}, prefill rank {rank} has {_describe(theirs)}"
                )
            remote_planes[rank] = planes
            remote_geometry[rank] = BlockGeometry.of(layout)
        shapes = {(g.layout, g.block_size) for g in remote_geometry.values()}
        if len(shapes) != 1:
            raise TopologyError(f"prefill ranks disagree on their KV layout and block size: {sorted(shapes)}")
        remote_block_size = next(iter(shapes))[1]
        if local_layout.packing is not None and remote_block_size != local_layout.block_size:
            raise TopologyError(
                f"blocks packed as {local_layout.packing!r} cannot be planned across block sizes (decode"
                f" {local_layout.block_size}, prefill {remote_block_size}): they need a PackedRegroup"
            )

        chosen = _choose(strategy, sources, remote_geometry, local_geometry, min_direct_run_bytes)
        element_size = local_layout.element_size
        plans = []
        for source in sources:
            remote = remote_geometry[source.remote_rank]
            pick = direct_unit if chosen == "direct" else staged_unit
            unit = pick(remote, local_geometry, source.num_heads)
            heads, slots = unit_grid(remote, unit, source.first_global_head, source.num_heads)
            remote_offsets = remote.offset(heads, slots) * element_size
            if chosen == "direct":
                heads, slots = unit_grid(local_geometry, unit, source.first_global_head, source.num_heads)
                local_offsets = local_geometry.offset(heads, slots) * element_size
            else:
                local_offsets = (
                    staged_offsets(remote, local_geometry, unit, source.first_global_head, source.num_heads)
                    * element_size
                )
            unit_bytes = unit.elements * element_size
            plans.append(
                SourcePlan(
                    remote_rank=source.remote_rank,
                    first_global_head=source.first_global_head,
                    num_heads=source.num_heads,
                    unit=unit,
                    unit_bytes=unit_bytes,
                    local_grid=build_grid(local_planes, local_offsets, unit_bytes),
                    remote_grid=build_grid(remote_planes[source.remote_rank], remote_offsets, unit_bytes),
                    num_planes=len(local_planes),
                    local_block_size=local_geometry.block_size,
                    remote_block_size=remote.block_size,
                    local_num_blocks=local_planes[0].num_blocks,
                    remote_num_blocks=remote_planes[source.remote_rank][0].num_blocks,
                )
            )
        postprocess = None
        if chosen == "staged":
            restage = _restage(sources, remote_geometry, local_geometry)
            if not _is_identity(restage):
                postprocess = Postprocess(
                    restage, len(local_planes), local_planes[0].num_blocks, element_size, postprocess_chunk_bytes
                )
        any_remote = remote_layouts[sources[0].remote_rank]
        readers = {rank: expected_readers(rank, any_remote, local_layout.tp_size) for rank in sorted(remote_planes)}
        return cls(local_layout, remote_tp, chosen, tuple(plans), postprocess, readers)

    def indices(
        self, remote_block_ids: BlockIds, local_block_ids: BlockIds, num_tokens: int
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """:meth:`SourcePlan.indices` of every source, in :attr:`sources` order."""
        return [source.indices(remote_block_ids, local_block_ids, num_tokens) for source in self.sources]

    def descriptor_stats(self, num_tokens: int) -> list[SourceStats]:
        """Descriptor rows and bytes a request of ``num_tokens`` tokens reads, per source."""
        check_num_tokens(num_tokens)
        return [
            SourceStats(
                remote_rank=source.remote_rank,
                unit_bytes=source.unit_bytes,
                rows=source.rows_for(num_tokens),
                bytes=source.rows_for(num_tokens) * source.unit_bytes,
                local_grid_rows=len(source.local_grid),
                remote_grid_rows=len(source.remote_grid),
            )
            for source in self.sources
        ]


def plane_views(region_tensors: Sequence[torch.Tensor], regions: Sequence[KVRegion]) -> list[torch.Tensor]:
    """One view per plane, in :func:`planes_of` order, of tensors described by ``regions`` (same order).

    A region with several kinds (K and V together) is split along dim 1, which must have one entry per kind
    (or the block is viewed as ``(len(kinds), -1)`` first). Views are ``(num_blocks, *block_shape)``.
    """
    if len(region_tensors) != len(regions):
        raise ValueError(f"got {len(region_tensors)} tensors for {len(regions)} regions")
    keyed: list[tuple[tuple[int, int], torch.Tensor]] = []
    for tensor, region in zip(region_tensors, regions, strict=True):
        if tensor.dim() < 2 or tensor.shape[0] != region.num_blocks:
            raise ValueError(
                f"layer {region.layer} {region.kinds}: tensor of shape {tuple(tensor.shape)} does not hold "
                f"{region.num_blocks} blocks"
            )
        if tensor.data_ptr() != region.base_address:
            raise ValueError(f"layer {region.layer} {region.kinds}: tensor is not the region's memory")
        if len(region.kinds) == 1:
            parts = [tensor]
        else:
            count = len(region.kinds)
            split = tensor if tensor.shape[1] == count else tensor.view(tensor.shape[0], count, -1)
            parts = [split[:, index] for index in range(count)]
        for kind, part in zip(region.kinds, parts, strict=True):
            keyed.append(((region.layer, _KIND_ORDER[kind]), part))
    keyed.sort(key=lambda item: item[0])
    return [view for _, view in keyed]


def _remote_tp_size(remote_layouts: Mapping[int, KVCacheLayout]) -> int:
    if not remote_layouts:
        raise TopologyError("no prefill rank layouts given")
    sizes = {layout.tp_size for layout in remote_layouts.values()}
    if len(sizes) != 1:
        raise TopologyError(f"prefill ranks disagree on their TP size: {sorted(sizes)}")
    return sizes.pop()


def _checked_planes(layout: KVCacheLayout, regions: Sequence[KVRegion], side: str) -> list[Plane]:
    planes = planes_of(list(regions))
    if not planes:
        raise TopologyError(f"{side} has no KV planes")
    keys = [(plane.layer, plane.kind) for plane in planes]
    if len(set(keys)) != len(keys):
        raise TopologyError(f"{side} describes a (layer, kind) plane twice")
    expected_kinds = {"latent"} if layout.fingerprint.use_mla else {"k", "v"}
    kinds = {plane.kind for plane in planes}
    if not kinds <= expected_kinds:
        raise TopologyError(f"{side} has planes of kinds {sorted(kinds)}, expected only {sorted(expected_kinds)}")
    for plane in planes:
        if plane.block_len != layout.plane_block_bytes:
            raise TopologyError(
                f"{side} layer {plane.layer} {plane.kind}: plane block is {plane.block_len} bytes, its layout says "
                f"{layout.plane_block_bytes} ({layout.num_local_heads} heads x {layout.block_size} tokens x "
                f"{layout.fingerprint.head_size} x {layout.element_size} bytes)"
            )
    counts = {plane.num_blocks for plane in planes}
    if len(counts) != 1:
        raise TopologyError(f"{side} planes have different block counts: {sorted(counts)}")
    return planes


def _describe(keys: tuple[tuple[int, str], ...]) -> str:
    shown = ", ".join(f"{layer}{kind}" for layer, kind in keys[:8])
    return f"{len(keys)} planes [{shown}{', ...' if len(keys) > 8 else ''}]"


def _rows(units: list[UnitShape], sources: list[HeadSource], tokens: int) -> int:
    return sum((s.num_heads // u.heads) * (tokens // u.tokens) for s, u in zip(sources, units, strict=True))


def _choose(
    strategy: str,
    sources: list[HeadSource],
    remote: Mapping[int, BlockGeometry],
    local: BlockGeometry,
    min_direct_run_bytes: int,
) -> Strategy:
    if strategy in ("direct", "staged"):
        return strategy  # type: ignore[return-value]
    if strategy != "auto":
        raise ValueError(f"strategy must be 'auto', 'direct' or 'staged', got {strategy!r}")
    direct = [direct_unit(remote[s.remote_rank], local, s.num_heads) for s in sources]
    staged = [staged_unit(remote[s.remote_rank], local, s.num_heads) for s in sources]
    shortest = min(unit.elements for unit in direct) * local.element_size
    tokens = max(local.block_size, max(remote[s.remote_rank].block_size for s in sources))
    if shortest >= min_direct_run_bytes or _rows(direct, sources, tokens) <= _rows(staged, sources, tokens):
        return "direct"
    return "staged"


def _restage(sources: list[HeadSource], remote: Mapping[int, BlockGeometry], local: BlockGeometry) -> Restage:
    first = remote[sources[0].remote_rank]  # every prefill rank has the same layout and block size
    return Restage(
        remote_layout=first.layout,
        local_layout=local.layout,
        num_heads=local.num_heads,
        block_size=local.block_size,
        piece=min(first.block_size, local.block_size),
        head_size=local.head_size,
        sources=tuple(StagedSource(s.first_global_head - local.first_head, s.num_heads) for s in sources),
    )


def _is_identity(restage: Restage) -> bool:
    """True when staged blocks already are in the local layout (no postprocess needed)."""
    probe = torch.arange(restage.block_elements, dtype=torch.int64).view(1, -1)
    expected = probe.clone()
    restage_blocks(probe, torch.zeros(1, dtype=torch.int64), restage)
    return bool(torch.equal(probe, expected))
