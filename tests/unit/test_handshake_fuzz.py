"""Hostile input straight to the handshake server in this process: it must answer ``malformed`` and keep serving.
A server in its own process fed garbage: tests/process/test_handshake.py."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import msgspec
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st
from zmq.utils.monitor import recv_monitor_message

from pd_transfer.handshake import (
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    Challenge,
    ErrorReply,
    GetMetadata,
    HandshakeClient,
    HandshakeServer,
    Hello,
    Metadata,
    decode,
    encode,
)
from pd_transfer.handshake.auth import get_metadata_mac, new_nonce
from pd_transfer.handshake.messages import MAX_REQUEST_BYTES, MAX_TP_RANKS
from pd_transfer.sim.handshake_server import RawPeer, fake_engine, fake_fingerprint

HOST = "127.0.0.1"
SECRET = "fuzz secret"
FUZZ = settings(max_examples=200, deadline=None, database=None)
TAGS = ("hello", "challenge", "get_metadata", "metadata", "error")
FIELDS = ("protocol_version", "client_nonce", "server_nonce", "fingerprint", "tp_ranks", "mac", "code", "engine")

msgpack_leaves = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=40)
)
msgpack_values = st.recursive(
    msgpack_leaves,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=8,
)


@pytest.fixture(scope="module")
def server() -> Iterator[HandshakeServer]:
    with HandshakeServer(fake_engine()) as handshake_server:
        yield handshake_server


@pytest.fixture(scope="module")
def raw(server: HandshakeServer) -> Iterator[RawPeer]:
    with RawPeer(HOST, server.port) as peer:
        yield peer


def still_serves(port: int, secret: str | None = None) -> bool:
    """A normal client, with an empty cache, completes a handshake."""
    with HandshakeClient(fake_fingerprint(), secret=secret, timeout_s=5.0, retries=0) as client:
        return client.fetch(HOST, port).ranks == fake_engine().ranks


def decodes(data: bytes) -> bool:
    try:
        decode(data)
    except Exception:
        return False
    return True


def assert_answer(reply: object, data: bytes) -> None:
    """Undecodable input is answered ``malformed``; anything else gets some well-formed reply."""
    if decodes(data):
        assert isinstance(reply, Challenge | Metadata | ErrorReply)
        assert not (isinstance(reply, ErrorReply) and reply.code in ("malformed", "internal"))
    else:
        assert isinstance(reply, ErrorReply) and reply.code == "malformed", reply


def test_random_bytes(server: HandshakeServer, raw: RawPeer) -> None:
    @FUZZ
    @given(st.binary(min_size=1, max_size=2048))
    def check(data: bytes) -> None:
        assert_answer(raw.request(data), data)

    check()
    assert server.stats["internal"] == 0
    assert still_serves(server.port)


def test_truncated_valid_messages(server: HandshakeServer, raw: RawPeer) -> None:
    valid = [
        encode(Hello(client_nonce=new_nonce())),
        encode(GetMetadata(PROTOCOL_VERSION, fake_fingerprint(), [0, 1], new_nonce(), new_nonce(), mac=b"m" * 32)),
        encode(GetMetadata(PROTOCOL_VERSION, fake_fingerprint(), None, new_nonce(), new_nonce())),
    ]

    @FUZZ
    @given(st.sampled_from(valid), st.data())
    def check(message: bytes, data: st.DataObject) -> None:
        cut = data.draw(st.integers(0, len(message) - 1))
        reply = raw.request(message[:cut])
        assert isinstance(reply, ErrorReply) and reply.code == "malformed"

    malformed_before = server.stats["malformed"]
    check()
    assert server.stats["malformed"] > malformed_before and server.stats["internal"] == 0
    assert still_serves(server.port)


def test_valid_msgpack_of_wrong_shapes(server: HandshakeServer, raw: RawPeer) -> None:
    shaped = st.one_of(
        msgpack_values,
        st.dictionaries(st.text(max_size=16), msgpack_leaves, max_size=6).map(lambda d: {**d, "type": "get_metadata"}),
        st.builds(
            lambda tag, body: {"type": tag, **body},
            st.sampled_from(TAGS),
            st.dictionaries(st.sampled_from(FIELDS), msgpack_leaves | st.lists(msgpack_leaves, max_size=3), max_size=6),
        ),
    )

    @FUZZ
    @given(shaped)
    def check(value: object) -> None:
        data = msgspec.msgpack.encode(value)
        assert_answer(raw.request(data), data)

    check()
    assert server.stats["internal"] == 0
    assert still_serves(server.port)


def test_unknown_tags(server: HandshakeServer, raw: RawPeer) -> None:
    @FUZZ
    @given(
        st.text(max_size=30).filter(lambda tag: tag not in TAGS),
        st.dictionaries(st.sampled_from(FIELDS), msgpack_leaves, max_size=4),
    )
    def check(tag: str, body: dict[str, object]) -> None:
        reply = raw.request(msgspec.msgpack.encode({**body, "type": tag}))
        assert isinstance(reply, ErrorReply) and reply.code == "malformed"

    check()
    assert still_serves(server.port)


def test_well_typed_requests_never_fail_internally(server: HandshakeServer, raw: RawPeer) -> None:
    fingerprints = st.builds(
        fake_fingerprint,
        head_size=st.sampled_from([64, 128]),
        dtype=st.sampled_from(["bfloat16", "float16"]),
        use_mla=st.booleans(),
    )
    requests = st.builds(
        GetMetadata,
        protocol_version=st.integers(-(2**63), 2**63 - 1),
        fingerprint=fingerprints,
        tp_ranks=st.none() | st.lists(st.integers(-(2**63), 2**63 - 1), max_size=5),
        client_nonce=st.binary(max_size=64),
        server_nonce=st.binary(max_size=64),
        mac=st.binary(max_size=64),
    )

    @FUZZ
    @given(requests)
    def check(request: GetMetadata) -> None:
        reply = raw.request(encode(request))
        assert isinstance(reply, Metadata | ErrorReply)
        if isinstance(reply, ErrorReply):
            out_of_bounds = any(not 0 <= rank < MAX_TP_RANKS for rank in request.tp_ranks or [])
            allowed = ("malformed",) if out_of_bounds else ("unsupported_version", "incompatible", "unknown_rank")
            assert reply.code in allowed, reply

    check()
    assert server.stats["internal"] == 0
    assert still_serves(server.port)


def test_multi_frame_and_empty_frames(server: HandshakeServer, raw: RawPeer) -> None:
    hello = encode(Hello())

    @FUZZ
    @given(st.lists(st.binary(max_size=64) | st.just(hello), min_size=2, max_size=5))
    def check(frames: list[bytes]) -> None:
        reply = raw.request(*frames)
        assert isinstance(reply, ErrorReply) and reply.code == "malformed" and "frame" in reply.message

    check()
    for frames in ([b""], [b"", hello]):  # an empty frame; a REQ-style empty delimiter
        reply = raw.request(*frames)
        assert isinstance(reply, ErrorReply) and reply.code == "malformed"
    assert still_serves(server.port)


@pytest.mark.parametrize("size", [MAX_REQUEST_BYTES + 1, 2 * 2**20, MAX_FRAME_BYTES + 1])
def test_oversized_frame_is_dropped_by_zmq(server: HandshakeServer, size: int) -> None:
    """A request over 64 KiB is dropped at its length header: no 2-17 MB junk frame is ever buffered."""
    counts_before = dict(server.stats)
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    monitor = dealer.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
    try:
        dealer.connect(f"tcp://{HOST}:{server.port}")
        dealer.send(b"\x00" * size)
        events = []
        while monitor.poll(10_000, zmq.POLLIN):  # the server disconnects us once it sees the size
            events.append(recv_monitor_message(monitor)["event"])
            if zmq.EVENT_DISCONNECTED in events:
                break
        assert zmq.EVENT_DISCONNECTED in events
        assert still_serves(server.port)
        assert server.stats["too_large"] == counts_before["too_large"]
        assert server.stats["malformed"] == counts_before["malformed"]
        assert server.stats["served"] == counts_before["served"] + 1
    finally:
        dealer.disable_monitor()
        monitor.close(linger=0)
        dealer.close(linger=0)
        context.term()


def test_nonce_replay_is_refused() -> None:
    with HandshakeServer(fake_engine(), secret=SECRET) as server, RawPeer(HOST, server.port) as raw:
        challenge = raw.request(encode(Hello(client_nonce=new_nonce())))
        assert isinstance(challenge, Challenge) and challenge.auth_required
        request = GetMetadata(PROTOCOL_VERSION, fake_fingerprint(), [0], new_nonce(), challenge.server_nonce)
        signed = encode(msgspec.structs.replace(request, mac=get_metadata_mac(SECRET, request)))
        first = raw.request(signed)
        assert isinstance(first, Metadata) and [rank.tp_rank for rank in first.engine.ranks] == [0]
        replayed = raw.request(signed)
        assert isinstance(replayed, ErrorReply) and replayed.code == "auth_failed" and "used" in replayed.message

        # A signed request whose fields were altered after signing does not verify either.
        challenge = raw.request(encode(Hello()))
        assert isinstance(challenge, Challenge)
        request = GetMetadata(PROTOCOL_VERSION, fake_fingerprint(), [0], new_nonce(), challenge.server_nonce)
        tampered = msgspec.structs.replace(request, mac=get_metadata_mac(SECRET, request), tp_ranks=[0, 1])
        reply = raw.request(encode(tampered))
        assert isinstance(reply, ErrorReply) and reply.code == "auth_failed"
        assert server.stats["served"] == 1 and server.stats["refused"] == 2
        assert still_serves(server.port, SECRET)


def test_oversized_fields_are_refused_small_and_never_echoed_whole(
    server: HandshakeServer, raw: RawPeer, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: 1.5 million tp_ranks made an 11.8 MB reply and log line, and a 6 MB model name came back whole.
    Frames that large are now dropped by ZMQ (test_oversized_frame_is_dropped_by_zmq); these fit in a request."""
    many_ranks = {
        "type": "get_metadata",
        "protocol_version": PROTOCOL_VERSION,
        "fingerprint": msgspec.to_builtins(fake_fingerprint()),
    }
    many_ranks |= {"tp_ranks": list(range(10_000)), "client_nonce": b"", "server_nonce": b""}
    long_name = GetMetadata(
        PROTOCOL_VERSION, fake_fingerprint(model="m" * 50_000), None, b"", b""
    )  # larger frames: dropped by ZMQ
    near_limit = GetMetadata(PROTOCOL_VERSION, fake_fingerprint(model="x" * 4000), list(range(MAX_TP_RANKS)), b"", b"")
    with caplog.at_level(logging.DEBUG, logger="pd_transfer.handshake"):
        for frame in (msgspec.msgpack.encode(many_ranks), encode(long_name), encode(near_limit)):
            caplog.clear()
            raw.send(frame)
            (reply_bytes,) = raw.receive_frames()
            reply = decode(reply_bytes)
            assert isinstance(reply, ErrorReply) and reply.code in ("malformed", "incompatible"), reply
            assert len(reply_bytes) < 1200, len(reply_bytes)
            assert all(len(record.getMessage()) < 1200 for record in caplog.records)
    assert still_serves(server.port)
