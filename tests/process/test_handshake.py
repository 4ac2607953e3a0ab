"""Side-channel handshake: a client against servers in separate processes (fetching and caching, refusals,
authentication, a dead endpoint that comes back, a hello flood, garbage frames). The in-process cases, auth and
nonce units: tests/unit/test_handshake_local.py."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import msgspec
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st
from test_handshake_fuzz import decodes, still_serves
from test_handshake_local import Clock, unused_port

from pd_transfer.handshake import (
    PROTOCOL_VERSION,
    AuthenticationError,
    Challenge,
    EngineMetadata,
    ErrorReply,
    GetMetadata,
    HandshakeBackoff,
    HandshakeClient,
    HandshakeRefused,
    HandshakeTimeout,
    Hello,
    IncompatiblePeer,
    encode,
)
from pd_transfer.handshake.auth import get_metadata_mac, new_nonce
from pd_transfer.sim.handshake_server import RawPeer, ServerProcess, fake_engine, fake_fingerprint

HOST = "127.0.0.1"
SECRET = "correct horse battery staple"


@pytest.fixture(scope="module")
def plain_server() -> Iterator[ServerProcess]:
    """A 2-rank fake engine without a secret, in its own process."""
    with ServerProcess() as process:
        yield process


@pytest.fixture(scope="module")
def secret_server() -> Iterator[ServerProcess]:
    """A 2-rank fake engine requiring ``SECRET``, in its own process."""
    with ServerProcess(secret=SECRET, engine_id="prefill-secret") as process:
        yield process


@pytest.fixture
def client() -> Iterator[HandshakeClient]:
    with HandshakeClient(fake_fingerprint(), timeout_s=5.0, retries=0) as handshake_client:
        yield handshake_client


# ---------------------------------------------------------------------------- fetching and caching


def test_fetch_all_ranks(plain_server: ServerProcess, client: HandshakeClient) -> None:
    engine = client.fetch(HOST, plain_server.port)
    assert engine == fake_engine()
    assert [rank.tp_rank for rank in engine.ranks] == [0, 1]
    assert engine.ranks[1].agent_metadata.startswith(b"fake-nixl-agent:prefill-0:1")
    assert client.handshakes_performed == 1


def test_fetch_one_rank(plain_server: ServerProcess, client: HandshakeClient) -> None:
    engine = client.fetch(HOST, plain_server.port, tp_ranks=[1])
    assert engine.ranks == [fake_engine().ranks[1]]
    assert engine.tp_size == 2


def test_second_fetch_is_cached(plain_server: ServerProcess, client: HandshakeClient) -> None:
    first = client.fetch(HOST, plain_server.port, [0])
    assert client.fetch(HOST, plain_server.port, [0]) is first
    assert client.handshakes_performed == 1
    client.fetch(HOST, plain_server.port, [1])  # another key: another handshake
    assert client.handshakes_performed == 2
    merged = client.cached("prefill-0")
    assert merged is not None and [rank.tp_rank for rank in merged.ranks] == [0, 1]
    assert client.cached("no-such-engine") is None


def test_forget_forces_a_new_handshake(plain_server: ServerProcess, client: HandshakeClient) -> None:
    client.fetch(HOST, plain_server.port)
    client.forget(HOST, plain_server.port)
    assert client.cached("prefill-0") is None
    client.fetch(HOST, plain_server.port)
    client.forget_engine("prefill-0")
    assert client.cached("prefill-0") is None
    client.fetch(HOST, plain_server.port)
    assert client.handshakes_performed == 3


def test_concurrent_fetches_of_one_key_share_a_handshake(plain_server: ServerProcess, client: HandshakeClient) -> None:
    results: list[EngineMetadata] = []
    errors: list[BaseException] = []

    def fetch() -> None:
        try:
            results.append(client.fetch(HOST, plain_server.port, [0, 1]))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=fetch) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10.0)
    assert not errors
    assert len(results) == 8 and all(result == results[0] for result in results)
    assert client.handshakes_performed == 1


def test_concurrent_fetches_of_different_peers(plain_server: ServerProcess) -> None:
    with ServerProcess(engine_id="prefill-1") as other, HandshakeClient(fake_fingerprint(), retries=0) as client:
        results: dict[int, str] = {}

        def fetch(port: int) -> None:
            results[port] = client.fetch(HOST, port).engine_id

        threads = [threading.Thread(target=fetch, args=(port,)) for port in (plain_server.port, other.port)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10.0)
        assert results == {plain_server.port: "prefill-0", other.port: "prefill-1"}
        assert client.handshakes_performed == 2


def test_fetch_after_close_fails(plain_server: ServerProcess) -> None:
    client = HandshakeClient(fake_fingerprint())
    client.close()
    client.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        client.fetch(HOST, plain_server.port)


# ---------------------------------------------------------------------------- refusals


def test_mismatched_fingerprint_is_refused(plain_server: ServerProcess) -> None:
    with HandshakeClient(fake_fingerprint(head_size=64), retries=0) as client:
        with pytest.raises(IncompatiblePeer) as caught:
            client.fetch(HOST, plain_server.port)
        assert caught.value.fields == ["head_size"]
        assert caught.value.code == "incompatible"
        message = str(caught.value)
        assert "head_size: 128 != 64" in message
        assert f"{HOST}:{plain_server.port}" in message and "prefill-0" in message
        assert client.handshakes_performed == 0 and client.cached("prefill-0") is None


def test_every_differing_field_is_named(plain_server: ServerProcess) -> None:
    with HandshakeClient(fake_fingerprint(dtype="float16", num_layers=3), retries=0) as client:
        with pytest.raises(IncompatiblePeer) as caught:
            client.fetch(HOST, plain_server.port)
    assert caught.value.fields == ["dtype", "num_layers"]
    assert "dtype: 'bfloat16' != 'float16'" in str(caught.value)
    assert "num_layers: 2 != 3" in str(caught.value)


def test_unknown_rank_is_refused(plain_server: ServerProcess, client: HandshakeClient) -> None:
    with pytest.raises(HandshakeRefused) as caught:
        client.fetch(HOST, plain_server.port, tp_ranks=[1, 5])
    assert caught.value.code == "unknown_rank"
    assert "[5]" in caught.value.message and "[0, 1]" in caught.value.message


def test_unsupported_protocol_version_is_refused(plain_server: ServerProcess) -> None:
    # the server answers a newer client in its own version; a client that speaks only 99 refuses, naming both
    with HandshakeClient(fake_fingerprint(), retries=0, protocol_version=99) as client:
        with pytest.raises(HandshakeRefused) as caught:
            client.fetch(HOST, plain_server.port)
    assert caught.value.code == "unsupported_version"
    assert (
        f"speaks protocol version {PROTOCOL_VERSION}" in caught.value.message
        and "this client speaks 99" in caught.value.message
    )


def test_get_metadata_with_unsupported_version_is_refused(plain_server: ServerProcess) -> None:
    with RawPeer(HOST, plain_server.port) as raw:
        challenge = raw.request(encode(Hello()))
        assert isinstance(challenge, Challenge) and not challenge.auth_required
        request = GetMetadata(7, fake_fingerprint(), None, new_nonce(), challenge.server_nonce)
        reply = raw.request(encode(request))
    assert reply.code == "unsupported_version" and "7" in reply.message  # type: ignore[union-attr]


# ---------------------------------------------------------------------------- authentication


def test_right_secret_works_and_reply_mac_is_verified(secret_server: ServerProcess) -> None:
    with HandshakeClient(fake_fingerprint(), secret=SECRET, retries=0) as client:
        engine = client.fetch(HOST, secret_server.port, [0])
    assert engine.engine_id == "prefill-secret" and [rank.tp_rank for rank in engine.ranks] == [0]


def test_secret_may_be_given_as_bytes(secret_server: ServerProcess) -> None:
    with HandshakeClient(fake_fingerprint(), secret=SECRET.encode(), retries=0) as client:
        assert client.fetch(HOST, secret_server.port).engine_id == "prefill-secret"


def test_wrong_secret_is_refused(secret_server: ServerProcess) -> None:
    with HandshakeClient(fake_fingerprint(), secret="wrong", retries=0) as client:
        with pytest.raises(AuthenticationError) as caught:
            client.fetch(HOST, secret_server.port)
    assert caught.value.code == "auth_failed"
    assert f"{HOST}:{secret_server.port}" in str(caught.value)


def test_missing_secret_gives_a_clear_error(secret_server: ServerProcess) -> None:
    with HandshakeClient(fake_fingerprint(), retries=0) as client:
        with pytest.raises(AuthenticationError, match="requires a shared secret and this client has none"):
            client.fetch(HOST, secret_server.port)


def test_request_without_mac_is_refused_with_auth_required(secret_server: ServerProcess) -> None:
    with RawPeer(HOST, secret_server.port) as raw:
        challenge = raw.request(encode(Hello()))
        assert isinstance(challenge, Challenge) and challenge.auth_required
        request = GetMetadata(PROTOCOL_VERSION, fake_fingerprint(), None, new_nonce(), challenge.server_nonce)
        reply = raw.request(encode(request))
    assert reply.code == "auth_required" and "prefill-secret" in reply.message  # type: ignore[union-attr]


def test_client_with_secret_rejects_a_server_without_one(plain_server: ServerProcess) -> None:
    with HandshakeClient(fake_fingerprint(), secret=SECRET, retries=0) as client:
        with pytest.raises(AuthenticationError, match="does not authenticate"):
            client.fetch(HOST, plain_server.port)


# ---------------------------------------------------------------------------- fail-fast on a dead endpoint


def test_dead_endpoint_fails_fast_then_is_retried_and_recovers() -> None:
    port = unused_port()
    clock = Clock()
    with HandshakeClient(fake_fingerprint(), timeout_s=2.0, retries=2, failure_backoff_s=10.0, clock=clock) as client:
        start = time.monotonic()
        with pytest.raises(HandshakeTimeout) as first:
            client.fetch(HOST, port)
        assert time.monotonic() - start < 2.0 * 3 + 0.3 + 0.5  # within the fetch's own bound
        assert not isinstance(first.value, HandshakeBackoff) and client.failing(HOST, port)

        for tp_ranks in (None, [0]):  # any fetch from the endpoint, whatever the ranks
            start = time.monotonic()
            with pytest.raises(HandshakeBackoff) as fast:
                client.fetch(HOST, port, tp_ranks)
            assert time.monotonic() - start < 0.05
            message = str(fast.value)
            assert f"{HOST}:{port}" in message and "connection refused" in message
            assert "next attempt in 10.0 s" in message and "1 failure(s) in a row" in message
            assert fast.value.cause is first.value and fast.value.retry_in_s == pytest.approx(10.0)
            assert isinstance(fast.value, HandshakeTimeout)  # handled like the failure it repeats

        clock.now += 10.0  # the window passed: the next fetch tries again (still dead: a longer window)
        with pytest.raises(HandshakeTimeout) as second:
            client.fetch(HOST, port)
        assert not isinstance(second.value, HandshakeBackoff)
        with pytest.raises(HandshakeBackoff, match=r"next attempt in 20\.0 s \(2 failure"):
            client.fetch(HOST, port)

        with ServerProcess(port=port) as server:  # the endpoint comes back ...
            assert server.port == port
            with pytest.raises(HandshakeBackoff):  # ... but is not tried before its window ends
                client.fetch(HOST, port)
            clock.now += 20.0
            assert client.fetch(HOST, port).engine_id == "prefill-0"
            assert not client.failing(HOST, port) and client.handshakes_performed == 1


# ---------------------------------------------------------------------------- a hello flood


def _hello_flood(port: int, seconds: float, sent: list[int]) -> None:
    """Send Hello as fast as one socket can for ``seconds``, never reading the challenges."""
    context = zmq.Context()
    flood = context.socket(zmq.DEALER)
    flood.setsockopt(zmq.LINGER, 0)
    flood.setsockopt(zmq.SNDHWM, 100_000)
    flood.connect(f"tcp://{HOST}:{port}")
    frame, deadline = encode(Hello()), time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            for _ in range(500):
                try:
                    flood.send(frame, zmq.NOBLOCK)
                    sent[0] += 1
                except zmq.Again:
                    break
    finally:
        flood.close(linger=0)
        context.term()


def test_a_hello_flood_does_not_fail_a_slow_legitimate_handshake(secret_server: ServerProcess) -> None:
    sent = [0]
    flood = threading.Thread(target=_hello_flood, args=(secret_server.port, 4.0, sent), daemon=True)
    flood.start()
    try:
        with RawPeer(HOST, secret_server.port) as raw:
            outcomes = []
            for _ in range(8):
                challenge = raw.request(encode(Hello()), timeout_s=10.0)
                assert isinstance(challenge, Challenge)
                time.sleep(0.2)  # a slow client (not synchronisation): the flood runs between its two messages
                request = GetMetadata(PROTOCOL_VERSION, fake_fingerprint(), None, new_nonce(), challenge.server_nonce)
                request = msgspec.structs.replace(request, mac=get_metadata_mac(SECRET, request))
                outcomes.append(type(raw.request(encode(request), timeout_s=10.0)).__name__)
    finally:
        flood.join(10.0)
    assert sent[0] > 4096, f"the flood sent only {sent[0]} Hellos"
    assert outcomes == ["Metadata"] * 8


# ---------------------------------------------------------------------------- garbage
def test_separate_process_server_survives_garbage() -> None:
    with ServerProcess(secret=SECRET) as process, RawPeer(HOST, process.port) as raw:

        @settings(max_examples=100, deadline=None, database=None)
        @given(st.binary(min_size=1, max_size=1024) | st.lists(st.binary(max_size=32), min_size=2, max_size=4))
        def check(payload: bytes | list[bytes]) -> None:
            frames = [payload] if isinstance(payload, bytes) else payload
            reply = raw.request(*frames)
            if len(frames) > 1 or not decodes(frames[0]):
                assert isinstance(reply, ErrorReply) and reply.code == "malformed"
            else:
                assert isinstance(reply, Challenge | ErrorReply)

        check()
        assert still_serves(process.port, SECRET)
