"""The one-node fast path with real processes, on host memory: a prefill in a child process offers its cache (in
shareable memory) over the real, authenticated side channel; a decode here proves it is on the same host, opens it
and copies requests out of it (the same code the CUDA IPC path runs; tests/gpu runs it on a GPU), then ReadDone and
the lease confirmation go as over NIXL. And its lifetimes: handles closed when the engine is forgotten or restarts,
a prefill that exits while its memory is open here."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import same_host
from engine_specs import kv_layout as kv_layout_of
from prometheus_client import generate_latest
from same_host import pull

from pd_transfer.connector.decode.rank import DecodeRank
from pd_transfer.connector.messages import READ_CHECKS_OFFER
from pd_transfer.connector.transports.seam import NoTransport
from pd_transfer.handshake import HandshakeClient
from pd_transfer.handshake.messages import HostSegment, decode_rank_ipc
from pd_transfer.metrics import TransferMetrics
from pd_transfer.sim.peer import PrefillProcess, PrefillSpec
from pd_transfer.spec import KVCacheLayout, ModelFingerprint

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(not Path("/dev/shm").is_dir() or not hasattr(os, "memfd_create"), reason="needs Linux"),
]

FINGERPRINT = ModelFingerprint(model="ipc-llama", dtype="bfloat16", num_layers=2, total_num_kv_heads=4, head_size=16)
SECRET = "ipc-test-secret"
BLOCKS = same_host.BLOCKS


def layout(block_size: int = 16, tp: int = 1, rank: int = 0, kv_layout: str = "HND") -> KVCacheLayout:
    return kv_layout_of(FINGERPRINT, block_size, tp, rank, kv_layout)


def spec(engine_id: str, *, tp: int = 1, offer: bool = True, port: int = 0, seed: int = 7) -> PrefillSpec:
    layouts = [layout(16, tp, rank) for rank in range(tp)]
    transport = "auto" if offer else "nixl"
    return PrefillSpec(
        engine_id, layouts, BLOCKS, seed=seed, secret=SECRET, port=port, shareable=True, transport=transport
    )


@pytest.fixture(scope="module")
def shared() -> Iterator[PrefillProcess]:
    with PrefillProcess(spec("ipc-prefill", tp=2)) as process:
        yield process


def decode_rank(name: str, decode_layout: KVCacheLayout, transport: str = "auto", **more: object) -> DecodeRank:
    return same_host.decode_rank(name, decode_layout, SECRET, transport, **more)


def mapped_memfds() -> set[str]:
    """Names of the shareable host buffers mapped into this process now."""
    return {
        line.split("/memfd:")[1].split(" ")[0]
        for line in Path("/proc/self/maps").read_text().splitlines()
        if "/memfd:pd-transfer-kv-" in line
    }


@pytest.mark.parametrize(
    "decode_layout", [layout(16), layout(64, kv_layout="NHD")], ids=["tp2-to-tp1", "tp2-to-tp1-block64-NHD"]
)
def test_a_same_host_decode_copies_through_ipc_and_the_lease_is_confirmed(
    shared: PrefillProcess, decode_layout: KVCacheLayout
) -> None:
    metrics = TransferMetrics()
    name = f"ipc-{decode_layout.block_size}"
    decode = decode_rank(f"{name}-decode", decode_layout, metrics=metrics)
    try:
        transport, verified = pull(decode, shared, name)
        assert (transport, verified) == ("host_ipc", True)
        assert decode.reads_confirmed == 1  # ReadDone reached both ranks read, which confirmed the held blocks
        assert shared.wait_released(name, timeout_s=10) == [1, 1]
    finally:
        decode.close()
    text = generate_latest(metrics.registry).decode()
    assert 'pd_transfer_pulls_total{outcome="ok",transport="host_ipc"} 1.0' in text


def test_handles_go_only_to_a_client_that_proves_it_is_on_the_host(shared: PrefillProcess) -> None:
    with HandshakeClient(FINGERPRINT, secret=SECRET, retries=0) as unproven:
        ranks = unproven.fetch(shared.host, shared.port).ranks  # no same-host offer: only the read checks' (any host)
        assert all([offer.transport for offer in rank.offers] == [READ_CHECKS_OFFER] for rank in ranks)
    with HandshakeClient(FINGERPRINT, secret=SECRET, retries=0, prove_host=True) as proven:
        offered = proven.fetch(shared.host, shared.port).ranks
    offers = [decode_rank_ipc(payload) for rank in offered if (payload := rank.offer("host_ipc")) is not None]
    assert len(offers) == len(offered) and all(offer.pid != os.getpid() for offer in offers)
    assert all(isinstance(segment, HostSegment) for offer in offers for segment in offer.segments)
    assert all(rank.offer("host_cma") is not None for rank in offered)  # any host cache may be read in place too


def test_the_setting_nixl_reads_with_nixl_and_ipc_refuses_a_prefill_that_offers_none(shared: PrefillProcess) -> None:
    decode = decode_rank("ipc-decode-nixl", layout(), transport="nixl")
    try:
        assert pull(decode, shared, "nixl-read") == ("nixl", True)
    finally:
        decode.close()
    with PrefillProcess(spec("private-prefill", offer=False)) as private:
        decode = decode_rank("ipc-decode-forced", layout(), transport="ipc")
        try:
            with pytest.raises(NoTransport, match=r"engine private-prefill .*host_ipc: prefill rank 0: no host_ipc"):
                decode.connect(private.host, private.port)
        finally:
            decode.close()
        decode = decode_rank("ipc-decode-auto", layout())
        try:
            assert pull(decode, private, "private-read") == ("nixl", True)
        finally:
            decode.close()


def test_forgetting_an_engine_closes_its_handles(shared: PrefillProcess) -> None:
    before = mapped_memfds()
    decode = decode_rank("ipc-decode-forget", layout(16, 2, 0))
    try:
        assert pull(decode, shared, "forget-1") == ("host_ipc", True)
        opened = mapped_memfds() - before
        assert opened, "the prefill's memory is mapped here while the engine is connected"
        decode.forget(shared.host, shared.port)
        gc.collect()
        assert not opened & mapped_memfds()
        assert pull(decode, shared, "forget-2") == ("host_ipc", True)  # connected afresh
    finally:
        decode.close()
    gc.collect()
    assert not (mapped_memfds() - before), "closing the decode rank closes every handle"


def test_a_restarted_prefill_is_opened_afresh_and_its_old_memory_closed() -> None:
    decode = decode_rank("ipc-decode-restart", layout())
    try:
        with PrefillProcess(spec("restart-prefill")) as old:
            port = old.port
            assert pull(decode, old, "before") == ("host_ipc", True)
            stale = mapped_memfds()
            old_remote = decode.remotes.get(old.host, port)
            assert old_remote is not None and old_remote.link.opened is not None
        # the old prefill exited while its memory was open here: the mapping stays readable, and is known stale
        assert old_remote.link.opened.owner_exited()
        assert old_remote.link.opened.sources[0].remote_segments[0].sum().item() != 0
        with PrefillProcess(spec("restart-prefill", port=port, seed=8)) as new:
            assert pull(decode, new, "after") == ("host_ipc", True)  # its process exited: the address handshaken afresh
            assert old_remote.link.opened.closed
            gc.collect()
            assert not stale & mapped_memfds()
    finally:
        decode.close()
