"""The IPC path's copies on CPU tensors, in one process: a plan's rows located in the prefill's segments and ours,
copied by the row mover's torch fallback a group per segment pair (never a call per block), fixed up, and equal to
the prefill's KV bit for bit, across TP sizes, block sizes and layouts. (The segments here are the prefill cache's
own storages, as an opened handle would give them; tests/process opens them in another process, tests/gpu on a
GPU.)"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from engine_specs import kv_layout as kv_layout_of
from row_pulls import storage_pairs

from pd_transfer.connector.cache import KVCache
from pd_transfer.handshake.messages import RankIpc
from pd_transfer.rows import move_rows
from pd_transfer.rows.by_torch import FEW_RUNS
from pd_transfer.same_host.common import IpcUnavailable, pid_namespace
from pd_transfer.same_host.ipc_engine import IpcSource, locate, storages
from pd_transfer.same_host.opening import OwnerWatch
from pd_transfer.sim.peer import fill_pattern
from pd_transfer.sim.verify import received_correctly
from pd_transfer.spec import KVCacheLayout, ModelFingerprint
from pd_transfer.topology import PeerPlan, plane_views

FINGERPRINT = ModelFingerprint(model="ipc-llama", dtype="bfloat16", num_layers=3, total_num_kv_heads=4, head_size=16)
BLOCKS = 24


def layout(tp: int, rank: int, block_size: int, kv_layout: str = "HND") -> KVCacheLayout:
    return kv_layout_of(FINGERPRINT, block_size, tp, rank, kv_layout)


def copy_request(
    prefills: list[KVCache], decode: KVCache, remote_ids: list[int], local_ids: list[int], tokens: int
) -> list[tuple[int, int]]:
    """Plan, locate, copy and fix up one request the way the IPC path does; returns, per source, the torch calls
    made and the pairs of storages (prefill's, ours) the rows touch."""
    plan = PeerPlan.build(
        decode.layout,
        list(decode.regions),
        {cache.layout.tp_rank: cache.layout for cache in prefills},
        {cache.layout.tp_rank: list(cache.regions) for cache in prefills},
    )
    by_rank = {cache.layout.tp_rank: cache for cache in prefills}
    made = []
    for source in plan.sources:
        segments = storages(by_rank[source.remote_rank].tensors)
        opened = IpcSource.open(segments, [s.data_ptr() for s in segments], source, storages(decode.tensors))
        local_rows, remote_rows = source.indices(remote_ids, local_ids, tokens)
        copies = opened.copies(local_rows, remote_rows)
        made.append((move_rows(copies, torch.from_numpy, one_kernel=False), storage_pairs(copies)))
    if plan.postprocess is not None:
        plan.postprocess.apply(plane_views(decode.tensors, decode.regions), local_ids, tokens)
    return made


def prefill_caches(tp: int, block_size: int, kv_layout: str = "HND", *, kv_split: bool = True) -> list[KVCache]:
    caches = []
    for rank in range(tp):
        cache = KVCache.allocate(layout(tp, rank, block_size, kv_layout), BLOCKS, kv_split=kv_split)
        fill_pattern(cache, seed=5)
        caches.append(cache)
    return caches


@pytest.mark.parametrize(
    ("prefill", "decode"),
    [
        ((1, 16, "HND"), (1, 16, "HND")),
        ((1, 16, "HND"), (1, 32, "HND")),
        ((1, 32, "NHD"), (1, 16, "HND")),
        ((2, 16, "HND"), (1, 16, "NHD")),
        ((1, 16, "HND"), (2, 16, "HND")),
    ],
    ids=["same", "block-16-to-32", "block-32-NHD-to-16-HND", "tp2-to-tp1-NHD", "tp1-to-tp2"],
)
def test_a_request_copied_through_the_ipc_path_equals_the_prefill_s_kv(
    prefill: tuple[int, int, str], decode: tuple[int, int, str]
) -> None:
    tokens = 70
    prefills = prefill_caches(*prefill)
    rng = np.random.default_rng(3)
    for decode_rank in range(decode[0]):
        local = KVCache.allocate(layout(decode[0], decode_rank, decode[1], decode[2]), BLOCKS)
        remote_ids = rng.choice(BLOCKS, -(-tokens // prefill[1]), replace=False).tolist()
        local_ids = rng.choice(BLOCKS, -(-tokens // decode[1]), replace=False).tolist()
        made = copy_request(prefills, local, remote_ids, local_ids, tokens)
        # per pair of storages, a slice copy per run where they are few, else a gather and a scatter at most
        assert all(calls <= max(FEW_RUNS, 2) * pairs for calls, pairs in made), made
        assert received_correctly(local, local_ids, prefills, remote_ids, tokens)


def test_one_run_of_blocks_is_one_pair_of_storages_and_k_v_in_one_block_are_located() -> None:
    prefills = prefill_caches(1, 16, kv_split=False)
    local = KVCache.allocate(layout(1, 0, 16), BLOCKS, kv_split=False)
    remote_ids, local_ids = list(range(4, 9)), list(range(10, 15))
    ((calls, pairs),) = copy_request(prefills, local, remote_ids, local_ids, 80)
    assert pairs == 1 and calls <= 2
    assert received_correctly(local, local_ids, prefills, remote_ids, 80)


def test_a_row_outside_the_shared_memory_is_refused() -> None:
    segment, row = (0x10000, 4096), 256
    segments, offsets = locate(np.array([0x10000, 0x10F00], dtype=np.uint64), row, [segment[0]], [segment[1]])
    assert segments.tolist() == [0, 0] and offsets.tolist() == [0, 0xF00]
    with pytest.raises(IpcUnavailable, match="lies outside the shared memory"):
        locate(np.array([0x10F80], dtype=np.uint64), row, [segment[0]], [segment[1]])
    with pytest.raises(IpcUnavailable, match="lies outside the shared memory"):
        locate(np.array([0x0F000], dtype=np.uint64), row, [segment[0]], [segment[1]])


def test_the_owner_is_watched_only_in_its_own_pid_namespace() -> None:
    own = RankIpc(boot_id="b", pid=os.getpid(), pid_namespace=pid_namespace(), segments=[])
    watch = OwnerWatch(own)
    assert not watch.exited()  # this process runs
    watch.close()
    elsewhere = OwnerWatch(RankIpc(boot_id="b", pid=os.getpid(), pid_namespace=pid_namespace() + 1, segments=[]))
    assert not elsewhere.exited()  # there its pid may name another process: not watched, never "exited"
    elsewhere.close()
