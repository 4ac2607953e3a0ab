"""Read lanes: a large read split over several NIXL agents and threads, against a real peer process."""

from __future__ import annotations

import itertools
import os
import signal

import numpy as np
import pytest
import torch
from agent_peer import BLOCK_WORDS, NUM_BLOCKS, NUM_REGIONS, pattern
from test_transfer_agent import Peer, connect

from pd_transfer.settings import DEFAULTS
from pd_transfer.spec import region_from_tensor
from pd_transfer.transfer import PeerDisconnected, TransferAgent
from pd_transfer.transfer.lanes import split_rows

BLOCK_BYTES = BLOCK_WORDS * 4
ALL_ROWS = NUM_REGIONS * NUM_BLOCKS


def _agent(split_min_bytes: int = 16 * BLOCK_BYTES) -> tuple[TransferAgent, list[torch.Tensor]]:
    tensors = [torch.full((NUM_BLOCKS, BLOCK_WORDS), -1, dtype=torch.int32) for _ in range(NUM_REGIONS)]
    agent = TransferAgent("lanes-decode", read_lanes=2, split_min_bytes=split_min_bytes, settings=DEFAULTS)
    agent.register_regions([region_from_tensor(t, layer=r, kinds=("k",)) for r, t in enumerate(tensors)])
    return agent, tensors


def _expected_after(local_rows: np.ndarray, remote_rows: np.ndarray) -> list[torch.Tensor]:
    """What the local regions hold after reading ``remote_rows`` into ``local_rows`` (row = region * blocks +
    block), starting from -1 everywhere."""
    out = [torch.full((NUM_BLOCKS, BLOCK_WORDS), -1, dtype=torch.int32) for _ in range(NUM_REGIONS)]
    for local_row, remote_row in zip(local_rows.tolist(), remote_rows.tolist(), strict=True):
        source = pattern(remote_row // NUM_BLOCKS)[remote_row % NUM_BLOCKS]
        out[local_row // NUM_BLOCKS][local_row % NUM_BLOCKS] = source
    return out


def test_split_rows_cuts_byte_balanced_consecutive_runs() -> None:
    assert split_rows(np.full(10, 4), 2) == [slice(0, 5), slice(5, 10)]
    assert split_rows(np.array([100, 1, 1, 1, 1]), 2) == [slice(0, 1), slice(1, 5)]  # one big row: its own part
    assert split_rows(np.array([7]), 4) == [slice(0, 1)]
    parts = split_rows(np.arange(1, 1001), 3)
    assert parts[0].start == 0 and parts[-1].stop == 1000
    assert all(a.stop == b.start for a, b in itertools.pairwise(parts))
    sums = [int(np.arange(1, 1001)[p].sum()) for p in parts]
    assert max(sums) - min(sums) < 1000 * 2


@pytest.mark.parametrize("connect_first", [False, True], ids=["lanes-then-peer", "peer-then-lanes (replayed)"])
def test_large_read_is_split_exact_and_notified_after_every_part(connect_first: bool) -> None:
    agent, tensors = _agent()
    peer = Peer()
    try:
        if connect_first:  # the peer and its lists exist before the lanes: mirrored when they come up
            _, remote, local_list = connect(agent, peer, tensors)
            assert agent.lanes_ready.wait(60) and agent.lanes is not None
        else:
            assert agent.lanes_ready.wait(60) and agent.lanes is not None
            _, remote, local_list = connect(agent, peer, tensors)
        lanes = agent.lanes
        rng = np.random.default_rng(3)
        local_rows = rng.permutation(ALL_ROWS)[:200].astype(np.int32)
        remote_rows = rng.permutation(ALL_ROWS)[:200].astype(np.int32)
        stats = agent.read(local_list, local_rows, remote, remote_rows, notification=b"all-landed")
        assert stats.bytes == 200 * BLOCK_BYTES and stats.descriptors == 200
        assert lanes.split_reads == 1
        for got, want in zip(tensors, _expected_after(local_rows, remote_rows), strict=True):
            assert torch.equal(got, want)
        assert peer.notification() == (agent.name, b"all-landed")  # from the owner, not a lane
        # a small read goes whole
        agent.read(local_list, local_rows[:2], remote, remote_rows[:2])
        assert lanes.split_reads == 1
    finally:
        agent.close()
        peer.close()


def test_split_read_from_a_dead_peer_raises_disconnected() -> None:
    agent, tensors = _agent()
    peer = Peer()
    try:
        assert agent.lanes_ready.wait(60) and agent.lanes is not None
        _, remote, local_list = connect(agent, peer, tensors)
        rows = np.arange(ALL_ROWS, dtype=np.int32)
        agent.read(local_list, rows, remote, rows)
        os.kill(peer.process.pid, signal.SIGKILL)
        peer.process.join(10)
        with pytest.raises(PeerDisconnected):
            agent.read(local_list, rows, remote, rows, timeout_s=10.0)
    finally:
        agent.close()
        peer.close()
