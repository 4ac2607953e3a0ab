"""The Grafana dashboard (docker/grafana/pd-transfer.json) as Prometheus queries: every panel's PromQL run against
a real Prometheus's HTTP API until each panel returns data, bounded. Grafana does not run in the tests: these are
the queries it would run. Used by tests/vllm/test_dashboard.py (a ``pd-transfer up`` cluster) and docker/test-cluster
(the compose cluster's own Prometheus container). Standard library only (docker/test-cluster runs on a bare
Python); docker/ is no package, so callers put this folder on ``sys.path``.
"""

from __future__ import annotations

import json
import re
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DASHBOARD = Path(__file__).resolve().parent / "grafana" / "pd-transfer.json"
#: Metrics that appear only once their event happened (a stored block refused on load): a panel showing them
#: beside others may lack that one series.
EVENT_ONLY = {"vllm:pd_transfer_offload_rejected_blocks_total"}
#: Panels whose value must be above zero after traffic (not only present).
POSITIVE = {
    "Request rate by endpoint and status",
    "Hop latency (p50, p99): prefill, decode",
    "Time to first token at the proxy (p50, p99, streams)",
    "Time to first token per vLLM server (p50, p99)",
    "KV bytes pulled per second",
    "Pull seconds (p50, p99)",
    "Leases by outcome (prefill)",
    "Offload bytes stored and loaded per second",
    "Offload bytes held",
}
#: The row of the offload tiers' panels: data only where servers run with an offload tier.
OFFLOAD_ROW = "Offload tiers (vllm:pd_transfer_offload_*)"


class QueryRefused(RuntimeError):
    """Prometheus refused a query (bad PromQL) or did not answer."""


def panels(path: Path = DASHBOARD) -> list[dict[str, Any]]:
    """The dashboard's panels (rows left out), as Grafana's JSON has them; each gets a ``row`` key: the title of
    the row above it ("" before the first row)."""
    found: list[dict[str, Any]] = []
    row = ""
    for panel in json.loads(path.read_text())["panels"]:
        if panel["type"] == "row":
            row = str(panel["title"])
        else:
            found.append({**panel, "row": row})
    return found


def query(prometheus: str, expr: str, timeout_s: float = 10.0) -> list[dict[str, Any]]:
    """The result vector of an instant query (now) at ``prometheus`` (``http://host:port``)."""
    url = f"{prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            answer = json.loads(response.read())
    except (OSError, ValueError) as error:
        raise QueryRefused(f"{expr}: {error}") from error
    if answer.get("status") != "success":
        raise QueryRefused(f"{expr}: {str(answer)[:300]}")
    return list(answer["data"]["result"])


def panel_value(prometheus: str, panel: dict[str, Any], window: str) -> float:
    """The largest finite value of the panel's series now, ``$__rate_interval`` read as ``window`` (e.g. "10m");
    NaN when there is none (no series, or a quantile of no observations)."""
    values = [
        float(series["value"][1])
        for target in panel["targets"]
        for series in query(prometheus, target["expr"].replace("$__rate_interval", window))
    ]
    finite = [v for v in values if v == v and abs(v) != float("inf")]
    return max(finite) if finite else float("nan")


def metric_names(chosen: list[dict[str, Any]]) -> set[str]:
    """The metric names the panels' queries select (``name{...}``)."""
    return {name for p in chosen for t in p["targets"] for name in re.findall(r"[a-z_:]+(?=\{)", t["expr"])}


def seen_metrics(prometheus: str, timeout_s: float = 10.0) -> set[str]:
    """Every metric name Prometheus holds."""
    with urllib.request.urlopen(f"{prometheus}/api/v1/label/__name__/values", timeout=timeout_s) as response:
        return set(json.loads(response.read())["data"])


@dataclass
class Coverage:
    """Each panel's largest value seen (NaN: no data), the panels lacking data (or a positive value where
    ``POSITIVE`` wants one), and the metrics the panels name that Prometheus never saw."""

    best: dict[str, float] = field(default_factory=dict)
    lacking: list[str] = field(default_factory=list)
    unseen: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def lines(self) -> list[str]:
        return [f"{value:14.6g}  {title}" for title, value in self.best.items()]


def await_data(prometheus: str, chosen: list[dict[str, Any]], window: str, timeout_s: float) -> Coverage:
    """Queries every panel of ``chosen`` once a second until each has data (and the ``POSITIVE`` ones a value
    above zero) and every metric they name was seen, or ``timeout_s`` s passed; returns what was found then."""
    started = time.monotonic()
    coverage = Coverage()
    names = metric_names(chosen)
    while True:
        for panel in chosen:
            value = panel_value(prometheus, panel, window)
            previous = coverage.best.get(panel["title"], float("nan"))
            coverage.best[panel["title"]] = value if previous != previous else max(previous, value)
        coverage.lacking = [t for t, v in coverage.best.items() if v != v or (t in POSITIVE and v <= 0)]
        coverage.unseen = sorted(names - seen_metrics(prometheus) - EVENT_ONLY)
        coverage.seconds = time.monotonic() - started
        if not (coverage.lacking or coverage.unseen) or coverage.seconds >= timeout_s:
            return coverage
        time.sleep(1.0)
