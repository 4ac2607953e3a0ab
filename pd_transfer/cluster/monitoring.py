"""A Prometheus scrape config for a ``pd-transfer up`` cluster: the proxy (job ``pd-proxy``, ``pd_proxy_*``) and
every vLLM server (job ``vllm``, labels ``role`` = prefill | decode and ``server`` = prefill-0 ...; vLLM's own
``vllm:*`` metrics and ours, re-exported as ``vllm:pd_transfer_*``). The Grafana dashboard
``docker/grafana/pd-transfer.json`` queries these job and label names; ``docker/prometheus.yml`` is the same for
the compose cluster.

``pd-transfer up`` writes ``LOG_DIR/prometheus.yml`` once the cluster is ready; for another cluster state file::

    python -m pd_transfer.cluster.monitoring runs/up-.../cluster.json [--interval 5] [--output FILE]

The text is YAML written by hand (no YAML library needed): every string is a JSON string, which YAML reads as is.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

__all__ = ["ScrapeTarget", "cluster_targets", "main", "prometheus_config", "write_scrape_config"]

CONFIG_FILE = "prometheus.yml"
PROXY_JOB = "pd-proxy"
SERVER_JOB = "vllm"
SERVER_ROLES = ("prefill", "decode")
DEFAULT_INTERVAL_S = 5.0


@dataclass(frozen=True)
class ScrapeTarget:
    """One ``/metrics`` endpoint: its job, ``host:port`` and the labels Prometheus adds to its series."""

    job: str
    address: str
    labels: Mapping[str, str]


def cluster_targets(state: Mapping[str, Any]) -> list[ScrapeTarget]:
    """The targets of a cluster described as in ``cluster.json`` (``processes``: name, role, url): the proxy and
    every prefill and decode server, in that file's order; other processes (the demo's plain server) are left out.
    Raises ``ValueError`` on a process without a usable ``http://host:port`` URL."""
    targets = []
    for process in state.get("processes", []):
        role = str(process.get("role", ""))
        if role != "proxy" and role not in SERVER_ROLES:
            continue
        address = urlsplit(str(process.get("url", ""))).netloc
        if not address or ":" not in address:
            raise ValueError(f"process {str(process.get('name'))[:40]!r} has no http://host:port URL")
        job = PROXY_JOB if role == "proxy" else SERVER_JOB
        targets.append(ScrapeTarget(job, address, {"role": role, "server": str(process.get("name", role))}))
    return targets


def _seconds(value: float) -> str:
    """A Prometheus duration: whole seconds as ``5s``, else milliseconds (``500ms``)."""
    return f"{value:g}s" if float(value).is_integer() else f"{round(value * 1000)}ms"


def prometheus_config(
    targets: Sequence[ScrapeTarget], interval_s: float = DEFAULT_INTERVAL_S, comment: str = ""
) -> str:
    """Prometheus's configuration (YAML text) scraping ``targets`` every ``interval_s`` seconds (> 0), one scrape
    job per distinct job name in the order first seen; ``comment`` (lines) heads the file."""
    if not interval_s > 0:
        raise ValueError(f"the scrape interval must be positive, not {interval_s}")
    lines = [f"# {line}".rstrip() for line in comment.splitlines()]
    lines += ["global:", f"  scrape_interval: {_seconds(interval_s)}", f"  evaluation_interval: {_seconds(interval_s)}"]
    lines += ["scrape_configs:"]
    for job in dict.fromkeys(t.job for t in targets):
        lines += [f"  - job_name: {json.dumps(job)}", "    static_configs:"]
        for target in (t for t in targets if t.job == job):
            labels = ", ".join(f"{key}: {json.dumps(value)}" for key, value in target.labels.items())
            lines += [f"      - targets: [{json.dumps(target.address)}]", f"        labels: {{{labels}}}"]
    return "\n".join(lines) + "\n"


def write_scrape_config(log_dir: Path, interval_s: float = DEFAULT_INTERVAL_S) -> Path:
    """Writes ``log_dir/prometheus.yml`` for the cluster its ``cluster.json`` describes; returns its path."""
    state = json.loads((log_dir / "cluster.json").read_text())
    comment = (
        f"The pd-transfer up cluster of {log_dir} (written by pd-transfer up).\n"
        f"prometheus --config.file={log_dir / CONFIG_FILE} --storage.tsdb.path=DIR"
    )
    path = log_dir / CONFIG_FILE
    path.write_text(prometheus_config(cluster_targets(state), interval_s, comment))
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m pd_transfer.cluster.monitoring CLUSTER_JSON``: prints (or writes) the scrape config."""
    parser = argparse.ArgumentParser(description="A Prometheus scrape config for a pd-transfer up cluster.")
    parser.add_argument("state", type=Path, help="the cluster's cluster.json (in up's --log-dir)")
    parser.add_argument("--interval", type=float, default=DEFAULT_INTERVAL_S, metavar="S", help="scrape interval")
    parser.add_argument("--output", type=Path, default=None, metavar="FILE", help="write here instead of stdout")
    args = parser.parse_args(argv)
    try:
        text = prometheus_config(cluster_targets(json.loads(args.state.read_text())), args.interval)
    except (OSError, ValueError) as error:
        print(f"pd_transfer.cluster.monitoring: {args.state}: {error}", file=sys.stderr)
        return 2
    if args.output is None:
        sys.stdout.write(text)
    else:
        args.output.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
