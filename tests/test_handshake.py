"""Side-channel handshake: a client against servers in separate processes, plus auth and nonce units."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from pd_transfer.handshake import (
    PROTOCOL_VERSION,
    AuthenticationError,
    Challenge,
    EngineMetadata,
    ErrorReply,
    GetMetadata,
    HandshakeBackoff,
    HandshakeClient,
    HandshakeError,
    HandshakeRefused,
    HandshakeServer,
    HandshakeTimeout,
    Hello,
    IncompatiblePeer,
    Metadata,
    decode,
    encode,
    encode_engine,
)
from pd_transfer.handshake.auth import get_metadata_mac, new_nonce, reply_mac, request_mac, verify
from pd_transfer.handshake.nonces import NonceBook
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


def test_refusals_are_not_retried() -> None:
    with HandshakeServer(fake_engine()) as server, HandshakeClient(fake_fingerprint(), retries=3) as client:
        with pytest.raises(HandshakeRefused):
            client.fetch(HOST, server.port, tp_ranks=[9])
        assert server.stats["challenges"] == 1 and server.stats["refused"] == 1


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


def _scripted_server(router: zmq.Socket, replies: list[bytes], timeout_s: float = 5.0) -> None:
    """Answer one request per reply in ``replies``, whatever the requests say."""
    for reply in replies:
        if not router.poll(int(timeout_s * 1000), zmq.POLLIN):
            return
        identity, _ = router.recv_multipart()
        router.send_multipart([identity, reply])


@pytest.fixture
def router() -> Iterator[tuple[zmq.Socket, int]]:
    context = zmq.Context()
    sock = context.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port(f"tcp://{HOST}")
    yield sock, port
    sock.close(linger=0)
    context.term()


def test_client_rejects_a_reply_with_a_bad_mac(router: tuple[zmq.Socket, int]) -> None:
    sock, port = router
    engine = fake_engine()
    forged = [
        encode(Challenge(PROTOCOL_VERSION, new_nonce(), auth_required=True)),
        encode(Metadata(PROTOCOL_VERSION, engine, mac=reply_mac("not the secret", b"whatever", encode_engine(engine)))),
    ]
    thread = threading.Thread(target=_scripted_server, args=(sock, forged))
    thread.start()
    with HandshakeClient(fake_fingerprint(), secret=SECRET, retries=0, timeout_s=5.0) as client:
        with pytest.raises(AuthenticationError, match="failed MAC verification"):
            client.fetch(HOST, port)
    thread.join(5.0)
    assert not thread.is_alive()


def test_client_rechecks_the_served_fingerprint(router: tuple[zmq.Socket, int]) -> None:
    sock, port = router
    impostor = fake_engine(fingerprint=fake_fingerprint(model="other/model"))
    replies = [
        encode(Challenge(PROTOCOL_VERSION, new_nonce(), auth_required=False)),
        encode(Metadata(PROTOCOL_VERSION, impostor)),
    ]
    thread = threading.Thread(target=_scripted_server, args=(sock, replies))
    thread.start()
    with HandshakeClient(fake_fingerprint(), retries=0) as client:
        with pytest.raises(IncompatiblePeer) as caught:
            client.fetch(HOST, port)
    thread.join(5.0)
    assert caught.value.fields == ["model"]


def test_undecodable_reply_is_a_handshake_error(router: tuple[zmq.Socket, int]) -> None:
    sock, port = router
    thread = threading.Thread(target=_scripted_server, args=(sock, [b"\xc1 not msgpack"]))
    thread.start()
    with HandshakeClient(fake_fingerprint(), retries=2) as client:
        with pytest.raises(HandshakeError, match="undecodable reply"):
            client.fetch(HOST, port)
    thread.join(5.0)
    assert not thread.is_alive()


# ---------------------------------------------------------------------------- timeouts


def test_silent_server_times_out_after_all_attempts(router: tuple[zmq.Socket, int]) -> None:
    sock, port = router
    timeout_s, retries = 0.3, 2
    with HandshakeClient(fake_fingerprint(), timeout_s=timeout_s, retries=retries) as client:
        start = time.monotonic()
        with pytest.raises(HandshakeTimeout) as caught:
            client.fetch(HOST, port)
        elapsed = time.monotonic() - start
    assert timeout_s * (retries + 1) * 0.9 <= elapsed <= timeout_s * (retries + 1) + 1.0
    assert caught.value.attempts == 3 and f"{HOST}:{port}" in str(caught.value) and "3 attempt" in str(caught.value)
    identities = set()
    while len(identities) < 3 and sock.poll(1000, zmq.POLLIN):  # each attempt: a Hello on a fresh socket
        identity, payload = sock.recv_multipart()
        assert isinstance(decode(payload), Hello)
        identities.add(identity)
    assert len(identities) == 3


def _free_port() -> int:
    """A port nobody listens on (until a test starts a server there)."""
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return probe.getsockname()[1]


def test_closed_port_is_refused_fast() -> None:
    port = _free_port()
    with HandshakeClient(fake_fingerprint(), timeout_s=5.0, retries=2) as client:
        start = time.monotonic()
        with pytest.raises(HandshakeTimeout, match=f"{HOST}:{port}") as caught:
            client.fetch(HOST, port)
    # refused at once on each attempt (the monitor sees it), not 3 x 5 s: only the 0.1 + 0.2 s pauses
    assert time.monotonic() - start < 1.5
    assert caught.value.refused and caught.value.reasons == ["connection refused"] * 3
    assert "connection refused x3" in str(caught.value)


# ---------------------------------------------------------------------------- fail-fast on a dead endpoint


class Clock:
    """Monotonic time the test moves forward (the windows are long; the network is real)."""

    def __init__(self) -> None:
        self.now = time.monotonic()

    def __call__(self) -> float:
        return self.now


def test_dead_endpoint_fails_fast_then_is_retried_and_recovers() -> None:
    port = _free_port()
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


def test_forget_clears_the_failure_and_windows_are_bounded() -> None:
    port = _free_port()
    clock = Clock()
    with HandshakeClient(
        fake_fingerprint(), timeout_s=1.0, retries=0, failure_backoff_s=1.0, failure_backoff_max_s=2.5, clock=clock
    ) as client:
        for window in (1.0, 2.0, 2.5, 2.5):  # doubling, capped
            with pytest.raises(HandshakeTimeout):
                client.fetch(HOST, port)
            with pytest.raises(HandshakeBackoff) as fast:
                client.fetch(HOST, port)
            assert fast.value.retry_in_s == pytest.approx(window)
            clock.now += window
        with pytest.raises(HandshakeTimeout):
            client.fetch(HOST, port)
        client.forget(HOST, port)
        assert not client.failing(HOST, port)
        with pytest.raises(HandshakeTimeout) as again:  # tried at once, and counted from one again
            client.fetch(HOST, port)
        assert not isinstance(again.value, HandshakeBackoff)
        with pytest.raises(HandshakeBackoff, match="1 failure"):
            client.fetch(HOST, port)


def test_zero_backoff_turns_fail_fast_off() -> None:
    port = _free_port()
    with HandshakeClient(fake_fingerprint(), timeout_s=1.0, retries=0, failure_backoff_s=0) as client:
        for _ in range(2):
            with pytest.raises(HandshakeTimeout) as caught:
                client.fetch(HOST, port)
            assert not isinstance(caught.value, HandshakeBackoff)
        assert not client.failing(HOST, port)


def test_while_a_probe_runs_other_fetches_fail_fast(router: tuple[zmq.Socket, int]) -> None:
    sock, port = router  # connects, never answers
    clock = Clock()
    with HandshakeClient(fake_fingerprint(), timeout_s=0.5, retries=0, clock=clock) as client:
        with pytest.raises(HandshakeTimeout, match=r"no Challenge in 0\.5 s"):
            client.fetch(HOST, port)
        assert sock.poll(1000, zmq.POLLIN)
        sock.recv_multipart()  # the first attempt's Hello
        clock.now += 10.0
        errors: list[BaseException] = []

        def probe() -> None:
            try:
                client.fetch(HOST, port)
            except BaseException as exc:  # checked below
                errors.append(exc)

        thread = threading.Thread(target=probe)
        thread.start()
        try:
            assert sock.poll(2000, zmq.POLLIN)  # the probe's Hello arrived: it is in flight
            start = time.monotonic()
            with pytest.raises(HandshakeBackoff):
                client.fetch(HOST, port, [1])
            assert time.monotonic() - start < 0.05
        finally:
            thread.join(5.0)
        assert not thread.is_alive() and len(errors) == 1 and not isinstance(errors[0], HandshakeBackoff)


def test_an_answer_clears_the_failure(router: tuple[zmq.Socket, int]) -> None:
    sock, port = router
    clock = Clock()
    with HandshakeClient(fake_fingerprint(), timeout_s=0.3, retries=0, clock=clock) as client:
        with pytest.raises(HandshakeTimeout):
            client.fetch(HOST, port)
        assert client.failing(HOST, port)
        clock.now += 10.0
        assert sock.poll(1000, zmq.POLLIN)
        sock.recv_multipart()  # the failed attempt's Hello
        thread = threading.Thread(target=_scripted_server, args=(sock, [b"\xc1 not msgpack"]))
        thread.start()
        with pytest.raises(HandshakeError, match="undecodable reply"):  # the peer is there: no fail-fast
            client.fetch(HOST, port)
        thread.join(5.0)
        assert not client.failing(HOST, port)


# ---------------------------------------------------------------------------- server lifecycle


def test_server_stops_promptly_and_frees_its_port() -> None:
    server = HandshakeServer(fake_engine()).start()
    assert server.running and server.address == f"tcp://{HOST}:{server.port}"
    start = time.monotonic()
    server.stop()
    assert time.monotonic() - start < 0.2
    assert not server.running
    with HandshakeServer(fake_engine(), port=server.port) as again:  # the port is free again
        assert again.port == server.port


def test_server_refuses_a_busy_port() -> None:
    with HandshakeServer(fake_engine()) as server:
        with pytest.raises(OSError, match="cannot bind"):
            HandshakeServer(fake_engine(), port=server.port).start()


def test_engine_callable_is_called_per_request() -> None:
    engines = [fake_engine("prefill-a"), fake_engine("prefill-b")]
    calls: list[int] = []

    def current() -> EngineMetadata:
        calls.append(1)
        return engines[len(calls) - 1]

    with HandshakeServer(current) as server, HandshakeClient(fake_fingerprint(), retries=0) as client:
        assert client.fetch(HOST, server.port).engine_id == "prefill-a"
        client.forget(HOST, server.port)
        assert client.fetch(HOST, server.port).engine_id == "prefill-b"
        assert server.stats["served"] == 2


def test_engine_callable_failure_answers_internal_and_keeps_serving() -> None:
    healthy = [False]

    def current() -> EngineMetadata:
        if not healthy[0]:
            raise RuntimeError("ranks not registered yet")
        return fake_engine()

    with HandshakeServer(current) as server, HandshakeClient(fake_fingerprint(), retries=0) as client:
        with pytest.raises(HandshakeRefused) as caught:
            client.fetch(HOST, server.port)
        assert caught.value.code == "internal" and server.stats["internal"] == 1
        healthy[0] = True
        assert client.fetch(HOST, server.port).engine_id == "prefill-0"


def test_nonce_expires_after_ttl() -> None:
    now = [0.0]
    with HandshakeServer(fake_engine(), secret=SECRET, nonce_ttl_s=30.0, clock=lambda: now[0]) as server:
        with RawPeer(HOST, server.port) as raw:
            challenge = raw.request(encode(Hello()))
            assert isinstance(challenge, Challenge)
            now[0] = 31.0
            request = GetMetadata(PROTOCOL_VERSION, fake_fingerprint(), None, new_nonce(), challenge.server_nonce)
            request = msgspec.structs.replace(request, mac=get_metadata_mac(SECRET, request))
            reply = raw.request(encode(request))
    assert reply.code == "auth_failed" and "expired" in reply.message  # type: ignore[union-attr]


# ---------------------------------------------------------------------------- auth and nonce units


def test_request_mac_covers_every_field() -> None:
    request = GetMetadata(PROTOCOL_VERSION, fake_fingerprint(), [0], new_nonce(), new_nonce())
    mac = get_metadata_mac(SECRET, request)
    assert verify(mac, get_metadata_mac(SECRET.encode(), request))
    changes = {
        "protocol_version": 2,
        "fingerprint": fake_fingerprint(head_size=64),
        "tp_ranks": [1],
        "client_nonce": new_nonce(),
        "server_nonce": new_nonce(),
    }
    for field, value in changes.items():
        changed = msgspec.structs.replace(request, **{field: value})
        assert not verify(mac, get_metadata_mac(SECRET, changed)), field
    assert not verify(mac, get_metadata_mac("other", request))
    assert get_metadata_mac(SECRET, msgspec.structs.replace(request, mac=b"x" * 32)) == mac  # mac field excluded


def test_request_and_reply_macs_are_domain_separated() -> None:
    nonce, payload = new_nonce(), b"payload"
    assert request_mac(SECRET, nonce, payload) != reply_mac(SECRET, nonce, payload)
    assert len(new_nonce()) == 32 and new_nonce() != new_nonce()
    with pytest.raises(ValueError):
        request_mac(b"", nonce, payload)


def test_nonce_book_is_single_use_and_expiring() -> None:
    now = [100.0]
    book = NonceBook(ttl_s=10.0, capacity=2, clock=lambda: now[0])
    first = book.issue()
    assert book.consume(first) == "ok" and book.consume(first) == "reused"
    assert book.consume(new_nonce()) == "unknown"  # not issued here
    assert book.consume(NonceBook(10.0, 2, clock=lambda: now[0]).issue()) == "unknown"  # another server's key
    tampered = bytearray(book.issue())
    tampered[0] ^= 1  # an earlier issue time under the same tag
    assert book.consume(bytes(tampered)) == "unknown"
    late = book.issue()
    now[0] += 10.0
    assert book.consume(late) == "expired"


def test_issuing_stores_nothing_so_a_hello_flood_evicts_no_nonce() -> None:
    """Before: 4,096 outstanding nonces were kept and the oldest evicted, so a Hello flood made a slow client's
    GetMetadata fail. Now a nonce is verified from its own bytes."""
    book = NonceBook(ttl_s=30.0, capacity=4096)
    legitimate = book.issue()
    for _ in range(50_000):
        book.issue()
    assert len(book) == 0
    assert book.consume(legitimate) == "ok"


def test_used_nonces_are_bounded_and_a_full_store_refuses_rather_than_forgets() -> None:
    now = [0.0]
    book = NonceBook(ttl_s=10.0, capacity=2, clock=lambda: now[0])
    first, second, third = book.issue(), book.issue(), book.issue()
    assert book.consume(first) == "ok" and book.consume(second) == "ok"
    assert book.consume(third) == "busy" and book.refused_busy == 1 and len(book) == 2
    assert book.consume(first) == "reused"  # still remembered: no replay while full
    now[0] = 10.5
    fresh = book.issue()
    assert book.consume(fresh) == "ok" and len(book) == 1  # the expired ones were purged


def test_a_wrong_mac_does_not_use_up_the_nonce() -> None:
    with HandshakeServer(fake_engine(), secret=SECRET) as server, RawPeer(HOST, server.port) as raw:
        challenge = raw.request(encode(Hello()))
        assert isinstance(challenge, Challenge)
        request = GetMetadata(PROTOCOL_VERSION, fake_fingerprint(), None, new_nonce(), challenge.server_nonce)
        forged = msgspec.structs.replace(request, mac=get_metadata_mac("not the secret", request))
        refused = raw.request(encode(forged))
        assert isinstance(refused, ErrorReply) and "MAC" in refused.message
        signed = msgspec.structs.replace(request, mac=get_metadata_mac(SECRET, request))
        assert isinstance(raw.request(encode(signed)), Metadata)
        replayed = raw.request(encode(signed))
        assert isinstance(replayed, ErrorReply) and "already used" in replayed.message


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
