"""A prefill engine in its own OS process, driven over a pipe: for benchmarks, tests and the demo.

The child allocates one cache per TP rank, fills it with a deterministic pattern (``fill_pattern``,
which the parent can recompute to check what it received), registers each rank with its own NIXL
agent, serves the side channel, and answers commands until told to stop or until its parent dies.
"""

from __future__ import annotations

import multiprocessing.connection
import os
import time
from dataclasses import dataclass

import msgspec
import torch

from pd_transfer.connector.cache import KVCache
from pd_transfer.sim.child import ChildProcess, commands
from pd_transfer.spec import KVCacheLayout

_READY_TIMEOUT_S = 120.0
_REPLY_TIMEOUT_S = 120.0


def fill_pattern(cache: KVCache, seed: int) -> None:
    """Give every 4-byte word a value unique within (seed, heads held): an arange from an offset.

    Ranks holding the same heads (replicated KV heads, MLA) get identical contents, as in a real engine.
    """
    offset = (seed * 64 + cache.layout.first_global_head) * (1 << 26)
    for tensor in cache.tensors:
        words = tensor.view(torch.int32)
        count = words.numel()
        words.copy_(torch.arange(offset, offset + count, dtype=torch.int64).to(torch.int32).view_as(words))
        offset += count


@dataclass(frozen=True)
class PrefillSpec:
    engine_id: str
    layouts: list[KVCacheLayout]  # one per rank served by the process
    num_blocks: int
    kv_split: bool = True
    seed: int = 1
    secret: str | None = None
    port: int = 0  # the side channel's port (0: any free one; a fixed one to restart an engine where it was)

    def caches(self) -> list[KVCache]:
        """The caches the child holds, recomputed in this process."""
        out = []
        for layout in self.layouts:
            cache = KVCache.allocate(layout, self.num_blocks, kv_split=self.kv_split)
            fill_pattern(cache, self.seed)
            out.append(cache)
        return out


def _child(conn: multiprocessing.connection.Connection, spec_bytes: bytes) -> None:
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    from pd_transfer.connector.prefill import PrefillRank, serve_engine

    spec = msgspec.msgpack.decode(spec_bytes, type=PrefillSpec)
    ranks = [PrefillRank(spec.engine_id, cache) for cache in spec.caches()]
    server = serve_engine(spec.engine_id, [rank.rank_metadata for rank in ranks], port=spec.port, secret=spec.secret)
    conn.send(("ready", server.port))
    try:
        for command, *args in commands(conn):
            if command == "idle_cpu":
                (seconds,) = args
                cpu_start, wall_start = time.process_time(), time.perf_counter()
                time.sleep(seconds)  # measuring idle: sleeping is the workload
                cpu = time.process_time() - cpu_start
                conn.send(("idle_cpu", 100.0 * cpu / (time.perf_counter() - wall_start)))
            elif command == "wait_released":
                request_id, timeout_s = args
                reports = [rank.wait_released(request_id, timeout_s) for rank in ranks]
                conn.send(("released", [None if r is None else len(r) for r in reports]))
            elif command == "notifications":
                conn.send(("notifications", [rank.agent.notifications_received for rank in ranks]))
            else:
                conn.send(("error", f"unknown command {command!r}"))
    finally:
        server.stop()
        for rank in ranks:
            rank.close()


class PrefillProcess(ChildProcess):
    """Handle on a prefill engine child process; use as a context manager."""

    def __init__(self, spec: PrefillSpec) -> None:
        self.spec = spec
        super().__init__(_child, msgspec.msgpack.encode(spec), what="prefill process", ready_timeout_s=_READY_TIMEOUT_S)
        kind, port = self.ready
        assert kind == "ready", self.ready
        self.host = "127.0.0.1"
        self.port: int = port

    def request(self, *command: object, timeout_s: float = _REPLY_TIMEOUT_S) -> tuple:
        self.send(*command)
        return self.receive(timeout_s)

    def idle_cpu_percent(self, seconds: float) -> float:
        return float(self.request("idle_cpu", seconds, timeout_s=seconds + 30)[1])

    def wait_released(self, request_id: str, timeout_s: float) -> list[int | None]:
        return list(self.request("wait_released", request_id, timeout_s, timeout_s=timeout_s + 30)[1])
