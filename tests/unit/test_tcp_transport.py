"""The built-in ``tcp`` transport (pd_transfer/connector/transports/tcp) with the fake agents: a pull goes by it (the
bytes verified, its name on the stats and the metrics, the lease confirmed over its connection, no NIXL peer), into
another block size and from a TP 2 engine too; block ids outside the plan are refused before a row moves; the prefill
end stands up to raw clients on its port (a hello without the secret, reads of memory outside the cache, frames that
are garbage or too long: each ends at most its own connection); a read past its deadline against a stand-in rank
written here drops the connection, and the next use connects afresh; a stand-in that names another rank is another
incarnation; and a prefill that closes fails the next pull at once."""

from __future__ import annotations

import ctypes
import os
import queue
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch
from engine_specs import kv_layout
from in_process_prefill import InProcessPrefill

from pd_transfer.connector import messages
from pd_transfer.connector.cache import KVCache
from pd_transfer.connector.decode.rank import DecodeRank
from pd_transfer.connector.options import DecodeOptions, PrefillOptions
from pd_transfer.connector.prefill.rank import PrefillRank, serve_engine
from pd_transfer.connector.transports.tcp.connection import TcpConnection
from pd_transfer.connector.transports.tcp.decode_end import TcpDecodeEnd, TcpLink
from pd_transfer.connector.transports.tcp.frames import (
    MAX_FRAME,
    BadFrame,
    expect,
    fields,
    receive_frame,
    send_frame,
    shut,
)
from pd_transfer.connector.transports.tcp.prefill_end import TcpPrefillEnd
from pd_transfer.handshake.auth import connection_mac, verify
from pd_transfer.metrics import TransferMetrics
from pd_transfer.settings import DEFAULTS
from pd_transfer.sim.peer import fill_pattern
from pd_transfer.sim.verify import received_correctly
from pd_transfer.spec import KVCacheLayout, ModelFingerprint, planes_of
from pd_transfer.transfer.agent_protocol import AgentFactory
from pd_transfer.transfer.cma import IOVEC, entries_of
from pd_transfer.transfer.digests import Verify, rows_digest
from pd_transfer.transfer.dlists import merged_spans
from pd_transfer.transfer.errors import DigestMismatch, PeerDisconnected, TransferError, TransferTimeout

MODEL = ModelFingerprint(model="tcp-transport", dtype="float16", num_layers=2, total_num_kv_heads=2, head_size=16)
LAYOUT = KVCacheLayout(fingerprint=MODEL, tp_size=1, tp_rank=0, block_size=16)
BLOCKS = 32
TCP = "tcp"
SECRET = "tcp-transport-secret"
BOUND_S = 10.0  # what any one wait here may take


def prefill_named(kind: str, agent_factory: AgentFactory, *, secret: str | None = None) -> InProcessPrefill:
    return InProcessPrefill(
        f"tcp-{kind}-{time.monotonic_ns()}", LAYOUT, BLOCKS, agent_factory, seed=13, transport=TCP, secret=secret
    )


@pytest.fixture
def prefill(agent_factory: AgentFactory) -> Iterator[InProcessPrefill]:
    made = prefill_named("prefill", agent_factory)
    try:
        yield made
    finally:
        made.close()


@pytest.fixture
def guarded(agent_factory: AgentFactory) -> Iterator[InProcessPrefill]:
    """A prefill whose side channel and tcp connections ask for ``SECRET``."""
    made = prefill_named("guarded", agent_factory, secret=SECRET)
    try:
        yield made
    finally:
        made.close()


def decode_rank(
    agent_factory: AgentFactory, layout: KVCacheLayout = LAYOUT, *, secret: str | None = None, verify: Verify = "sample"
) -> DecodeRank:
    options = DecodeOptions(
        settings=DEFAULTS,
        transport=TCP,
        secret=secret,
        handshake_timeout_s=2.0,
        confirm_timeout_s=5.0,
        verify=verify,
    )
    return DecodeRank(
        f"tcp-decode-{time.monotonic_ns()}",
        KVCache.allocate(layout, BLOCKS),
        options,
        metrics=TransferMetrics(),
        agent_factory=agent_factory,
    )


def tcp_end(prefill: InProcessPrefill) -> TcpPrefillEnd:
    end = prefill.rank.ends[TCP]
    assert isinstance(end, TcpPrefillEnd) and end.port > 0
    return end


def pulls(decode: DecodeRank, outcome: str) -> float | None:
    return decode.metrics.registry.get_sample_value("pd_transfer_pulls_total", {"outcome": outcome, "transport": TCP})


# ---------------------------------------------------------------------------------------------------------- pulls
def test_a_pull_goes_by_tcp_and_the_lease_with_it_with_no_nixl_peer(
    prefill: InProcessPrefill, agent_factory: AgentFactory
) -> None:
    end = tcp_end(prefill)
    assert [offer.transport for offer in prefill.rank.offers] == [TCP, messages.READ_CHECKS_OFFER]
    decode = decode_rank(agent_factory)
    try:
        remote_ids, local_ids, tokens = [9, 2, 30, 17], [4, 0, 21, 13], 16 * 3 + 5
        prefill.rank.hold("tcp-1", remote_ids)
        stats = decode.pull_confirmed("tcp-1", prefill.host, prefill.port, remote_ids, local_ids, tokens)
        assert stats.transport == TCP and stats.bytes > 0 and end.bytes_sent == stats.bytes
        assert received_correctly(decode.cache, local_ids, prefill.expected(), remote_ids, tokens)
        remote = decode.remotes.get(prefill.host, prefill.port)
        assert remote is not None and isinstance(remote.link, TcpLink)
        assert pulls(decode, "ok") == 1
        assert decode.confirmations.received == 1  # the LeaseConfirm came back on the tcp connection
        assert prefill.rank.ledger.readers_complete("tcp-1") is not None  # every reader reported
        assert prefill.rank.ledger.blocks_held == 0  # so the blocks are free
        assert not decode.agent.has_peer(prefill.rank.agent.name)  # no NIXL peer, so no NIXL read either
        prefill.rank.hold("tcp-2", [1, 3])
        again = decode.pull_confirmed("tcp-2", prefill.host, prefill.port, [1, 3], [30, 31], 20)  # the same link
        assert again.transport == TCP and decode.remotes.get(prefill.host, prefill.port) is remote
        assert received_correctly(decode.cache, [30, 31], prefill.expected(), [1, 3], 20)
        assert pulls(decode, "ok") == 2 and prefill.rank.ledger.blocks_held == 0
        checks = decode.metrics.registry.get_sample_value("pd_transfer_digest_checks_total", {"outcome": "equal"})
        assert checks == 2  # each read's sampled rows checked against the prefill's digest (verify: sample)
    finally:
        decode.close()


def test_with_the_secret_on_both_sides_a_pull_goes_by_tcp(
    guarded: InProcessPrefill, agent_factory: AgentFactory
) -> None:
    decode = decode_rank(agent_factory, secret=SECRET)
    try:
        guarded.rank.hold("tcp-secret", [5, 6, 7])
        stats = decode.pull_confirmed("tcp-secret", guarded.host, guarded.port, [5, 6, 7], [0, 1, 2], 40)
        assert stats.transport == TCP and stats.bytes == tcp_end(guarded).bytes_sent
        assert received_correctly(decode.cache, [0, 1, 2], guarded.expected(), [5, 6, 7], 40)
        assert guarded.rank.ledger.blocks_held == 0
    finally:
        decode.close()


class TwoRankPrefill:
    """A TP 2 prefill engine in this process (InProcessPrefill serves one rank): two ranks, a head each, filled as
    ``fill_pattern(cache, seed)``, behind one side channel, offering tcp."""

    def __init__(self, agents: AgentFactory, seed: int) -> None:
        self.engine_id = f"tcp-tp2-{time.monotonic_ns()}"
        self.seed = seed
        self.layouts = [kv_layout(MODEL, 16, 2, rank) for rank in range(2)]
        options = PrefillOptions(settings=DEFAULTS, transport=TCP, listen_host="127.0.0.1")
        self.ranks: list[PrefillRank] = []
        try:
            for cache in self.expected():
                self.ranks.append(PrefillRank(self.engine_id, cache, options, agent_factory=agents))
            self.server = serve_engine(self.engine_id, [rank.rank_metadata for rank in self.ranks])
        except BaseException:
            for rank in self.ranks:
                rank.close()
            raise
        self.host, self.port = "127.0.0.1", self.server.port

    def expected(self) -> list[KVCache]:
        caches = [KVCache.allocate(layout, BLOCKS) for layout in self.layouts]
        for cache in caches:
            fill_pattern(cache, self.seed)
        return caches

    def close(self) -> None:
        self.server.stop()
        for rank in self.ranks:
            rank.close()


@pytest.mark.parametrize(
    ("tp", "decode_layout"),
    [
        (1, kv_layout(MODEL, 32)),  # a block-size regroup: a 16-token row lands as half of a 32-token one
        (2, kv_layout(MODEL, 16)),  # each prefill rank's head into its place
        (2, kv_layout(MODEL, 32, layout="NHD")),  # a row per token and head, from HND blocks of 16 tokens
    ],
    ids=["block16-to-32", "tp2-to-tp1", "tp2-to-tp1-block32-NHD"],
)
def test_a_pull_by_tcp_regroups_into_another_layout(
    agent_factory: AgentFactory, tp: int, decode_layout: KVCacheLayout
) -> None:
    """Rows of any size land in place (the plan reads directly, no fix-up after the reads)."""
    prefill = prefill_named("regroup", agent_factory) if tp == 1 else TwoRankPrefill(agent_factory, seed=17)
    decode = decode_rank(agent_factory, decode_layout)
    try:
        ranks = [prefill.rank] if isinstance(prefill, InProcessPrefill) else prefill.ranks
        remote_ids, tokens = [11, 3, 28, 19, 6], 16 * 4 + 9
        local_ids = [7, 2, 9, 30, 0][: -(-tokens // decode_layout.block_size)]
        for rank in ranks:
            rank.hold("tcp-regroup", remote_ids)
        stats = decode.pull_confirmed("tcp-regroup", prefill.host, prefill.port, remote_ids, local_ids, tokens)
        assert stats.transport == TCP
        assert received_correctly(decode.cache, local_ids, prefill.expected(), remote_ids, tokens)
        remote = decode.remotes.get(prefill.host, prefill.port)
        assert remote is not None and len(remote.sources) == tp
        assert remote.plan.strategy == "direct" and remote.plan.postprocess is None
        sent = [end.bytes_sent for end in (rank.ends[TCP] for rank in ranks) if isinstance(end, TcpPrefillEnd)]
        assert len(sent) == tp and all(sent) and sum(sent) == stats.bytes
        assert decode.confirmations.received == tp
        assert all(rank.ledger.blocks_held == 0 for rank in ranks)
    finally:
        decode.close()
        prefill.close()


def test_block_ids_outside_the_plan_are_refused_before_a_row_moves(
    prefill: InProcessPrefill, agent_factory: AgentFactory
) -> None:
    decode = decode_rank(agent_factory)
    try:
        before = [tensor.clone() for tensor in decode.cache.tensors]
        prefill.rank.hold("tcp-bad", [1, 2])
        for remote_ids, local_ids in (([1, BLOCKS + 5], [3, 4]), ([1, 2], [3, BLOCKS])):
            with pytest.raises(ValueError):
                decode.pull("tcp-bad", prefill.host, prefill.port, remote_ids, local_ids, 20)
        assert all(a.equal(b) for a, b in zip(before, decode.cache.tensors, strict=True))
        assert tcp_end(prefill).bytes_sent == 0
        assert pulls(decode, "ok") is None
    finally:
        decode.close()


def test_a_prefill_that_closes_fails_the_next_pull_at_once(agent_factory: AgentFactory) -> None:
    prefill = prefill_named("closing", agent_factory)
    decode = decode_rank(agent_factory)
    try:
        prefill.rank.hold("tcp-before", [4, 5])
        assert decode.pull_confirmed("tcp-before", prefill.host, prefill.port, [4, 5], [0, 1], 32).transport == TCP
        remote = decode.remotes.get(prefill.host, prefill.port)
        assert remote is not None and isinstance(remote.link, TcpLink)  # its connection open
        prefill.close()
        started = time.monotonic()
        with pytest.raises(TransferError) as raised:
            decode.pull("tcp-after", prefill.host, prefill.port, [6, 7], [2, 3], 32, timeout_s=BOUND_S)
        assert time.monotonic() - started < BOUND_S / 2
        assert isinstance(raised.value, PeerDisconnected)
        assert pulls(decode, "failed") == 1
        assert decode.remotes.get(prefill.host, prefill.port) is None  # dropped: the next pull handshakes afresh
    finally:
        decode.close()
        prefill.close()


# ------------------------------------------------------------------------------------------- raw clients
def dial(port: int) -> tuple[socket.socket, bytes]:
    """A raw connection to a prefill end's port, and the nonce of the challenge it opens with."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=BOUND_S)
    (nonce,) = expect(receive_frame(sock), "challenge", bytes)
    assert len(nonce) == 32
    return sock, nonce


def greeted(prefill: InProcessPrefill, name: str = "raw-client") -> socket.socket:
    """A raw connection that proved the secret, welcomed by the rank."""
    sock, nonce = dial(tcp_end(prefill).port)
    send_frame(sock, ["hello", name, connection_mac(SECRET, nonce, name.encode())])
    assert receive_frame(sock) == ["welcome", prefill.rank.agent.name]
    return sock


REFUSED = "the hello does not prove the side channel's secret"


def ended(sock: socket.socket) -> bool:
    """Whether the peer ended the connection (nothing more comes)."""
    try:
        return receive_frame(sock) is None
    except ConnectionResetError:
        return True  # it closed with our bytes unread


def exactly(sock: socket.socket, count: int) -> bytes:
    data = bytearray()
    while len(data) < count:
        chunk = sock.recv(count - len(data))
        assert chunk, f"the connection ended after {len(data)} of {count} bytes"
        data += chunk
    return bytes(data)


def rows_of(*rows: tuple[int, int]) -> bytes:
    return np.array(list(rows), dtype=IOVEC).tobytes()


def good_rows(prefill: InProcessPrefill) -> list[tuple[int, int]]:
    """Rows inside the rank's cache: a whole block of one region, part of a block of another, its very last byte."""
    regions = prefill.rank.cache.regions
    last = regions[-1]
    return [
        (regions[1].base_address + 3 * regions[1].block_stride, regions[1].block_len),
        (regions[0].base_address + 17, 300),
        (last.base_address + last.span_bytes - 1, 1),
    ]


def expected_bytes(prefill: InProcessPrefill, rows: list[tuple[int, int]]) -> bytes:
    """What the rank's cache holds at ``rows``, read from a fresh copy of its contents (not the memory served)."""
    served, fresh = prefill.rank.cache.regions, prefill.expected()[0]
    out = b""
    for address, length in rows:
        index = next(i for i, r in enumerate(served) if r.base_address <= address < r.base_address + r.span_bytes)
        out += ctypes.string_at(fresh.regions[index].base_address + address - served[index].base_address, length)
    return out


def read_and_check(sock: socket.socket, prefill: InProcessPrefill, read_id: int) -> None:
    rows = good_rows(prefill)
    nbytes = sum(length for _, length in rows)
    send_frame(sock, ["read", read_id, rows_of(*rows)])
    assert receive_frame(sock) == ["rows", read_id, nbytes]
    assert exactly(sock, nbytes) == expected_bytes(prefill, rows)


FORGED: dict[str, Callable[[bytes], bytes]] = {
    "none": lambda nonce: b"",
    "zeros": lambda nonce: bytes(32),
    "another secret": lambda nonce: connection_mac("another-secret", nonce, b"mallory"),
}


@pytest.mark.parametrize("forged", list(FORGED))
def test_a_hello_without_the_secret_is_refused_and_its_connection_closed(
    guarded: InProcessPrefill, forged: str
) -> None:
    sock, nonce = dial(tcp_end(guarded).port)
    with sock:
        send_frame(sock, ["hello", "mallory", FORGED[forged](nonce)])
        assert receive_frame(sock) == ["refused", REFUSED]
        assert ended(sock)
    with greeted(guarded) as good:  # the end still welcomes who proves it
        read_and_check(good, guarded, 1)


def test_a_mac_over_another_nonce_or_name_is_refused(guarded: InProcessPrefill) -> None:
    port = tcp_end(guarded).port
    replayed, nonce = dial(port)
    fresh, _ = dial(port)
    with replayed, fresh:
        send_frame(replayed, ["hello", "alice", connection_mac(SECRET, nonce, b"alice")])
        assert receive_frame(replayed) == ["welcome", guarded.rank.agent.name]
        send_frame(fresh, ["hello", "alice", connection_mac(SECRET, nonce, b"alice")])  # another connection's nonce
        assert receive_frame(fresh) == ["refused", REFUSED] and ended(fresh)
    renamed, nonce = dial(port)
    with renamed:
        send_frame(renamed, ["hello", "mallory", connection_mac(SECRET, nonce, b"alice")])
        assert receive_frame(renamed) == ["refused", REFUSED] and ended(renamed)


def refusal(sock: socket.socket, read_id: int) -> str:
    """The reason of the ``["refused", read_id, reason]`` that comes next."""
    answer = receive_frame(sock)
    assert answer is not None and len(answer) == 3 and answer[:2] == ["refused", read_id], answer
    return str(answer[2])


def outside_rows(prefill: InProcessPrefill) -> dict[str, bytes]:
    spans = merged_spans(prefill.rank.cache.regions)
    first, end = spans[0][0], spans[-1][1]
    return {
        "before the cache": rows_of((first - 64, 64)),
        "past its end": rows_of((end, 16)),
        "across its end": rows_of((end - 8, 16)),
        "at address 0": rows_of((0, 0)),
        "wrapping around": rows_of((first, 2**64 - 1)),
        "a good row, then a bad one": rows_of(*good_rows(prefill), (end, 1)),
        "no whole number of entries": rows_of((first, 16))[:-3],  # the one refusal not "outside the cache"
    }


def test_reads_of_memory_outside_the_cache_are_refused_and_the_connection_serves_on(
    guarded: InProcessPrefill,
) -> None:
    end = tcp_end(guarded)
    with greeted(guarded) as sock:
        for read_id, (what, packed) in enumerate(outside_rows(guarded).items()):
            send_frame(sock, ["read", read_id, packed])
            reason = refusal(sock, read_id)
            assert ("no whole number" if what.startswith("no whole") else "is outside the cache") in reason, what
            assert reason.startswith("row 3 (") == (what == "a good row, then a bad one"), what  # the bad one named
        assert end.bytes_sent == 0
        read_and_check(sock, guarded, 100)
        read_and_check(sock, guarded, 101)  # and again
        send_frame(sock, ["read", 102, outside_rows(guarded)["past its end"]])
        assert "row 0 " in refusal(sock, 102)  # answered once the reads before it were counted
        assert end.bytes_sent == 2 * sum(length for _, length in good_rows(guarded))


HEADER = struct.Struct("!I")


def framed(payload: bytes) -> bytes:
    return HEADER.pack(len(payload)) + payload


GARBAGE = {
    "too long": HEADER.pack(MAX_FRAME + 1) + b"\x00" * 64,
    "longest length": HEADER.pack(2**32 - 1),
    "no msgpack": framed(b"\xc1\xc1\xc1"),
    "no list": framed(b"\x2a"),  # 42
    "an empty list": framed(b"\x90"),
    "no kind": framed(b"\x91\x07"),  # [7]
    "an unknown kind": framed(b"\x91\xa5bogus"),  # ["bogus"]
    "a read of the wrong fields": framed(b"\x93\xa4read\xa1x\xc4\x00"),  # ["read", "x", b""]
    "a message that does not decode": framed(b"\x92\xa7message\xc4\x03abc"),  # ["message", b"abc"]
    "a hello again": framed(b"\x93\xa5hello\xa1x\xc4\x00"),  # ["hello", "x", b""]
}


@pytest.mark.parametrize("garbage", list(GARBAGE), ids=list(GARBAGE))
def test_garbage_ends_its_own_connection_only_and_a_fresh_decode_still_pulls(
    guarded: InProcessPrefill, agent_factory: AgentFactory, garbage: str
) -> None:
    with greeted(guarded, "bystander") as bystander, greeted(guarded, "vandal") as vandal:
        vandal.sendall(GARBAGE[garbage])
        assert ended(vandal)
        read_and_check(bystander, guarded, 0)  # the connection beside it serves on
    before_hello, _ = dial(tcp_end(guarded).port)
    with before_hello:
        before_hello.sendall(GARBAGE[garbage])  # where the hello was due: the hello of no MAC is refused first
        assert (garbage == "a hello again") == (receive_frame(before_hello) == ["refused", REFUSED])
        assert ended(before_hello)
    decode = decode_rank(agent_factory, secret=SECRET)
    try:
        guarded.rank.hold("after-garbage", [8, 9])
        stats = decode.pull_confirmed("after-garbage", guarded.host, guarded.port, [8, 9], [10, 11], 30)
        assert stats.transport == TCP
        assert received_correctly(decode.cache, [10, 11], guarded.expected(), [8, 9], 30)
    finally:
        decode.close()


# -------------------------------------------------------------------------------------------- a stand-in rank
class StandInRank:
    """A prefill rank's tcp end written here: a real listener at 127.0.0.1 that opens each connection as the
    transport does (``["challenge", nonce]``; after the hello, ``["welcome", welcome]``, or ``["refused", ...]`` when
    ``refuse``), then leaves every read on its first connection unanswered and answers those on later ones with the
    bytes of the rows asked for (memory of this process). ``hellos``: (name, whether its MAC proved ``secret``) of
    each hello; ``ended``: the number of each connection its peer ended."""

    def __init__(
        self,
        welcome: str,
        *,
        secret: str | None = None,
        refuse: bool = False,
        unanswered: int = 1,
        digest_off_by: int = 0,
    ) -> None:
        """``unanswered``: connections whose reads are left unanswered (the first ones). A read asking for a digest
        gets the digest of the rows it names, plus ``digest_off_by`` (a rank whose bytes differ from what it held)."""
        self.welcome, self.secret, self.refuse = welcome, secret, refuse
        self.unanswered, self.digest_off_by = unanswered, digest_off_by
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self.hellos: queue.Queue[tuple[str, bool]] = queue.Queue()
        self.ended: queue.Queue[int] = queue.Queue()
        self._connections: list[socket.socket] = []
        self._threads = [threading.Thread(target=self._accept, name="stand-in-accept", daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        number = 0
        while True:
            try:
                connection, _ = self.listener.accept()
            except OSError:
                return  # closed
            self._connections.append(connection)
            serving = threading.Thread(target=self._serve, args=(connection, number), daemon=True)
            self._threads.append(serving)
            serving.start()
            number += 1

    def _serve(self, connection: socket.socket, number: int) -> None:
        try:
            connection.settimeout(BOUND_S)
            nonce = os.urandom(32)
            send_frame(connection, ["challenge", nonce])
            name, mac = expect(receive_frame(connection), "hello", str, bytes)
            proved = self.secret is not None and verify(connection_mac(self.secret, nonce, name.encode()), mac)
            self.hellos.put((name, proved))
            send_frame(connection, ["refused", "not you"] if self.refuse else ["welcome", self.welcome])
            while (frame := receive_frame(connection)) is not None:
                if frame[0] == "read" and number >= self.unanswered:
                    read_id, packed, *check = fields(frame, int, bytes, *[bytes] * (len(frame) - 3))
                    rows = np.frombuffer(packed, dtype=IOVEC).tolist()
                    answer: list[object] = ["rows", read_id, sum(length for _, length in rows)]
                    if check:
                        digest = rows_digest(np.frombuffer(check[0], dtype=IOVEC)) + self.digest_off_by
                        answer.append(digest % 2**64)
                    send_frame(connection, answer)
                    connection.sendall(b"".join(ctypes.string_at(base, length) for base, length in rows))
        except (OSError, BadFrame):
            pass  # the decode ended it
        self.ended.put(number)

    def close(self) -> None:
        shut(self.listener)
        for connection in self._connections:
            shut(connection)
        for thread in self._threads:
            thread.join(BOUND_S)
            assert not thread.is_alive()


@pytest.fixture
def decode_with_secret(agent_factory: AgentFactory) -> Iterator[DecodeRank]:
    made = decode_rank(agent_factory, secret=SECRET)
    try:
        yield made
    finally:
        made.close()


def site_end(decode: DecodeRank) -> TcpDecodeEnd:
    end = decode.ends[TCP]
    assert isinstance(end, TcpDecodeEnd)
    return end


def test_a_read_past_its_deadline_drops_the_connection_and_the_next_use_connects_afresh(
    decode_with_secret: DecodeRank,
) -> None:
    stand_in = StandInRank("the-rank", secret=SECRET)
    memory = np.random.default_rng(5).integers(0, 256, 4096, dtype=np.uint8)
    target = np.zeros(4096, dtype=np.uint8)
    remote = entries_of(np.uint64(memory.ctypes.data) + np.array([0, 2048], dtype=np.uint64), 1024)
    local = entries_of(np.uint64(target.ctypes.data) + np.array([1024, 0], dtype=np.uint64), 1024)
    name = decode_with_secret.agent.name
    connection = TcpConnection(site_end(decode_with_secret).site, "the-rank", ("127.0.0.1", stand_in.port))
    try:
        assert stand_in.hellos.get(timeout=BOUND_S) == (name, True)  # the hello proved the secret
        pending = connection.post(local, remote)
        started = time.perf_counter()
        with pytest.raises(TransferTimeout, match="not answered in time"):
            connection.wait(pending, started + 0.3)
        assert 0.25 <= time.perf_counter() - started < BOUND_S / 2
        assert stand_in.ended.get(timeout=BOUND_S) == 0  # the decode ended the connection
        assert not target.any()
        pending = connection.post(local, remote)  # the next use connects afresh
        assert stand_in.hellos.get(timeout=BOUND_S) == (name, True)
        connection.wait(pending, time.perf_counter() + BOUND_S)
        assert np.array_equal(target[1024:2048], memory[0:1024])
        assert np.array_equal(target[0:1024], memory[2048:3072])
        assert not target[2048:].any()
    finally:
        connection.close()
        stand_in.close()
    assert stand_in.ended.get(timeout=BOUND_S) == 1
    assert stand_in.hellos.empty()  # two connections in all


def test_a_rank_that_names_itself_otherwise_is_another_incarnation(decode_with_secret: DecodeRank) -> None:
    stand_in = StandInRank("a-restarted-rank")
    try:
        with pytest.raises(PeerDisconnected, match="another incarnation"):
            TcpConnection(site_end(decode_with_secret).site, "the-rank", ("127.0.0.1", stand_in.port))
        assert stand_in.hellos.get(timeout=BOUND_S)[0] == decode_with_secret.agent.name
        assert stand_in.ended.get(timeout=BOUND_S) == 0  # the decode closed it
    finally:
        stand_in.close()


def test_a_refused_hello_or_nothing_listening_fails_the_connection(decode_with_secret: DecodeRank) -> None:
    stand_in = StandInRank("the-rank", refuse=True)
    try:
        with pytest.raises(PeerDisconnected, match=r"refused: .*not you"):
            TcpConnection(site_end(decode_with_secret).site, "the-rank", ("127.0.0.1", stand_in.port))
    finally:
        stand_in.close()
    with socket.socket() as bound:  # a port of ours nobody listens at
        bound.bind(("127.0.0.1", 0))
        with pytest.raises(PeerDisconnected, match="cannot reach the-rank"):
            TcpConnection(site_end(decode_with_secret).site, "the-rank", ("127.0.0.1", bound.getsockname()[1]))


def test_a_block_changed_in_the_prefills_cache_after_its_hold_fails_the_read_naming_it(
    prefill: InProcessPrefill, agent_factory: AgentFactory
) -> None:
    """A request held, then a byte of one of its blocks changed in the prefill's cache (after the forward, before the
    read): the digest computed as the rows are sent would match what lands, so the prefill checks the blocks of the
    rows checked against their digests at the hold, and answers ``changed``: the read fails as a mismatch naming the
    block, nothing of it is used, the prefill is told and holds nothing; the next request reads."""
    end = tcp_end(prefill)
    assert end.held is not None
    decode = decode_rank(agent_factory, verify="all")
    try:
        remote_ids, local_ids, tokens = [9, 2, 30, 17], [4, 0, 21, 13], 16 * 3 + 5
        prefill.rank.hold("tcp-changed", remote_ids)
        assert end.held.blocks == len(remote_ids) * len(planes_of(list(prefill.rank.cache.regions)))
        tensor = prefill.rank.cache.tensors[-1]  # the last region's block 30: a byte in its middle
        tensor[30].view(torch.uint8).view(-1)[tensor[30].nbytes // 2] ^= 0x5A
        with pytest.raises(DigestMismatch, match=r"block 30 of layer .* changed in the prefill's cache after request"):
            decode.pull_confirmed("tcp-changed", prefill.host, prefill.port, remote_ids, local_ids, tokens)
        checks = decode.metrics.registry.get_sample_value("pd_transfer_digest_checks_total", {"outcome": "mismatch"})
        assert checks == 1
        reports = prefill.rank.wait_released("tcp-changed", BOUND_S)
        assert reports is not None and [type(report) for report in reports] == [messages.ReadFailed]
        assert prefill.rank.ledger.blocks_held == 0 and end.held.blocks == 0  # freed: its digests dropped
        prefill.rank.hold("tcp-after", [1, 3])
        decode.pull_confirmed("tcp-after", prefill.host, prefill.port, [1, 3], [30, 31], 20)
        assert received_correctly(decode.cache, [30, 31], prefill.expected(), [1, 3], 20)
    finally:
        decode.close()


@pytest.mark.parametrize("off_by", [0, 1], ids=["its digest", "another digest"])
def test_a_read_is_checked_against_the_digest_the_rank_sends_before_its_rows(
    decode_with_secret: DecodeRank, off_by: int
) -> None:
    """A rank that offers digests is asked for one of the rows checked; rows whose bytes here differ from it (the
    stand-in adds one to it: as if the bytes had changed on the way) fail the read, naming the rank."""
    stand_in = StandInRank("the-rank", secret=SECRET, unanswered=0, digest_off_by=off_by)
    memory = np.random.default_rng(7).integers(0, 256, 4096, dtype=np.uint8)
    target = np.zeros(4096, dtype=np.uint8)
    remote = entries_of(np.uint64(memory.ctypes.data) + np.array([0, 2048, 1024], dtype=np.uint64), 512)
    local = entries_of(np.uint64(target.ctypes.data) + np.array([1024, 0, 3072], dtype=np.uint64), 512)
    site = site_end(decode_with_secret).site
    connection = TcpConnection(site, "the-rank", ("127.0.0.1", stand_in.port), digests=True)
    try:
        pending = connection.post(local, remote, check=(local[1:], remote[1:]))
        if off_by:
            with pytest.raises(DigestMismatch, match="rows read from the-rank differ from what the prefill held"):
                connection.wait(pending, time.perf_counter() + BOUND_S)
        else:
            connection.wait(pending, time.perf_counter() + BOUND_S)
        assert np.array_equal(target[1024:1536], memory[0:512])  # the bytes landed either way: not to be used
    finally:
        connection.close()
        stand_in.close()
