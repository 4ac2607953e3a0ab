"""The operators' view on real data: the Grafana dashboard's panels against a real Prometheus scraping real servers.

End to end (vLLM, the test model and Prometheus needed): a real ``pd-transfer up`` cluster with
an offload directory and a small host tier, a real Prometheus scraping it every second (its own storage directory,
a free port), traffic through our proxy (completions, streamed chats, a malformed body, a client that goes away
mid-stream) plus a prompt sent to the prefill then to the decode directly (the decode loads it from the shared
directory); then every panel's PromQL runs against Prometheus's HTTP API until each panel returns data (bounded).
Grafana itself does not run here: the panels' queries are what it would run. The configs and the dashboard's JSON
without servers: tests/unit/test_monitoring_configs.py and tests/process/test_promtool.py.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from dashboard_panels import await_data, panels, query
from deploy_tools import missing_tool, promtool_check, start_prometheus
from up_cluster import UP_TIMEOUT_S, UpCluster, up_cluster

from pd_transfer.cluster.http_client import get_text, metric_value, post_json, post_stream, wait_metric
from pd_transfer.cluster.monitoring import cluster_targets, prometheus_config
from pd_transfer.cluster.processes import ManagedProcess, stop_all

RATE_WINDOW = "10m"  # what $__rate_interval becomes here: longer than the test, so its traffic stays in view
DATA_TIMEOUT_S = 120.0


# ---------------------------------------------------------------------------------------------- end to end
def _targets_up(prometheus: str) -> bool:
    targets = json.loads(get_text(f"{prometheus}/api/v1/targets"))["data"]["activeTargets"]
    return bool(targets) and all(t["health"] == "up" for t in targets)


@pytest.fixture(scope="module")
def monitored(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[UpCluster, str]]:
    """An up cluster (offload directory, a 4 MiB host tier each: 8 blocks) and a Prometheus scraping it every second."""
    if (reason := missing_tool("prometheus") or missing_tool("promtool")) is not None:
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
