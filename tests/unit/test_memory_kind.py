"""Where a cache's memory is, through every layer: the region (filled from the tensor, on the wire), the cache (one
memory), NIXL's name for it, and the side channel's refusal of peers that predate it (protocol version 3)."""

from __future__ import annotations

import msgspec
import pytest
import torch

from pd_transfer.connector.cache import KVCache
from pd_transfer.handshake import PROTOCOL_VERSION, HandshakeClient, HandshakeRefused, HandshakeServer
from pd_transfer.handshake.messages import EngineMetadata, Metadata, decode, encode
from pd_transfer.sim.handshake_server import fake_engine, fake_fingerprint
from pd_transfer.spec import HOST, KVCacheLayout, KVRegion, MemoryPlace, memory_of, region_from_tensor
from pd_transfer.transfer.session import nixl_memory_type

LAYOUT = KVCacheLayout(fingerprint=fake_fingerprint(head_size=16), tp_size=1, tp_rank=0, block_size=16)


def cuda_engine(device_index: int = 1) -> EngineMetadata:
    """``fake_engine`` with every region on GPU ``device_index``."""
    engine = fake_engine()
    ranks = [
        msgspec.structs.replace(
            rank,
            regions=[
                msgspec.structs.replace(region, memory="cuda", device_index=device_index) for region in rank.regions
            ],
        )
        for rank in engine.ranks
    ]
    return msgspec.structs.replace(engine, ranks=ranks)


def test_a_host_tensor_is_described_as_host_memory() -> None:
    region = region_from_tensor(torch.zeros(4, 2, 8), layer=3, kinds=("k",))
    assert (region.memory, region.device_index, region.place) == ("host", 0, HOST)
    assert KVCache.allocate(LAYOUT, 4).place == HOST


def test_tensors_on_other_devices_are_refused() -> None:
    with pytest.raises(ValueError, match="host or CUDA memory, not on meta"):
        region_from_tensor(torch.zeros(4, 2, 8, device="meta"), layer=0, kinds=("k",))


def test_the_memory_kind_and_device_cross_the_wire() -> None:
    engine = cuda_engine(device_index=5)
    reply = decode(encode(Metadata(PROTOCOL_VERSION, engine)))
    assert isinstance(reply, Metadata)
    places = {region.place for rank in reply.engine.ranks for region in rank.regions}
    assert places == {MemoryPlace("cuda", 5)}


@pytest.mark.parametrize(("field", "value"), [("memory", "tpu"), ("device_index", -1), ("device_index", 4096)])
def test_an_unknown_memory_kind_or_device_is_refused_when_decoded(field: str, value: object) -> None:
    raw = msgspec.msgpack.decode(encode(Metadata(PROTOCOL_VERSION, fake_engine())))
    raw["engine"]["ranks"][0]["regions"][0][field] = value
    with pytest.raises(msgspec.ValidationError, match=field):
        decode(msgspec.msgpack.encode(raw))


def test_a_cache_spread_over_two_memories_is_refused_naming_both() -> None:
    cache = KVCache.allocate(LAYOUT, 4)
    moved = [cache.regions[0], msgspec.structs.replace(cache.regions[1], memory="cuda", device_index=2)]
    with pytest.raises(ValueError, match=r"layer 0 is in host, layer 0 in cuda:2"):
        memory_of(moved)
    with pytest.raises(ValueError, match="share one memory"):
        KVCache(LAYOUT, cache.tensors[:2], moved)


def test_nixl_names_host_memory_dram_and_gpu_memory_vram() -> None:
    assert nixl_memory_type(HOST) == "DRAM"
    assert nixl_memory_type(MemoryPlace("cuda", 3)) == "VRAM"


def test_regions_without_the_new_fields_decode_as_host_memory() -> None:
    """A region as version 2 encoded it is host memory (what every version 2 cache was)."""
    raw = msgspec.to_builtins(fake_engine().ranks[0].regions[0])
    del raw["memory"], raw["device_index"]
    assert msgspec.convert(raw, KVRegion).place == HOST


@pytest.mark.parametrize(("server", "client"), [(PROTOCOL_VERSION, PROTOCOL_VERSION - 1), (2, PROTOCOL_VERSION)])
def test_mixed_protocol_versions_are_refused_naming_both(server: int, client: int) -> None:
    with (
        HandshakeServer(fake_engine(), protocol_version=server, supported_versions=frozenset({server})) as served,
        HandshakeClient(fake_fingerprint(), retries=0, protocol_version=client) as asking,
    ):
        with pytest.raises(HandshakeRefused) as caught:
            asking.fetch("127.0.0.1", served.port)
    assert caught.value.code == "unsupported_version"
    assert str(server) in caught.value.message and f"client speaks {client}" in caught.value.message
