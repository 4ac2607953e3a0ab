"""Reads in place, with real processes: a prefill in a child process offers its host cache (ordinary memory, not
shareable) over the real, authenticated side channel; a decode here, in the same pid namespace, probes it and reads
requests straight out of its memory with process_vm_readv, block-size regroups landing in place, then ReadDone and
the lease confirmation go as over NIXL. And what ends it: the setting nixl, a version 3 client, a probe that
differs, a prefill that exits or restarts. (A prefill that offers nothing: test_ipc_pull.py.)"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import msgspec
import pytest
import same_host
from engine_specs import kv_layout as kv_layout_of
from prometheus_client import generate_latest
from same_host import pull

from pd_transfer.connector.decode.rank import DecodeRank
from pd_transfer.handshake import HandshakeClient
from pd_transfer.handshake.messages import CmaSegment, RankIpc, RankMetadata, decode_rank_ipc
from pd_transfer.metrics import TransferMetrics
from pd_transfer.same_host.cma_engine import CmaEngine
from pd_transfer.same_host.common import IpcUnavailable
from pd_transfer.sim.peer import PrefillProcess, PrefillSpec
from pd_transfer.spec import KVCacheLayout, ModelFingerprint

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process_vm_readv is Linux's"),
]

FINGERPRINT = ModelFingerprint(model="cma-llama", dtype="bfloat16", num_layers=2, total_num_kv_heads=4, head_size=128)
SECRET = "cma-test-secret"
BLOCKS = same_host.BLOCKS


def layout(block_size: int = 16, tp: int = 1, rank: int = 0, kv_layout: str = "HND") -> KVCacheLayout:
    return kv_layout_of(FINGERPRINT, block_size, tp, rank, kv_layout)


def spec(engine_id: str, *, tp: int = 1, port: int = 0, seed: int = 7) -> PrefillSpec:
    layouts = [layout(16, tp, rank) for rank in range(tp)]
    return PrefillSpec(engine_id, layouts, BLOCKS, seed=seed, secret=SECRET, port=port)


@pytest.fixture(scope="module")
def tp2() -> Iterator[PrefillProcess]:
    with PrefillProcess(spec("cma-prefill-tp2", tp=2)) as process:
        yield process


@pytest.fixture(scope="module")
def tp1() -> Iterator[PrefillProcess]:
    with PrefillProcess(spec("cma-prefill-tp1")) as process:
        yield process


def decode_rank(name: str, decode_layout: KVCacheLayout, transport: str = "auto", **more: object) -> DecodeRank:
    return same_host.decode_rank(name, decode_layout, SECRET, transport, **more)


@pytest.mark.parametrize(
    ("prefill", "decode_layout", "in_place"),
    [
        ("tp1", layout(16), True),
        ("tp2", layout(16), True),
        ("tp1", layout(64), True),  # a block-size regroup done by the copy: a piece per head, no fix-up
        ("tp2", layout(64, kv_layout="NHD"), False),  # a head per token: the engine plan's fix-up after the reads
    ],
    ids=["homogeneous", "tp2-to-tp1", "block16-to-64", "tp2-to-tp1-block64-NHD"],
)
def test_a_same_host_decode_reads_in_place_and_the_lease_is_confirmed(
    request: pytest.FixtureRequest, prefill: str, decode_layout: KVCacheLayout, in_place: bool
) -> None:
    process: PrefillProcess = request.getfixturevalue(prefill)
    metrics = TransferMetrics()
    name = f"cma-{prefill}-{decode_layout.block_size}-{decode_layout.layout}"
    decode = decode_rank(f"{name}-decode", decode_layout, metrics=metrics)
    try:
        assert pull(decode, process, name) == ("host_cma", True)
        assert decode.reads_confirmed == 1  # ReadDone reached every rank read, which confirmed the held blocks
        assert process.wait_released(name, timeout_s=10) == [1] * len(process.spec.layouts)
        remote = decode.remotes.get(process.host, process.port)
        assert remote is not None and remote.link.opened is not None
        assert (remote.link.opened.plan.postprocess is None) is in_place
        assert pull(decode, process, f"{name}-again", first=20) == ("host_cma", True)
    finally:
        decode.close()
    text = generate_latest(metrics.registry).decode()
    assert 'pd_transfer_pulls_total{outcome="ok",transport="host_cma"} 2.0' in text


def offer_of(rank: RankMetadata, transport: str) -> RankIpc | None:
    payload = rank.offer(transport)
    return None if payload is None else decode_rank_ipc(payload)


def test_the_offer_goes_to_proven_clients_only_and_to_older_ones_as_they_read_it(tp1: PrefillProcess) -> None:
    with HandshakeClient(FINGERPRINT, secret=SECRET, retries=0) as unproven:
        assert all(rank.offer("host_cma") is None for rank in unproven.fetch(tp1.host, tp1.port).ranks)
    for version in (5, 4):  # a version 4 client is sent it as the rank's ipc, read back as the offer
        with HandshakeClient(
            FINGERPRINT, secret=SECRET, retries=0, prove_host=True, protocol_version=version
        ) as proven:
            offers = [offer_of(rank, "host_cma") for rank in proven.fetch(tp1.host, tp1.port).ranks]
        assert all(offer is not None and offer.pid == tp1.pid != os.getpid() for offer in offers)
        assert all(isinstance(segment, CmaSegment) for offer in offers for segment in offer.segments)  # type: ignore[union-attr]
    with HandshakeClient(FINGERPRINT, secret=SECRET, retries=0, prove_host=True, protocol_version=3) as old:
        assert all(rank.offer("host_cma") is None for rank in old.fetch(tp1.host, tp1.port).ranks)  # not for it


def test_the_setting_nixl_reads_with_nixl(tp1: PrefillProcess) -> None:
    decode = decode_rank("cma-decode-nixl", layout(), transport="nixl")
    try:
        assert pull(decode, tp1, "cma-nixl-read") == ("nixl", True)
    finally:
        decode.close()


def test_a_probe_that_differs_is_not_read_in_place(tp1: PrefillProcess) -> None:
    """Metadata naming another process (here: this one), or other probe bytes, is refused at open."""
    with HandshakeClient(FINGERPRINT, secret=SECRET, retries=0, prove_host=True) as client:
        engine = client.fetch(tp1.host, tp1.port)
    decode = decode_rank("cma-decode-probe", layout())
    try:
        plan = decode.remotes.connect(tp1.host, tp1.port).plan
        offer = offer_of(engine.ranks[0], "host_cma")
        assert offer is not None and isinstance(offer.segments[0], CmaSegment)
        segment = offer.segments[0]
        elsewhere = msgspec.structs.replace(offer, pid=os.getpid())
        wrong = msgspec.structs.replace(offer, segments=[msgspec.structs.replace(segment, probe=bytes(16))])
        for bad in (elsewhere, wrong):
            with pytest.raises(IpcUnavailable, match="is not the prefill"):
                CmaEngine.open(engine.engine_id, {0: bad}, plan)
        opened = CmaEngine.open(engine.engine_id, {0: offer}, plan)
        assert not opened.owner_exited()
        opened.close()
        assert opened.closed
    finally:
        decode.close()


def test_a_restarted_prefill_is_probed_afresh_and_an_exited_one_is_never_read() -> None:
    decode = decode_rank("cma-decode-restart", layout())
    try:
        with PrefillProcess(spec("cma-restart")) as old:
            port = old.port
            assert pull(decode, old, "cma-before") == ("host_cma", True)
            old_remote = decode.remotes.get(old.host, port)
            assert old_remote is not None and old_remote.link.opened is not None
        assert old_remote.link.opened.owner_exited()  # its pid may name another process now: never read again
        with PrefillProcess(spec("cma-restart", port=port, seed=8)) as new:
            assert pull(decode, new, "cma-after") == ("host_cma", True)  # the address handshaken afresh
            assert old_remote.link.opened.closed
            remote = decode.remotes.get(new.host, port)
            assert remote is not None and remote.link.opened is not None
            assert remote.link.opened.sources[0].pid == new.pid
    finally:
        decode.close()
