"""Foundation end to end: a prefill engine in its own process, a decode rank here, real ZMQ and NIXL."""

from __future__ import annotations

import time

import pytest

from pd_transfer.connector.cache import KVCache
from pd_transfer.connector.decode.rank import DecodeRank
from pd_transfer.connector.options import DecodeOptions
from pd_transfer.handshake.errors import AuthenticationError, HandshakeTimeout, IncompatiblePeer
from pd_transfer.settings import DEFAULTS
from pd_transfer.sim.peer import PrefillProcess, PrefillSpec
from pd_transfer.sim.verify import received_correctly
from pd_transfer.spec import KVCacheLayout, ModelFingerprint
from pd_transfer.transfer.errors import TransferError

FINGERPRINT = ModelFingerprint(model="test-llama", dtype="bfloat16", num_layers=3, total_num_kv_heads=4, head_size=16)
LAYOUT = KVCacheLayout(fingerprint=FINGERPRINT, tp_size=1, tp_rank=0, block_size=16)
NUM_BLOCKS = 40


@pytest.fixture(scope="module")
def prefill() -> PrefillProcess:
    with PrefillProcess(PrefillSpec("test-prefill", [LAYOUT], NUM_BLOCKS, seed=5)) as process:
        yield process


@pytest.fixture(scope="module")
def expected(prefill: PrefillProcess) -> list[KVCache]:
    return prefill.spec.caches()


def test_scattered_pull_is_exact_and_releases_the_request(prefill: PrefillProcess, expected: list[KVCache]) -> None:
    decode = DecodeRank("test-decode", KVCache.allocate(LAYOUT, NUM_BLOCKS), DecodeOptions(settings=DEFAULTS))
    try:
        remote_ids, local_ids = [17, 3, 29, 8, 30, 12], [5, 33, 0, 21, 22, 9]
        tokens = 16 * 5 + 7  # last block partly filled
        stats = decode.pull("req-scattered", prefill.host, prefill.port, remote_ids, local_ids, tokens)
        assert stats.bytes == 6 * 3 * 2 * 4 * 16 * 16 * 2  # blocks x layers x K,V x heads x tokens x dim x bf16
        assert received_correctly(decode.cache, local_ids, expected, remote_ids, tokens)
        untouched = sorted(set(range(NUM_BLOCKS)) - set(local_ids))
        for tensor in decode.cache.tensors:
            assert bool((tensor[untouched] == 0).all())
        assert prefill.wait_released("req-scattered", timeout_s=10) == [1]

        # a second request to the same engine reuses the handshake and the prepared descriptor lists
        decode.pull("req-second", prefill.host, prefill.port, [1, 2], [3, 4], 20)
        assert received_correctly(decode.cache, [3, 4], expected, [1, 2], 20)
        assert decode.client.handshakes_performed == 1
        assert prefill.wait_released("req-second", timeout_s=10) == [1]
    finally:
        decode.close()


def test_bad_block_ids_are_refused_before_any_read(prefill: PrefillProcess) -> None:
    decode = DecodeRank("test-decode-bad", KVCache.allocate(LAYOUT, NUM_BLOCKS), DecodeOptions(settings=DEFAULTS))
    try:
        for remote_ids, local_ids, tokens in (
            ([NUM_BLOCKS], [0], 10),  # remote id out of range
            ([0], [-1], 10),  # negative local id
            ([0, 1], [2], 20),  # fewer local blocks than the tokens need
            ([0], [1], 40),  # more tokens than the blocks hold
        ):
            with pytest.raises(ValueError):
                decode.pull("req-bad", prefill.host, prefill.port, remote_ids, local_ids, tokens)
        for tensor in decode.cache.tensors:
            assert bool((tensor == 0).all())
    finally:
        decode.close()


def test_mismatched_model_is_refused_naming_the_field(prefill: PrefillProcess) -> None:
    other = KVCacheLayout(
        fingerprint=ModelFingerprint(
            model="test-llama", dtype="bfloat16", num_layers=3, total_num_kv_heads=4, head_size=32
        ),
        tp_size=1,
        tp_rank=0,
        block_size=16,
    )
    decode = DecodeRank("test-decode-other", KVCache.allocate(other, 4), DecodeOptions(settings=DEFAULTS))
    try:
        with pytest.raises(IncompatiblePeer, match=r"head_size: (32 != 16|16 != 32)"):
            decode.connect(prefill.host, prefill.port)
    finally:
        decode.close()


def test_secret_side_channel() -> None:
    spec = PrefillSpec("test-prefill-secret", [LAYOUT], 8, seed=6, secret="s3cret")
    with PrefillProcess(spec) as prefill:
        stranger = DecodeRank("test-decode-stranger", KVCache.allocate(LAYOUT, 8), DecodeOptions(settings=DEFAULTS))
        wrong = DecodeRank(
            "test-decode-wrong", KVCache.allocate(LAYOUT, 8), DecodeOptions(settings=DEFAULTS, secret="guess")
        )
        friend = DecodeRank(
            "test-decode-friend", KVCache.allocate(LAYOUT, 8), DecodeOptions(settings=DEFAULTS, secret="s3cret")
        )
        try:
            with pytest.raises(AuthenticationError):
                stranger.connect(prefill.host, prefill.port)
            with pytest.raises(AuthenticationError):
                wrong.connect(prefill.host, prefill.port)
            friend.pull("req-secret", prefill.host, prefill.port, [2, 5], [7, 1], 30)
            assert received_correctly(friend.cache, [7, 1], spec.caches(), [2, 5], 30)
        finally:
            for decode in (stranger, wrong, friend):
                decode.close()


def test_dead_prefill_gives_a_clear_error_and_a_fresh_handshake_after_restart() -> None:
    spec = PrefillSpec("test-prefill-dies", [LAYOUT], 8, seed=7)
    decode = DecodeRank(
        "test-decode-survivor",
        KVCache.allocate(LAYOUT, 8),
        DecodeOptions(settings=DEFAULTS, handshake_timeout_s=1.0, transport="nixl"),
    )  # NIXL's own disconnect (a decode on the prefill's host reads in place by default: test_cma_pull.py)
    try:
        prefill = PrefillProcess(spec)
        host, port = prefill.host, prefill.port
        decode.pull("req-before", host, port, [1], [1], 16)
        prefill.kill()
        started = time.monotonic()
        with pytest.raises(TransferError, match="disconnected"):
            decode.pull("req-after", host, port, [2], [2], 16)
        assert time.monotonic() - started < 5
        # the dead engine was forgotten: the next pull handshakes again, and finds nobody
        with pytest.raises(HandshakeTimeout):
            decode.pull("req-after-2", host, port, [2], [2], 16)
        assert decode.client.handshakes_performed == 1
        # the engine was forgotten: a new one (new agent, new port) is handshaken afresh
        with PrefillProcess(spec) as restarted:
            decode.pull("req-restarted", restarted.host, restarted.port, [3], [3], 16)
            assert received_correctly(decode.cache, [3], spec.caches(), [3], 16)
    finally:
        decode.close()


def test_a_dead_engine_does_not_stall_pulls_from_others(prefill: PrefillProcess, expected: list[KVCache]) -> None:
    import socket
    import threading

    with socket.socket() as probe:  # a port with nobody behind it
        probe.bind(("127.0.0.1", 0))
        dead_port = probe.getsockname()[1]
    decode = DecodeRank(
        "test-decode-two-engines",
        KVCache.allocate(LAYOUT, NUM_BLOCKS),
        DecodeOptions(settings=DEFAULTS, handshake_timeout_s=2.0),
    )
    failures: list[BaseException] = []

    def connect_dead() -> None:
        try:
            decode.connect("127.0.0.1", dead_port)
        except HandshakeTimeout as error:
            failures.append(error)

    stuck = threading.Thread(target=connect_dead, daemon=True)
    try:
        stuck.start()
        started = time.monotonic()
        decode.pull("req-beside-dead", prefill.host, prefill.port, [6], [7], 16)
        assert time.monotonic() - started < 1.5  # not behind the dead engine's 3 x 2 s of attempts
        assert received_correctly(decode.cache, [7], expected, [6], 16)
        stuck.join(20)
        assert not stuck.is_alive() and len(failures) == 1
    finally:
        decode.close()
