"""The Kubernetes manifests in deploy/k8s/, read with PyYAML: the servers, the proxy and their Services agree (each
``pd-transfer`` command is accepted by the real parser, the side channel binds the pod IP from the downward API,
ports, probes, scrape annotations and Service selectors match, the proxy's URLs name the Services). Validated
against the Kubernetes schemas and run on a real Prometheus: tests/process/test_k8s_manifests.py."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from deploy_tools import REPO
from test_docker import parse_pd_transfer

K8S = REPO / "deploy" / "k8s"
FILES = sorted(K8S.glob("*.yaml"))
NAME = "app.kubernetes.io/name"
COMPONENT = "app.kubernetes.io/component"


def k8s_resources() -> dict[tuple[str, str], dict[str, Any]]:
    """(kind, name) -> resource, from every file."""
    found = {}
    for path in FILES:
        for doc in yaml.safe_load_all(path.read_text()):
            found[doc["kind"], doc["metadata"]["name"]] = doc
    return found


def _container(deployment: dict[str, Any]) -> dict[str, Any]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return dict(container)


def _ports(container: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container["ports"]}


def _check_pod(resources: dict[tuple[str, str], dict[str, Any]], name: str, port: int) -> dict[str, Any]:
    """Common to every pd-transfer Deployment: Service selects its pods, probes and scrape annotation on ``port``."""
    deployment, service = resources["Deployment", name], resources["Service", name]
    template = deployment["spec"]["template"]
    labels = template["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert service["spec"]["selector"].items() <= labels.items() and labels[NAME] == "pd-transfer"
    container = _container(deployment)
    assert _ports(container)["http"] == port and service["spec"]["ports"][0]["targetPort"] == "http"
    assert template["metadata"]["annotations"] == {"prometheus.io/scrape": "true", "prometheus.io/port": str(port)}
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}, (name, probe)
    return container


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_servers_bind_the_side_channel_to_the_pod_ip(role: str) -> None:
    resources = k8s_resources()
    container = _container(resources["Deployment", f"pd-{role}"])
    args = parse_pd_transfer(container["command"][1:])
    assert not isinstance(args, str), args
    assert (args.command, args.role, args.host) == ("serve", role, "0.0.0.0")
    _check_pod(resources, f"pd-{role}", args.port)
    env = {e["name"]: e for e in container["env"]}
    # Kubernetes expands $(POD_IP) in the command from the env var the downward API fills with the pod's IP
    assert args.side_channel_host == "$(POD_IP)"
    assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert _ports(container)["side-channel"] == args.side_channel_port
    assert env[args.secret_env]["valueFrom"]["secretKeyRef"] == {"name": "pd-transfer-side-channel", "key": "secret"}
    assert env["UCX_NET_DEVICES"]["value"] == "eth0"


def test_proxy_routes_to_the_services() -> None:
    resources = k8s_resources()
    container = _container(resources["Deployment", "pd-proxy"])
    args = parse_pd_transfer(container["command"][1:])
    assert not isinstance(args, str), args
    _check_pod(resources, "pd-proxy", args.port)
    for role, urls in (("prefill", args.prefill), ("decode", args.decode)):
        port = resources["Service", f"pd-{role}"]["spec"]["ports"][0]["port"]
        assert urls == [f"http://pd-{role}:{port}"], (role, urls)
