"""The operators' tools the deployment tests run: :func:`deploy_tool` finds those ``scripts/setup-deploy`` installs
(``vllm-router`` in ``.venv-deploy``, ``prometheus``, ``promtool`` and ``kubernetes-validate`` on PATH),
:func:`missing_tool` says why a test skips without one, :func:`start_prometheus` runs a real Prometheus on a config,
:func:`promtool_check` checks one. Shared by tests/process (configs checked offline) and tests/vllm (Prometheus
scraping real servers)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from pd_transfer.cluster.http_client import free_port
from pd_transfer.cluster.processes import ManagedProcess, wait_ready

REPO = Path(__file__).resolve().parents[2]


def deploy_tool(name: str) -> str | None:
    """The path of ``name`` from ``.venv-deploy/bin`` (``scripts/setup-deploy``) or PATH; None if neither has it."""
    local = REPO / ".venv-deploy" / "bin" / name
    return str(local) if os.access(local, os.X_OK) else shutil.which(name)


def missing_tool(name: str) -> str | None:
    """A one-line skip reason when ``name`` is not installed, else None."""
    return None if deploy_tool(name) else f"{name} is not installed (scripts/setup-deploy installs it)"


def promtool_check(path: Path) -> str:
    """``promtool check config path``: its output; fails the test when promtool refuses the file."""
    result = subprocess.run(
        [str(deploy_tool("promtool")), "check", "config", str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout + result.stderr


class PrometheusProcess(ManagedProcess):
    """Prometheus as a managed process: ready when ``/-/ready`` answers 200."""

    @property
    def health_url(self) -> str:
        return f"{self.url}/-/ready"


def start_prometheus(config: Path, work: Path, port: int | None = None, timeout_s: float = 60.0) -> PrometheusProcess:
    """A real Prometheus on ``config``: its storage in ``work/tsdb``, its log ``work/prometheus.log``, on local
    ``port`` (default: a free one); started and ready (at most ``timeout_s``). The caller stops it (``stop_all``)."""
    port = port or free_port()
    command = [str(deploy_tool("prometheus")), f"--config.file={config}", f"--storage.tsdb.path={work / 'tsdb'}"]
    command.append(f"--web.listen-address=127.0.0.1:{port}")
    prometheus = PrometheusProcess("prometheus", command, {}, work / "prometheus.log", f"http://127.0.0.1:{port}")
    prometheus.start()
    wait_ready([prometheus], timeout_s)
    return prometheus
