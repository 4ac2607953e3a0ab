"""A running ``pd-transfer up`` cluster, for end-to-end tests of what sits in
front of or beside our servers (vLLM's router, Prometheus).

:func:`up_cluster` runs ``pd-transfer up`` (no demo: it serves until SIGINT) as a subprocess in its own session,
waits (bounded) until it says the cluster is ready, yields its ``cluster.json`` and stops it the way a user would
(SIGINT, then SIGKILL of every process group it recorded). The operators' tools: :mod:`deploy_tools`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_servers import DEFAULT_MODEL, EAGER, KV_CACHE_BYTES, free_base_port

REPO = Path(__file__).resolve().parents[2]
UP_TIMEOUT_S = float(os.environ.get("PD_TRANSFER_VLLM_STARTUP_S", "900"))
READY_LINE = "Ctrl-C stops the cluster."
STOP_TIMEOUT_S = 90.0


@dataclass
class UpCluster:
    """``pd-transfer up`` running: its process, its printed output and its ``cluster.json``."""

    process: subprocess.Popen[bytes]
    output: Path
    log_dir: Path
    state: dict[str, Any] = field(default_factory=dict)

    def text(self) -> str:
        return self.output.read_text(errors="replace")

    def load_state(self) -> dict[str, Any]:
        try:
            self.state = json.loads((self.log_dir / "cluster.json").read_text())
        except (OSError, ValueError):
            pass
        return self.state

    @property
    def proxy(self) -> str:
        return str(self.state["proxy"])

    @property
    def model(self) -> str:
        return str(self.state["model"])

    def urls(self, role: str) -> list[str]:
        """The URLs of the servers of ``role`` (``prefill``, ``decode``, ``proxy``), in order."""
        return [str(p["url"]) for p in self.state.get("processes", []) if p.get("role") == role]

    def logs(self, lines: int = 30) -> str:
        """The ends of every log of the cluster (for failure messages)."""
        return "\n".join(
            f"--- {path.name} ---\n" + "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
            for path in sorted(self.log_dir.glob("*.log"))
        )

    def stop(self) -> None:
        """SIGINT to ``up`` (it stops what it started), then SIGKILL to every process group it recorded."""
        pgids = [int(p["pgid"]) for p in self.load_state().get("processes", [])]
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
        for pgid in pgids:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@contextmanager
def up_cluster(work: Path, *flags: str, timeout_s: float = UP_TIMEOUT_S) -> Iterator[UpCluster]:
    """``pd-transfer up`` of the test model (one prefill, one decode unless ``flags`` say otherwise) on free ports,
    logs in ``work/logs``; yields once it printed that it is ready (at most ``timeout_s`` + 120 s), stops it after.
    SIGTERM to pytest meanwhile still stops it (``up`` lives in its own session)."""
    base = free_base_port()
    command = [sys.executable, "-m", "pd_transfer.cluster", "up", "--model", DEFAULT_MODEL]
    command += ["--kvcache-gib", str(KV_CACHE_BYTES / 2**30), "--base-port", str(base)]
    command += ["--proxy-port", str(base - 1), "--log-dir", str(work / "logs"), "--startup-timeout", str(timeout_s)]
    command += ["--eager"] if EAGER else []
    command += list(flags)
    previous = signal.signal(signal.SIGTERM, signal.getsignal(signal.SIGINT))
    output = work / "up.out"
    with open(output, "wb") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
    cluster = UpCluster(process, output, work / "logs")
    try:
        deadline = time.monotonic() + timeout_s + 120
        while READY_LINE not in cluster.text():
            assert process.poll() is None, f"up exited with {process.returncode}:\n{cluster.text()}\n{cluster.logs()}"
            assert time.monotonic() < deadline, f"up not ready in time:\n{cluster.text()}\n{cluster.logs()}"
            time.sleep(1.0)
        cluster.load_state()
        yield cluster
    finally:
        cluster.stop()
        signal.signal(signal.SIGTERM, previous)
