"""The transfer layer alone: a child process owns the memory, this process reads it with NIXL."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from agent_peer import BLOCK_WORDS, NUM_BLOCKS, NUM_REGIONS, pattern, serve

from pd_transfer.settings import DEFAULTS
from pd_transfer.spec import region_from_tensor
from pd_transfer.transfer import DescriptorList, PeerDisconnected, TransferAgent, TransferError, TransferTimeout
from pd_transfer.transfer.probe import peer_gone

BLOCK_BYTES = BLOCK_WORDS * 4


class Peer:
    def __init__(self, env: dict[str, str] | None = None) -> None:
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(target=serve, args=(child, env or {}), daemon=True)
        self.process.start()
        started = time.monotonic()
        assert self.conn.poll(60), (
            f"peer did not start in 60 s (alive: {self.process.is_alive()}, exit code {self.process.exitcode},"
            f" load average {os.getloadavg()[0]:.1f}; its start costs ~3.5 s of CPU, mostly importing nixl/torch)"
        )
        self.start_seconds = time.monotonic() - started
        self.metadata, self.bases = self.conn.recv()

    def notification(self) -> tuple[str, bytes] | None:
        self.conn.send("notification")
        assert self.conn.poll(30)
        return self.conn.recv()

    def close(self) -> None:
        if self.process.is_alive():
            self.conn.send("stop")
            self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)


def grid(bases: list[int]) -> np.ndarray:
    """One row per (region, block): row = region * NUM_BLOCKS + block."""
    rows = [(base + block * BLOCK_BYTES, BLOCK_BYTES, 0) for base in bases for block in range(NUM_BLOCKS)]
    return np.array(rows, dtype=np.uint64)


def connect(
    agent: TransferAgent, peer: Peer, tensors: list[torch.Tensor]
) -> tuple[str, DescriptorList, DescriptorList]:
    """Add the peer and prepare both sides' block grids: (peer name, remote list, local list)."""
    name = agent.add_peer(peer.metadata)
    return (
        name,
        agent.prepare_remote(name, grid(peer.bases)),
        agent.prepare_local(grid([t.data_ptr() for t in tensors])),
    )


@pytest.fixture
def local() -> tuple[TransferAgent, list[torch.Tensor]]:
    tensors = [torch.full((NUM_BLOCKS, BLOCK_WORDS), -1, dtype=torch.int32) for _ in range(NUM_REGIONS)]
    agent = TransferAgent("test-decode", settings=DEFAULTS)
    agent.register_regions([region_from_tensor(t, layer=r, kinds=("k",)) for r, t in enumerate(tensors)])
    yield agent, tensors
    agent.close()


def test_scattered_read_is_exact_and_notifies(local: tuple[TransferAgent, list[torch.Tensor]]) -> None:
    agent, tensors = local
    peer = Peer()
    try:
        name, remote, local_list = connect(agent, peer, tensors)
        rng = np.random.default_rng(3)
        remote_blocks = rng.choice(NUM_BLOCKS, 20, replace=False)
        local_blocks = rng.choice(NUM_BLOCKS, 20, replace=False)
        remote_rows = np.concatenate([r * NUM_BLOCKS + remote_blocks for r in range(NUM_REGIONS)])
        local_rows = np.concatenate([r * NUM_BLOCKS + local_blocks for r in range(NUM_REGIONS)])
        stats = agent.read(local_list, local_rows, remote, remote_rows, notification=b"req-1 done", timeout_s=10)
        assert stats.bytes == 20 * NUM_REGIONS * BLOCK_BYTES
        for region, tensor in enumerate(tensors):
            expected = pattern(region)
            assert torch.equal(tensor[torch.from_numpy(local_blocks)], expected[torch.from_numpy(remote_blocks)])
            untouched = np.setdiff1d(np.arange(NUM_BLOCKS), local_blocks)
            assert bool((tensor[torch.from_numpy(untouched)] == -1).all())
        assert peer.notification() == (agent.name, b"req-1 done")
        # a second read on the same prepared lists (prepare once, post many)
        agent.read(local_list, local_rows[:1], remote, remote_rows[-1:], notification=b"req-2", timeout_s=10)
        assert peer.notification() == (agent.name, b"req-2")
        agent.notify(name, b"standalone")
        assert peer.notification() == (agent.name, b"standalone")
    finally:
        peer.close()


def test_read_from_dead_peer_raises_quickly(local: tuple[TransferAgent, list[torch.Tensor]]) -> None:
    agent, tensors = local
    peer = Peer()
    try:
        name, remote, local_list = connect(agent, peer, tensors)
        agent.read(local_list, np.arange(4), remote, np.arange(4), timeout_s=10)  # connection up
        peer.process.kill()
        peer.process.join(10)
        started = time.monotonic()
        with pytest.raises(TransferError) as failure:
            agent.read(local_list, np.arange(8), remote, np.arange(8), timeout_s=5)
        assert time.monotonic() - started < 5
        assert isinstance(failure.value, PeerDisconnected), failure.value
        with pytest.raises(TransferError):
            agent.notify(name, b"anyone?")
    finally:
        peer.close()


def test_liveness_probe_after_a_failed_read_tells_dead_from_alive(
    local: tuple[TransferAgent, list[torch.Tensor]],
) -> None:
    # A read that hits a peer killed moments ago may fail as nixlBackendError (UCX's I/O error) before UCX ran
    # the endpoint's error handler; the agent then probes the peer before naming the error. The probe itself:
    agent, tensors = local
    peer = Peer()
    try:
        _, remote, local_list = connect(agent, peer, tensors)
        agent.read(local_list, np.arange(4), remote, np.arange(4), timeout_s=10)
        started = time.monotonic()
        assert peer_gone(agent, local_list, remote, 5, 6) is None  # alive: the one-row read works
        assert torch.equal(tensors[0][5], pattern(0)[6])
        agent.read(local_list, np.arange(1), remote, np.arange(1), notification=b"after-probe", timeout_s=10)
        assert peer.notification() == (agent.name, b"after-probe")  # the probe itself notified nobody
        peer.process.kill()
        peer.process.join(10)
        gone = peer_gone(agent, local_list, remote, 5, 6)
        assert gone is not None and "isconnect" in gone, gone
        assert time.monotonic() - started < 5.0  # bounded (0.5 s per probe at most, plus the kill)
        assert agent.unreleased_transfers == 0
    finally:
        peer.close()


def test_read_against_frozen_tcp_peer_times_out(monkeypatch: pytest.MonkeyPatch) -> None:
    # with tcp, reads need the target's progress: a SIGSTOPped target never finishes them. Past its timeout the read
    # is drained (waited for until NIXL ends it, at most drain_s: a frozen peer on this host is not severed), then
    # abandoned, counted
    monkeypatch.setenv("UCX_TLS", "tcp")
    peer = Peer(env={"UCX_TLS": "tcp"})
    tensors = [torch.zeros((NUM_BLOCKS, BLOCK_WORDS), dtype=torch.int32) for _ in range(NUM_REGIONS)]
    agent = TransferAgent("test-decode-tcp", settings=replace(DEFAULTS, drain_s=1.0))
    try:
        agent.register_regions([region_from_tensor(t, layer=r, kinds=("k",)) for r, t in enumerate(tensors)])
        _, remote, local_list = connect(agent, peer, tensors)
        agent.read(local_list, np.arange(2), remote, np.arange(2), timeout_s=20)
        os.kill(peer.process.pid, signal.SIGSTOP)
        try:
            # kill() returns before the stop takes hold; a loaded machine ran the peer on long enough for the whole
            # read to finish (once, in a fresh clone's run): read only once every thread of it is stopped
            wait_stopped(peer.process.pid, timeout_s=10.0)
            started = time.monotonic()
            with pytest.raises(TransferTimeout):
                agent.read(
                    local_list,
                    np.arange(NUM_BLOCKS * NUM_REGIONS),
                    remote,
                    np.arange(NUM_BLOCKS * NUM_REGIONS),
                    timeout_s=0.5,
                )
            assert 1.5 <= time.monotonic() - started < 4.0  # its timeout, then its drain
            assert agent.abandoned_transfers == 1
        finally:
            os.kill(peer.process.pid, signal.SIGCONT)
    finally:
        agent.close()
        peer.close()


def wait_stopped(pid: int, timeout_s: float) -> None:
    """Returns once every thread of process ``pid`` is stopped (``T`` or ``t`` in ``/proc/PID/task/*/stat``); fails the
    test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        states = []
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:  # a thread that ended meanwhile
                continue
        if states and all(state in ("T", "t") for state in states):
            return
        if time.monotonic() > deadline:
            pytest.fail(f"process {pid} not stopped {timeout_s} s after SIGSTOP: thread states {states}")
        time.sleep(0.005)  # polling a condition, bounded by the deadline


def test_bad_descriptors_are_refused_with_a_clear_error(local: tuple[TransferAgent, list[torch.Tensor]]) -> None:
    agent, _ = local
    outside = np.array([[12345, 4096, 0]], dtype=np.uint64)
    with pytest.raises(TransferError, match="registered memory"):
        agent.prepare_local(outside)
    with pytest.raises(ValueError):
        agent.prepare_local(np.zeros((0, 3), dtype=np.uint64))
