"""A bare TransferAgent in a child process for the transfer-layer tests (imported by the spawned child)."""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import queue
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

NUM_BLOCKS = 64
BLOCK_WORDS = 1024  # 4 KiB blocks
NUM_REGIONS = 4


def pattern(region: int) -> torch.Tensor:
    """What region ``region`` of the child holds: (NUM_BLOCKS, BLOCK_WORDS) int32, unique words."""
    start = region * NUM_BLOCKS * BLOCK_WORDS
    return torch.arange(start, start + NUM_BLOCKS * BLOCK_WORDS, dtype=torch.int32).view(NUM_BLOCKS, BLOCK_WORDS)


def serve(
    conn: multiprocessing.connection.Connection,
    env: dict[str, str],
    serves_reads: bool = False,
    python_progress: bool = True,
) -> None:
    """Register the NUM_REGIONS patterns, send (metadata, region bases), then answer "notification" with the next
    one received (None after 10 s) until "stop". ``serves_reads``: the agent's like a prefill rank's;
    ``python_progress=False`` stops its poller first, so that only NIXL's own thread (if any) progresses it."""
    os.environ.update(env)
    from pd_transfer.settings import Settings, apply_process_defaults
    from pd_transfer.spec import region_from_tensor
    from pd_transfer.transfer.agent import TransferAgent

    settings = apply_process_defaults(Settings.from_environ(os.environ))  # this child's edge: what ``env`` says

    received: queue.Queue[tuple[str, bytes]] = queue.Queue()
    tensors = [pattern(r).clone() for r in range(NUM_REGIONS)]
    agent = TransferAgent(
        "peer-prefill",
        on_notification=lambda peer, msg: received.put((peer, msg)),
        serves_reads=serves_reads,
        settings=settings,
    )
    regions = [region_from_tensor(t, layer=r, kinds=("k",)) for r, t in enumerate(tensors)]
    agent.register_regions(regions)
    if not python_progress:
        agent.stop_polling()
    conn.send((agent.metadata, [r.base_address for r in regions]))
    while conn.poll(60):
        command = conn.recv()
        if command == "notification":
            try:
                conn.send(received.get(timeout=10))
            except queue.Empty:
                conn.send(None)
        elif command == "listening_ports":
            conn.send(listening_tcp_ports())
        elif command == "stop":
            break
    agent.close()


def listening_tcp_ports() -> set[int]:
    """The TCP ports this process listens on (IPv4 and IPv6): its socket descriptors matched by inode against
    ``/proc/self/net/tcp{,6}`` rows in state LISTEN (0A)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    ports = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with open(table) as rows:
            next(rows)
            for row in rows:
                fields = row.split()
                if fields[3] == "0A" and fields[9] in inodes:
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


@contextmanager
def served_peer(
    env: dict[str, str], *, serves_reads: bool = False, python_progress: bool = True, start_timeout_s: float = 60.0
) -> Iterator[tuple[multiprocessing.connection.Connection, bytes, list[int]]]:
    """:func:`serve` in a spawned child: yields (its pipe, its agent metadata, its region bases); stops it after."""
    context = multiprocessing.get_context("spawn")
    conn, child = context.Pipe()
    process = context.Process(target=serve, args=(child, env, serves_reads, python_progress), daemon=True)
    process.start()
    try:
        assert conn.poll(start_timeout_s), f"peer did not start (exit code {process.exitcode})"
        metadata, bases = conn.recv()
        yield conn, metadata, bases
        assert process.is_alive()
    finally:
        if process.is_alive():
            conn.send("stop")
            process.join(10)
        if process.is_alive():
            process.kill()
            process.join(5)


def read_whole_regions(
    agent: Any, metadata: bytes, bases: list[int], order: list[int], *, notification: bytes = b"", timeout_s: float
) -> list[torch.Tensor]:
    """With ``agent`` (a TransferAgent), read the peer's region ``order[i]`` whole (one descriptor each) into
    fresh tensor i; returns the tensors, after checking the bytes the read reports."""
    tensors = [torch.full((NUM_BLOCKS, BLOCK_WORDS), -1, dtype=torch.int32) for _ in range(NUM_REGIONS)]
    from pd_transfer.spec import region_from_tensor

    agent.register_regions([region_from_tensor(t, layer=r, kinds=("k",)) for r, t in enumerate(tensors)])
    peer = agent.add_peer(metadata)
    nbytes = NUM_BLOCKS * BLOCK_WORDS * 4
    remote = agent.prepare_remote(peer, np.array([[base, nbytes, 0] for base in bases], dtype=np.uint64))
    local = agent.prepare_local(np.array([[t.data_ptr(), nbytes, 0] for t in tensors], dtype=np.uint64))
    every = np.arange(NUM_REGIONS)
    stats = agent.read(local, every, remote, np.array(order), notification=notification, timeout_s=timeout_s)
    assert stats.bytes == NUM_REGIONS * nbytes
    return tensors


def large_pattern(words: int) -> torch.Tensor:
    """``words`` unique int32 words (0, 1, 2, ...): what :func:`serve_large` registers."""
    return torch.arange(words, dtype=torch.int32)


def serve_large(conn: multiprocessing.connection.Connection, words: int) -> None:
    """Register ``words`` int32 words written on the allocator's small pages (so the agent's huge-page collapse
    has work to do while the parent reads), send (metadata, base address), then answer "collapse" with the
    collapse results and the bytes of the span now in huge pages once the collapse ended."""
    from pd_transfer.settings import DEFAULTS
    from pd_transfer.transfer.agent import TransferAgent
    from pd_transfer.transfer.huge_pages import resident_huge_page_bytes

    memory = large_pattern(words)
    span = (memory.data_ptr(), memory.data_ptr() + memory.numel() * 4)
    agent = TransferAgent("peer-large", settings=DEFAULTS)
    agent.register_spans([span], huge_pages=True)
    conn.send((agent.metadata, span[0]))
    while conn.poll(120):
        command = conn.recv()
        if command == "collapse":
            ended = agent.huge_pages.wait(60.0)
            conn.send((ended, list(agent.huge_pages.results), resident_huge_page_bytes([span])))
        elif command == "stop":
            break
    agent.close()
