"""vLLM's own router (PyPI ``vllm-router``, a Rust binary) as a second front beside our proxy in ``pd-transfer
bench proxy``: in P/D mode (``--vllm-pd-disaggregation --kv-connector nixl``) over the same stand-in prefill and
decode, pinned to the proxy's core, so both fronts do the same two hops for the same client load.

The binary is found as ``--vllm-router PATH`` (passed as ``explicit`` by the command), else ``vllm-router`` on
PATH, else ``.venv-deploy/bin/vllm-router`` beside the interpreter's virtual environment (``scripts/setup-deploy``
puts it there). Without one the benchmark records why and measures our proxy alone.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pd_transfer.cluster.http_client import free_port, is_healthy

__all__ = ["RouterProcess", "find_router", "router_command", "start_router"]

START_TIMEOUT_S = 120.0  # the router reads every backend at start: slow on a loaded 2-core host
LOG_TAIL_CHARS = 2000


def find_router(explicit: str | None = None) -> str | None:
    """The ``vllm-router`` executable to run (see the module docstring), or None when there is none."""
    if explicit:
        return explicit
    on_path = shutil.which("vllm-router")
    if on_path:
        return on_path
    beside = Path(sys.prefix).parent / ".venv-deploy" / "bin" / "vllm-router"
    return str(beside) if os.access(beside, os.X_OK) else None


def router_command(
    binary: str, prefills: list[str], decodes: list[str], port: int, metrics_port: int, policy: str = "round_robin"
) -> list[str]:
    """vLLM's router in P/D mode over ``prefills`` and ``decodes`` (URLs), NixlConnector's ``kv_transfer_params``
    flow (what our servers speak), listening on 127.0.0.1:``port``, its Prometheus metrics on ``metrics_port``."""
    command = [binary, "--vllm-pd-disaggregation", "--kv-connector", "nixl", "--policy", policy]
    for url in prefills:
        command += ["--prefill", url]
    for url in decodes:
        command += ["--decode", url]
    return [*command, "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(metrics_port)]


class RouterProcess:
    """A started router: its URL, its process (pid for CPU accounting) and its log file (removed by ``stop``)."""

    def __init__(self, url: str, process: subprocess.Popen[bytes], log_path: Path) -> None:
        self.url = url
        self.process = process
        self.log_path = log_path

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:]
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s; the log file goes."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log_path.unlink(missing_ok=True)


def start_router(binary: str, prefill: str, decode: str, env: dict[str, str]) -> RouterProcess:
    """Starts the router over one prefill and one decode on free ports and waits (at most ``START_TIMEOUT_S``) for
    its ``/health``. Raises ``RuntimeError`` with its log's end when it exits or is not healthy in time."""
    port = free_port()
    handle, name = tempfile.mkstemp(prefix="vllm-router-", suffix=".log")
    os.close(handle)
    log_path = Path(name)
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            router_command(binary, [prefill], [decode], port, free_port()),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
        )
    router = RouterProcess(f"http://127.0.0.1:{port}", process, log_path)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not is_healthy(f"{router.url}/health"):
        if process.poll() is not None or time.monotonic() > deadline:
            tail = router.log_tail()
            router.stop()
            raise RuntimeError(f"vllm-router did not become healthy (exit {process.poll()}): {tail}")
        time.sleep(0.2)
    return router
