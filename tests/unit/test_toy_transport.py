"""A transport written only in tests/ (``toy_socket_transport``: rows over a socket of its own, the lease protocol's
messages too) plugged in by the connector's ``transport`` setting alone, on both ends: the pull goes by the toy
(verified bytes, its name on the pull's stats and metrics, the lease confirmed and the blocks freed), the engine gets no
NIXL peer, and the decode falls back on the next transport it names where the toy cannot read. Engines in this
process with the fake agents; tests/process/test_toy_transport_through_proxy.py carries requests through the proxy
between two processes."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from in_process_prefill import InProcessPrefill
from toy_socket_transport import NAME, ToyDecodeEnd, ToyPrefillEnd

from pd_transfer.connector.cache import KVCache
from pd_transfer.connector.decode.rank import DecodeRank
from pd_transfer.connector.messages import READ_CHECKS_OFFER
from pd_transfer.connector.options import DecodeOptions
from pd_transfer.connector.transports.registry import UnknownTransport
from pd_transfer.metrics import TransferMetrics
from pd_transfer.settings import DEFAULTS
from pd_transfer.sim.verify import received_correctly
from pd_transfer.spec import KVCacheLayout, ModelFingerprint
from pd_transfer.transfer.agent_protocol import AgentFactory

MODEL = ModelFingerprint(model="toy-transport", dtype="float16", num_layers=2, total_num_kv_heads=2, head_size=16)
LAYOUT = KVCacheLayout(fingerprint=MODEL, tp_size=1, tp_rank=0, block_size=16)
BLOCKS = 32
TOY = "toy_socket_transport:TOY"


@pytest.fixture
def prefill(agent_factory: AgentFactory) -> Iterator[InProcessPrefill]:
    made = InProcessPrefill(f"toy-prefill-{time.monotonic_ns()}", LAYOUT, BLOCKS, agent_factory, seed=11, transport=TOY)
    try:
        yield made
    finally:
        made.close()


def decode_rank(agent_factory: AgentFactory, transport: str, layout: KVCacheLayout = LAYOUT) -> DecodeRank:
    options = DecodeOptions(settings=DEFAULTS, transport=transport)
    cache = KVCache.allocate(layout, BLOCKS)
    return DecodeRank(
        f"toy-decode-{time.monotonic_ns()}", cache, options, metrics=TransferMetrics(), agent_factory=agent_factory
    )


def test_the_toy_carries_the_pull_and_the_lease_with_no_nixl_peer(
    prefill: InProcessPrefill, agent_factory: AgentFactory
) -> None:
    prefill_end = prefill.rank.ends[NAME]
    assert isinstance(prefill_end, ToyPrefillEnd)
    # NIXL offers nothing beyond the rank; read checks are the rank's, whatever carries the rows
    assert [offer.transport for offer in prefill.rank.offers] == [NAME, READ_CHECKS_OFFER]
    decode = decode_rank(agent_factory, TOY)
    try:
        remote_ids, local_ids, tokens = [9, 2, 30, 17], [4, 0, 21, 13], 16 * 3 + 5
        prefill.rank.hold("toy-1", remote_ids)
        stats = decode.pull_confirmed("toy-1", prefill.host, prefill.port, remote_ids, local_ids, tokens)
        end = decode.ends[NAME]
        assert isinstance(end, ToyDecodeEnd) and end.requests == ["toy-1"]
        assert stats.transport == NAME and stats.bytes > 0 and prefill_end.rows_served > 0
        assert received_correctly(decode.cache, local_ids, prefill.expected(), remote_ids, tokens)
        assert (
            decode.metrics.registry.get_sample_value("pd_transfer_pulls_total", {"outcome": "ok", "transport": NAME})
            == 1
        )
        assert decode.confirmations.received == 1  # the LeaseConfirm came back on the toy's connection
        # and the digest of the rows the read checked (verify "sample" by default), compared with them where they landed
        assert decode.confirmations.digests_received == 1
        checked = decode.metrics.registry.get_sample_value("pd_transfer_digest_checks_total", {"outcome": "equal"})
        assert checked == 1
        assert prefill.rank.ledger.readers_complete("toy-1") is not None  # every reader reported (confirmed)
        assert prefill.rank.ledger.blocks_held == 0  # so the blocks are free
        assert not decode.agent.has_peer(prefill.rank.agent.name)  # no NIXL peer, so no NIXL read either
    finally:
        decode.close()
    assert end.closed


def test_block_ids_outside_the_plan_are_refused_before_the_toy_moves_anything(
    prefill: InProcessPrefill, agent_factory: AgentFactory
) -> None:
    decode = decode_rank(agent_factory, TOY)
    try:
        before = [tensor.clone() for tensor in decode.cache.tensors]
        prefill.rank.hold("toy-bad", [1, 2])
        with pytest.raises(ValueError):
            decode.pull("toy-bad", prefill.host, prefill.port, [1, BLOCKS + 5], [3, 4], 20)
        assert all(a.equal(b) for a, b in zip(before, decode.cache.tensors, strict=True))
        assert decode.ends[NAME].requests == []  # type: ignore[attr-defined]
    finally:
        decode.close()


def test_where_the_toy_is_not_offered_the_next_transport_named_reads(agent_factory: AgentFactory) -> None:
    plain = InProcessPrefill(f"plain-prefill-{time.monotonic_ns()}", LAYOUT, BLOCKS, agent_factory, transport="nixl")
    decode = decode_rank(agent_factory, f"{TOY}, nixl")
    try:
        assert [offer.transport for offer in plain.rank.offers] == [READ_CHECKS_OFFER]
        plain.rank.hold("not-toy", [5, 6])
        stats = decode.pull_confirmed("not-toy", plain.host, plain.port, [5, 6], [7, 8], 32)
        assert stats.transport == "nixl" and decode.ends[NAME].requests == []  # type: ignore[attr-defined]
        assert received_correctly(decode.cache, [7, 8], plain.expected(), [5, 6], 32)
    finally:
        decode.close()
        plain.close()


def test_a_transport_the_setting_names_must_exist(agent_factory: AgentFactory) -> None:
    with pytest.raises(UnknownTransport, match="no transport is named 'toy'"):
        decode_rank(agent_factory, "toy")
    with pytest.raises(UnknownTransport, match="module 'no_toy_here' does not import"):
        decode_rank(agent_factory, "no_toy_here:TOY")
