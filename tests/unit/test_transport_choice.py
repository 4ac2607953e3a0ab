"""Which transport a decode reads a prefill engine with: the first its setting names that reads it; a same-host one
only where every rank read offered its kind, is on this host, in the same kind of memory as ours and (GPU) on a GPU
ours can reach; NIXL reads any."""

from __future__ import annotations

import msgspec
import pytest

from pd_transfer.connector.config import ConfigError, ConnectorConfig
from pd_transfer.connector.transports.ipc.choice import SameHostKind, refusal
from pd_transfer.connector.transports.registry import UnknownTransport, select
from pd_transfer.handshake.messages import CmaSegment, CudaSegment, HostSegment, RankIpc, RankMetadata
from pd_transfer.settings import DEFAULTS
from pd_transfer.sim.handshake_server import fake_engine
from pd_transfer.spec import HOST, MemoryPlace

BOOT = "5c0ffee0-0000-4000-8000-000000000001"
GPU0 = MemoryPlace("cuda", 0)
NAMESPACE = 4026531836  # our pid namespace, as the inode of /proc/self/ns/pid


def host_rank(boot_id: str = BOOT) -> RankMetadata:
    segment = HostSegment(base_address=0x7F00_0000_0000, nbytes=1 << 20, pid=1234, fd=7, name="pd-transfer-kv-0")
    offer = RankIpc(boot_id=boot_id, pid=1234, pid_namespace=1, segments=[segment])
    return msgspec.structs.replace(fake_engine().ranks[0], ipc=offer)


def cma_rank(pid_namespace: int = NAMESPACE) -> RankMetadata:
    segment = CmaSegment(probe_address=0x7F00_0000_1000, probe=bytes(range(16)))
    offer = RankIpc(boot_id=BOOT, pid=1234, pid_namespace=pid_namespace, segments=[segment])
    return msgspec.structs.replace(fake_engine().ranks[0], ipc=offer)


def cuda_rank(uuid: str = "GPU-a") -> RankMetadata:
    rank = fake_engine().ranks[0]
    regions = [msgspec.structs.replace(region, memory="cuda", device_index=3) for region in rank.regions]
    segment = CudaSegment(
        base_address=0x7F00_0000_0000,
        nbytes=1 << 20,
        device_uuid=uuid,
        handle=b"h" * 64,
        offset_bytes=0,
        ref_counter=b"/torch_1",
        ref_counter_offset=0,
        event_handle=b"e" * 64,
        event_sync_required=True,
    )
    offer = RankIpc(boot_id=BOOT, pid=1234, pid_namespace=1, segments=[segment])
    return msgspec.structs.replace(rank, regions=regions, ipc=offer)


def reachable(local: int, uuid: str) -> str:
    return "" if uuid == "GPU-a" else f"cuda:{local} cannot access {uuid}"


def why_not(kind: SameHostKind, local: MemoryPlace, *ranks: RankMetadata) -> str:
    """Why ``kind`` does not read ``ranks`` into a cache at ``local`` ("" when it does)."""
    offers = [(rank.tp_rank, rank.ipc) for rank in ranks]
    return refusal(kind, local, offers, BOOT, reach=reachable, pid_namespace=NAMESPACE)


def first_transport(setting: str, local: MemoryPlace, *ranks: RankMetadata) -> str:
    """The first transport of ``setting`` that reads ``ranks`` (NIXL reads any): as a decode rank asks them."""
    for transport in select(setting):
        if transport.name == "nixl" or not why_not(transport.name, local, *ranks):  # type: ignore[arg-type]
            return transport.name
    return ""


def test_same_host_shareable_host_memory_is_copied_through_host_ipc() -> None:
    assert first_transport("auto", HOST, host_rank(), host_rank()) == "host_ipc"
    assert first_transport("ipc", HOST, host_rank()) == "host_ipc"


def test_a_reachable_gpu_on_this_host_is_copied_through_cuda_ipc() -> None:
    assert why_not("cuda_ipc", GPU0, cuda_rank()) == ""
    assert first_transport("auto", GPU0, cuda_rank()) == "cuda_ipc"


def test_other_host_memory_in_our_pid_namespace_is_read_in_place() -> None:
    assert first_transport("auto", HOST, cma_rank(), cma_rank()) == "host_cma"
    assert first_transport("ipc", HOST, cma_rank()) == "host_cma"


def test_ranks_offering_different_kinds_read_with_nixl() -> None:
    assert "rank 0: its offer holds no host_cma segments only" in why_not("host_cma", HOST, host_rank(), cma_rank())
    assert "its offer holds no host_ipc segments only" in why_not("host_ipc", HOST, host_rank(), cma_rank())
    assert first_transport("auto", HOST, host_rank(), cma_rank()) == "nixl"


def test_the_setting_nixl_never_uses_ipc_and_ipc_never_nixl() -> None:
    assert [transport.name for transport in select("nixl")] == ["nixl"]
    assert first_transport("nixl", HOST, host_rank()) == "nixl"
    assert first_transport("ipc", HOST, fake_engine().ranks[1]) == ""  # the engine is refused


@pytest.mark.parametrize(
    ("kind", "local", "rank", "why"),
    [
        ("host_ipc", HOST, fake_engine().ranks[1], "rank 1: no host_ipc offer"),
        ("host_ipc", HOST, host_rank(boot_id="another-boot"), "rank 0: on another host"),
        ("host_ipc", GPU0, host_rank(), "our cache is in cuda:0, which host_ipc does not read into"),
        ("cuda_ipc", HOST, cuda_rank(), "our cache is in host, which cuda_ipc does not read into"),
        ("cuda_ipc", GPU0, host_rank(), "rank 0: its offer holds no cuda_ipc segments only"),
        ("cuda_ipc", GPU0, cuda_rank(uuid="GPU-b"), "rank 0: cuda:0 cannot access GPU-b"),
        ("host_cma", HOST, cma_rank(pid_namespace=NAMESPACE + 1), "rank 0: its process is in another pid namespace"),
        ("host_cma", GPU0, cma_rank(), "our cache is in cuda:0, which host_cma does not read into"),
    ],
)
def test_a_same_host_transport_refuses_the_rest_saying_why(
    kind: SameHostKind, local: MemoryPlace, rank: RankMetadata, why: str
) -> None:
    assert why in why_not(kind, local, rank)


def test_the_transport_setting_is_checked_when_read_and_resolved_when_a_rank_is_made() -> None:
    assert ConnectorConfig.from_dict({}, env={}, settings=DEFAULTS).transport == "auto"
    assert ConnectorConfig.from_dict({"transport": "ipc"}, env={}, settings=DEFAULTS).transport == "ipc"
    assert ConnectorConfig.from_dict({"transport": "toy, nixl"}, env={}, settings=DEFAULTS).transport == "toy, nixl"
    for bad in ("", "Cuda IPC", "nixl, nixl", "a:b:c"):
        with pytest.raises(ConfigError, match="transport"):
            ConnectorConfig.from_dict({"transport": bad}, env={}, settings=DEFAULTS)
    assert [transport.name for transport in select("auto")] == ["cuda_ipc", "host_ipc", "host_cma", "nixl"]
    assert [transport.name for transport in select("host_cma, auto")] == ["host_cma", "cuda_ipc", "host_ipc", "nixl"]
    with pytest.raises(UnknownTransport, match="no transport is named 'cuda'; known: auto, ipc, nixl"):
        select("cuda")
    with pytest.raises(UnknownTransport, match="module 'no_such_module' does not import"):
        select("no_such_module:TRANSPORT")
    with pytest.raises(UnknownTransport, match="is no transport: it has no name, same_host, prefill_end, decode_end"):
        select("json:dumps")
