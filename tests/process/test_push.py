"""Push over TCP: prefill ranks in their own process write a held request's blocks into a decode rank here (real
ZMQ, NIXL and UCX's tcp transport); refusals and failures fall back to reading, bad orders and setups are refused."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import pytest

from pd_transfer.bench.transfer.ucx_transports import ucx_transports
from pd_transfer.cluster.http_client import free_port
from pd_transfer.connector import messages
from pd_transfer.connector.cache import KVCache
from pd_transfer.connector.decode.rank import DecodeRank
from pd_transfer.connector.errors import LeaseNotConfirmed
from pd_transfer.connector.options import DecodeOptions, PrefillOptions
from pd_transfer.connector.prefill.rank import PrefillRank, serve_engine
from pd_transfer.connector.transports.nixl import push_orders
from pd_transfer.connector.transports.nixl.push_plans import plan_to_wire
from pd_transfer.connector.transports.requests import PullRequest
from pd_transfer.settings import Settings
from pd_transfer.sim.peer import PrefillProcess, PrefillSpec, fill_pattern
from pd_transfer.sim.verify import received_correctly
from pd_transfer.spec import KVCacheLayout, ModelFingerprint
from pd_transfer.topology.plan import SourcePlan
from pd_transfer.transfer.errors import TransferError

pytestmark = pytest.mark.timeout(240)

FINGERPRINT = ModelFingerprint(model="test-llama", dtype="bfloat16", num_layers=3, total_num_kv_heads=4, head_size=16)
NUM_BLOCKS = 40
TCP = {"UCX_TLS": "tcp,self"}


def layout(tp_size: int = 1, tp_rank: int = 0, block_size: int = 16) -> KVCacheLayout:
    return KVCacheLayout(fingerprint=FINGERPRINT, tp_size=tp_size, tp_rank=tp_rank, block_size=block_size)


@pytest.fixture(scope="module")
def tcp_settings() -> Iterator[Settings]:
    """UCX on TCP in this process's environment (UCX reads it here; prefill processes inherit it), and the settings
    both sides run with: push "auto" (so, over TCP only, push), every request pushed however small."""
    if "tcp" not in ucx_transports(TCP):
        pytest.skip("UCX has no tcp transport here")
    with pytest.MonkeyPatch.context() as patch:
        for key, value in TCP.items():
            patch.setenv(key, value)
        yield Settings(push="auto", push_min_bytes=0, ucx_tls=TCP["UCX_TLS"])


@pytest.fixture(scope="module")
def prefill(tcp_settings: Settings) -> Iterator[PrefillProcess]:
    spec = PrefillSpec("test-push-prefill", [layout()], NUM_BLOCKS, seed=11, settings=tcp_settings)
    with PrefillProcess(spec) as process:
        yield process


@pytest.fixture
def decode(tcp_settings: Settings) -> Iterator[DecodeRank]:
    cache = KVCache.allocate(layout(), NUM_BLOCKS)
    rank = DecodeRank(
        f"test-push-decode-{time.monotonic_ns()}", cache, DecodeOptions(settings=tcp_settings, transport="nixl")
    )
    try:
        yield rank
    finally:
        rank.close()


def test_a_held_request_is_pushed_exactly_and_counts_as_read(prefill: PrefillProcess, decode: DecodeRank) -> None:
    assert decode.ends["nixl"].pushes is not None  # auto: UCX_TLS names tcp only
    assert decode.push_ready(prefill.host, prefill.port, timeout_s=30)
    remote_ids, local_ids, tokens = [17, 3, 29, 8, 30, 12], [5, 33, 0, 21, 22, 9], 16 * 5 + 7
    prefill.request("hold", "req-pushed", remote_ids)
    stats = decode.pull_confirmed("req-pushed", prefill.host, prefill.port, remote_ids, local_ids, tokens)
    assert stats.pushed_peers == tuple(
        source.peer for source in decode.remotes.connect(prefill.host, prefill.port).sources
    )
    assert stats.bytes == 6 * 3 * 2 * 4 * 16 * 16 * 2
    assert stats.confirm_seconds < 1.0  # no LeaseConfirm asked: the write proved the lease
    assert received_correctly(decode.cache, local_ids, prefill.spec.caches(), remote_ids, tokens)
    untouched = sorted(set(range(NUM_BLOCKS)) - set(local_ids))
    for tensor in decode.cache.tensors:
        assert bool((tensor[untouched] == 0).all())
    assert prefill.wait_released("req-pushed", timeout_s=10) == [1]  # the write counted as the reader's report
    assert decode.confirmations.received == 0
    assert stats.pushed_bytes == stats.bytes


def test_an_unheld_request_is_read_instead_and_not_confirmed(prefill: PrefillProcess, decode: DecodeRank) -> None:
    assert decode.push_ready(prefill.host, prefill.port, timeout_s=30)
    remote_ids, local_ids = [1, 2], [3, 4]
    stats = decode.pull("req-never-held", prefill.host, prefill.port, remote_ids, local_ids, 20)
    assert stats.pushed_peers == ()  # refused with may_read: read as before
    assert decode.ends["nixl"].pushes is not None and decode.ends["nixl"].pushes.read_instead == 1
    assert received_correctly(decode.cache, local_ids, prefill.spec.caches(), remote_ids, 20)
    with pytest.raises(LeaseNotConfirmed):  # and the read's confirmation tells the truth
        decode.pull_confirmed("req-never-held-2", prefill.host, prefill.port, [5], [6], 16, confirm_timeout_s=10)


def test_block_ids_outside_the_lease_are_refused(prefill: PrefillProcess, decode: DecodeRank) -> None:
    assert decode.push_ready(prefill.host, prefill.port, timeout_s=30)
    prefill.request("hold", "req-narrow", [7])
    stats = decode.pull("req-narrow", prefill.host, prefill.port, [7, 8], [0, 1], 20)  # block 8 is not its own
    assert stats.pushed_peers == ()


def test_a_malformed_order_is_refused_without_a_read(prefill: PrefillProcess, decode: DecodeRank) -> None:
    # the decode validates ids before it orders; a reader that did not is refused by the prefill (no may_read)
    assert decode.push_ready(prefill.host, prefill.port, timeout_s=30)
    assert decode.ends["nixl"].pushes is not None
    prefill.request("hold", "req-malformed", [1])
    remote = decode.remotes.connect(prefill.host, prefill.port)
    malformed = PullRequest("req-malformed", [NUM_BLOCKS + 5], [0], 10)
    outcomes = decode.ends["nixl"].pushes.push(malformed, remote.sources, time.perf_counter() + 20)
    (outcome,) = outcomes.values()
    assert not outcome.ok and not outcome.may_read and "malformed" in outcome.reason
    for tensor in decode.cache.tensors:
        assert bool((tensor == 0).all())
    # and the prefill still pushes the next good order
    prefill.request("hold", "req-after-malformed", [2])
    assert decode.pull("req-after-malformed", prefill.host, prefill.port, [2], [3], 16).pushed_peers


def test_a_setup_outside_the_prefill_cache_is_refused_and_read_instead(
    prefill: PrefillProcess, decode: DecodeRank, monkeypatch: pytest.MonkeyPatch
) -> None:
    def shifted(plan: SourcePlan) -> messages.PushPlan:
        grid = plan.remote_grid.copy()
        grid[:, 0] += np.uint64(1 << 40)  # the prefill's rows moved to where it has no cache
        return plan_to_wire(dataclasses.replace(plan, remote_grid=grid))

    monkeypatch.setattr(push_orders, "plan_to_wire", shifted)
    assert not decode.push_ready(prefill.host, prefill.port, timeout_s=30)
    prefill.request("hold", "req-refused-setup", [4, 5])
    stats = decode.pull_confirmed("req-refused-setup", prefill.host, prefill.port, [4, 5], [6, 7], 32)
    assert stats.pushed_peers == ()
    assert received_correctly(decode.cache, [6, 7], prefill.spec.caches(), [4, 5], 32)


def test_a_request_below_the_push_size_is_read(prefill: PrefillProcess, tcp_settings: Settings) -> None:
    two_blocks = replace(tcp_settings, push_min_bytes=2 * 3 * 2 * 4 * 16 * 16 * 2)
    decode = DecodeRank(
        "test-push-small", KVCache.allocate(layout(), NUM_BLOCKS), DecodeOptions(settings=two_blocks, transport="nixl")
    )
    try:
        assert decode.push_ready(prefill.host, prefill.port, timeout_s=30)
        prefill.request("hold", "req-small", [9])
        assert decode.pull_confirmed("req-small", prefill.host, prefill.port, [9], [1], 16).pushed_peers == ()
        prefill.request("hold", "req-large-enough", [10, 11])
        stats = decode.pull_confirmed("req-large-enough", prefill.host, prefill.port, [10, 11], [2, 3], 32)
        assert stats.pushed_peers and stats.pushed_bytes == stats.bytes
    finally:
        decode.close()


def test_a_reader_dropped_by_the_prefill_sets_up_again(tcp_settings: Settings) -> None:
    # the prefill keeps max_readers readers: a third decode rank pushes the first out, whose next order is read
    # and asks it to set up again; its order after that is pushed
    cache = KVCache.allocate(layout(), NUM_BLOCKS)
    fill_pattern(cache, seed=4)
    rank = PrefillRank("test-push-evicting", cache, PrefillOptions(settings=tcp_settings))
    rank.ends["nixl"].writer.max_readers = 1
    server = serve_engine("test-push-evicting", [rank.rank_metadata])
    host, port = server.host, server.port
    first, second = (
        DecodeRank(
            f"test-push-reader-{n}",
            KVCache.allocate(layout(), NUM_BLOCKS),
            DecodeOptions(settings=tcp_settings, transport="nixl"),
        )
        for n in (1, 2)
    )
    try:
        assert first.push_ready(host, port, timeout_s=30) and second.push_ready(host, port, timeout_s=30)
        rank.hold("req-evicted", [1])
        assert first.pull_confirmed("req-evicted", host, port, [1], [2], 16).pushed_peers == ()  # read
        assert first.push_ready(host, port, timeout_s=30)  # set up again
        rank.hold("req-again", [3])
        assert first.pull_confirmed("req-again", host, port, [3], [4], 16).pushed_peers
        assert received_correctly(first.cache, [2, 4], [cache], [1, 3], 32)
    finally:
        first.close()
        second.close()
        server.stop()
        rank.close()


def test_a_decode_with_push_off_reads(prefill: PrefillProcess, tcp_settings: Settings) -> None:
    off = replace(tcp_settings, push="off")  # PD_TRANSFER_PUSH=off
    decode = DecodeRank(
        "test-push-off", KVCache.allocate(layout(), NUM_BLOCKS), DecodeOptions(settings=off, transport="nixl")
    )
    try:
        assert decode.ends["nixl"].pushes is None and not decode.push_ready(prefill.host, prefill.port, timeout_s=5)
        prefill.request("hold", "req-push-off", [9])
        assert decode.pull_confirmed("req-push-off", prefill.host, prefill.port, [9], [1], 16).pushed_peers == ()
    finally:
        decode.close()


def test_a_prefill_with_push_off_refuses_setups(tcp_settings: Settings) -> None:
    off = replace(tcp_settings, push="off")  # PD_TRANSFER_PUSH=off in the prefill's process
    with PrefillProcess(PrefillSpec("test-push-off-prefill", [layout()], NUM_BLOCKS, seed=3, settings=off)) as prefill:
        cache = KVCache.allocate(layout(), NUM_BLOCKS)
        decode = DecodeRank("test-push-asks", cache, DecodeOptions(push="on", settings=tcp_settings, transport="nixl"))
        try:
            assert not decode.push_ready(prefill.host, prefill.port, timeout_s=30)
            prefill.request("hold", "req-prefill-off", [2, 3])
            stats = decode.pull_confirmed("req-prefill-off", prefill.host, prefill.port, [2, 3], [4, 5], 32)
            assert stats.pushed_peers == ()
            assert received_correctly(decode.cache, [4, 5], prefill.spec.caches(), [2, 3], 32)
        finally:
            decode.close()


@pytest.mark.parametrize("decode_block_size", [16, 32])
def test_two_prefill_ranks_into_one_decode_rank(tcp_settings: Settings, decode_block_size: int) -> None:
    # TP 2 -> TP 1: each prefill rank writes its heads; 16-token blocks into 32-token ones need a fix-up after the
    # transfer, and such plans are read (staged), never pushed
    prefill_layouts = [layout(2, rank) for rank in range(2)]
    spec = PrefillSpec("test-push-tp2", prefill_layouts, NUM_BLOCKS, seed=9, settings=tcp_settings)
    with PrefillProcess(spec) as prefill:
        cache = KVCache.allocate(layout(block_size=decode_block_size), NUM_BLOCKS)
        decode = DecodeRank("test-push-tp1", cache, DecodeOptions(push="on", settings=tcp_settings, transport="nixl"))
        try:
            pushing = decode.remote_plan(prefill.host, prefill.port).postprocess is None
            assert pushing == (decode_block_size == 16)
            assert decode.push_ready(prefill.host, prefill.port, timeout_s=10) == pushing
            remote_ids, local_ids, tokens = [11, 4, 20, 6], [3, 9, 1, 7][: 64 // decode_block_size], 60
            prefill.request("hold", "req-tp2", remote_ids)
            stats = decode.pull_confirmed("req-tp2", prefill.host, prefill.port, remote_ids, local_ids, tokens)
            assert len(stats.pushed_peers) == (2 if pushing else 0)
            assert received_correctly(decode.cache, local_ids, prefill.spec.caches(), remote_ids, tokens)
            assert prefill.wait_released("req-tp2", timeout_s=10) == [1, 1]
        finally:
            decode.close()


def test_an_order_to_a_dead_prefill_fails_fast_and_reads_its_restart(tcp_settings: Settings) -> None:
    # the prefill dies after the decode connected: the order goes nowhere, and the probes of the silent rank give
    # the disconnect away long before the 30 s read timeout; a prefill restarted at the address is then read from
    spec = PrefillSpec("test-push-dies", [layout()], NUM_BLOCKS, seed=2, port=free_port(), settings=tcp_settings)
    prefill = PrefillProcess(spec)
    cache = KVCache.allocate(layout(), NUM_BLOCKS)
    decode = DecodeRank("test-push-orphan", cache, DecodeOptions(push="on", settings=tcp_settings, transport="nixl"))
    try:
        assert decode.push_ready(prefill.host, prefill.port, timeout_s=30)
        prefill.kill()
        started = time.monotonic()
        with pytest.raises(TransferError):  # no new incarnation there: the disconnect is raised
            decode.pull("req-orphan", spec.host, spec.port, [1], [2], 16, timeout_s=30)
        assert time.monotonic() - started < 15
        with PrefillProcess(spec) as restarted:
            restarted.request("hold", "req-after-restart", [1])
            stats = decode.pull_confirmed("req-after-restart", spec.host, spec.port, [1], [2], 16)
            assert received_correctly(decode.cache, [2], spec.caches(), [1], 16)
            assert stats.bytes > 0
    finally:
        decode.close()
        prefill.close()
