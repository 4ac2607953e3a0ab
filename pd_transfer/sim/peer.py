"""A prefill engine in its own OS process, driven over a pipe: for benchmarks, tests and the demo.

The child allocates one cache per TP rank, fills it with a deterministic pattern (``fill_pattern``,
which the parent can recompute to check what it received), registers each rank with its own NIXL
agent, serves the side channel, and answers commands until told to stop or until its parent dies.
"""

from __future__ import annotations

import ctypes
import multiprocessing.connection
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
import torch

from pd_transfer.connector.cache import KVCache
from pd_transfer.settings import Settings, apply_process_defaults, read_settings, set_process_environment
from pd_transfer.sim.child import ChildProcess, commands
from pd_transfer.spec import KVCacheLayout

if TYPE_CHECKING:  # imported by the child itself, after it entered its namespace
    from pd_transfer.connector.prefill.rank import PrefillRank

_READY_TIMEOUT_S = 120.0
_REPLY_TIMEOUT_S = 120.0
_CLONE_NEWNET = 0x40000000  # <sched.h> and <sys/mount.h> constants for _enter_netns
_CLONE_NEWNS = 0x00020000
_MS_REC = 0x4000
_MS_SLAVE = 1 << 19
_MNT_DETACH = 2


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
    host: str = "127.0.0.1"  # the side channel's address (inside ``netns`` when that is set)
    netns: str = ""  # a named network namespace (``ip netns``) the child enters before anything opens a socket
    ucx_net_devices: str = ""  # the child's UCX_NET_DEVICES ("": the parent's, else lo)
    device: str = "cpu"  # where the caches are ("cuda", "cuda:1", ...)
    shareable: bool = False  # host caches in shareable memory (offered to same-host decodes through IPC)
    # the transports the child's ranks offer (``PrefillOptions.transport``; "nixl": no same-host offer)
    transport: str = "auto"
    # the child also runs :func:`_busy_engine`, as a serving engine's Python loop keeps the GIL busy
    busy_engine: bool = False
    # the child's settings (None: read from its environment, inherited from the parent, at its start: its edge)
    settings: Settings | None = None

    def caches(self, device: str | None = None, *, huge_pages: bool = False) -> list[KVCache]:
        """The caches the child holds, recomputed in this process (on ``device``, default the spec's; host caches in
        huge pages with ``huge_pages``: the child's own, as its settings say; a copy to check reads against needs
        none)."""
        out = []
        for layout in self.layouts:
            cache = KVCache.allocate(
                layout,
                self.num_blocks,
                kv_split=self.kv_split,
                device=device or self.device,
                shareable=self.shareable,
                huge_pages=huge_pages,
            )
            fill_pattern(cache, self.seed)
            out.append(cache)
        return out


def _busy_engine(stop: threading.Event) -> None:
    """Pure-Python work without a pause until ``stop``: it holds the GIL but for the interpreter's switch interval
    (5 ms), as vLLM's engine loop does when it spins (docs/vllm.md, "Engine spinning"), so this process's other Python
    threads (side channel, progress poller) run only when they win the GIL from it."""
    while not stop.is_set():
        sum(range(2000))


def _enter_netns(name: str) -> None:
    """Move this process (its only thread, before it opens sockets) into the network namespace ``name``, and show
    it that namespace's /sys (UCX finds network devices in /sys/class/net), as ``ip netns exec`` does: a mount
    namespace of its own, /sys mounted again."""
    libc = ctypes.CDLL(None, use_errno=True)

    def check(result: int, what: str) -> None:
        if result != 0:
            raise OSError(ctypes.get_errno(), f"entering network namespace {name}: {what} failed")

    with open(f"/var/run/netns/{name}", "rb") as handle:
        check(libc.setns(handle.fileno(), _CLONE_NEWNET), "setns")
    check(libc.unshare(_CLONE_NEWNS), "unshare of the mount namespace")
    check(libc.mount(b"none", b"/", None, _MS_REC | _MS_SLAVE, None), "making / a slave mount")
    check(libc.umount2(b"/sys", _MNT_DETACH), "unmounting /sys")
    check(libc.mount(name.encode(), b"/sys", b"sysfs", 0, None), "mounting /sys")


def _child(conn: multiprocessing.connection.Connection, spec_bytes: bytes) -> None:
    spec = msgspec.msgpack.decode(spec_bytes, type=PrefillSpec)
    if spec.netns:
        _enter_netns(spec.netns)
    if spec.ucx_net_devices:
        set_process_environment({"UCX_NET_DEVICES": spec.ucx_net_devices})
    settings = apply_process_defaults(  # this child's edge
        spec.settings or read_settings(), net_devices="lo", vram=spec.device.startswith("cuda")
    )
    from pd_transfer.connector.options import PrefillOptions
    from pd_transfer.connector.prefill.rank import PrefillRank, serve_engine

    ranks = [
        PrefillRank(
            spec.engine_id,
            cache,
            PrefillOptions(settings=settings, transport=spec.transport, secret=spec.secret, listen_host=spec.host),
        )
        for cache in spec.caches(huge_pages=settings.own_huge_pages)
    ]
    server = serve_engine(
        spec.engine_id, [rank.rank_metadata for rank in ranks], host=spec.host, port=spec.port, secret=spec.secret
    )
    stop_engine = threading.Event()
    if spec.busy_engine:
        threading.Thread(target=_busy_engine, args=(stop_engine,), name="busy-engine", daemon=True).start()
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
            elif command == "hold":  # hold blocks for readers, as a finished request does (its lease)
                request_id, block_ids = args
                conn.send(("held", [rank.hold(request_id, list(block_ids)) is None for rank in ranks]))
            elif command == "compute":  # a request computed layer by layer (its KV is the cache's pattern), then held
                request_id, block_ids, layer_seconds = args
                conn.send(("computed", _compute(ranks, request_id, list(block_ids), float(layer_seconds))))
            elif command == "release":
                (request_id,) = args
                conn.send(("released", [rank.release(request_id, read_possible=False) is not None for rank in ranks]))
            elif command == "notifications":
                conn.send(("notifications", [rank.agent.notifications_received for rank in ranks]))
            elif command == "cpu_seconds":  # this process's CPU time so far, every thread, user and system
                conn.send(("cpu_seconds", time.process_time()))
            else:
                conn.send(("error", f"unknown command {command!r}"))
    finally:
        stop_engine.set()
        server.stop()
        for rank in ranks:
            rank.close()


def _compute(ranks: list[PrefillRank], request_id: str, block_ids: list[int], layer_seconds: float) -> float:
    """Stand in for an engine computing ``request_id`` into ``block_ids``: each layer takes ``layer_seconds`` (slept:
    the cache already holds the pattern a read is checked against), then is written on every rank; then the request
    is held. Returns the seconds it took."""
    started = time.perf_counter()
    for rank in ranks:
        rank.computing(request_id, block_ids)
    for layer in range(1, ranks[0].streams.num_layers + 1):
        time.sleep(layer_seconds)  # the layer's compute: the workload this stands in for
        for rank in ranks:
            rank.layers_written(request_id, layer)
    for rank in ranks:
        rank.hold(request_id, block_ids)
    return time.perf_counter() - started


class PrefillProcess(ChildProcess):
    """Handle on a prefill engine child process; use as a context manager."""

    def __init__(self, spec: PrefillSpec) -> None:
        self.spec = spec
        super().__init__(_child, msgspec.msgpack.encode(spec), what="prefill process", ready_timeout_s=_READY_TIMEOUT_S)
        kind, port = self.ready
        assert kind == "ready", self.ready
        self.host = spec.host
        self.port: int = port

    def request(self, *command: object, timeout_s: float = _REPLY_TIMEOUT_S) -> tuple:
        self.send(*command)
        return self.receive(timeout_s)

    def idle_cpu_percent(self, seconds: float) -> float:
        return float(self.request("idle_cpu", seconds, timeout_s=seconds + 30)[1])

    def cpu_seconds(self) -> float:
        """The prefill process's CPU time so far (seconds, all its threads, user and system)."""
        return float(self.request("cpu_seconds")[1])

    def wait_released(self, request_id: str, timeout_s: float) -> list[int | None]:
        return list(self.request("wait_released", request_id, timeout_s, timeout_s=timeout_s + 30)[1])
