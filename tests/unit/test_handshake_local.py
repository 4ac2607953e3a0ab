"""The side-channel handshake in one process: the client against scripted ZMQ peers and in-process servers
(refusals, forged or undecodable replies, timeouts, fail-fast on a dead endpoint), the server's lifecycle, and the
MAC and nonce units. The client against servers in other processes: tests/process/test_handshake.py."""

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
from pd_transfer.sim.handshake_server import RawPeer, fake_engine, fake_fingerprint

HOST = "127.0.0.1"
SECRET = "correct horse battery staple"


def test_refusals_are_not_retried() -> None:
    with HandshakeServer(fake_engine()) as server, HandshakeClient(fake_fingerprint(), retries=3) as client:
        with pytest.raises(HandshakeRefused):
            client.fetch(HOST, server.port, tp_ranks=[9])
        assert server.stats["challenges"] == 1 and server.stats["refused"] == 1


# ---------------------------------------------------------------------------- forged and silent peers
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


def unused_port() -> int:
    """A port nobody listens on (until a test starts a server there)."""
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return probe.getsockname()[1]


# ---------------------------------------------------------------------------- fail-fast on a dead endpoint
def test_closed_port_is_refused_after_one_attempt() -> None:
    """Refused at once (the monitor sees it, not 5 s), and not retried: a bare TCP connect right after is refused too,
    so nothing listens there (three attempts with 0.1 + 0.2 s of pauses before)."""
    port = unused_port()
    with HandshakeClient(fake_fingerprint(), timeout_s=5.0, retries=2) as client:
        start = time.monotonic()
        with pytest.raises(HandshakeTimeout, match=f"{HOST}:{port}") as caught:
            client.fetch(HOST, port)
        seconds = time.monotonic() - start
    assert caught.value.refused and caught.value.attempts == 1 and caught.value.reasons == ["connection refused"]
    assert "1 attempt(s)" in str(caught.value)
    print(f"\nnothing listening: the fetch failed after {seconds * 1e3:.1f} ms")


class Clock:
    """Monotonic time the test moves forward (the windows are long; the network is real)."""

    def __init__(self) -> None:
        self.now = time.monotonic()

    def __call__(self) -> float:
        return self.now


def test_forget_clears_the_failure_and_windows_are_bounded() -> None:
    port = unused_port()
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
    port = unused_port()
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


# ---------------------------------------------------------------------------- auth and nonce units
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
        assert server.used_nonces == 0  # the reply came after the server had checked: nothing stored
        signed = msgspec.structs.replace(request, mac=get_metadata_mac(SECRET, request))
        assert isinstance(raw.request(encode(signed)), Metadata)
        assert server.used_nonces == 1
        replayed = raw.request(encode(signed))
        assert isinstance(replayed, ErrorReply) and "already used" in replayed.message
        assert server.used_nonces == 1
