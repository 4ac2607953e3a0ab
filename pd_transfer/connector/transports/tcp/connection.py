"""The ``tcp`` transport's connection from a decode rank to one prefill rank (:class:`TcpConnection`): what it asks
(reads, watches, streams) answered in order by its listener thread, which receives rows straight into place; the
prefill's messages handed to the site. Its frames: :mod:`.frames`."""

from __future__ import annotations

import itertools
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import msgspec
import numpy as np

from pd_transfer.connector import messages
from pd_transfer.handshake.auth import as_secret, connection_mac
from pd_transfer.metrics import TransferMetrics
from pd_transfer.transfer.digests import rows_digest
from pd_transfer.transfer.errors import DigestMismatch, PeerDisconnected, TransferError, TransferTimeout
from pd_transfer.transfer.socket_rows import receive_rows, set_send_timeout

from ..seam import DecodeSite
from .frames import BadFrame, expect, fields, receive_frame, send_frame, shut, wake

logger = logging.getLogger(__name__)

#: Connecting to a prefill rank and its hello, at most (s).
CONNECT_TIMEOUT_S = 10.0
#: A send to a prefill rank that moves nothing for this long (s) fails.
SEND_STALL_S = 30.0


@dataclass(eq=False)
class Pending:
    """Something asked of a prefill rank, answered on the connection: a read (its rows, one group), a stream (a group
    of rows per layer, then ``end``: ``streamed``) or a watch (no rows; ``blocks``: the request's block ids and
    generation). ``done`` is set when it ended (``error`` None: every byte arrived, and every group in ``verify``
    had the digest the prefill computed once it held the request); ``arrived``: when each group's last byte did
    (``perf_counter`` time). A stream's ``layers``: the layer of each group (to name one that differs)."""

    groups: list[np.ndarray]  # IOVEC entries in the cache
    streamed: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    error: TransferError | None = None
    arrived: list[float] = field(default_factory=list)
    blocks: tuple[list[int], int, str] | None = None  # a watch's answer: block ids, generation, request id
    layers: list[int] = field(default_factory=list)
    verify: list[int] = field(default_factory=list)  # a stream's groups checked, in the order the digests come
    received: dict[int, int] = field(default_factory=dict)  # group -> digest of its rows here, once they arrived
    expected: list[int] | None = None  # the prefill's digests: of the groups in ``verify``, or of ``check``
    check: np.ndarray | None = None  # a read's rows here (some of them) whose digest comes with the rows

    @property
    def nbytes(self) -> int:
        return sum(int(group["length"].sum()) for group in self.groups)

    def end(self, error: TransferError | None) -> None:
        self.error = error
        self.done.set()

    @property
    def checked(self) -> int:
        """How many digests it compares: a stream's groups in ``verify``, a read's ``check`` (one)."""
        return len(self.verify) + (self.check is not None)

    def differing(self, peer: str) -> DigestMismatch | None:
        """Why what arrived whole must not be used: a read's ``check`` rows, or a stream's group in ``verify``, whose
        bytes here differ from the prefill's digest, or no digest from a prefill asked for one; None when all that
        was checked is equal (or nothing was)."""
        if not self.checked:
            return None
        if self.expected is None:
            return DigestMismatch(f"{peer} sent no digest of what was checked")
        if self.check is not None:
            if rows_digest(self.check) != self.expected[0]:
                return DigestMismatch(f"rows read from {peer} differ from what the prefill held")
            return None
        for index, expected in zip(self.verify, self.expected, strict=True):
            if self.received.get(index) != expected:
                return DigestMismatch(
                    f"layer {self.layers[index]} from {peer} differs from what the prefill held (group {index})"
                )
        return None


class TcpConnection:
    """A decode rank's connection to one prefill rank (``peer``, its agent's name) at ``address``: reads answered in
    order by its listener thread, messages from the rank handed to the site. It is also the rank's courier."""

    def __init__(self, site: DecodeSite, peer: str, address: tuple[str, int], *, digests: bool = False) -> None:
        """``digests``: the rank sends digests a read or a stream asks for (its offer says so)."""
        self.site, self.peer, self.address = site, peer, address
        self.digests = digests
        self._secret = as_secret(site.options.secret)
        self._lock = threading.Lock()  # the socket, its listener, the pending reads
        self._send_lock = threading.Lock()
        self._ids = itertools.count()
        self._pending: dict[int, Pending] = {}
        self._sock: socket.socket | None = None
        self._listener: threading.Thread | None = None
        self._closed = False
        self._connect()

    # ------------------------------------------------------------------ a courier
    def notify(self, peer: str, payload: bytes) -> None:
        sock = self._socket()
        try:
            with self._send_lock:
                send_frame(sock, ["message", payload])
        except OSError as error:
            self._drop(sock)
            raise PeerDisconnected(f"tcp connection to {self.peer}: {error}") from None

    # ------------------------------------------------------------------ reads
    def post(
        self, local: np.ndarray, remote: np.ndarray, check: tuple[np.ndarray, np.ndarray] | None = None
    ) -> Pending:
        """Ask the rank for the rows ``remote`` (:data:`~pd_transfer.transfer.cma.IOVEC` entries in its cache) into
        ``local`` (the same bytes in ours); :meth:`wait` for it. ``check``: rows of them (here, there) whose digest the
        rank computes before it sends them, compared with theirs here once they landed (``DigestMismatch``); only
        where the rank offers digests (:attr:`digests`)."""
        if check is None or not self.digests:
            return self._ask(Pending([local]), lambda read_id: ["read", read_id, remote.tobytes()])
        here, there = check
        return self._ask(
            Pending([local], check=here), lambda read_id: ["read", read_id, remote.tobytes(), there.tobytes()]
        )

    def watch(self, request_id: str, wait_s: float) -> Pending:
        """Ask the rank for ``request_id``'s blocks once it computes or holds it (waiting up to ``wait_s`` there)."""
        return self._ask(Pending([]), lambda watch_id: ["watch", watch_id, request_id, float(wait_s)])

    def stream(
        self,
        request_id: str,
        generation: int,
        local: list[np.ndarray],
        remote: list[np.ndarray],
        layers: list[int],
        wait_s: float,
        verify: Sequence[int] = (),
    ) -> Pending:
        """Ask the rank to send ``request_id``'s rows group by group (``remote[g]`` into ``local[g]``, group ``g``
        once layer ``layers[g]`` is written), then ``end`` once it is held in ``generation`` (see
        :mod:`.stream_sender`; ``wait_s``: the longest it waits for each step there). ``verify``: the groups whose
        digests are checked (where the rank answers ``verify``: :attr:`digests`; else none is)."""
        ends = np.cumsum([len(group) for group in remote]).tolist()
        rows = np.concatenate(remote).tobytes() if remote else b""
        checked = list(verify) if self.digests else []

        def frame(read_id: int) -> list[object]:
            asked: list[object] = ["stream", read_id, request_id, generation, rows, ends, layers, float(wait_s)]
            return [*asked, checked] if checked else asked

        return self._ask(Pending(local, streamed=True, layers=list(layers), verify=checked), frame)

    def _ask(self, pending: Pending, frame: Callable[[int], list[object]]) -> Pending:
        """Register ``pending`` under a new id and send ``frame(id)``; a connection that fails ends it at once."""
        sock = self._socket()
        with self._lock:
            if self._sock is not sock:  # dropped meanwhile: its listener has failed what it had pending
                pending.end(PeerDisconnected(f"tcp connection to {self.peer} dropped"))
                return pending
            frame_id = next(self._ids)
            self._pending[frame_id] = pending
        try:
            with self._send_lock:
                send_frame(sock, frame(frame_id))
        except OSError as error:
            self._drop(sock)
            pending.end(PeerDisconnected(f"tcp connection to {self.peer}: {error}"))
        return pending

    def wait(self, pending: Pending, deadline: float) -> None:
        """Until ``pending`` ended: raise its error; past ``deadline`` (``perf_counter`` time) drop the connection (no
        byte of it lands after this returns) and raise ``TransferTimeout``."""
        if not pending.done.wait(max(0.0, deadline - time.perf_counter())):
            with self._lock:
                sock, listener = self._sock, self._listener
            if sock is not None:
                self._drop(sock)
            if listener is not None and listener is not threading.current_thread():
                listener.join(timeout=CONNECT_TIMEOUT_S)  # it stops at the shutdown: nothing lands after this
            if not pending.done.is_set() or pending.error is not None:
                raise TransferTimeout(f"tcp read from {self.peer} not answered in time")
        if pending.error is not None:
            raise pending.error

    def close(self) -> None:
        with self._lock:
            self._closed = True
            sock, listener = self._sock, self._listener
        if sock is not None:
            self._drop(sock)
        if listener is not None:
            listener.join(timeout=CONNECT_TIMEOUT_S)

    # ------------------------------------------------------------------ the connection
    def _socket(self) -> socket.socket:
        """The connected socket, connecting afresh if the last one was dropped (``PeerDisconnected`` if that fails)."""
        with self._lock:
            sock = self._sock
        if sock is not None:
            return sock
        return self._connect()

    def _connect(self) -> socket.socket:
        try:
            sock = socket.create_connection(self.address, timeout=CONNECT_TIMEOUT_S)
        except OSError as error:
            where = f"{self.address[0]}:{self.address[1]}"
            raise PeerDisconnected(f"tcp: cannot reach {self.peer} at {where}: {error}") from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._greet(sock)
            sock.settimeout(None)
            set_send_timeout(sock, SEND_STALL_S)
        except (OSError, BadFrame) as error:
            shut(sock)
            raise PeerDisconnected(f"tcp: {self.peer} at {self.address[0]}:{self.address[1]}: {error}") from None
        listener = threading.Thread(target=self._listen, args=(sock,), name=f"{self.peer}-tcp", daemon=True)
        with self._lock:
            if self._closed:
                shut(sock)
                raise PeerDisconnected(f"tcp connection to {self.peer} closed")
            if self._sock is not None:  # another thread connected meanwhile
                shut(sock)
                return self._sock
            self._sock, self._listener = sock, listener
        listener.start()
        return sock

    def _greet(self, sock: socket.socket) -> None:
        (nonce,) = expect(receive_frame(sock), "challenge", bytes)
        name = self.site.agent.name
        mac = b"" if self._secret is None else connection_mac(self._secret, nonce, name.encode())
        send_frame(sock, ["hello", name, mac])
        answer = receive_frame(sock)
        if answer is not None and answer[0] == "refused":
            raise BadFrame(f"refused: {str(answer[1:])[:200]}")
        (welcome,) = expect(answer, "welcome", str)
        if welcome != self.peer:
            raise BadFrame(f"another incarnation answers there ({welcome[:80]!r})")

    def _drop(self, sock: socket.socket) -> None:
        """Shut ``sock`` down (its listener ends, failing what it had pending, and closes it); the next use connects
        afresh."""
        with self._lock:
            if self._sock is sock:
                self._sock = None
        wake(sock)

    def _listen(self, sock: socket.socket) -> None:
        why = "closed by the prefill"
        try:
            while (frame := receive_frame(sock)) is not None:
                self._take(sock, frame)
        except (OSError, BadFrame, TransferError, msgspec.DecodeError, ValueError) as error:
            why = str(error)[:200]
        self._drop(sock)
        sock.close()  # here only: this thread is the one receiving rows through it
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
        for each in pending:
            each.end(PeerDisconnected(f"tcp connection to {self.peer}: {why}"))

    def _take(self, sock: socket.socket, frame: list[object]) -> None:
        kind = frame[0]
        if kind == "rows":
            read_id, nbytes, *digest = fields(frame, int, int, int) if len(frame) == 4 else fields(frame, int, int)
            self._receive(sock, read_id, self._pending_of(read_id, pop=False), 0, nbytes)
            pending = self._pending_of(read_id, pop=True)
            pending.expected = digest or None
            pending.end(pending.differing(self.peer))
        elif kind == "layer":
            read_id, index, nbytes = fields(frame, int, int, int)
            self._receive(sock, read_id, self._pending_of(read_id, pop=False), index, nbytes)
        elif kind == "digests":
            read_id, values = fields(frame, int, list)
            pending = self._pending_of(read_id, pop=False)
            if len(values) != len(pending.verify) or not all(type(value) is int for value in values):
                raise BadFrame(f"{len(values)} digests for stream {read_id}, {len(pending.verify)} asked for")
            pending.expected = values
        elif kind == "end":
            (read_id,) = fields(frame, int)
            pending = self._pending_of(read_id, pop=True)
            if not pending.streamed or len(pending.arrived) != len(pending.groups):
                raise BadFrame(f"stream {read_id} ended after {len(pending.arrived)} of {len(pending.groups)} layers")
            pending.end(pending.differing(self.peer))
        elif kind == "blocks":
            watch_id, block_ids, generation, request_id = fields(frame, int, list, int, str)
            pending = self._pending_of(watch_id, pop=True)
            if pending.groups or not all(isinstance(block, int) for block in block_ids):
                raise BadFrame(f"blocks for {watch_id}, which is no watch, or ids that are not numbers")
            pending.blocks = (block_ids, generation, request_id)
            pending.end(None)
        elif kind == "refused":
            read_id, reason = fields(frame, int, str)
            self._pending_of(read_id, pop=True).end(TransferError(f"{self.peer} refused: {reason[:200]}"))
        elif kind == "changed":  # checked rows' blocks changed in the prefill's cache since its hold: a mismatch
            read_id, reason = fields(frame, int, str)
            pending = self._pending_of(read_id, pop=True)
            if not pending.checked:
                raise BadFrame(f"changed rows for {read_id}, which checks none")
            pending.end(DigestMismatch(f"{self.peer}: {reason[:200]}"))
        elif kind == "message":
            (payload,) = fields(frame, bytes)
            self.site.deliver(self.peer, messages.decode(payload))
        else:
            raise BadFrame(f"a frame of kind {str(kind)[:40]!r}")

    def _pending_of(self, frame_id: int, *, pop: bool) -> Pending:
        with self._lock:
            pending = self._pending.pop(frame_id, None) if pop else self._pending.get(frame_id)
        if pending is None:
            raise BadFrame(f"an answer to {frame_id}, which is not pending")
        return pending

    @staticmethod
    def _receive(sock: socket.socket, frame_id: int, pending: Pending, index: int, nbytes: int) -> None:
        """Group ``index`` of ``pending``'s rows, ``nbytes`` announced: the next one due, of that size."""
        if index != len(pending.arrived) or index >= len(pending.groups):
            raise BadFrame(f"group {index} of {frame_id} where group {len(pending.arrived)} was due")
        group = pending.groups[index]
        if nbytes != int(group["length"].sum()):
            raise BadFrame(f"{frame_id}: {nbytes} bytes announced, {int(group['length'].sum())} asked for")
        receive_rows(sock, group)
        pending.arrived.append(time.perf_counter())
        if index in pending.verify:  # while the next layer is on its way (a few ms a 32 MiB layer)
            pending.received[index] = rows_digest(group)


@contextmanager
def digest_checks_counted(metrics: TransferMetrics, pendings: Sequence[Pending]) -> Iterator[None]:
    """Count what ``pendings`` compared (``pd_transfer_digest_checks_total``) once the block waiting for them ends:
    each digest equal, or the one mismatch that ended it (raised on)."""
    try:
        yield
    except DigestMismatch:
        metrics.digest_checks.labels("mismatch").inc()
        raise
    metrics.digest_checks.labels("equal").inc(sum(pending.checked for pending in pendings))
