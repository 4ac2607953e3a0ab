"""Metrics of real pulls from a prefill process, read back through the Prometheus exposition format: a pull's bytes
and seconds, failed loads counted by kind. Without a pull: tests/unit/test_metric_counts.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from test_metric_counts import LAYOUT, samples

from pd_transfer.connector.cache import KVCache
from pd_transfer.connector.config import ConnectorConfig
from pd_transfer.connector.decode.rank import DecodeRank
from pd_transfer.connector.options import DecodeOptions
from pd_transfer.connector.params import remote_prefill_params
from pd_transfer.metrics import TransferMetrics
from pd_transfer.settings import DEFAULTS
from pd_transfer.sim.engines import DecodeEngine
from pd_transfer.sim.peer import PrefillProcess, PrefillSpec


@pytest.fixture(scope="module")
def prefill() -> Iterator[PrefillProcess]:
    with PrefillProcess(PrefillSpec("metrics-prefill-engine", [LAYOUT], 16, seed=2)) as process:
        yield process


def test_pull_metrics(prefill: PrefillProcess) -> None:
    metrics = TransferMetrics()
    layout = prefill.spec.layouts[0]
    decode = DecodeRank(
        "metrics-decode",
        KVCache.allocate(layout, 16),
        DecodeOptions(settings=DEFAULTS, transport="nixl"),
        metrics=metrics,
    )
    try:
        stats = decode.pull("metrics-1", prefill.host, prefill.port, [1, 2], [3, 4], 20)
    finally:
        decode.close()
    got = samples(metrics)
    nixl = (("transport", "nixl"),)
    assert stats.transport == "nixl"
    assert got[("pd_transfer_pulled_bytes_total", nixl)] == stats.bytes > 0
    assert got[("pd_transfer_pulls_total", (("outcome", "ok"), *nixl))] == 1
    assert got[("pd_transfer_pull_seconds_count", nixl)] == 1
    assert got[("pd_transfer_pull_descriptor_rows_sum", ())] == stats.descriptors
    assert got[("pd_transfer_handshakes_total", (("outcome", "ok"),))] == 1  # the decode rank's own registry


def test_failed_loads_are_counted_by_kind_and_a_wrong_engine_id_is_not_asked_again_at_once(
    prefill: PrefillProcess,
) -> None:
    metrics = TransferMetrics()
    config = ConnectorConfig(side_channel_host="127.0.0.1", side_channel_port=0, handshake_timeout_s=2.0)
    with DecodeEngine("metrics-decode-engine", [LAYOUT], 16, config, metrics=metrics, settings=DEFAULTS) as decode:
        params = remote_prefill_params(
            engine_id="not-this-one",
            request_id="r",
            block_ids=[0, 1],
            host=prefill.host,
            port=prefill.port,
            tp_size=1,
            num_tokens=20,
            block_size=16,
        )
        for name in ("wrong-1", "wrong-2"):
            got = decode.receive(name, 20, params)
            assert got.finished and set(got.local_block_ids) <= got.load_errors
        client = decode.workers[0].decode_rank().client  # type: ignore[attr-defined]
        # connect, then one fresh handshake to see whether the prefill restarted under a new id; the second
        # request within a second is refused from what that handshake found
        assert client.handshakes_performed == 2
    got = samples(metrics)
    assert got[("pd_transfer_pull_failures_total", (("kind", "wrong_engine"),))] == 2
    assert not any(name == "pd_transfer_peer_rehandshakes_total" for name, _ in got)  # it did not restart
