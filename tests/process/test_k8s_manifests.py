"""The Kubernetes manifests in deploy/k8s/, checked offline.

- Every resource validates against the Kubernetes schemas (``kubernetes-validate --strict``, PyPI, pinned by
  ``scripts/setup-deploy``; no cluster needed).
- The Prometheus config in the ConfigMap relabels discovered pods into the jobs and labels the dashboard queries:
  run on a real Prometheus, with the Kubernetes discovery swapped for static targets carrying the same
  ``__meta_kubernetes_*`` labels a pod would (Debian's Prometheus is built without Kubernetes discovery), pointed at
  that Prometheus's own ``/metrics``.

How the servers, the proxy and their Services agree: tests/unit/test_k8s_wiring.py.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_tools import deploy_tool, missing_tool, promtool_check, start_prometheus
from test_k8s_wiring import FILES, k8s_resources

from pd_transfer.cluster.http_client import free_port, get_text
from pd_transfer.cluster.processes import stop_all


def test_manifests_validate_against_the_kubernetes_schemas() -> None:
    tool = deploy_tool("kubernetes-validate")
    if tool is None:
        pytest.skip(str(missing_tool("kubernetes-validate")))
    result = subprocess.run([tool, "--strict", *map(str, FILES)], capture_output=True, text=True, timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    passed = [line for line in output.splitlines() if " passed for resource " in line]
    print(f"\n{len(passed)} resources valid (kubernetes-validate --strict):\n" + "\n".join(passed))
    assert len(passed) == len(k8s_resources()) >= 12, output


def _pod(component: str, name: str, port: int, *, part_of: str = "pd-transfer", scrape: str = "true") -> dict:
    """The meta labels Kubernetes pod discovery gives a pod."""
    return {
        "__meta_kubernetes_pod_ip": "127.0.0.1",
        "__meta_kubernetes_pod_name": name,
        "__meta_kubernetes_pod_label_app_kubernetes_io_name": part_of,
        "__meta_kubernetes_pod_label_app_kubernetes_io_component": component,
        "__meta_kubernetes_pod_annotation_prometheus_io_scrape": scrape,
        "__meta_kubernetes_pod_annotation_prometheus_io_port": str(port),
    }


def test_prometheus_config_relabels_pods_into_the_dashboards_jobs(tmp_path: Path) -> None:
    reason = missing_tool("prometheus") or missing_tool("promtool")
    if reason is not None:
        pytest.skip(reason)
    config = yaml.safe_load(k8s_resources()["ConfigMap", "pd-prometheus"]["data"]["prometheus.yml"])
    port = free_port()
    pods = [
        _pod("proxy", "pd-proxy-7d9f", port),
        _pod("prefill", "pd-prefill-5c2a", port),
        _pod("decode", "pd-decode-0b1e", port),
        _pod("decode", "pd-decode-unscraped", port, scrape="false"),
        _pod("decode", "someone-else", port, part_of="other-app"),
        _pod("prometheus", "pd-prometheus-1234", port),
    ]
    for job in config["scrape_configs"]:
        assert job.pop("kubernetes_sd_configs") == [{"role": "pod", "namespaces": {"own_namespace": True}}]
        job["static_configs"] = [{"targets": ["pod-discovery:1"], "labels": pod} for pod in pods]
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    promtool_check(path)
    prometheus = start_prometheus(path, tmp_path, port)
    try:
        targets = _wait_targets_up(prometheus.url, 3, 30.0)
    finally:
        stop_all([prometheus])
    found = {(t["labels"]["job"], t["labels"]["role"], t["labels"]["server"], t["labels"]["instance"]) for t in targets}
    address = f"127.0.0.1:{port}"
    assert found == {
        ("pd-proxy", "proxy", "pd-proxy-7d9f", address),
        ("vllm", "prefill", "pd-prefill-5c2a", address),
        ("vllm", "decode", "pd-decode-0b1e", address),
    }


def _wait_targets_up(url: str, count: int, timeout_s: float) -> list[dict[str, Any]]:
    """Prometheus's active targets once ``count`` of them are scraped healthy (bounded by ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        targets = json.loads(get_text(f"{url}/api/v1/targets"))["data"]["activeTargets"]
        if len(targets) == count and all(t["health"] == "up" for t in targets):
            return list(targets)
        assert time.monotonic() < deadline, f"targets not all up: {json.dumps(targets)[:2000]}"
        time.sleep(0.5)
