"""Streams over the ``tcp`` transport (issue 41): a decode rank streams a request's KV layer by layer while the prefill
rank computes it (:meth:`DecodeRank.pull_streamed`, :mod:`pd_transfer.connector.transports.tcp.stream_sender`).

Real sockets between a prefill rank and decode ranks in this process (their NIXL agents are the fake fabric's, which
carry nothing here: the rows and the lease protocol go by tcp). The test plays the engine: ``computing``,
``layers_written``, ``hold``. Each layer is seen in the decode's cache before the next one is written; faults end in a
``TransferError`` and leave the prefill holding nothing; hostile stream frames sent over a raw socket are refused and
the connection goes on."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import numpy as np
import pytest
import torch
import xxhash
from in_process_prefill import InProcessPrefill

from pd_transfer.connector import messages
from pd_transfer.connector.cache import KVCache
from pd_transfer.connector.decode.rank import DecodeRank
from pd_transfer.connector.options import DecodeOptions
from pd_transfer.connector.transports.tcp.frames import expect, receive_frame, send_frame
from pd_transfer.connector.transports.tcp.prefill_end import TcpPrefillEnd
from pd_transfer.metrics import TransferMetrics
from pd_transfer.settings import DEFAULTS
from pd_transfer.sim.verify import logical, received_correctly
from pd_transfer.spec import KVCacheLayout, ModelFingerprint
from pd_transfer.transfer.agent_protocol import AgentFactory
from pd_transfer.transfer.cma import IOVEC, entries_of
from pd_transfer.transfer.digests import Verify
from pd_transfer.transfer.errors import DigestMismatch, TransferError

LAYERS = 4
MODEL = ModelFingerprint(model="tcp-streams", dtype="float16", num_layers=LAYERS, total_num_kv_heads=2, head_size=16)
LAYOUT = KVCacheLayout(fingerprint=MODEL, tp_size=1, tp_rank=0, block_size=16)
BLOCKS = 32
REMOTE, LOCAL, TOKENS = [9, 2, 30, 17], [4, 0, 21, 13], 16 * 3 + 5
OTHER = [11, 12, 13, 14]  # where a preempted request is computed again
WAIT_S = 10.0  # the bound on every wait here (each ends far sooner)
PULL_S = 20.0  # a pull's own timeout, where it is not the point
STEP_S, GAP_S = 1.0, 0.4  # a stream's timeout where it is the point, and the pause between two of its steps


@pytest.fixture
def prefill(agent_factory: AgentFactory) -> Iterator[InProcessPrefill]:
    made = InProcessPrefill(f"stream-prefill-{time.monotonic_ns()}", LAYOUT, BLOCKS, agent_factory, transport="tcp")
    try:
        yield made
    finally:
        made.close()


@pytest.fixture
def decode(agent_factory: AgentFactory) -> Iterator[DecodeRank]:
    made = decode_rank(agent_factory)
    try:
        yield made
    finally:
        made.close()


def decode_rank(agent_factory: AgentFactory, verify: Verify = "sample") -> DecodeRank:
    options = DecodeOptions(settings=DEFAULTS, transport="tcp", verify=verify)
    cache = KVCache.allocate(LAYOUT, BLOCKS)
    return DecodeRank(
        f"stream-decode-{time.monotonic_ns()}", cache, options, metrics=TransferMetrics(), agent_factory=agent_factory
    )


def tcp_end(prefill: InProcessPrefill) -> TcpPrefillEnd:
    end = prefill.rank.ends["tcp"]
    assert isinstance(end, TcpPrefillEnd)
    return end


class Pull:
    """``decode.pull_streamed`` of ``request_id`` from ``prefill`` on a thread of its own: :attr:`done` is set once it
    returned (:attr:`stats`) or raised (:attr:`error`)."""

    def __init__(
        self, decode: DecodeRank, request_id: str, prefill: InProcessPrefill, *, timeout_s: float = PULL_S
    ) -> None:
        self.done = threading.Event()
        self.stats: Any = None
        self.error: BaseException | None = None

        def run() -> None:
            try:
                self.stats = decode.pull_streamed(
                    request_id, prefill.host, prefill.port, LOCAL, TOKENS, timeout_s=timeout_s
                )
            except BaseException as error:
                self.error = error
            finally:
                self.done.set()

        self.thread = threading.Thread(target=run, name=f"pull-{request_id}", daemon=True)
        self.thread.start()

    def result(self) -> Any:
        """Its stats (raising what it raised), once it ended (bounded)."""
        assert self.done.wait(WAIT_S), "the pull did not end in time"
        self.thread.join(timeout=WAIT_S)
        if self.error is not None:
            raise self.error
        return self.stats

    def failure(self) -> BaseException:
        """What it raised, once it ended (bounded)."""
        assert self.done.wait(WAIT_S), "the pull did not end in time"
        assert self.error is not None, f"the pull ended well: {self.stats}"
        return self.error

    def until(self, condition: Callable[[], bool], what: str) -> None:
        """Bounded: until ``condition()`` holds, looking again each time a few milliseconds pass on :attr:`done` (the
        pull ending early stops the wait: ``condition`` then fails)."""
        deadline = time.monotonic() + WAIT_S
        while not condition():
            assert not self.done.is_set(), f"the pull ended ({self.error!r}) before {what}"
            assert time.monotonic() < deadline, f"not in time: {what}"
            self.done.wait(0.002)


def stream_threads(prefill: InProcessPrefill) -> list[threading.Thread]:
    """The prefill rank's threads serving watches and streams (the rank runs in this process)."""
    name = f"{prefill.rank.agent.name}-stream"
    return [thread for thread in threading.enumerate() if thread.name == name]


def layer_arrived(decode: DecodeRank, prefill: InProcessPrefill, layer: int) -> bool:
    """Whether the decode's cache holds every token of layer ``layer`` (K and V) of the request as the prefill's."""
    have = logical(decode.cache, LOCAL, TOKENS)
    want = logical(prefill.expected()[0], REMOTE, TOKENS)
    planes = len(have) // LAYERS  # planes are ordered by layer, then kind
    rows = slice(layer * planes, (layer + 1) * planes)
    return torch.equal(have[rows].view(torch.int16), want[rows].view(torch.int16))


def sent_past(end: TcpPrefillEnd, sent: int) -> bool:
    """Whether the prefill's tcp end sent rows' bytes beyond ``sent``."""
    return end.bytes_sent > sent


def assert_lease_ended_as_read(prefill: InProcessPrefill, request_id: str) -> None:
    reports = prefill.rank.wait_released(request_id, WAIT_S)
    assert reports is not None and [type(report) for report in reports] == [messages.ReadDone]
    assert prefill.rank.ledger.status(request_id) == "read"
    assert prefill.rank.ledger.blocks_held == 0


def assert_digests_failed_the_read(prefill: InProcessPrefill, decode: DecodeRank, request_id: str) -> None:
    """One mismatch counted on the decode, the prefill told (``ReadFailed``) and holding nothing."""
    assert digest_checks(decode, "mismatch") == 1
    reports = prefill.rank.wait_released(request_id, WAIT_S)
    assert reports is not None and [type(report) for report in reports] == [messages.ReadFailed]
    assert prefill.rank.ledger.blocks_held == 0


# ----------------------------------------------------------------------------------------------- streams that end well
def test_the_decode_asks_first_and_each_layer_arrives_as_it_is_written(
    prefill: InProcessPrefill, decode: DecodeRank
) -> None:
    end = tcp_end(prefill)
    sent_before = end.bytes_sent
    pull = Pull(decode, "s-first", prefill)
    pull.until(lambda: len(stream_threads(prefill)) == 1, "the prefill serves the decode's watch")
    assert prefill.rank.streams.progress("s-first") is None  # asked before the prefill knew of the request
    prefill.rank.computing("s-first", REMOTE)
    for written in range(1, LAYERS + 1):
        sent = end.bytes_sent
        prefill.rank.layers_written("s-first", written)
        pull.until(partial(sent_past, end, sent), f"layer {written - 1} is sent")
        pull.until(partial(layer_arrived, decode, prefill, written - 1), f"layer {written - 1} arrives")
        assert not any(layer_arrived(decode, prefill, later) for later in range(written, LAYERS))  # not yet written
        assert prefill.rank.ledger.status("s-first") == "unknown" and not pull.done.is_set()  # not held yet
    prefill.rank.hold("s-first", REMOTE)
    stats = pull.result()
    assert received_correctly(decode.cache, LOCAL, prefill.expected(), REMOTE, TOKENS)
    assert stats.transport == "tcp" and stats.layers_streamed == LAYERS
    assert stats.bytes == end.bytes_sent - sent_before > 0
    assert_lease_ended_as_read(prefill, "s-first")
    progress = prefill.rank.streams.progress("s-first")
    assert progress is not None and progress.ended == "read"


def test_a_request_the_prefill_finished_first_is_streamed_at_once(
    prefill: InProcessPrefill, decode: DecodeRank
) -> None:
    prefill.rank.hold("s-done", REMOTE)  # never announced as computing: held, every layer written
    began = time.monotonic()
    stats = decode.pull_streamed("s-done", prefill.host, prefill.port, LOCAL, TOKENS, timeout_s=PULL_S)
    assert time.monotonic() - began < WAIT_S
    assert received_correctly(decode.cache, LOCAL, prefill.expected(), REMOTE, TOKENS)
    assert stats.transport == "tcp" and stats.layers_streamed == LAYERS and stats.bytes > 0
    assert_lease_ended_as_read(prefill, "s-done")


def test_a_stream_that_keeps_moving_outlasts_its_timeout(prefill: InProcessPrefill, decode: DecodeRank) -> None:
    """The timeout bounds each step, not the whole stream: a request whose compute takes longer than it (each step
    here comes ``GAP_S`` after the one before, six steps, the timeout ``STEP_S``) still streams whole."""
    pace = threading.Event()  # never set: its timed waits are the prefill's compute
    pull = Pull(decode, "s-long", prefill, timeout_s=STEP_S)
    pull.until(lambda: len(stream_threads(prefill)) == 1, "the prefill serves the decode's watch")
    began = time.monotonic()
    pace.wait(GAP_S)
    prefill.rank.computing("s-long", REMOTE)
    for written in range(1, LAYERS + 1):
        pace.wait(GAP_S)
        prefill.rank.layers_written("s-long", written)
        pull.until(partial(layer_arrived, decode, prefill, written - 1), f"layer {written - 1} arrives")
    pace.wait(GAP_S)
    prefill.rank.hold("s-long", REMOTE)
    stats = pull.result()
    assert time.monotonic() - began > STEP_S  # the whole stream took longer than the timeout
    assert stats.layers_streamed == LAYERS
    assert received_correctly(decode.cache, LOCAL, prefill.expected(), REMOTE, TOKENS)
    assert_lease_ended_as_read(prefill, "s-long")


def test_a_stream_that_stops_moving_fails_a_timeout_after_its_last_layer(
    prefill: InProcessPrefill, decode: DecodeRank
) -> None:
    pull = Pull(decode, "s-stall", prefill, timeout_s=STEP_S)
    prefill.rank.computing("s-stall", REMOTE)
    prefill.rank.layers_written("s-stall", 1)
    pull.until(lambda: layer_arrived(decode, prefill, 0), "layer 0 arrives")
    arrived = time.monotonic()
    error = pull.failure()  # layer 1 never written
    # whichever side's bound ends first: the decode's, a step after layer 0 arrived, or the prefill's, a step after
    # it sent layer 0 (it then refuses the stream)
    assert isinstance(error, TransferError)
    assert "not answered in time" in str(error) or "did not come in time" in str(error), error
    assert STEP_S * 0.9 <= time.monotonic() - arrived < WAIT_S
    reports = prefill.rank.wait_released("s-stall", WAIT_S)  # the decode said it gave up
    assert reports is not None and [type(report) for report in reports] == [messages.ReadFailed]


# ------------------------------------------------------------------------------------------------ digests (issue 42)
def digest_checks(decode: DecodeRank, outcome: str) -> float:
    value = decode.metrics.registry.get_sample_value("pd_transfer_digest_checks_total", {"outcome": outcome})
    return value or 0.0


def test_every_layer_checked_against_the_prefills_digests_under_verify_all(
    prefill: InProcessPrefill, agent_factory: AgentFactory
) -> None:
    decode = decode_rank(agent_factory, verify="all")
    try:
        pull = Pull(decode, "s-all", prefill)
        prefill.rank.computing("s-all", REMOTE)
        prefill.rank.layers_written("s-all", LAYERS)
        prefill.rank.hold("s-all", REMOTE)
        assert pull.result().layers_streamed == LAYERS
        assert received_correctly(decode.cache, LOCAL, prefill.expected(), REMOTE, TOKENS)
        assert digest_checks(decode, "equal") == LAYERS and digest_checks(decode, "mismatch") == 0
        assert_lease_ended_as_read(prefill, "s-all")
    finally:
        decode.close()


def test_sampled_checks_turn_over_the_layers_from_request_to_request(
    prefill: InProcessPrefill, decode: DecodeRank
) -> None:
    """``sample`` (the default) checks one layer a request here (4 layers: one in 4), another each time."""
    for number in range(LAYERS):
        request_id = f"s-sample-{number}"
        prefill.rank.hold(request_id, REMOTE)
        decode.pull_streamed(request_id, prefill.host, prefill.port, LOCAL, TOKENS, timeout_s=PULL_S)
        assert digest_checks(decode, "equal") == number + 1
    assert digest_checks(decode, "mismatch") == 0


def test_a_layer_changed_after_it_was_sent_fails_the_stream_naming_the_layer(
    prefill: InProcessPrefill, agent_factory: AgentFactory
) -> None:
    """Layer 0 goes out as soon as it is written; then a byte of it changes in the prefill's cache before the request
    is held (as if it went out before its KV was whole): the decode's copy differs from the prefill's digest at the
    hold, so the stream fails, naming the layer; the prefill is told and holds nothing after."""
    decode = decode_rank(agent_factory, verify="all")
    try:
        pull = Pull(decode, "s-changed", prefill)
        prefill.rank.computing("s-changed", REMOTE)
        prefill.rank.layers_written("s-changed", 1)
        pull.until(lambda: layer_arrived(decode, prefill, 0), "layer 0 arrives")
        cache = prefill.rank.cache
        first = min(range(len(cache.regions)), key=lambda index: cache.regions[index].layer)
        cache.tensors[first][REMOTE[0]].view(torch.uint8).view(-1)[0] ^= 0xFF  # its first token's first byte
        prefill.rank.layers_written("s-changed", LAYERS)
        prefill.rank.hold("s-changed", REMOTE)
        error = pull.failure()
        assert isinstance(error, DigestMismatch) and "layer 0 " in str(error), error
        assert_digests_failed_the_read(prefill, decode, "s-changed")
    finally:
        decode.close()


def test_a_block_changed_after_the_hold_fails_a_stream_asked_for_later(
    prefill: InProcessPrefill, agent_factory: AgentFactory
) -> None:
    """A request held (its blocks digested then), then a byte of it changed in the prefill's cache, then streamed:
    every layer goes out as the cache holds it now, so the digests of those bytes would match; the prefill's check
    against the hold answers ``changed`` instead, and the stream fails as a mismatch naming the block."""
    decode = decode_rank(agent_factory, verify="all")
    try:
        prefill.rank.hold("s-after-hold", REMOTE)
        cache = prefill.rank.cache
        first = min(range(len(cache.regions)), key=lambda index: cache.regions[index].layer)
        cache.tensors[first][REMOTE[0]].view(torch.uint8).view(-1)[0] ^= 0xFF
        with pytest.raises(DigestMismatch, match=f"block {REMOTE[0]} of layer 0 "):
            decode.pull_streamed("s-after-hold", prefill.host, prefill.port, LOCAL, TOKENS, timeout_s=PULL_S)
        assert_digests_failed_the_read(prefill, decode, "s-after-hold")
    finally:
        decode.close()


# -------------------------------------------------------------------------------------------------------------- faults
def start_streaming(prefill: InProcessPrefill, decode: DecodeRank, request_id: str) -> Pull:
    """A pull of ``request_id`` under way: computing in REMOTE, its first layer written and arrived."""
    pull = Pull(decode, request_id, prefill)
    prefill.rank.computing(request_id, REMOTE)
    prefill.rank.layers_written(request_id, 1)
    pull.until(lambda: layer_arrived(decode, prefill, 0), "layer 0 arrives")
    return pull


def test_a_request_aborted_mid_stream_is_refused(prefill: InProcessPrefill, decode: DecodeRank) -> None:
    pull = start_streaming(prefill, decode, "s-abort")
    assert prefill.rank.abort("s-abort") is None  # not held: nothing to free, the stream ends
    error = pull.failure()
    assert isinstance(error, TransferError) and "refused" in str(error) and "aborted" in str(error)
    reports = prefill.rank.wait_released("s-abort", WAIT_S)  # the decode said it gave up
    assert reports is not None and [type(report) for report in reports] == [messages.ReadFailed]
    assert prefill.rank.ledger.blocks_held == 0


def test_a_request_computed_again_elsewhere_mid_stream_is_refused(
    prefill: InProcessPrefill, decode: DecodeRank
) -> None:
    pull = start_streaming(prefill, decode, "s-again")
    prefill.rank.computing("s-again", OTHER)  # preempted, computed again into other blocks
    error = pull.failure()
    assert isinstance(error, TransferError) and "computed again" in str(error)
    reports = prefill.rank.wait_released("s-again", WAIT_S)
    assert reports is not None and [type(report) for report in reports] == [messages.ReadFailed]
    prefill.rank.layers_written("s-again", LAYERS)
    freed = prefill.rank.hold("s-again", OTHER)  # its only reader gave up: the blocks come back at once
    assert freed is not None and freed.block_ids == tuple(OTHER)
    assert prefill.rank.ledger.blocks_held == 0


def test_a_request_the_prefill_never_computes_is_refused_after_the_decode_timeout(
    prefill: InProcessPrefill, decode: DecodeRank
) -> None:
    decode.connect(prefill.host, prefill.port)  # the handshake and the connection, out of the timed part
    began = time.monotonic()
    with pytest.raises(TransferError):
        decode.pull_streamed("s-never", prefill.host, prefill.port, LOCAL, TOKENS, timeout_s=0.3)
    assert 0.3 <= time.monotonic() - began < WAIT_S
    assert prefill.rank.streams.progress("s-never") is None
    assert prefill.rank.ledger.blocks_held == 0
    assert not received_correctly(decode.cache, LOCAL, prefill.expected(), REMOTE, TOKENS)  # nothing landed


def test_a_decode_that_closes_mid_stream_leaves_the_prefill_whole(
    prefill: InProcessPrefill, decode: DecodeRank, agent_factory: AgentFactory
) -> None:
    pull = start_streaming(prefill, decode, "s-gone")
    decode.close()
    assert isinstance(pull.failure(), TransferError)
    prefill.rank.layers_written("s-gone", LAYERS)  # wakes the stream's thread: its sends fail, it ends
    prefill.rank.hold("s-gone", REMOTE)
    for thread in stream_threads(prefill):
        thread.join(timeout=WAIT_S)
    assert stream_threads(prefill) == []
    freed = prefill.rank.release("s-gone", read_possible=False)  # nobody will read it
    assert freed is not None and freed.block_ids == tuple(REMOTE)
    assert prefill.rank.ledger.blocks_held == 0
    progress = prefill.rank.streams.progress("s-gone")
    assert progress is not None and progress.ended == "released"

    fresh = decode_rank(agent_factory)  # and the prefill serves the next decode
    try:
        prefill.rank.computing("s-next", REMOTE)
        prefill.rank.layers_written("s-next", LAYERS)
        prefill.rank.hold("s-next", REMOTE)
        stats = fresh.pull_streamed("s-next", prefill.host, prefill.port, LOCAL, TOKENS, timeout_s=PULL_S)
        assert stats.layers_streamed == LAYERS
        assert received_correctly(fresh.cache, LOCAL, prefill.expected(), REMOTE, TOKENS)
        assert_lease_ended_as_read(prefill, "s-next")
    finally:
        fresh.close()


# ------------------------------------------------------------------------------------------------------ hostile frames
class RawConnection:
    """A connection to the prefill's tcp end that says hello (the prefill has no secret), then frames as the test
    writes them."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
        expect(receive_frame(self.sock), "challenge", bytes)
        send_frame(self.sock, ["hello", "hostile-decode", b""])
        expect(receive_frame(self.sock), "welcome", str)

    def ask(self, frame: list[Any]) -> list[Any]:
        send_frame(self.sock, frame)
        answer = receive_frame(self.sock)
        assert answer is not None
        return answer

    def receive_bytes(self, count: int) -> bytes:
        data = bytearray()
        while len(data) < count:
            chunk = self.sock.recv(count - len(data))
            assert chunk, "the prefill closed the connection"
            data += chunk
        return bytes(data)

    def close(self) -> None:
        self.sock.close()


def block_row(cache: KVCache, region: int, block: int) -> tuple[np.ndarray, bytes]:
    """The row of ``block`` of the cache's region ``region`` (an IOVEC entry) and its bytes."""
    spec = cache.regions[region]
    row = entries_of(np.array([spec.base_address + block * spec.block_stride], dtype=np.uint64), spec.block_len)
    return row, cache.tensors[region][block].contiguous().view(torch.uint8).numpy().tobytes()


def test_hostile_stream_frames_are_refused_and_the_connection_goes_on(prefill: InProcessPrefill) -> None:
    cache = prefill.rank.cache
    first, first_bytes = block_row(cache, 0, REMOTE[0])  # layer 0's K
    second, second_bytes = block_row(cache, 2, REMOTE[0])  # layer 1's K
    rows = np.concatenate([first, second]).tobytes()
    prefill.rank.hold("s-raw", REMOTE)
    progress = prefill.rank.streams.progress("s-raw")
    assert progress is not None
    generation = progress.generation
    last = cache.regions[-1]
    end_of_cache = last.base_address + last.span_bytes
    hostile: list[tuple[bytes, list[Any], list[Any], str]] = [
        (rows, [2, 1], [0, 1], "do not cut the rows in order"),  # groups out of order
        (rows, [1], [0], "do not cut the rows in order"),  # the groups leave a row out
        (rows, [1, 2], [0], "do not cut the rows in order"),  # a group with no layer
        (rows, [1.0, 2], [0, 1], "do not cut the rows in order"),  # ends that are no entries
        (rows, [], [], "do not cut the rows in order"),  # rows in no group
        (rows, [1, 2], [0, LAYERS], "name a layer the cache does not have"),
        (rows, [1, 2], [-1, 0], "name a layer the cache does not have"),
        (entries_of(np.array([4096], dtype=np.uint64), 64).tobytes(), [1], [0], "outside the cache"),
        (entries_of(np.array([end_of_cache - 8], dtype=np.uint64), 16).tobytes(), [1], [LAYERS - 1], "outside"),
        (rows[:-3], [1], [0], "no whole number of entries"),
    ]
    raw = RawConnection(tcp_end(prefill).port)
    try:
        for index, (packed, ends, layers, why) in enumerate(hostile):
            answer = raw.ask(["stream", index, "s-raw", generation, packed, ends, layers, WAIT_S])
            assert answer[:2] == ["refused", index] and why in answer[2], answer
        answer = raw.ask(["watch", 100, "s-nobody", 0.0])
        assert answer[:2] == ["refused", 100] and "did not come in time" in answer[2]
        answer = raw.ask(["watch", 101, "s-raw", WAIT_S])
        assert answer == ["blocks", 101, REMOTE, generation, "s-raw"]
        # the same connection streams rows that are the cache's, cut right: each layer's bytes, then the end
        assert raw.ask(["stream", 102, "s-raw", generation, rows, [1, 2], [0, 1], WAIT_S]) == [
            "layer",
            102,
            0,
            len(first_bytes),
        ]
        assert raw.receive_bytes(len(first_bytes)) == first_bytes
        assert expect(receive_frame(raw.sock), "layer", int, int, int) == [102, 1, len(second_bytes)]
        assert raw.receive_bytes(len(second_bytes)) == second_bytes
        assert expect(receive_frame(raw.sock), "end", int) == [102]  # a decode before issue 42: no digests
        for index, verify in enumerate([[2], [-1], [0, 0], [True], ["0"]], start=110):  # ninth field: verify
            answer = raw.ask(["stream", index, "s-raw", generation, rows, [1, 2], [0, 1], WAIT_S, verify])
            assert answer[:2] == ["refused", index] and "verify names groups" in answer[2], answer
        assert raw.ask(["stream", 104, "s-raw", generation, rows, [1, 2], [0, 1], WAIT_S, [1]])[:3] == ["layer", 104, 0]
        assert raw.receive_bytes(len(first_bytes)) == first_bytes
        assert expect(receive_frame(raw.sock), "layer", int, int, int) == [104, 1, len(second_bytes)]
        assert raw.receive_bytes(len(second_bytes)) == second_bytes
        assert expect(receive_frame(raw.sock), "digests", int, list) == [104, [xxhash.xxh3_64_intdigest(second_bytes)]]
        assert expect(receive_frame(raw.sock), "end", int) == [104]
        answer = raw.ask(["stream", 103, "s-raw", generation + 1, rows, [1, 2], [0, 1], WAIT_S])
        assert answer[:2] == ["refused", 103] and "computed again" in answer[2]  # a generation it is not in
    finally:
        raw.close()
    assert len(np.frombuffer(rows, dtype=IOVEC)) == 2
    freed = prefill.rank.release("s-raw", read_possible=False)
    assert freed is not None and prefill.rank.ledger.blocks_held == 0


# ------------------------------------------------------------------------------------------------------------- aliases
def test_a_decode_that_names_the_request_by_its_stream_id_reads_it_and_reports_it_by_the_prefills_id(
    prefill: InProcessPrefill, decode: DecodeRank
) -> None:
    pull = Pull(decode, "stream-7", prefill)
    pull.until(lambda: len(stream_threads(prefill)) == 1, "the prefill serves the decode's watch")
    prefill.rank.computing("s-named", REMOTE, alias="stream-7")
    prefill.rank.layers_written("s-named", 1)
    pull.until(lambda: layer_arrived(decode, prefill, 0), "layer 0 arrives")
    prefill.rank.layers_written("s-named", LAYERS)
    prefill.rank.hold("s-named", REMOTE)
    stats = pull.result()
    assert stats.request_id == "stream-7" and stats.layers_streamed == LAYERS
    assert received_correctly(decode.cache, LOCAL, prefill.expected(), REMOTE, TOKENS)
    assert_lease_ended_as_read(prefill, "s-named")  # the ReadDone named the prefill's id


def test_a_stream_by_stream_id_refused_mid_way_tells_the_prefill_of_its_request(
    prefill: InProcessPrefill, decode: DecodeRank
) -> None:
    pull = Pull(decode, "stream-8", prefill)
    prefill.rank.computing("s-aliased", REMOTE, alias="stream-8")
    prefill.rank.layers_written("s-aliased", 1)
    pull.until(lambda: layer_arrived(decode, prefill, 0), "layer 0 arrives")
    prefill.rank.computing("s-aliased", OTHER, alias="stream-8")  # preempted, computed again elsewhere
    error = pull.failure()
    assert isinstance(error, TransferError) and "computed again" in str(error)
    reports = prefill.rank.wait_released("s-aliased", WAIT_S)  # the decode's ReadFailed counts for the request
    assert reports is not None and [type(report) for report in reports] == [messages.ReadFailed]
    prefill.rank.layers_written("s-aliased", LAYERS)
    freed = prefill.rank.hold("s-aliased", OTHER)  # its only reader gave up: the blocks come back at once
    assert freed is not None and prefill.rank.ledger.blocks_held == 0
