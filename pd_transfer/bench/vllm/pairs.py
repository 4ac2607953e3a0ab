"""The servers of ``pd-transfer bench vllm``: a prefill and a decode per connector, a plain reference server, all
with the same flags (``--dtype float32 --max-model-len 2048 --seed 0 --block-size 128``, 1 GiB of KV cache,
prefill bound to core 0 and decode to core 1); only ``--kv-transfer-config`` (and, for NixlConnector, its
side-channel variables) differ. Started and stopped with the cluster toolkit (``pd_transfer.cluster``)."""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from pd_transfer.affinity import allowed_cpu
from pd_transfer.cluster.http_client import free_port
from pd_transfer.cluster.launch import ServerSpec, server_process, vllm_command, vllm_env
from pd_transfer.cluster.processes import ManagedProcess, group_members, proc_stat_fields, wait_ready
from pd_transfer.settings import child_environment

__all__ = [
    "BLOCK_SIZE",
    "CONNECTORS",
    "CONNECTOR_NAMES",
    "CPU_INDEX",
    "NIXL_KV_TRANSFER_CONFIG",
    "Pair",
    "bench_server",
    "idle_cpu_percent",
    "nixl_server",
    "start_servers",
]

CONNECTORS = ("nixl", "ours")
CONNECTOR_NAMES = {"nixl": "NixlConnector", "ours": "PdTransferConnector"}
BLOCK_SIZE = 128
CPU_INDEX = {"prefill": 0, "decode": 1, "reference": 0}  # the n-th CPU this process may use (allowed_cpu)
MEMORY_PER_SERVER_GIB = 3.0  # a tiny-model server takes ~2.5 GB here; vLLM refuses to start short of memory
PROGRESS_EVERY_S = 30.0
NIXL_KV_TRANSFER_CONFIG: Mapping[str, str] = {
    "kv_connector": "NixlConnector",
    "kv_role": "kv_both",
    "kv_buffer_device": "cpu",
}


def _two_ports() -> tuple[int, int]:
    """Two different free ports (``free_port`` draws at random: two calls can give the same one)."""
    first = free_port()
    while (second := free_port()) == first:
        pass
    return first, second


def _spec(role: str, model: str, max_model_len: int, kvcache_gib: float, extra_args: Sequence[str]) -> ServerSpec:
    port, side_channel_port = _two_ports()
    return ServerSpec(
        role="both" if role == "reference" else role,  # type: ignore[arg-type]
        model=model,
        port=port,
        side_channel_port=side_channel_port,
        block_size=BLOCK_SIZE,
        cpu_bind=allowed_cpu(CPU_INDEX[role]),
        kvcache_gib=kvcache_gib,
        dtype="float32",
        max_model_len=max_model_len,
        seed=0,
        extra_args=tuple(extra_args),
    )


def nixl_server(name: str, spec: ServerSpec, log_path: Path, *, python: str) -> ManagedProcess:
    """A server with vLLM's NixlConnector: its config on the command line, its side channel in the environment."""
    command = vllm_command(spec, python, connector=False)
    command += ["--kv-transfer-config", json.dumps(NIXL_KV_TRANSFER_CONFIG, separators=(",", ":"))]
    env = vllm_env(spec, child_environment())
    env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = spec.side_channel_host
    env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(spec.side_channel_port)
    return ManagedProcess(name, command, env, log_path, spec.url)


def bench_server(
    connector: str | None,
    role: str,
    model: str,
    python: str,
    log_dir: Path,
    *,
    max_model_len: int = 2048,
    kvcache_gib: float = 1.0,
    extra_args: Sequence[str] = (),
) -> ManagedProcess:
    """One vLLM server (not started) of ``role`` (prefill, decode, reference): ``connector`` ``"nixl"``, ``"ours"``
    or None (plain); same flags for all (``max_model_len`` tokens, ``kvcache_gib`` GiB of KV cache, then
    ``extra_args``), fresh free ports, its log in ``log_dir/NAME.log``."""
    spec = _spec(role, model, max_model_len, kvcache_gib, extra_args)
    name = role if connector is None else f"{connector}-{role}"
    log_path = log_dir / f"{name}.log"
    if connector == "nixl":
        return nixl_server(name, spec, log_path, python=python)
    return server_process(name, spec, log_path, python=python, connector=connector == "ours")


def _available_gib() -> float:
    """``MemAvailable`` of /proc/meminfo in GiB (infinite where unknown)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return math.inf


def start_servers(
    servers: Sequence[ManagedProcess],
    timeout_s: float,
    log: Callable[[str], None],
    gib_each: float = MEMORY_PER_SERVER_GIB,
) -> None:
    """Start ``servers`` at once and wait (at most ``timeout_s`` s) until all answer /health, noting every 30 s which
    are still starting. Raises ``RuntimeError`` when less than ``gib_each`` GiB per server is available,
    ``StartupFailed`` on a server that exits or is late (the caller stops them)."""
    need = gib_each * len(servers)
    if (have := _available_gib()) < need:
        raise RuntimeError(f"{have:.1f} GiB available, {len(servers)} vLLM servers need about {need:.0f} GiB")
    for server in servers:
        server.start()
    last_note = time.monotonic()

    def note(waited: float, waiting: Sequence[ManagedProcess]) -> None:
        nonlocal last_note
        if waiting and time.monotonic() - last_note >= PROGRESS_EVERY_S:
            last_note = time.monotonic()
            log(f"  waiting for {', '.join(s.name for s in waiting)} ({waited:.0f} s)")

    wait_ready(servers, timeout_s, on_poll=note)


@dataclass
class Pair:
    """A prefill and a decode server of one connector (``"nixl"`` or ``"ours"``), and the request's settings."""

    connector: str
    prefill: ManagedProcess
    decode: ManagedProcess
    model: str
    max_tokens: int


def _group_cpu_seconds(process: ManagedProcess) -> float:
    """CPU seconds (user + system) used so far by the live processes of ``process``'s group."""
    total = 0
    for pid in group_members(process.pid):
        fields = proc_stat_fields(pid)
        if len(fields) > 12:
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of proc(5))
    return total / os.sysconf("SC_CLK_TCK")


def idle_cpu_percent(servers: Sequence[ManagedProcess], seconds: float = 5.0) -> dict[str, float]:
    """Each server's CPU use (% of one core) over ``seconds`` with no request in flight (a measurement window,
    not a wait for anything)."""
    before = {s.name: _group_cpu_seconds(s) for s in servers}
    time.sleep(seconds)
    return {s.name: round(100 * (_group_cpu_seconds(s) - before[s.name]) / seconds, 1) for s in servers}
