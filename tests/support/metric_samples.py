"""Reading a metric back in tests: its samples by label value, through the Prometheus exposition format."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pd_transfer.metrics import TransferMetrics


def metric_samples(metrics: TransferMetrics, name: str) -> dict[str, float]:
    """``name``'s samples in ``metrics`` by the value of their one label (a counter's ``_total`` name)."""
    text = generate_latest(metrics.registry).decode()
    return {
        next(iter(sample.labels.values())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    }
