"""Reads over UCX's tcp transport with pd-transfer's segment sizes (:mod:`pd_transfer.transfer.tcp`): a child
process owns the memory, this process reads it with NIXL; either side may be a peer left at UCX's own defaults."""

from __future__ import annotations

import multiprocessing
import os

import numpy as np
import pytest
import torch
from agent_peer import BLOCK_WORDS, NUM_BLOCKS, NUM_REGIONS, pattern, serve

from pd_transfer.spec import region_from_tensor
from pd_transfer.transfer import TransferAgent
from pd_transfer.transfer.tcp import TCP_SEGMENT_ENV, apply_tcp_defaults
from pd_transfer.transfer.transports import ucx_transports

pytestmark = pytest.mark.timeout(180)

UCX_DEFAULTS = {"UCX_TCP_TX_SEG_SIZE": "8k", "UCX_TCP_RX_SEG_SIZE": "64k"}  # UCX's own
_START_TIMEOUT_S = 60.0


def test_segment_sizes_are_left_alone_when_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PD_TRANSFER_TCP_SEGMENTS", "0")
    monkeypatch.setenv("UCX_TCP_TX_SEG_SIZE", "")
    assert apply_tcp_defaults() == {}
    assert os.environ["UCX_TCP_TX_SEG_SIZE"] == ""


def test_segment_sizes_are_set_unless_the_user_set_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PD_TRANSFER_TCP_SEGMENTS", raising=False)  # on by default
    monkeypatch.setenv("UCX_TCP_TX_SEG_SIZE", "")  # blank counts as unset (and is restored after the test)
    monkeypatch.setenv("UCX_TCP_RX_SEG_SIZE", "128k")
    in_force = apply_tcp_defaults()
    assert in_force == {"UCX_TCP_TX_SEG_SIZE": TCP_SEGMENT_ENV["UCX_TCP_TX_SEG_SIZE"], "UCX_TCP_RX_SEG_SIZE": "128k"}
    assert os.environ["UCX_TCP_TX_SEG_SIZE"] == TCP_SEGMENT_ENV["UCX_TCP_TX_SEG_SIZE"]


@pytest.mark.parametrize("at_ucx_defaults", ["target", "reader"])
def test_whole_regions_read_over_tcp_beside_a_peer_at_ucx_defaults(
    monkeypatch: pytest.MonkeyPatch, at_ucx_defaults: str
) -> None:
    # a read of whole regions goes as one descriptor of NUM_BLOCKS blocks each: many segments of either size
    if "tcp" not in ucx_transports({"UCX_TLS": "tcp,self"}):
        pytest.skip("UCX has no tcp transport here")
    monkeypatch.setenv("UCX_TLS", "tcp,self")
    ours, theirs = TCP_SEGMENT_ENV, UCX_DEFAULTS
    reader_env, target_env = (ours, theirs) if at_ucx_defaults == "target" else (theirs, ours)
    for key, value in reader_env.items():
        monkeypatch.setenv(key, value)
    context = multiprocessing.get_context("spawn")
    conn, child = context.Pipe()
    process = context.Process(target=serve, args=(child, {"UCX_TLS": "tcp,self", **target_env}), daemon=True)
    process.start()
    tensors = [torch.full((NUM_BLOCKS, BLOCK_WORDS), -1, dtype=torch.int32) for _ in range(NUM_REGIONS)]
    agent = TransferAgent("test-decode-tcp-segments")
    try:
        assert conn.poll(_START_TIMEOUT_S), f"peer did not start (exit code {process.exitcode})"
        metadata, bases = conn.recv()
        agent.register_regions([region_from_tensor(t, layer=r, kinds=("k",)) for r, t in enumerate(tensors)])
        peer = agent.add_peer(metadata)
        rows = NUM_BLOCKS * BLOCK_WORDS * 4
        remote = agent.prepare_remote(peer, np.array([[base, rows, 0] for base in bases], dtype=np.uint64))
        local = agent.prepare_local(np.array([[t.data_ptr(), rows, 0] for t in tensors], dtype=np.uint64))
        every = np.arange(NUM_REGIONS)
        stats = agent.read(local, every, remote, every[::-1].copy(), notification=b"whole", timeout_s=60)
        assert stats.bytes == NUM_REGIONS * rows
        for region, tensor in enumerate(tensors):
            assert torch.equal(tensor, pattern(NUM_REGIONS - 1 - region)), region
        conn.send("notification")
        assert conn.poll(30) and conn.recv() == (agent.name, b"whole")
        assert process.is_alive()
    finally:
        agent.close()
        if process.is_alive():
            conn.send("stop")
            process.join(10)
        if process.is_alive():
            process.kill()
            process.join(5)
