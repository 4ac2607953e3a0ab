"""What a rank's transports offer, on the side channel (protocol version 5): each offer under its transport's name, the
same-host ones only for a client that proved it is on the host, and older clients served as they read a rank (the
first built-in same-host offer as ``ipc``, no ``offers`` key at all: a version 4 client decodes it and its MAC over the
re-encoded metadata verifies), while a version 4 server's ``ipc`` reads as the offer of its segments' kind."""

from __future__ import annotations

import msgspec
import pytest

from pd_transfer.handshake.client import HandshakeClient
from pd_transfer.handshake.messages import (
    CmaSegment,
    CudaSegment,
    HostSegment,
    RankIpc,
    RankMetadata,
    TransportOffer,
    decode_rank_ipc,
    encode_rank_ipc,
)
from pd_transfer.handshake.server import HandshakeServer
from pd_transfer.sim.handshake_server import fake_engine, fake_fingerprint
from pd_transfer.spec import KVCacheLayout, KVRegion

SECRET = "offers-secret"
MEMFD = RankIpc(
    boot_id="b", pid=7, pid_namespace=1, segments=[HostSegment(base_address=4096, nbytes=4096, pid=7, fd=3, name="m")]
)
CMA = RankIpc(boot_id="b", pid=7, pid_namespace=1, segments=[CmaSegment(probe_address=64, probe=bytes(16))])
TOY = TransportOffer(transport="toy_socket", payload=b'{"port": 1}')


def with_offers(*offers: TransportOffer, rank: int = 0) -> RankMetadata:
    return msgspec.structs.replace(fake_engine().ranks[rank], offers=list(offers))


def same_host(name: str, ipc: RankIpc) -> TransportOffer:
    return TransportOffer(transport=name, payload=encode_rank_ipc(ipc), same_host=True)


class RankMetadataV4(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A version 4 peer's rank, as it was declared then."""

    tp_rank: int
    agent_name: str
    agent_metadata: bytes
    layout: KVCacheLayout
    regions: list[KVRegion]
    ipc: RankIpc | None = None


def test_offers_are_found_by_name() -> None:
    rank = with_offers(same_host("host_cma", CMA), TOY)
    assert rank.offer("toy_socket") == TOY.payload
    assert decode_rank_ipc(rank.offer("host_cma") or b"") == CMA
    assert rank.offer("host_ipc") is None and fake_engine().ranks[0].offer("toy_socket") is None


def test_a_client_not_proven_on_the_host_keeps_only_the_offers_for_anyone() -> None:
    rank = with_offers(same_host("host_cma", CMA), TOY).without_same_host()
    assert rank.offers == [TOY] and rank.ipc is None


@pytest.mark.parametrize(("version", "legacy"), [(4, MEMFD), (3, MEMFD)])
def test_an_older_client_gets_the_first_same_host_offer_as_ipc_and_no_offers_key(version: int, legacy: RankIpc) -> None:
    rank = with_offers(TOY, same_host("host_cma", CMA), same_host("host_ipc", MEMFD)).for_version(version)
    assert rank.ipc == legacy and isinstance(rank.offers, msgspec.UnsetType)
    wire = msgspec.msgpack.encode(rank)
    assert "offers" not in msgspec.msgpack.decode(wire)
    old = msgspec.msgpack.decode(wire, type=RankMetadataV4)  # a version 4 peer decodes it ...
    assert msgspec.msgpack.encode(old) == wire  # ... and re-encodes the very bytes its MAC check covers


def test_a_version_3_client_is_never_sent_an_offer_read_in_place() -> None:
    assert with_offers(same_host("host_cma", CMA)).for_version(3).ipc is None
    assert with_offers(same_host("host_cma", CMA)).for_version(4).ipc == CMA


def test_a_version_4_servers_ipc_reads_as_the_offer_of_its_kind() -> None:
    base = fake_engine().ranks[0]
    for ipc, name in ((MEMFD, "host_ipc"), (CMA, "host_cma")):
        upgraded = msgspec.structs.replace(base, ipc=ipc).with_offers()
        assert upgraded.ipc is None and decode_rank_ipc(upgraded.offer(name) or b"") == ipc
    cuda = CudaSegment(
        base_address=0,
        nbytes=1,
        device_uuid="GPU-a",
        handle=b"h",
        offset_bytes=0,
        ref_counter=b"r",
        ref_counter_offset=0,
        event_handle=b"e",
        event_sync_required=False,
    )
    mixed = msgspec.structs.replace(MEMFD, segments=[*MEMFD.segments, cuda])
    assert msgspec.structs.replace(base, ipc=mixed).with_offers().offers == []  # of no one kind: not offered
    assert base.with_offers() is base


@pytest.mark.parametrize("version", [5, 4])
def test_a_server_sends_each_client_the_offers_it_may_have(version: int) -> None:
    engine = fake_engine()
    ranks = [with_offers(same_host("host_cma", CMA), TOY, rank=r.tp_rank) for r in engine.ranks]
    served = msgspec.structs.replace(engine, ranks=ranks)
    with (
        HandshakeServer(served, secret=SECRET) as server,
        HandshakeClient(fake_fingerprint(), secret=SECRET, retries=0, protocol_version=version) as client,
    ):
        fetched = client.fetch("127.0.0.1", server.port)  # the MAC verified
    for rank in fetched.ranks:
        assert rank.offer("host_cma") is None  # not proven on the host
        assert rank.offer("toy_socket") == (TOY.payload if version == 5 else None)  # a version 4 client: none


def test_malformed_offers_are_refused_when_decoded() -> None:
    rank = with_offers(TOY)
    frame = msgspec.msgpack.encode(rank).replace(b"toy_socket", b"Toy Socket")
    with pytest.raises(msgspec.ValidationError, match="transport"):
        msgspec.msgpack.decode(frame, type=RankMetadata)
    too_many = msgspec.structs.replace(rank, offers=[TOY] * 17)
    with pytest.raises(msgspec.ValidationError, match="offers"):
        msgspec.msgpack.decode(msgspec.msgpack.encode(too_many), type=RankMetadata)
