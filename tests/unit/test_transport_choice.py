"""Which transport a decode reads a prefill engine with: same-host IPC only where every rank read offered it, is on
this host, in the same kind of memory as ours and (GPU) on a GPU ours can reach; NIXL otherwise; the setting wins."""

from __future__ import annotations

import msgspec
import pytest

from pd_transfer.connector.config import ConfigError, ConnectorConfig
from pd_transfer.connector.decode.transport_choice import choose_transport
from pd_transfer.handshake.messages import CmaSegment, CudaSegment, HostSegment, RankIpc, RankMetadata
from pd_transfer.settings import DEFAULTS
from pd_transfer.sim.handshake_server import fake_engine
from pd_transfer.spec import HOST, MemoryPlace, TransportSetting

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


def choose(
    setting: TransportSetting, local: MemoryPlace, *ranks: RankMetadata, packed: bool = False
) -> tuple[str, str]:
    choice = choose_transport(
        setting, local, list(ranks), BOOT, packed=packed, reach=reachable, pid_namespace=NAMESPACE
    )
    return choice.transport, choice.reason


def test_same_host_shareable_host_memory_is_copied_through_host_ipc() -> None:
    assert choose("auto", HOST, host_rank(), host_rank())[0] == "host_ipc"
    assert choose("ipc", HOST, host_rank())[0] == "host_ipc"


def test_a_reachable_gpu_on_this_host_is_copied_through_cuda_ipc() -> None:
    transport, reason = choose("auto", GPU0, cuda_rank())
    assert transport == "cuda_ipc" and "cuda:0" in reason


def test_other_host_memory_in_our_pid_namespace_is_read_in_place() -> None:
    transport, reason = choose("auto", HOST, cma_rank(), cma_rank())
    assert transport == "host_cma" and "pid namespace" in reason
    assert choose("ipc", HOST, cma_rank())[0] == "host_cma"


def test_ranks_offering_different_kinds_read_with_nixl() -> None:
    transport, reason = choose("auto", HOST, host_rank(), cma_rank())
    assert transport == "nixl" and "different kinds of IPC" in reason


def test_the_setting_nixl_never_uses_ipc() -> None:
    assert choose("nixl", HOST, host_rank()) == ("nixl", "transport is set to nixl")


@pytest.mark.parametrize(
    ("local", "rank", "why"),
    [
        (HOST, fake_engine().ranks[1], "rank 1: no IPC offered"),
        (HOST, host_rank(boot_id="another-boot"), "rank 0: on another host"),
        (GPU0, host_rank(), "rank 0: its cache is in host memory, ours in cuda:0"),
        (HOST, cuda_rank(), "rank 0: its cache is in GPU memory, ours in host"),
        (GPU0, cuda_rank(uuid="GPU-b"), "rank 0: cuda:0 cannot access GPU-b"),
        (HOST, cma_rank(pid_namespace=NAMESPACE + 1), "rank 0: its process is in another pid namespace"),
        (GPU0, cma_rank(), "rank 0: its cache is in host memory, ours in cuda:0"),
    ],
)
def test_everything_else_reads_with_nixl_saying_why(local: MemoryPlace, rank: RankMetadata, why: str) -> None:
    readable = host_rank() if local.is_host else cuda_rank()
    transport, reason = choose("auto", local, readable, rank)
    assert transport == "nixl" and why in reason


def test_packed_blocks_of_another_size_read_with_nixl() -> None:
    assert choose("auto", HOST, host_rank(), packed=True)[0] == "nixl"


def test_the_transport_setting_is_typed() -> None:
    assert ConnectorConfig.from_dict({}, env={}, settings=DEFAULTS).transport == "auto"
    assert ConnectorConfig.from_dict({"transport": "ipc"}, env={}, settings=DEFAULTS).transport == "ipc"
    with pytest.raises(ConfigError, match="transport"):
        ConnectorConfig.from_dict({"transport": "cuda"}, env={}, settings=DEFAULTS)
