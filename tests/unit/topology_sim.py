"""Test helpers for the topology planner: encoded KV caches in real memory, a byte-level stand-in for NIXL
READs (``ctypes.memmove`` over the descriptor grids) and the expectation checker.

Written the slow, obvious way on purpose: nothing here reuses the planner's arithmetic. Every element of a
prefill cache that belongs to a request token holds :func:`code` of its (layer, kind, token, global head,
dim); every other element holds :data:`REMOTE_SENTINEL`. Decode caches start as :data:`LOCAL_SENTINEL`.
Real-NIXL tests can reuse :func:`build_cache`, :func:`fill_request` and :func:`check_received`.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pd_transfer.spec import KVCacheLayout, KVRegion, ModelFingerprint, planes_of, region_from_tensor
from pd_transfer.topology import PeerPlan, plane_views

KIND_INDEX = {"k": 0, "v": 1, "latent": 2}
MAX_TOKENS = 4096
MAX_HEADS = 16
MAX_DIM = 16

#: Storage dtype per element size: the planner only moves bytes, integers make exact comparisons easy.
STORAGE = {4: torch.int32, 2: torch.int16, 1: torch.uint8}
REMOTE_SENTINEL = {4: -1, 2: -1, 1: 255}
LOCAL_SENTINEL = {4: -2, 2: -2, 1: 254}


def code(layer: int, kind: str, token: np.ndarray | int, head: np.ndarray | int, dim: np.ndarray | int, size: int):
    """The value stored for (layer, kind, token, global head, dim) in a cache of ``size``-byte elements.

    Injective for 4-byte elements; a mixing hash into ``[0, 2**15)`` / ``[0, 254)`` for 2 / 1-byte ones
    (never equal to a sentinel)."""
    index = (((layer * 3 + KIND_INDEX[kind]) * MAX_TOKENS + np.asarray(token)) * MAX_HEADS + np.asarray(head)) * MAX_DIM
    index = index + np.asarray(dim)
    if size == 4:
        return (index + 1).astype(np.int64)
    mixed = (index.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(40)
    if size == 2:
        return (mixed % np.uint64(1 << 15)).astype(np.int64)
    return (mixed % np.uint64(254)).astype(np.int64)


@dataclass
class RankCache:
    """One rank's cache: the registered region tensors (and their padded backing buffers)."""

    layout: KVCacheLayout
    together: bool  # K and V in one region
    tensors: list[torch.Tensor]  # one per region, (num_blocks, [kinds,] *block_shape)
    regions: list[KVRegion]
    buffers: list[torch.Tensor]  # backing storage incl. padding between blocks

    @property
    def kinds(self) -> tuple[str, ...]:
        return ("latent",) if self.layout.fingerprint.use_mla else ("k", "v")

    def block(self, layer: int, kind: str, block: int) -> np.ndarray:
        """Numpy view (heads, tokens, dim) of one plane block, whatever the layout."""
        kinds = self.kinds
        if self.together:
            tensor = self.tensors[layer][block, kinds.index(kind)]
        else:
            tensor = self.tensors[layer * len(kinds) + kinds.index(kind)][block]
        array = tensor.numpy()
        return array if self.layout.layout == "HND" else array.transpose(1, 0, 2)

    def planes(self) -> list[torch.Tensor]:
        return plane_views(self.tensors, self.regions)


def block_shape(layout: KVCacheLayout) -> tuple[int, int, int]:
    heads, tokens, dim = layout.num_local_heads, layout.block_size, layout.fingerprint.head_size
    return (heads, tokens, dim) if layout.layout == "HND" else (tokens, heads, dim)


def build_cache(layout: KVCacheLayout, num_blocks: int, together: bool, pad: int, fill: int) -> RankCache:
    """A cache of ``num_blocks`` blocks per layer filled with ``fill``; ``pad`` extra elements after each block
    (so the block stride exceeds the block length)."""
    size = layout.element_size
    shape = block_shape(layout)
    elements = int(np.prod(shape))
    kinds = ("latent",) if layout.fingerprint.use_mla else ("k", "v")
    groups = [kinds] if together else [(kind,) for kind in kinds]
    tensors, regions, buffers = [], [], []
    for layer in range(layout.fingerprint.num_layers):
        for group in groups:
            buffer = torch.full((num_blocks, len(group) * elements + pad), fill, dtype=STORAGE[size])
            used = buffer[:, : len(group) * elements]
            tensor = used.view(num_blocks, len(group), *shape) if len(group) > 1 else used.view(num_blocks, *shape)
            tensors.append(tensor)
            regions.append(region_from_tensor(tensor, layer, group))
            buffers.append(buffer)
    return RankCache(layout, together and len(kinds) > 1, tensors, regions, buffers)


def fill_request(cache: RankCache, block_ids: Sequence[int], num_tokens: int) -> None:
    """Write the codes of tokens ``[0, num_tokens)`` of the rank's heads into its request blocks."""
    layout = cache.layout
    size = layout.element_size
    heads = np.arange(layout.first_global_head, layout.first_global_head + layout.num_local_heads)
    dims = np.arange(layout.fingerprint.head_size)
    for layer in range(layout.fingerprint.num_layers):
        for kind in cache.kinds:
            for token in range(num_tokens):
                block = cache.block(layer, kind, block_ids[token // layout.block_size])
                block[:, token % layout.block_size, :] = code(layer, kind, token, heads[:, None], dims[None, :], size)


def check_received(cache: RankCache, block_ids: Sequence[int], num_tokens: int) -> None:
    """Assert every request token slot holds its code and every byte outside the request blocks is untouched.

    Slots of request blocks beyond ``num_tokens`` may hold anything."""
    layout = cache.layout
    size = layout.element_size
    expected = build_cache(layout, cache.regions[0].num_blocks, cache.together, _pad(cache), LOCAL_SENTINEL[size])
    care = build_cache(layout, cache.regions[0].num_blocks, cache.together, _pad(cache), 1)
    heads = np.arange(layout.first_global_head, layout.first_global_head + layout.num_local_heads)
    dims = np.arange(layout.fingerprint.head_size)
    for layer in range(layout.fingerprint.num_layers):
        for kind in cache.kinds:
            for block_id in block_ids:
                care.block(layer, kind, block_id)[...] = 0
            for token in range(num_tokens):
                block_id, slot = block_ids[token // layout.block_size], token % layout.block_size
                care.block(layer, kind, block_id)[:, slot, :] = 1
                values = code(layer, kind, token, heads[:, None], dims[None, :], size)
                expected.block(layer, kind, block_id)[:, slot, :] = values
    for index, (got, want, mask) in enumerate(zip(cache.buffers, expected.buffers, care.buffers, strict=True)):
        bad = (got != want) & (mask != 0)
        if bool(bad.any()):
            where = tuple(int(i) for i in bad.nonzero()[0])
            raise AssertionError(
                f"region {index} ({cache.regions[index].layer}, {cache.regions[index].kinds}) element {where}: "
                f"got {int(got[where])}, expected {int(want[where])}; {int(bad.sum())} elements wrong"
            )


def _pad(cache: RankCache) -> int:
    return cache.buffers[0].shape[1] - cache.tensors[0][0].numel()


def _locate(regions: list[KVRegion], addresses: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
    """For byte ranges ``[a, a + length)``: (plane index, block id) of the plane block holding each, asserting
    each lies inside exactly one plane block."""
    planes = planes_of(regions)
    plane_of = np.full(addresses.shape, -1, dtype=np.int64)
    block_of = np.full(addresses.shape, -1, dtype=np.int64)
    hits = np.zeros(addresses.shape, dtype=np.int64)
    signed = addresses.astype(np.int64)
    for index, plane in enumerate(planes):
        relative = signed - plane.base_address
        block, offset = np.divmod(relative, plane.block_stride)
        inside = (relative >= 0) & (block < plane.num_blocks) & (offset + length <= plane.block_len)
        hits += inside
        plane_of[inside] = index
        block_of[inside] = block[inside]
    assert (hits == 1).all(), "a descriptor does not lie inside exactly one plane block"
    return plane_of, block_of


def simulate_reads(
    plan: PeerPlan,
    remote_caches: dict[int, RankCache],
    local_cache: RankCache,
    remote_block_ids: Sequence[int],
    local_block_ids: Sequence[int],
    num_tokens: int,
) -> int:
    """Perform the plan's reads for one request with ``memmove`` and run its postprocess; returns the rows.

    Also asserts that reads touch only listed remote blocks, writes only listed local blocks, and that no two
    writes overlap."""
    writes: list[tuple[np.ndarray, np.ndarray]] = []
    total = 0
    for source, (local_rows, remote_rows) in zip(
        plan.sources, plan.indices(remote_block_ids, local_block_ids, num_tokens), strict=True
    ):
        assert local_rows.dtype == np.int64 and remote_rows.dtype == np.int64
        assert local_rows.shape == remote_rows.shape and local_rows.ndim == 1
        length = source.unit_bytes
        for grid in (source.local_grid, source.remote_grid):
            assert grid.dtype == np.uint64 and grid.shape[1] == 3
            assert (grid[:, 1] == length).all() and (grid[:, 2] == 0).all()
        local_addresses = source.local_grid[local_rows, 0]
        remote_addresses = source.remote_grid[remote_rows, 0]
        _, remote_blocks = _locate(remote_caches[source.remote_rank].regions, remote_addresses, length)
        assert np.isin(remote_blocks, np.asarray(remote_block_ids)).all(), "read a remote block not in the request"
        _, local_blocks = _locate(local_cache.regions, local_addresses, length)
        assert np.isin(local_blocks, np.asarray(local_block_ids)).all(), "wrote a local block not in the request"
        writes.append((local_addresses.astype(np.int64), np.full(local_addresses.shape, length, dtype=np.int64)))
        for destination, origin in zip(local_addresses.tolist(), remote_addresses.tolist(), strict=True):
            ctypes.memmove(destination, origin, length)
        total += len(local_rows)
    if writes:
        starts = np.concatenate([w[0] for w in writes])
        lengths = np.concatenate([w[1] for w in writes])
        order = np.argsort(starts, kind="stable")
        starts, lengths = starts[order], lengths[order]
        assert (starts[:-1] + lengths[:-1] <= starts[1:]).all(), "two descriptors write the same local bytes"
    if plan.postprocess is not None:
        plan.postprocess.apply(local_cache.planes(), list(local_block_ids), num_tokens)
    return total


def fingerprint(heads: int, head_size: int = 8, layers: int = 2, dtype: str = "float32", mla: bool = False):
    return ModelFingerprint(
        model="test-model",
        dtype=dtype,
        num_layers=layers,
        total_num_kv_heads=1 if mla else heads,
        head_size=head_size,
        use_mla=mla,
    )


@dataclass(frozen=True)
class Scenario:
    """One prefill engine -> every rank of one decode engine, one request."""

    heads: int = 8
    remote_tp: int = 1
    local_tp: int = 1
    remote_block: int = 16
    local_block: int = 16
    remote_layout: str = "HND"
    local_layout: str = "HND"
    remote_together: bool = False
    local_together: bool = False
    num_tokens: int = 37
    mla: bool = False
    head_size: int = 8
    dtype: str = "float32"
    plan: str = "auto"  # auto | direct | staged (forced) | min0 | huge (min_direct_run_bytes)
    pad: int = 0  # elements after each block (block stride > block length)
    extra_blocks: int = 3  # unused blocks in each cache
    only_needed_ranks: bool = True  # give PeerPlan.build only the prefill ranks head_sources names
    seed: int = 0


@dataclass
class Outcome:
    plans: list[PeerPlan]
    rows: list[int]  # descriptor rows read per decode rank


def plan_kwargs(kind: str) -> dict:
    return {
        "auto": {},
        "direct": {"strategy": "direct"},
        "staged": {"strategy": "staged"},
        "min0": {"min_direct_run_bytes": 0},
        "huge": {"min_direct_run_bytes": 1 << 60},
    }[kind]


def run_scenario(s: Scenario) -> Outcome:
    """Build, fill, plan, read with memmove, postprocess and check every decode rank."""
    from pd_transfer.topology import head_sources

    rng = np.random.default_rng(s.seed)
    model = fingerprint(s.heads, s.head_size, dtype=s.dtype, mla=s.mla)
    size = KVCacheLayout(model, 1, 0, 1).element_size
    remote_needed = -(-s.num_tokens // s.remote_block)
    local_needed = -(-s.num_tokens // s.local_block)
    remote_blocks = remote_needed + s.extra_blocks
    local_blocks = local_needed + s.extra_blocks
    remote_ids = [int(i) for i in rng.permutation(remote_blocks)[:remote_needed]]
    remote_caches: dict[int, RankCache] = {}
    for rank in range(s.remote_tp):
        layout = KVCacheLayout(model, s.remote_tp, rank, s.remote_block, s.remote_layout)  # type: ignore[arg-type]
        cache = build_cache(layout, remote_blocks, s.remote_together, s.pad, REMOTE_SENTINEL[size])
        fill_request(cache, remote_ids, s.num_tokens)
        remote_caches[rank] = cache
    outcome = Outcome([], [])
    for rank in range(s.local_tp):
        layout = KVCacheLayout(model, s.local_tp, rank, s.local_block, s.local_layout)  # type: ignore[arg-type]
        local = build_cache(layout, local_blocks, s.local_together, s.pad, LOCAL_SENTINEL[size])
        local_ids = [int(i) for i in rng.permutation(local_blocks)[:local_needed]]
        ranks = range(s.remote_tp)
        if s.only_needed_ranks:
            ranks = sorted({source.remote_rank for source in head_sources(layout, s.remote_tp)})
        plan = PeerPlan.build(
            layout,
            local.regions,
            {r: remote_caches[r].layout for r in ranks},
            {r: remote_caches[r].regions for r in ranks},
            **plan_kwargs(s.plan),
        )
        rows = simulate_reads(plan, remote_caches, local, remote_ids, local_ids, s.num_tokens)
        check_received(local, local_ids, s.num_tokens)
        outcome.plans.append(plan)
        outcome.rows.append(rows)
    return outcome
