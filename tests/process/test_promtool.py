"""The operators' Prometheus configs pass ``promtool check config`` (``scripts/setup-deploy`` installs promtool;
skipped with that reason without it): the scrape config ``pd_transfer.cluster.monitoring`` renders for a
``pd-transfer up`` cluster, and ``docker/prometheus.yml``. What they say: tests/unit/test_monitoring_configs.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from deploy_tools import missing_tool, promtool_check
from test_monitoring_configs import COMPOSE_CONFIG, STATE

from pd_transfer.cluster.monitoring import cluster_targets, prometheus_config

pytestmark = pytest.mark.skipif(missing_tool("promtool") is not None, reason=missing_tool("promtool") or "")


def test_scrape_config_of_an_up_cluster_passes_promtool(tmp_path: Path) -> None:
    (tmp_path / "prometheus.yml").write_text(prometheus_config(cluster_targets(STATE), 0.5, comment="a test"))
    assert "SUCCESS" in promtool_check(tmp_path / "prometheus.yml")


def test_compose_prometheus_config_passes_promtool() -> None:
    assert "SUCCESS" in promtool_check(COMPOSE_CONFIG)
