"""The operators' configs, read without running them: the scrape config ``pd_transfer.cluster.monitoring`` renders
for a ``pd-transfer up`` cluster, ``docker/prometheus.yml`` scraping every service of the compose cluster at its
port, and the Grafana dashboard's JSON well formed. Both configs through ``promtool check config``:
tests/process/test_promtool.py; every panel on real data: tests/vllm/test_dashboard.py."""

from __future__ import annotations

import json
import re

import pytest
import yaml
from dashboard_panels import DASHBOARD, panels
from deploy_tools import REPO

from pd_transfer.cluster.monitoring import ScrapeTarget, cluster_targets, prometheus_config

COMPOSE_CONFIG = REPO / "docker" / "prometheus.yml"

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


def test_scrape_config_of_an_up_cluster() -> None:
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


# ---------------------------------------------------------------------------------------------- dashboard
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
