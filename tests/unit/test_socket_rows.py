"""Scattered rows over a stream socket (pd_transfer.transfer.socket_rows), for real: a sender thread's rows, permuted
in its buffer, of many lengths (zero-length ones too, a chunk of nothing but those last), more than IOV_MAX of them,
land in a receiver's rows cut elsewhere (or merged into runs on one side only), every byte checked, the bytes between
the rows untouched. Over a Unix socket pair and a loopback TCP connection, both with small buffers, and once more with
signals interrupting both threads' calls: a blocking ``sendmsg`` / ``recvmsg`` moves every byte it was given however
small the buffers, and returns having moved part of them (so that the next call goes on mid-row) only when interrupted
or stopped. Then what ends a transfer: a peer that closes, a shutdown from another thread, a send to a peer that
never reads past the socket's send timeout, a receive past its receive timeout, rows that are no IOVEC array. And
``cma.merged_rows``, which cuts the tcp transport's rows."""

from __future__ import annotations

import errno
import signal
import socket
import struct
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType

import numpy as np
import pytest

from pd_transfer.transfer.cma import IOVEC, entries_of, merged_rows
from pd_transfer.transfer.errors import PeerDisconnected, TransferError, TransferTimeout
from pd_transfer.transfer.socket_rows import IOV_MAX, receive_rows, send_rows, set_send_timeout

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the msghdr layout is Linux's")

ROW = 512  # the rows of a side whose rows are merged into runs
ROWS = 3000
STREAM = ROW * ROWS  # bytes sent in each transfer
SMALL_BUFFER = {"unix": 4096, "tcp": 65536}  # TCP's own small windows and delayed ACKs make 4 KiB crawl on loopback
BOUND_S = 10.0  # what any one wait here may take
INTERRUPT_S = BOUND_S / 2


@dataclass
class Cut:
    """Rows of ``buffer``: ``offsets`` and ``lengths`` in stream order; ``entries`` what is moved (the rows themselves,
    or runs of adjacent ones merged)."""

    buffer: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray
    entries: np.ndarray

    def gathered(self) -> np.ndarray:
        """The rows' bytes in stream order."""
        return np.concatenate(
            [self.buffer[o : o + n] for o, n in zip(self.offsets.tolist(), self.lengths.tolist(), strict=True)]
        )

    def outside(self) -> np.ndarray:
        """Whether each byte of the buffer lies outside every row."""
        covered = np.zeros(len(self.buffer), dtype=np.int64)
        np.add.at(covered, self.offsets[self.lengths > 0], 1)
        np.add.at(covered, (self.offsets + self.lengths)[self.lengths > 0], -1)
        return np.cumsum(covered)[: len(self.buffer)] == 0


def placed(rng: np.random.Generator, lengths: np.ndarray, min_gap: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(a buffer of random bytes, the offsets of rows of ``lengths`` in it): the rows laid out in a shuffled order,
    ``min_gap`` to 63 bytes apart."""
    order = rng.permutation(len(lengths))
    sizes = lengths[order] + rng.integers(min_gap, 64, len(lengths))
    offsets = np.empty(len(lengths), dtype=np.int64)
    offsets[order] = np.cumsum(sizes) - lengths[order]
    buffer = rng.integers(0, 256, int(sizes.sum()) + 64, dtype=np.uint8)
    return buffer, offsets


def scattered(rng: np.random.Generator) -> Cut:
    """The stream cut at random points into rows here and there, zero-length rows among them, and a last chunk of
    nothing but zero-length rows."""
    lengths = np.diff(np.concatenate([[0], np.sort(rng.integers(0, STREAM + 1, 2500)), [STREAM]]))
    lengths = np.insert(lengths, rng.integers(0, len(lengths), 40), 0)
    lengths = np.concatenate([lengths, np.zeros((-len(lengths)) % IOV_MAX + 3, dtype=lengths.dtype)])
    assert len(lengths) % IOV_MAX == 3 and not lengths[-3:].any() and len(lengths) > 2 * IOV_MAX
    buffer, offsets = placed(rng, lengths)
    return Cut(buffer, offsets, lengths, entries_of(np.uint64(buffer.ctypes.data) + offsets.astype(np.uint64), lengths))


def merged(rng: np.random.Generator) -> Cut:
    """The stream as rows of ``ROW`` bytes in five runs of adjacent rows, the runs shuffled in the buffer: five
    entries (``merged_rows``)."""
    runs = np.diff(np.concatenate([[0], np.sort(rng.choice(np.arange(1, ROWS), 4, replace=False)), [ROWS]]))
    buffer, starts = placed(rng, runs * ROW, min_gap=1)  # never two runs in one
    offsets = np.concatenate([start + np.arange(run) * ROW for start, run in zip(starts, runs, strict=True)])
    entries = merged_rows(np.uint64(buffer.ctypes.data) + offsets.astype(np.uint64), ROW)
    assert len(entries) == 5 and entries["length"].tolist() == (runs * ROW).tolist()
    return Cut(buffer, offsets, np.full(ROWS, ROW, dtype=np.int64), entries)


CUTS: dict[str, Callable[[np.random.Generator], Cut]] = {"scattered": scattered, "merged": merged}


def connected(family: str, buffer_bytes: int) -> tuple[socket.socket, socket.socket]:
    """Two blocking sockets connected to each other, with ``buffer_bytes`` send and receive buffers."""
    if family == "unix":
        a, b = socket.socketpair()
    else:
        with socket.create_server(("127.0.0.1", 0)) as listener:
            listener.settimeout(BOUND_S)
            a = socket.create_connection(listener.getsockname(), timeout=BOUND_S)
            b, _ = listener.accept()
        for sock in (a, b):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for sock in (a, b):
        sock.settimeout(None)  # blocking, as socket_rows needs
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)
    return a, b


def set_receive_timeout(sock: socket.socket, seconds: float) -> None:
    whole = int(seconds)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("@ll", whole, int((seconds - whole) * 1e6)))


def closed(*socks: socket.socket) -> None:
    for sock in socks:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # closed already, or never connected
        sock.close()


class Interruptions:
    """A thread sending SIGUSR1 (handled by doing nothing) to ``targets`` (thread idents) every 0.2 ms until
    :meth:`stop`, for ``INTERRUPT_S`` at most (a call retried after EINTR waits its socket's timeout afresh): a
    blocking call that moved some bytes returns with them, one that moved none fails with EINTR. A target thread must
    stay alive until :attr:`stopped` is set (a thread that ended may not be signalled)."""

    def __init__(self) -> None:
        self.targets: list[int] = []
        self.sent = 0
        self.running = threading.Event()  # set once the first signals went out
        self.stopped = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="interruptions", daemon=True)

    def start(self, targets: list[int]) -> None:
        self.targets = targets
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(BOUND_S)
            assert not self._thread.is_alive()
        self.stopped.set()

    def _run(self) -> None:
        until = time.monotonic() + INTERRUPT_S
        while True:
            for ident in self.targets:
                signal.pthread_kill(ident, signal.SIGUSR1)
                self.sent += 1
            self.running.set()
            if self._stop.wait(0.0002) or time.monotonic() >= until:
                return


@contextmanager
def ignoring_sigusr1() -> Iterator[None]:
    def nothing(signum: int, frame: FrameType | None) -> None:
        pass

    previous = signal.signal(signal.SIGUSR1, nothing)
    try:
        yield
    finally:
        signal.signal(signal.SIGUSR1, previous)


def transfer(family: str, sending: Cut, receiving: Cut, interrupted: bool) -> tuple[int, int]:
    """``sending``'s rows sent on a thread into ``receiving``'s rows here; (bytes sent, bytes received)."""
    a, b = connected(family, SMALL_BUFFER[family])
    set_send_timeout(a, BOUND_S)  # bounds: a side that stops moving fails instead of hanging the test
    set_receive_timeout(b, BOUND_S)
    interruptions = Interruptions()
    outcome: list[int | BaseException] = []

    def send() -> None:
        try:
            assert not interrupted or interruptions.running.wait(BOUND_S)
            outcome.append(send_rows(a, sending.entries))
        except BaseException as error:
            outcome.append(error)
            closed(a)  # the receiver sees the end at once
        finally:
            if interrupted:
                interruptions.stopped.wait(BOUND_S)  # alive while it may be signalled

    sender = threading.Thread(target=send, name="sender")
    try:
        with ignoring_sigusr1():
            sender.start()
            if interrupted:
                assert sender.ident is not None
                interruptions.start([threading.get_ident(), sender.ident])
                assert interruptions.running.wait(BOUND_S)
            try:
                received = receive_rows(b, receiving.entries)
            finally:
                interruptions.stop()
                closed(b)  # a sender still sending fails at once
                sender.join(BOUND_S)
                assert not sender.is_alive()
    finally:
        closed(a, b)
    (sent,) = outcome
    if isinstance(sent, BaseException):
        raise sent
    return sent, received


@pytest.mark.parametrize("interrupted", [False, True], ids=["blocking", "interrupted"])
@pytest.mark.parametrize("family", ["unix", "tcp"])
@pytest.mark.parametrize("cuts", ["scattered-to-scattered", "merged-to-scattered", "scattered-to-merged"])
def test_rows_land_in_rows_cut_elsewhere_every_byte_in_place(cuts: str, family: str, interrupted: bool) -> None:
    rng = np.random.default_rng(zlib.crc32(f"{cuts} {family} {interrupted}".encode()))
    sender_cut, receiver_cut = cuts.split("-to-")
    sending, receiving = CUTS[sender_cut](rng), CUTS[receiver_cut](rng)
    stream = sending.gathered()
    assert len(stream) == STREAM
    before = receiving.buffer.copy()
    assert transfer(family, sending, receiving, interrupted) == (STREAM, STREAM)
    assert np.array_equal(receiving.gathered(), stream)
    outside = receiving.outside()
    assert outside.any() and np.array_equal(receiving.buffer[outside], before[outside])


def test_rows_of_no_bytes_move_nothing_and_wait_for_nothing() -> None:
    a, b = connected("unix", SMALL_BUFFER["unix"])
    try:
        set_receive_timeout(b, BOUND_S)
        for count in (0, 1, IOV_MAX, 2 * IOV_MAX + 1):
            rows = entries_of(np.zeros(count, dtype=np.uint64), 0)
            assert send_rows(a, rows) == 0
            started = time.monotonic()
            assert receive_rows(b, rows) == 0
            assert time.monotonic() - started < 1.0
    finally:
        closed(a, b)


def test_a_peer_that_closes_mid_receive_raises_peer_disconnected() -> None:
    a, b = connected("unix", SMALL_BUFFER["unix"])
    target = np.zeros(4 * 1000 + 500, dtype=np.uint8)
    rows = entries_of(np.uint64(target.ctypes.data) + np.array([3500, 0, 2000, 1000], dtype=np.uint64), 1000)
    payload = np.arange(2500, dtype=np.uint8)

    def send_part_and_close() -> None:
        a.sendall(payload.tobytes())
        closed(a)

    closer = threading.Thread(target=send_part_and_close)
    try:
        set_receive_timeout(b, BOUND_S)
        closer.start()
        with pytest.raises(PeerDisconnected, match="closed the connection after 2500 of 4000 bytes"):
            receive_rows(b, rows)
        closer.join(BOUND_S)
        assert not closer.is_alive()
        assert np.array_equal(target[3500:4500], payload[:1000])  # what came landed where it belongs
        assert np.array_equal(target[0:1000], payload[1000:2000])
        assert np.array_equal(target[2000:2500], payload[2000:2500])
        assert not target[2500:3000].any() and not target[1000:2000].any()
    finally:
        closed(a, b)


def test_a_shutdown_from_another_thread_ends_a_receive_at_once() -> None:
    """How a reader past its deadline stops its listener: the receive returns, raising, and writes nothing more."""
    a, b = connected("unix", SMALL_BUFFER["unix"])
    target = np.zeros(1 << 16, dtype=np.uint8)
    errors: list[BaseException] = []

    def receive() -> None:
        try:
            receive_rows(b, entries_of(np.array([target.ctypes.data], dtype=np.uint64), len(target)))
        except BaseException as error:
            errors.append(error)

    receiver = threading.Thread(target=receive)
    try:
        set_receive_timeout(b, BOUND_S)
        receiver.start()
        a.sendall(b"\x01" * 100)
        started = time.monotonic()
        b.shutdown(socket.SHUT_RDWR)
        receiver.join(BOUND_S)
        assert not receiver.is_alive() and time.monotonic() - started < BOUND_S / 2
        assert len(errors) == 1 and isinstance(errors[0], PeerDisconnected)
        assert not target[100:].any()
    finally:
        closed(a, b)


def test_a_send_to_a_peer_that_closed_raises_peer_disconnected() -> None:
    a, b = connected("unix", SMALL_BUFFER["unix"])
    source = np.ones(1 << 20, dtype=np.uint8)
    try:
        closed(b)
        with pytest.raises(PeerDisconnected, match=r"sendmsg: .* after 0 of 1048576 bytes"):
            send_rows(a, entries_of(np.array([source.ctypes.data], dtype=np.uint64), len(source)))
    finally:
        closed(a)


def test_a_send_to_a_peer_that_never_reads_times_out() -> None:
    a, b = connected("unix", SMALL_BUFFER["unix"])
    source = np.ones(1 << 20, dtype=np.uint8)
    try:
        set_send_timeout(a, 0.2)
        started = time.monotonic()
        with pytest.raises(TransferTimeout, match=r"sendmsg: .* after \d+ of 1048576 bytes .*moved nothing"):
            send_rows(a, entries_of(np.array([source.ctypes.data], dtype=np.uint64), len(source)))
        elapsed = time.monotonic() - started
        assert 0.15 <= elapsed < 5.0  # the buffer filled, then one or two timeouts of 0.2 s
    finally:
        closed(a, b)


def test_a_receive_from_a_peer_that_sends_nothing_times_out() -> None:
    a, b = connected("unix", SMALL_BUFFER["unix"])
    target = np.zeros(4096, dtype=np.uint8)
    try:
        set_receive_timeout(b, 0.2)
        a.sendall(b"\x07" * 10)
        started = time.monotonic()
        with pytest.raises(TransferTimeout, match=r"recvmsg: .* after 10 of 4096 bytes"):
            receive_rows(b, entries_of(np.array([target.ctypes.data], dtype=np.uint64), len(target)))
        assert 0.15 <= time.monotonic() - started < 5.0
        assert target[:10].tolist() == [7] * 10
    finally:
        closed(a, b)


@pytest.mark.parametrize(
    "rows",
    [np.zeros(4, dtype=np.uint64), np.zeros((4, 2), dtype=np.uint64), np.zeros(4, dtype=[("a", "<u8"), ("b", "<u8")])],
    ids=["uint64", "pairs", "other-fields"],
)
def test_rows_that_are_no_iovec_array_are_refused(rows: np.ndarray) -> None:
    a, b = connected("unix", SMALL_BUFFER["unix"])
    try:
        with pytest.raises(TypeError, match="IOVEC"):
            send_rows(a, rows)
        with pytest.raises(TypeError, match="IOVEC"):
            receive_rows(b, rows)
    finally:
        closed(a, b)


def test_any_other_failure_names_its_errno() -> None:
    """A row at an address nothing is mapped at (EFAULT): a TransferError, neither a timeout nor a disconnect."""
    a, b = connected("unix", SMALL_BUFFER["unix"])
    try:
        with pytest.raises(
            TransferError, match=rf"sendmsg: Bad address after 0 of 64 bytes \(errno {errno.EFAULT}\)"
        ) as raised:
            send_rows(a, entries_of(np.array([8], dtype=np.uint64), 64))
        assert type(raised.value) is TransferError
    finally:
        closed(a, b)


def test_merged_rows_merges_rows_right_after_each_other_and_keeps_their_order() -> None:
    addresses = np.array([0, 16, 32, 100, 116, 48, 64, 0, 200], dtype=np.uint64)
    entries = merged_rows(addresses, 16)
    assert entries.dtype == IOVEC
    assert entries.tolist() == [(0, 48), (100, 32), (48, 32), (0, 16), (200, 16)]
    backwards = merged_rows(np.array([64, 48, 32], dtype=np.uint64), 16)
    assert backwards.tolist() == [(64, 16), (48, 16), (32, 16)]  # adjacent in memory, not in order: not merged
    assert merged_rows(np.arange(5, dtype=np.uint64) * np.uint64(16), 16).tolist() == [(0, 80)]
    assert merged_rows(np.array([8, 24], dtype=np.int64), 16).tolist() == [(8, 32)]


def test_merged_rows_of_nothing_is_an_empty_iovec_array() -> None:
    for empty in (np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=np.int64)):
        entries = merged_rows(empty, 4096)
        assert entries.dtype == IOVEC and len(entries) == 0
