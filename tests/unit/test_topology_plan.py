"""PeerPlan: unit sizes (descriptor coarseness), grid rows, strategy choice, request validation, build errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from topology_sim import LOCAL_SENTINEL, RankCache, build_cache, fingerprint

from pd_transfer.spec import KVCacheLayout, planes_of
from pd_transfer.topology import PeerPlan, TopologyError, UnitShape, plane_views
from pd_transfer.topology.own_rows import OwnRows


def make(**kwargs) -> PeerPlan:
    return make_with_caches(**kwargs)[0]


def make_with_caches(
    heads: int = 8,
    local_tp: int = 1,
    remote_tp: int = 1,
    local_block: int = 16,
    remote_block: int = 16,
    local_layout: str = "HND",
    remote_layout: str = "HND",
    head_size: int = 8,
    dtype: str = "float32",
    blocks: int = 8,
    rank: int = 0,
    **kwargs,
) -> tuple[PeerPlan, RankCache, dict[int, RankCache]]:
    """A plan for decode rank ``rank`` (K/V apart) reading a prefill engine (K/V together), with the caches."""
    model = fingerprint(heads, head_size, dtype=dtype)
    local = KVCacheLayout(model, local_tp, rank, local_block, local_layout)  # type: ignore[arg-type]
    local_cache = build_cache(local, blocks, False, 0, 0)
    layouts, caches = {}, {}
    for r in range(remote_tp):
        remote = KVCacheLayout(model, remote_tp, r, remote_block, remote_layout)  # type: ignore[arg-type]
        layouts[r] = remote
        caches[r] = build_cache(remote, blocks, True, 0, 0)
    regions = {r: cache.regions for r, cache in caches.items()}
    plan = PeerPlan.build(local, local_cache.regions, layouts, regions, **kwargs)
    return plan, local_cache, caches


def only(plan: PeerPlan):
    assert len(plan.sources) == 1
    return plan.sources[0]


class TestUnits:
    def test_same_topology_moves_whole_blocks(self) -> None:
        for layout in ("HND", "NHD"):
            plan = make(local_layout=layout, remote_layout=layout)
            source = only(plan)
            assert plan.strategy == "direct" and plan.postprocess is None
            assert source.unit_bytes == 8 * 16 * 8 * 4
            assert source.local_grid.shape == (2 * 2 * 8, 3) and source.remote_grid.shape == (2 * 2 * 8, 3)

    def test_decode_tp2_from_prefill_tp1_hnd_reads_the_head_slice_of_each_block(self) -> None:
        source = only(make(local_tp=2, rank=1))
        assert (source.first_global_head, source.num_heads) == (4, 4)
        assert source.unit_bytes == 4 * 16 * 8 * 4
        assert source.remote_units_per_block == 1 and source.local_units_per_block == 1

    def test_decode_tp2_from_prefill_tp1_nhd_reads_per_token(self) -> None:
        source = only(make(local_tp=2, local_layout="NHD", remote_layout="NHD"))
        assert source.unit_bytes == 4 * 8 * 4
        assert source.remote_units_per_block == 16

    def test_decode_tp1_from_prefill_tp2_one_source_per_rank(self) -> None:
        plan = make(remote_tp=2)
        assert [(s.remote_rank, s.first_global_head, s.unit_bytes) for s in plan.sources] == [
            (0, 0, 4 * 16 * 8 * 4),
            (1, 4, 4 * 16 * 8 * 4),
        ]
        assert plan.readers_hint == {0: 1, 1: 1}

    def test_block_16_to_64(self) -> None:
        direct = only(make(remote_block=16, local_block=64, strategy="direct"))
        assert direct.unit_bytes == 16 * 8 * 4  # one head of one remote block
        assert (direct.remote_units_per_block, direct.local_units_per_block) == (8, 32)
        plan = make(remote_block=16, local_block=64, strategy="staged")
        staged = only(plan)
        assert staged.unit_bytes == 8 * 16 * 8 * 4  # a whole remote block
        assert (staged.remote_units_per_block, staged.local_units_per_block) == (1, 4)
        assert plan.postprocess is not None

    def test_block_64_to_16_is_direct_per_head(self) -> None:
        plan = make(remote_block=64, local_block=16, min_direct_run_bytes=1 << 40)
        source = only(plan)
        assert plan.strategy == "direct" and plan.postprocess is None  # staging would not save a row
        assert source.unit_bytes == 16 * 8 * 4
        assert (source.remote_units_per_block, source.local_units_per_block) == (32, 8)

    def test_hnd_to_nhd_staged_is_one_run_per_block(self) -> None:
        plan = make(local_layout="NHD", strategy="staged")
        assert only(plan).unit_bytes == 8 * 16 * 8 * 4 and plan.postprocess is not None
        assert only(make(local_layout="NHD", strategy="direct")).unit_bytes == 8 * 4

    def test_staging_that_changes_nothing_needs_no_postprocess(self) -> None:
        plan = make(strategy="staged")
        assert plan.strategy == "staged" and plan.postprocess is None

    def test_auto_threshold(self) -> None:
        # Realistic shape: 8 heads x 128 bf16; block 16 -> 64 direct runs are 16 * 256 = 4096 bytes.
        shape = {"head_size": 128, "dtype": "bfloat16", "remote_block": 16, "local_block": 64, "blocks": 2}
        assert make(**shape).strategy == "staged"
        assert make(**shape, min_direct_run_bytes=4096).strategy == "direct"
        assert make(**shape, min_direct_run_bytes=0).strategy == "direct"
        # Same block size: the head slice is 4 heads x 16 x 256 = 16 KiB, direct either way.
        assert make(local_tp=2, head_size=128, dtype="bfloat16", blocks=2).strategy == "direct"

    def test_unknown_strategy(self) -> None:
        with pytest.raises(ValueError, match="strategy"):
            make(strategy="fast")


class TestGrids:
    def test_row_formula(self) -> None:
        plan, local_cache, remote_caches = make_with_caches(
            remote_block=16, local_block=64, strategy="direct", blocks=5
        )
        source = only(plan)
        local_planes = planes_of(local_cache.regions)
        remote_planes = planes_of(remote_caches[0].regions)
        element = 4
        for plane_index in (0, 3):
            for block in (0, 4):
                for head, token_unit in ((0, 0), (5, 3)):
                    local_unit = head * 4 + token_unit
                    row = (plane_index * 5 + block) * source.local_units_per_block + local_unit
                    plane = local_planes[plane_index]
                    expected = (
                        plane.base_address + block * plane.block_stride + (head * 64 + token_unit * 16) * 8 * element
                    )
                    assert int(source.local_grid[row, 0]) == expected
                remote_plane = remote_planes[plane_index]
                row = (plane_index * 5 + block) * source.remote_units_per_block + 6
                expected = remote_plane.base_address + block * remote_plane.block_stride + 6 * 16 * 8 * element
                assert int(source.remote_grid[row, 0]) == expected
        assert source.local_grid.dtype == np.uint64
        assert (source.local_grid[:, 1] == source.unit_bytes).all() and (source.local_grid[:, 2] == 0).all()

    def test_indices_skip_units_beyond_the_tokens(self) -> None:
        source = only(make(remote_block=64, local_block=16, blocks=4))
        local_rows, remote_rows = source.indices([2], [3, 1], 20)
        assert len(local_rows) == len(remote_rows) == 4 * 8 * 2  # planes x heads x 2 token units of 16
        assert source.rows_for(20) == len(local_rows)
        assert local_rows.dtype == np.int64 and remote_rows.dtype == np.int64
        # every remote row is in remote block 2, every local row in local blocks 3 or 1
        assert set(((remote_rows // source.remote_units_per_block) % 4).tolist()) == {2}
        assert set(((local_rows // source.local_units_per_block) % 4).tolist()) == {1, 3}
        # the last remote block covers only the existing local blocks: token units 0 and 1 of it
        assert set((remote_rows % source.remote_units_per_block % 4).tolist()) == {0, 1}

    def test_indices_partial_last_local_block(self) -> None:
        source = only(make(remote_block=16, local_block=64, blocks=4, strategy="staged"))
        local_rows, _ = source.indices([0, 3], [2], 20)
        assert len(local_rows) == 4 * 2  # planes x 2 remote blocks, one row each
        assert sorted(((local_rows // source.local_units_per_block) % 4).tolist()) == [2] * 8

    def test_zero_tokens(self) -> None:
        source = only(make())
        local_rows, remote_rows = source.indices([], [], 0)
        assert local_rows.shape == remote_rows.shape == (0,)

    @pytest.mark.parametrize(
        ("remote", "local", "tokens", "message"),
        [
            ([0], [0, 1], 20, "remote_block_ids: 20 tokens in blocks of 16 tokens need 2 block ids, got 1"),
            ([0, 1], [0], 20, "local_block_ids: 20 tokens in blocks of 16 tokens need 2 block ids, got 1"),
            ([0, -1], [0, 1], 20, "remote_block_ids: block id -1 is negative"),
            ([0, 8], [0, 1], 20, "remote_block_ids: block id 8 is out of range for a cache of 8 blocks"),
            ([0, 1], [9, 1], 20, "local_block_ids: block id 9 is out of range"),
            ([0, 1], [1, 1], 20, "local_block_ids: block ids repeat"),
            ([0.0, 1.0], [0, 1], 20, "remote_block_ids must hold integers"),
            ([[0, 1]], [0, 1], 20, "remote_block_ids must be a flat list"),
            ([0, 1], [0, 1], -1, "num_tokens must be a non-negative integer"),
        ],
    )
    def test_indices_validation(self, remote, local, tokens, message) -> None:
        with pytest.raises(ValueError, match=message):
            only(make()).indices(remote, local, tokens)

    def test_remote_block_ids_may_repeat(self) -> None:
        local_rows, _ = only(make()).indices([3, 3], [0, 1], 20)
        assert len(local_rows) == 8

    def test_descriptor_stats(self) -> None:
        plan = make(remote_tp=2, blocks=4)
        stats = plan.descriptor_stats(40)
        assert [(s.remote_rank, s.rows, s.bytes) for s in stats] == [
            (0, 4 * 3, 4 * 3 * 4 * 16 * 8 * 4),
            (1, 4 * 3, 4 * 3 * 4 * 16 * 8 * 4),
        ]
        assert stats[0].local_grid_rows == 4 * 4 and stats[0].remote_grid_rows == 4 * 4


class TestBuildErrors:
    def setup_method(self) -> None:
        self.model = fingerprint(8)
        self.local = KVCacheLayout(self.model, 1, 0, 16)
        self.local_cache = build_cache(self.local, 4, False, 0, 0)
        self.remote = [KVCacheLayout(self.model, 2, r, 16) for r in range(2)]
        self.remote_caches = [build_cache(layout, 4, False, 0, 0) for layout in self.remote]

    def build(self, layouts=None, regions=None, local_regions=None) -> PeerPlan:
        layouts = layouts if layouts is not None else dict(enumerate(self.remote))
        regions = regions if regions is not None else {r: c.regions for r, c in enumerate(self.remote_caches)}
        local_regions = local_regions if local_regions is not None else self.local_cache.regions
        return PeerPlan.build(self.local, local_regions, layouts, regions)

    def test_missing_rank(self) -> None:
        with pytest.raises(TopologyError, match="decode rank 0 reads prefill rank 1, which is missing"):
            self.build(layouts={0: self.remote[0]}, regions={0: self.remote_caches[0].regions})

    def test_rank_mismatch(self) -> None:
        with pytest.raises(TopologyError, match="the layout given for prefill rank 1 says it is rank 0"):
            self.build(layouts={0: self.remote[0], 1: self.remote[0]})

    def test_tp_sizes_disagree(self) -> None:
        other = KVCacheLayout(self.model, 4, 1, 16)
        with pytest.raises(TopologyError, match=r"prefill ranks disagree on their TP size: \[2, 4\]"):
            self.build(layouts={0: self.remote[0], 1: other})

    def test_missing_plane(self) -> None:
        regions = {0: self.remote_caches[0].regions[:-1], 1: self.remote_caches[1].regions}
        with pytest.raises(TopologyError, match=r"planes differ: decode has 4 planes .*prefill rank 0 has 3 planes"):
            self.build(regions=regions)

    def test_block_length_disagrees_with_layout(self) -> None:
        wrong = build_cache(KVCacheLayout(self.model, 1, 0, 16), 4, False, 0, 0)  # 8 heads, not 4
        with pytest.raises(TopologyError, match="plane block is 4096 bytes, its layout says 2048"):
            self.build(regions={0: wrong.regions, 1: self.remote_caches[1].regions})

    def test_incompatible_remote(self) -> None:
        other = fingerprint(8, dtype="bfloat16")
        layouts = {r: KVCacheLayout(other, 2, r, 16) for r in range(2)}
        with pytest.raises(TopologyError, match="dtype differs"):
            self.build(layouts=layouts)


class TestPlaneViewsAndPostprocess:
    def test_plane_views_order_and_split(self) -> None:
        layout = KVCacheLayout(fingerprint(2, 4), 1, 0, 4)
        together = build_cache(layout, 3, True, 0, 0)
        apart = build_cache(layout, 3, False, 0, 0)
        for cache in (together, apart):
            views = plane_views(cache.tensors, cache.regions)
            planes = planes_of(cache.regions)
            assert len(views) == len(planes) == 4
            for view, plane in zip(views, planes, strict=True):
                assert view.shape == (3, 2, 4, 4)
                assert view.data_ptr() == plane.base_address
                assert view.stride(0) * view.element_size() == plane.block_stride
        # reversed region order gives the same planes_of order
        views = plane_views(apart.tensors[::-1], apart.regions[::-1])
        assert [v.data_ptr() for v in views] == [p.base_address for p in planes_of(apart.regions)]

    def test_plane_views_flat_kv_region(self) -> None:
        layout = KVCacheLayout(fingerprint(2, 4), 1, 0, 4)
        cache = build_cache(layout, 3, True, 0, 0)
        flat = [t.view(3, -1) for t in cache.tensors]
        views = plane_views(flat, cache.regions)
        assert views[1].shape == (3, 32) and views[1].data_ptr() == planes_of(cache.regions)[1].base_address

    def test_plane_views_refuses_other_memory(self) -> None:
        layout = KVCacheLayout(fingerprint(2, 4), 1, 0, 4)
        cache = build_cache(layout, 3, False, 0, 0)
        with pytest.raises(ValueError, match="not the region's memory"):
            plane_views([t.clone() for t in cache.tensors], cache.regions)

    def test_postprocess_validation(self) -> None:
        model = fingerprint(8)
        local = KVCacheLayout(model, 1, 0, 64, "NHD")
        cache = build_cache(local, 4, False, 0, LOCAL_SENTINEL[4])
        remote = KVCacheLayout(model, 1, 0, 16)
        remote_cache = build_cache(remote, 16, False, 0, 0)
        plan = PeerPlan.build(local, cache.regions, {0: remote}, {0: remote_cache.regions}, strategy="staged")
        post = plan.postprocess
        assert post is not None
        planes = plane_views(cache.tensors, cache.regions)
        with pytest.raises(ValueError, match="expected 4 local planes, got 3"):
            post.apply(planes[:3], [0], 10)
        with pytest.raises(ValueError, match="local_block_ids: 70 tokens in blocks of 64 tokens need 2"):
            post.apply(planes, [0], 70)
        with pytest.raises(ValueError, match="expected 4 blocks"):
            post.apply([p[:2] for p in planes], [0], 10)
        post.apply(planes, torch.tensor([2, 0]), 70)  # tensors are accepted
        post.apply(planes, [], 0)  # nothing to do

    def test_postprocess_plane_range(self) -> None:
        model = fingerprint(4)
        local = KVCacheLayout(model, 1, 0, 8, "NHD")
        remote = KVCacheLayout(model, 1, 0, 8, "HND")
        cache = build_cache(local, 3, True, 0, 0)
        for tensor in cache.tensors:
            tensor.copy_(torch.arange(tensor.numel(), dtype=tensor.dtype).view(tensor.shape))
        plan = PeerPlan.build(local, cache.regions, {0: remote}, {0: build_cache(remote, 3, False, 0, 0).regions})
        assert plan.postprocess is not None
        planes = plane_views(cache.tensors, cache.regions)
        before = [plane.clone() for plane in planes]
        plan.postprocess.apply(planes, [1], 8, planes=range(1, 3))
        for index, (plane, old) in enumerate(zip(planes, before, strict=True)):
            assert torch.equal(plane[0], old[0]) and torch.equal(plane[2], old[2])
            assert torch.equal(plane[1], old[1]) == (index not in (1, 2))


#: Plans of every kind a read takes (TP either way, block sizes direct and staged, layouts), by name.
GEOMETRIES = {
    "same": {},
    "tp2-to-1": {"remote_tp": 2},
    "tp1-to-2": {"local_tp": 2, "rank": 1},
    "block16-to-64-direct": {"local_block": 64, "strategy": "direct"},
    "block16-to-64-staged": {"local_block": 64, "strategy": "staged"},
    "block32-to-16-nhd": {"remote_block": 32, "local_layout": "NHD"},
    "hnd-to-nhd": {"local_layout": "NHD", "remote_layout": "HND", "local_block": 32},
    "nhd-tp2-to-1": {"remote_layout": "NHD", "local_layout": "NHD", "remote_tp": 2},
}


@pytest.mark.parametrize("kwargs", list(GEOMETRIES.values()), ids=list(GEOMETRIES))
def test_addresses_are_the_grid_rows_indices_lists(kwargs: dict) -> None:
    """What the reads in place use: each source's addresses, computed from the block ids, equal its grids at the rows
    ``indices`` lists, for a request of a partial last block."""
    plan = make(blocks=16, **kwargs)
    rng = np.random.default_rng(5)
    tokens = 70
    for source in plan.sources:
        remote_ids = rng.choice(16, -(-tokens // source.remote_block_size), replace=False)
        local_ids = rng.choice(16, -(-tokens // source.local_block_size), replace=False)
        local_rows, remote_rows = source.indices(remote_ids, local_ids, tokens)
        local, remote = source.addresses(remote_ids, local_ids, tokens)
        assert local.dtype == remote.dtype == np.uint64
        assert np.array_equal(local, source.local_grid[local_rows, 0])
        assert np.array_equal(remote, source.remote_grid[remote_rows, 0])
    first = plan.sources[0]
    remote_ids = [16] * -(-tokens // first.remote_block_size)
    with pytest.raises(ValueError, match="block id 16 is out of range"):
        first.addresses(remote_ids, list(range(-(-tokens // first.local_block_size))), tokens)


@pytest.mark.parametrize("kwargs", list(GEOMETRIES.values()), ids=list(GEOMETRIES))
def test_a_prefill_finds_the_rows_a_decode_plan_reads_from_the_shape_alone(kwargs: dict) -> None:
    """Read checks: a prefill rank, given only a source plan's heads and unit shape, computes from its own layout
    and regions the very remote addresses the decode's plan reads, in the plan's order."""
    plan, _, caches = make_with_caches(blocks=16, **kwargs)
    rng = np.random.default_rng(11)
    tokens = 70
    for source in plan.sources:
        remote = caches[source.remote_rank]
        own = OwnRows(
            remote.layout,
            remote.regions,
            first_global_head=source.first_global_head,
            num_heads=source.num_heads,
            unit=source.unit,
        )
        assert own.unit_bytes == source.unit_bytes
        remote_ids = rng.choice(16, -(-tokens // source.remote_block_size), replace=False)
        local_ids = rng.choice(16, -(-tokens // source.local_block_size), replace=False)
        _, expected = source.addresses(remote_ids, local_ids, tokens)
        assert np.array_equal(own.addresses(remote_ids, tokens), expected)


def test_a_prefill_refuses_a_unit_shape_that_does_not_fit_its_blocks() -> None:
    """Shapes a decode might send that name heads the rank does not hold, units that do not tile its blocks or
    another head size: each a TopologyError, before any address is computed."""
    plan, _, caches = make_with_caches(remote_tp=2, blocks=4)
    source = plan.sources[1]
    remote = caches[source.remote_rank]
    unit = source.unit

    def own(first: int, heads: int, shape: UnitShape) -> OwnRows:
        return OwnRows(remote.layout, remote.regions, first_global_head=first, num_heads=heads, unit=shape)

    own(source.first_global_head, source.num_heads, unit)
    with pytest.raises(TopologyError, match="not all the rank's"):
        own(0, source.num_heads, unit)  # rank 1 holds heads 4..7
    with pytest.raises(TopologyError, match="do not tile"):
        own(source.first_global_head, source.num_heads, UnitShape(3, unit.tokens, unit.head_size))
    with pytest.raises(TopologyError, match="head size"):
        own(source.first_global_head, source.num_heads, UnitShape(unit.heads, unit.tokens, unit.head_size * 2))
    with pytest.raises(TopologyError, match="positive integer"):
        own(source.first_global_head, 0, unit)
    with pytest.raises(ValueError, match="out of range"):
        own(source.first_global_head, source.num_heads, unit).addresses([4], 16)
