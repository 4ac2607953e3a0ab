"""The operators' view: Prometheus scrape configs and the Grafana dashboard, on real data.

Fast checks: the scrape config ``pd_transfer.cluster.monitoring`` renders for a ``pd-transfer up`` cluster and
``docker/prometheus.yml`` (the compose cluster's services and ports) pass ``promtool check config``; the dashboard
JSON is well formed. End to end (vLLM, the test model and Prometheus needed): a real ``pd-transfer up`` cluster with
an offload directory and a small host tier, a real Prometheus scraping it every second (its own storage directory,
a free port), traffic through our proxy (completions, streamed chats, a malformed body, a client that goes away
mid-stream) plus a prompt sent to the prefill then to the decode directly (the decode loads it from the shared
directory); then every panel's PromQL runs against Prometheus's HTTP API until each panel returns data (bounded).
Grafana itself does not run here: the panels' queries are what it would run.
"""

from __future__ import annotations

import json
import re
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from up_cluster import REPO, UP_TIMEOUT_S, UpCluster, missing_tool, promtool_check, start_prometheus, up_cluster
from vllm_servers import DEFAULT_MODEL, vllm_missing

from pd_transfer.cluster.http_client import get_text, metric_value, post_json, post_stream, wait_metric
from pd_transfer.cluster.monitoring import ScrapeTarget, cluster_targets, prometheus_config
from pd_transfer.cluster.processes import ManagedProcess, stop_all

sys.path.insert(0, str(REPO / "docker"))  # the panel queries, shared with docker/test-cluster (docker/ is no package)
from dashboard_panels import DASHBOARD, await_data, panels, query

COMPOSE_CONFIG = REPO / "docker" / "prometheus.yml"
RATE_WINDOW = "10m"  # what $__rate_interval becomes here: longer than the test, so its traffic stays in view
DATA_TIMEOUT_S = 120.0


# ---------------------------------------------------------------------------------------------- configs
STATE = {
    "proxy": "http://127.0.0.1:8000",
    "processes": [
        {"name": "prefill-0", "role": "prefill", "url": "http://127.0.0.1:8100"},
        {"name": "prefill-1", "role": "prefill", "url": "http://127.0.0.1:8101"},
        {"name": "decode-0", "role": "decode", "url": "http://127.0.0.1:8102"},
        {"name": "reference", "role": "reference", "url": "http://127.0.0.1:8103"},
        {"name": "proxy", "role": "proxy", "url": "http://127.0.0.1:8000"},
    ],
}


def test_scrape_config_of_an_up_cluster(tmp_path: Path) -> None:
    targets = cluster_targets(STATE)
    assert targets == [
        ScrapeTarget("vllm", "127.0.0.1:8100", {"role": "prefill", "server": "prefill-0"}),
        ScrapeTarget("vllm", "127.0.0.1:8101", {"role": "prefill", "server": "prefill-1"}),
        ScrapeTarget("vllm", "127.0.0.1:8102", {"role": "decode", "server": "decode-0"}),
        ScrapeTarget("pd-proxy", "127.0.0.1:8000", {"role": "proxy", "server": "proxy"}),
    ]  # the plain reference server of --demo is not part of the cluster
    text = prometheus_config(targets, 0.5, comment="a test")
    config = yaml.safe_load(text)
    assert config["global"]["scrape_interval"] == "500ms"
    jobs = {job["job_name"]: job["static_configs"] for job in config["scrape_configs"]}
    assert [c["targets"] for c in jobs["vllm"]] == [["127.0.0.1:8100"], ["127.0.0.1:8101"], ["127.0.0.1:8102"]]
    assert jobs["pd-proxy"] == [{"targets": ["127.0.0.1:8000"], "labels": {"role": "proxy", "server": "proxy"}}]
    with pytest.raises(ValueError, match="scrape interval must be positive"):
        prometheus_config(targets, 0)
    with pytest.raises(ValueError, match="has no http://host:port URL"):
        cluster_targets({"processes": [{"name": "decode-0", "role": "decode", "url": "not a url"}]})
    if missing_tool("promtool"):
        pytest.skip(str(missing_tool("promtool")))
    (tmp_path / "prometheus.yml").write_text(text)
    assert "SUCCESS" in promtool_check(tmp_path / "prometheus.yml")


def _compose_default(value: str) -> str:
    """``${NAME:-default}`` -> ``default`` (the compose file's defaults)."""
    return re.sub(r"\$\{[A-Z0-9_]+:-([^}]*)\}", r"\1", str(value))


def test_compose_prometheus_config_scrapes_every_service() -> None:
    """docker/prometheus.yml scrapes the proxy and every vLLM server of docker-compose.yml at their ports."""
    compose = yaml.safe_load((REPO / "docker" / "docker-compose.yml").read_text())["services"]
    ports = {}
    for name, service in compose.items():
        if name in ("proxy", "prefill", "decode"):
            command = [_compose_default(word) for word in service["command"]]
            ports[name] = f"{name}:{command[command.index('--port') + 1]}"
    config = yaml.safe_load(COMPOSE_CONFIG.read_text())
    scraped = {
        target: (job["job_name"], static.get("labels", {}).get("role"))
        for job in config["scrape_configs"]
        for static in job["static_configs"]
        for target in static["targets"]
    }
    assert scraped == {
        ports["proxy"]: ("pd-proxy", "proxy"),
        ports["prefill"]: ("vllm", "prefill"),
        ports["decode"]: ("vllm", "decode"),
    }
    if missing_tool("promtool"):
        pytest.skip(str(missing_tool("promtool")))
    assert "SUCCESS" in promtool_check(COMPOSE_CONFIG)


def test_dashboard_is_well_formed() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    chosen = panels()
    assert dashboard["uid"] == "pd-transfer" and len(chosen) >= 20
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    assert [v["name"] for v in dashboard["templating"]["list"]] == ["datasource"]
    for panel in chosen:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"] and panel["description"], panel["title"]
        assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"]), panel["title"]
        for target in panel["targets"]:
            assert re.search(r'job="(pd-proxy|vllm)"', target["expr"]), (panel["title"], target["expr"])


# ---------------------------------------------------------------------------------------------- end to end
def _targets_up(prometheus: str) -> bool:
    targets = json.loads(get_text(f"{prometheus}/api/v1/targets"))["data"]["activeTargets"]
    return bool(targets) and all(t["health"] == "up" for t in targets)


@pytest.fixture(scope="module")
def monitored(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[UpCluster, str]]:
    """An up cluster (offload directory, a 4 MiB host tier each: 8 blocks) and a Prometheus scraping it every second."""
    reason = vllm_missing() or missing_tool("prometheus") or missing_tool("promtool")
    if reason is None and not (Path(DEFAULT_MODEL) / "config.json").exists():
        reason = f"no model at {DEFAULT_MODEL} (make it with `pd-transfer make-model`)"
    if reason is not None:
        pytest.skip(reason)
    work = tmp_path_factory.mktemp("dashboard")
    offload = ["--offload-dir", str(work / "kv"), "--offload-host-bytes", str(4 << 20)]
    prometheus: ManagedProcess | None = None
    try:
        with up_cluster(work, *offload) as cluster:
            promtool_check(cluster.log_dir / "prometheus.yml")  # the file up wrote for its users
            config = work / "prometheus.yml"
            config.write_text(prometheus_config(cluster_targets(cluster.state), 1.0))
            prometheus = start_prometheus(config, work)
            deadline = time.monotonic() + 30.0
            while not _targets_up(prometheus.url):
                assert time.monotonic() < deadline, get_text(f"{prometheus.url}/api/v1/targets")
                time.sleep(0.5)
            yield cluster, prometheus.url
    finally:
        if prometheus is not None:
            stop_all([prometheus])


WORDS = "lantern harbor stone river castle meadow".split()


def _traffic(cluster: UpCluster, prometheus: str) -> None:
    """Completions and streamed chats through the proxy, a malformed body, a client leaving mid-stream, and one
    prompt sent to the prefill then the decode directly (the decode loads it from the shared directory). The
    proxy's labelled series are born with their first event, and a rate needs two samples: one round first, then,
    once Prometheus holds those series, the rest."""
    proxy, model = cluster.proxy, cluster.model
    _proxy_round(proxy, model, 0)
    deadline = time.monotonic() + 30.0
    while len(query(prometheus, 'pd_proxy_time_to_first_token_seconds_count{job="pd-proxy"}')) < 2:
        assert time.monotonic() < deadline, "Prometheus did not see the proxy's first requests"
        time.sleep(0.5)
    for k in range(1, 4):  # with round 0: 4 x 2 prompts of about 3 blocks: more than the 4 MiB host tier holds
        _proxy_round(proxy, model, k)
    shared = {"model": model, "prompt": " ".join(reversed(WORDS * 60)), "max_tokens": 2, "temperature": 0}
    (prefill,), (decode,) = cluster.urls("prefill"), cluster.urls("decode")
    stored = ("vllm:pd_transfer_offload_stored_bytes_total", {"tier": "disk"})
    before = metric_value(prefill, stored[0], **stored[1])
    post_json(f"{prefill}/v1/completions", shared)
    assert wait_metric(prefill, stored[0], lambda v: v > before, 30.0, labels=stored[1]).reached
    post_json(f"{decode}/v1/completions", shared)
    # the worker's stats reach /metrics with a later engine step: one more short request makes one
    loaded = ("vllm:pd_transfer_offload_loaded_bytes_total", {"tier": "disk"})
    post_json(f"{decode}/v1/completions", {"model": model, "prompt": "Alice", "max_tokens": 2, "temperature": 0})
    assert wait_metric(decode, loaded[0], lambda v: v > 0, 30.0, labels=loaded[1]).reached


def _proxy_round(proxy: str, model: str, k: int) -> None:
    """A completion and a streamed chat (new prompts, about 300 words each), a malformed body, a client leaving."""
    prompt = " ".join(WORDS[(k + i) % len(WORDS)] for i in range(300)) + f" {k}"
    post_json(f"{proxy}/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0})
    chat = {"model": model, "messages": [{"role": "user", "content": f"{k} " + " ".join(WORDS * 50)}]}
    post_stream(f"{proxy}/v1/chat/completions", chat | {"max_tokens": 4, "temperature": 0})
    request = urllib.request.Request(f"{proxy}/v1/completions", b"{not json", {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError):
        urllib.request.urlopen(request, timeout=30)
    _leave_mid_stream(proxy, model, k + 1)


def _leave_mid_stream(proxy: str, model: str, count: int) -> None:
    """A streamed completion whose client closes the connection after the first bytes; waits (bounded) until the
    proxy counted ``count`` disconnects."""
    body = {"model": model, "prompt": "Alice saw", "max_tokens": 400, "ignore_eos": True, "stream": True}
    request = urllib.request.Request(
        f"{proxy}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.read(16)
    labels = {"hop": "client", "kind": "disconnect"}
    assert wait_metric(proxy, "pd_proxy_errors_total", lambda v: v >= count, 30.0, labels=labels).reached


@pytest.mark.timeout(UP_TIMEOUT_S + 900)
def test_every_panel_returns_data(monitored: tuple[UpCluster, str]) -> None:
    cluster, prometheus = monitored
    started = time.monotonic()
    _traffic(cluster, prometheus)
    print(f"\ntraffic sent in {time.monotonic() - started:.1f} s")
    coverage = await_data(prometheus, panels(), RATE_WINDOW, DATA_TIMEOUT_S)
    print(f"every panel's largest value within {time.monotonic() - started:.0f} s of the first request:")
    print("\n".join(coverage.lines()))
    assert not coverage.lacking, f"panels without data after {DATA_TIMEOUT_S:.0f} s: {coverage.lacking}"
    assert not coverage.unseen, f"the dashboard names metrics Prometheus never saw: {coverage.unseen}"
