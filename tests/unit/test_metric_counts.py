"""Metrics read back through the Prometheus exposition format, without a pull: a prefill rank's leases (held blocks,
how leases ended; a fake agent), the side channel's refusals and handshakes (a real server and clients in this
process), requests waiting for remote KV on the decode's scheduler side. A real pull's metrics:
tests/process/test_metrics.py."""

from __future__ import annotations

import msgspec
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pd_transfer.connector.cache import KVCache
from pd_transfer.connector.config import ConnectorConfig
from pd_transfer.connector.options import PrefillOptions
from pd_transfer.connector.params import remote_prefill_params
from pd_transfer.connector.prefill.rank import PrefillRank
from pd_transfer.connector.scheduler import SchedulerSide
from pd_transfer.handshake import (
    PROTOCOL_VERSION,
    AuthenticationError,
    Challenge,
    ErrorReply,
    GetMetadata,
    HandshakeClient,
    HandshakeServer,
    Hello,
    Metadata,
    encode,
)
from pd_transfer.handshake.auth import new_nonce, signed_request_mac
from pd_transfer.handshake.compat import fingerprint_digest
from pd_transfer.metrics import TransferMetrics, default_metrics
from pd_transfer.settings import DEFAULTS
from pd_transfer.sim.handshake_server import RawPeer, fake_engine
from pd_transfer.spec import KVCacheLayout, ModelFingerprint
from pd_transfer.transfer.agent_protocol import AgentFactory

LAYOUT = KVCacheLayout(
    fingerprint=ModelFingerprint(model="m", dtype="bfloat16", num_layers=2, total_num_kv_heads=2, head_size=16),
    tp_size=1,
    tp_rank=0,
    block_size=16,
)


def samples(metrics: TransferMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(metrics.registry).decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_lease_metrics(agent_factory: AgentFactory) -> None:
    metrics = TransferMetrics()
    now = [0.0]
    rank = PrefillRank(
        "metrics-prefill",
        KVCache.allocate(LAYOUT, 8),
        PrefillOptions(settings=DEFAULTS, lease_seconds=5.0),
        clock=lambda: now[0],
        metrics=metrics,
        agent_factory=agent_factory,
    )
    try:
        rank.hold("held-then-expired", [1, 2, 3])
        rank.hold("held-then-aborted", [4])
        rank.hold("held-then-released", [5])
        assert (
            samples(metrics)[("pd_transfer_prefill_blocks_held", (("engine", "metrics-prefill"), ("rank", "0")))] == 5
        )
        assert rank.release("held-then-released", read_possible=False) is not None  # no decode has its params
        now[0] = 2.0  # past the hold window (a third of the lease): an abort frees at once
        rank.abort("held-then-aborted")
        now[0] = 6.0
        assert [freed.request_id for freed in rank.expire()] == ["held-then-expired"]
        got = samples(metrics)
        assert got[("pd_transfer_leases_ended_total", (("reason", "expired"),))] == 1
        assert got[("pd_transfer_leases_ended_total", (("reason", "aborted"),))] == 1
        assert got[("pd_transfer_leases_ended_total", (("reason", "released"),))] == 1
        assert got[("pd_transfer_prefill_blocks_held", (("engine", "metrics-prefill"), ("rank", "0")))] == 0
    finally:
        rank.close()


def test_side_channel_metrics_after_real_handshakes_and_bad_frames() -> None:
    """Server side: frames refused by reason, nonces refused; client side: handshakes by outcome and their seconds;
    both: ``pd_transfer_info``. A real server on TCP, real clients, real garbage."""
    server_metrics, client_metrics = TransferMetrics(), TransferMetrics()
    engine = fake_engine("metrics-side-channel", 1)
    with HandshakeServer(engine, secret="s", metrics=server_metrics) as server:
        with HandshakeClient(engine.fingerprint, secret="s", retries=0, metrics=client_metrics) as client:
            client.fetch("127.0.0.1", server.port)
        with HandshakeClient(engine.fingerprint, secret="wrong", retries=0, metrics=client_metrics) as client:
            with pytest.raises(AuthenticationError):
                client.fetch("127.0.0.1", server.port)
        with RawPeer("127.0.0.1", server.port) as raw:
            assert isinstance(raw.request(b"\xc1 not msgpack"), ErrorReply)
            assert isinstance(raw.request(encode(Hello(protocol_version=0))), ErrorReply)
            challenge = raw.request(encode(Hello()))
            assert isinstance(challenge, Challenge)
            request = GetMetadata(PROTOCOL_VERSION, engine.fingerprint, None, new_nonce(), challenge.server_nonce)
            signed = msgspec.structs.replace(request, mac=signed_request_mac("s", request))
            assert isinstance(raw.request(encode(signed)), Metadata)
            assert isinstance(raw.request(encode(signed)), ErrorReply)  # the same nonce again
    served, asked = samples(server_metrics), samples(client_metrics)
    rejected = "pd_transfer_side_channel_rejected_total"
    assert served[(rejected, (("reason", "malformed"),))] == 1
    assert served[(rejected, (("reason", "unsupported_version"),))] == 1
    assert served[(rejected, (("reason", "auth_failed"),))] == 2  # the wrong secret's MAC, the reused nonce
    assert served[("pd_transfer_side_channel_nonces_refused_total", (("reason", "reused"),))] == 1
    assert asked[("pd_transfer_handshakes_total", (("outcome", "ok"),))] == 1
    assert asked[("pd_transfer_handshakes_total", (("outcome", "auth"),))] == 1
    assert asked[("pd_transfer_handshake_seconds_count", ())] == 2
    for got in (served, asked):
        info = [labels for (name, labels) in got if name == "pd_transfer_info"]
        assert info == [
            (
                ("dtype", engine.fingerprint.dtype),
                ("fingerprint", fingerprint_digest(engine.fingerprint)),
                ("model", engine.fingerprint.model),
                ("protocol_version", str(PROTOCOL_VERSION)),
            )
        ]


def test_requests_waiting_for_remote_kv_on_the_decode() -> None:
    """The decode's scheduler side counts requests whose KV a prefill holds until they are loaded or dropped."""
    config = ConnectorConfig(side_channel_host="127.0.0.1", side_channel_port=0)
    scheduler = SchedulerSide(config, engine_id="metrics-waiting", block_size=16)
    params = remote_prefill_params(
        engine_id="p",
        request_id="r",
        block_ids=[0, 1],
        host="127.0.0.1",
        port=1,
        tp_size=1,
        num_tokens=20,
        block_size=16,
    )
    gauge = ("pd_transfer_requests_waiting_for_kv", (("engine", "metrics-waiting"),))
    for name in ("a", "b"):
        scheduler.on_new_request(name, params, prompt_len=20)
    scheduler.build_step_metadata()
    assert samples(default_metrics())[gauge] == 2
    scheduler.request_finished("a", [], "abort", params)
    scheduler.request_finished("b", [], "abort", params)
    scheduler.build_step_metadata()
    assert samples(default_metrics())[gauge] == 0
