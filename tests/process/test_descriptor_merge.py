"""Rows a plan posts that are adjacent on both sides reach UCX as one descriptor: NIXL merges them when the transfer
is made (``make_prepped_xfer``), and the plan lists a request's rows in memory order (plane, token, head), so a pull
of consecutive blocks posts a few large reads, not one per block.

Real NIXL (two agents of this process, over loopback), asked for its own count through its per-transfer telemetry
(``descCount``). The rows are the plan's (:meth:`SourcePlan.indices` over its prepared grids), the expected count
an oracle over their addresses (a new descriptor wherever a row does not continue the previous one on both sides),
and the bytes the reads moved are compared with what the byte-level stand-in of ``topology_sim`` (``memmove`` per
row) wrote there first.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import numpy as np
import pytest
import torch
from nixl._api import nixl_agent, nixl_agent_config
from topology_sim import LOCAL_SENTINEL, RankCache, build_cache, fingerprint, simulate_reads

from pd_transfer.spec import KVCacheLayout
from pd_transfer.topology import PeerPlan

LAYERS = 32  # 64 planes (K and V apart on both sides)
REQUEST_BLOCKS = 256  # 64 x 256 = 16,384 rows of 4 KiB (8 heads x 16 tokens x 8 x float32): 64 MiB
CACHE_BLOCKS = 260
BLOCK = 16
POLL_BOUND_S = 60.0


@pytest.fixture
def agents() -> Iterator[tuple[nixl_agent, nixl_agent]]:
    config = nixl_agent_config(backends=["UCX"], capture_telemetry=True)
    yield nixl_agent("merge-decode", config), nixl_agent("merge-prefill", config)


def caches(remote_tp: int) -> tuple[PeerPlan, RankCache, dict[int, RankCache]]:
    """Decode rank 0 of TP 1 and a prefill engine of ``remote_tp`` ranks, HND, 16-token blocks; random prefill bytes."""
    model = fingerprint(8, 8, layers=LAYERS)
    local_layout = KVCacheLayout(model, 1, 0, BLOCK, "HND")
    local = build_cache(local_layout, CACHE_BLOCKS, False, 0, LOCAL_SENTINEL[4])
    layouts, remote = {}, {}
    generator = torch.Generator().manual_seed(3)
    for rank in range(remote_tp):
        layouts[rank] = KVCacheLayout(model, remote_tp, rank, BLOCK, "HND")
        remote[rank] = build_cache(layouts[rank], CACHE_BLOCKS, False, 0, 0)
        for buffer in remote[rank].buffers:
            buffer.copy_(torch.randint(0, 2**31 - 1, buffer.shape, generator=generator, dtype=torch.int32))
    plan = PeerPlan.build(
        local_layout, local.regions, layouts, {r: c.regions for r, c in remote.items()}, strategy="direct"
    )
    return plan, local, remote


def runs(local: np.ndarray, remote: np.ndarray, length: int) -> int:
    """The descriptors rows at these addresses make once those adjacent on both sides are merged."""
    continues = (local[1:] == local[:-1] + length) & (remote[1:] == remote[:-1] + length)
    return int(len(local) - np.count_nonzero(continues))


def read(decode: nixl_agent, local_list: object, remote_list: object, rows: tuple[np.ndarray, np.ndarray]) -> int:
    """Post one READ of ``rows`` (local, remote), wait for it, return NIXL's descriptor count of it."""
    handle = decode.make_prepped_xfer("READ", local_list, rows[0], remote_list, rows[1])
    try:
        state = decode.transfer(handle)
        deadline = time.monotonic() + POLL_BOUND_S
        while state == "PROC" and time.monotonic() < deadline:
            state = decode.check_xfer_state(handle)
        assert state == "DONE", f"the READ ended {state}"
        return int(decode.get_xfer_telemetry(handle).descCount)
    finally:
        decode.release_xfer_handle(handle)


def pull(
    agents: tuple[nixl_agent, nixl_agent], remote_tp: int, remote_ids: Sequence[int], local_ids: Sequence[int]
) -> list[tuple[int, int, int]]:
    """Read a request of ``REQUEST_BLOCKS`` blocks as the plan lists it, one READ per prefill rank; check every byte
    against the stand-in; return (rows, NIXL's descriptors, the oracle's) per READ."""
    decode, prefill = agents
    plan, local, remote = caches(remote_tp)
    tokens = len(remote_ids) * BLOCK
    simulate_reads(plan, remote, local, remote_ids, local_ids, tokens)  # the plan's addresses are local's
    expected_bytes = [buffer.clone() for buffer in local.buffers]
    for buffer in local.buffers:
        buffer.fill_(LOCAL_SENTINEL[4])
    decode.register_memory(local.buffers)
    prefill.register_memory([buffer for cache in remote.values() for buffer in cache.buffers])
    decode.add_remote_agent(prefill.get_agent_metadata())
    counts = []
    for source, rows in zip(plan.sources, plan.indices(remote_ids, local_ids, tokens), strict=True):
        local_list = decode.prep_xfer_dlist("", source.local_grid, "DRAM")
        remote_list = decode.prep_xfer_dlist("merge-prefill", source.remote_grid, "DRAM")
        posted = read(decode, local_list, remote_list, rows)
        expected = runs(source.local_grid[rows[0], 0], source.remote_grid[rows[1], 0], source.unit_bytes)
        counts.append((len(rows[0]), posted, expected))
    for got, want in zip(local.buffers, expected_bytes, strict=True):
        assert torch.equal(got, want), "NIXL's reads left other bytes than the stand-in's"
    print(f"\n(rows, NIXL's descriptors, oracle's) per READ: {counts}")
    return counts


def test_a_pull_of_consecutive_blocks_posts_one_descriptor_per_plane(agents: tuple[nixl_agent, nixl_agent]) -> None:
    remote_ids = list(range(REQUEST_BLOCKS))
    local_ids = list(range(3, 3 + REQUEST_BLOCKS))  # consecutive on both sides, at other places
    [(rows, posted, expected)] = pull(agents, 1, remote_ids, local_ids)
    assert (rows, posted, expected) == (16_384, 2 * LAYERS, 2 * LAYERS)


def test_rows_adjacent_on_one_side_only_stay_apart(agents: tuple[nixl_agent, nixl_agent]) -> None:
    order = np.random.default_rng(5).permutation(REQUEST_BLOCKS)
    remote_ids = list(range(REQUEST_BLOCKS))  # consecutive here, scattered on the decode
    counts = pull(agents, 1, remote_ids, [int(i) for i in order])
    [(rows, posted, expected)] = counts
    assert rows == 16_384 and posted == expected and expected > rows * 0.9


def test_a_rank_holding_half_the_heads_merges_where_both_sides_continue(
    agents: tuple[nixl_agent, nixl_agent],
) -> None:
    """Decode TP 1 from prefill TP 2: a prefill block (4 heads) is half a decode block, so consecutive blocks continue
    on the prefill but not on the decode: one descriptor per row, as the oracle says."""
    counts = pull(agents, 2, list(range(REQUEST_BLOCKS)), list(range(REQUEST_BLOCKS)))
    assert len(counts) == 2
    for rows, posted, expected in counts:
        assert posted == expected == rows == 16_384
