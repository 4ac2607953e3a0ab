"""The ``tcp`` transport's decode end: a connection to each prefill rank an engine's plan reads, over which a pull asks
for its rows and receives them straight into place in the host cache
(:func:`~pd_transfer.transfer.socket_rows.receive_rows`), and the lease protocol's messages go both ways.

**Per request** (:meth:`TcpLink.read`): the plan's rows as addresses on both sides (block ids that do not fit the plan
raise ``ValueError`` before anything moves), rows adjacent on a side merged; every source asked at once, each
connection's listener receiving its rows in order; the fix-up, if the plan has one; then each source hears ``ReadDone``.
A read past its deadline shuts its connection down (the listener stops writing into the cache before the read
returns), and the next use of the connection connects afresh to the same rank (another incarnation there is refused:
its memory is not the one planned for).
"""

from __future__ import annotations

import itertools
import logging
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec
import numpy as np

from pd_transfer.connector import messages
from pd_transfer.handshake.auth import as_secret, connection_mac
from pd_transfer.handshake.messages import RankMetadata
from pd_transfer.topology import PeerPlan, expected_readers
from pd_transfer.transfer.cma import merged_rows
from pd_transfer.transfer.errors import PeerDisconnected, TransferError, TransferTimeout
from pd_transfer.transfer.socket_rows import receive_rows, set_send_timeout

from ..requests import PullRequest, ReadTotals
from ..seam import DecodeSite, Link, OfferedEngine, Refusal, Source
from .frames import BadFrame, decode_offer, expect, fields, receive_frame, send_frame, shut

logger = logging.getLogger(__name__)

NAME = "tcp"
#: Connecting to a prefill rank and its hello, at most (s).
CONNECT_TIMEOUT_S = 10.0
#: A send to a prefill rank that moves nothing for this long (s) fails.
SEND_STALL_S = 30.0


@dataclass(eq=False)
class _Pending:
    """A read asked of a prefill rank: where its rows land, and how it ended (``done`` set: ``error`` None when every
    byte arrived)."""

    local: np.ndarray  # IOVEC entries in the cache
    nbytes: int
    done: threading.Event = field(default_factory=threading.Event)
    error: TransferError | None = None

    def end(self, error: TransferError | None) -> None:
        self.error = error
        self.done.set()


class TcpConnection:
    """A decode rank's connection to one prefill rank (``peer``, its agent's name) at ``address``: reads answered in
    order by its listener thread, messages from the rank handed to the site. It is also the rank's courier."""

    def __init__(self, site: DecodeSite, peer: str, address: tuple[str, int]) -> None:
        self.site, self.peer, self.address = site, peer, address
        self._secret = as_secret(site.options.secret)
        self._lock = threading.Lock()  # the socket, its listener, the pending reads
        self._send_lock = threading.Lock()
        self._ids = itertools.count()
        self._pending: dict[int, _Pending] = {}
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
    def post(self, local: np.ndarray, remote: np.ndarray) -> _Pending:
        """Ask the rank for the rows ``remote`` (:data:`~pd_transfer.transfer.cma.IOVEC` entries in its cache) into
        ``local`` (the same bytes in ours); :meth:`wait` for it."""
        pending = _Pending(local, int(remote["length"].sum()))
        sock = self._socket()
        with self._lock:
            if self._sock is not sock:  # dropped meanwhile: its listener has failed what it had pending
                pending.end(PeerDisconnected(f"tcp connection to {self.peer} dropped"))
                return pending
            read_id = next(self._ids)
            self._pending[read_id] = pending
        try:
            with self._send_lock:
                send_frame(sock, ["read", read_id, remote.tobytes()])
        except OSError as error:
            self._drop(sock)
            pending.end(PeerDisconnected(f"tcp connection to {self.peer}: {error}"))
        return pending

    def wait(self, pending: _Pending, deadline: float) -> None:
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
        """Shut ``sock`` down (its listener ends, failing what it had pending); the next use connects afresh."""
        with self._lock:
            if self._sock is sock:
                self._sock = None
        shut(sock)

    def _listen(self, sock: socket.socket) -> None:
        why = "closed by the prefill"
        try:
            while (frame := receive_frame(sock)) is not None:
                self._take(sock, frame)
        except (OSError, BadFrame, TransferError, msgspec.DecodeError, ValueError) as error:
            why = str(error)[:200]
        self._drop(sock)
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
        for each in pending:
            each.end(PeerDisconnected(f"tcp connection to {self.peer}: {why}"))

    def _take(self, sock: socket.socket, frame: list[object]) -> None:
        kind = frame[0]
        if kind == "rows":
            read_id, nbytes = fields(frame, int, int)
            pending = self._take_pending(read_id)
            if nbytes != pending.nbytes:
                raise BadFrame(f"read {read_id}: {nbytes} bytes announced, {pending.nbytes} asked for")
            receive_rows(sock, pending.local)
            pending.end(None)
        elif kind == "refused":
            read_id, reason = fields(frame, int, str)
            self._take_pending(read_id).end(TransferError(f"tcp read from {self.peer} refused: {reason[:200]}"))
        elif kind == "message":
            (payload,) = fields(frame, bytes)
            self.site.deliver(self.peer, messages.decode(payload))
        else:
            raise BadFrame(f"a frame of kind {str(kind)[:40]!r}")

    def _take_pending(self, read_id: int) -> _Pending:
        with self._lock:
            pending = self._pending.pop(read_id, None)
        if pending is None:
            raise BadFrame(f"an answer to read {read_id}, which is not pending")
        return pending


@dataclass
class TcpLink:
    """An engine opened by ``tcp`` (a :class:`~..seam.Link`): a connection to each source rank."""

    plan: PeerPlan
    sources: Sequence[Source]
    connections: list[TcpConnection]
    end: TcpDecodeEnd
    offered: OfferedEngine
    transport: str = NAME
    reached: list[TcpConnection] = field(default_factory=list)

    def read(self, request: PullRequest, deadline: float) -> ReadTotals:
        planned = [
            plan.addresses(request.remote_block_ids, request.local_block_ids, request.num_tokens)
            for plan in self.plan.sources
        ]  # every source's first: block ids that do not fit the plan raise before anything moves
        started = time.perf_counter()
        posted = [
            connection.post(merged_rows(local, plan.unit_bytes), merged_rows(remote, plan.unit_bytes))
            for plan, (local, remote), connection in zip(self.plan.sources, planned, self.connections, strict=True)
        ]
        for connection, pending in zip(self.connections, posted, strict=True):
            connection.wait(pending, deadline)
        read = time.perf_counter()
        postprocess = self.plan.postprocess
        if postprocess is not None:
            postprocess.apply(self.end.site.planes, request.local_block_ids, request.num_tokens)
        done = time.perf_counter()
        self.end.site.tell_read(self.sources, request.request_id)
        return ReadTotals(
            bytes=sum(pending.nbytes for pending in posted),
            descriptors=sum(len(local) for local, _ in planned),
            read_seconds=read - started,
            postprocess_seconds=done - read,
            postprocess_exposed_seconds=done - read,
        )

    def reach(self, rank: RankMetadata) -> Source:
        connection = self.end.connect(self.offered, rank)
        self.reached.append(connection)
        return self.end.source_of(rank, connection)

    def push_ready(self, timeout_s: float) -> bool:
        return False  # the prefill sends what the decode asks for: nothing to set up

    def close(self) -> None:
        for connection in [*self.connections, *self.reached]:
            connection.close()


class TcpDecodeEnd:
    """Opens engines whose every rank read offers ``tcp``, into a host cache (a :class:`~..seam.DecodeEnd`)."""

    def __init__(self, site: DecodeSite) -> None:
        self.site = site

    def open(self, engine: OfferedEngine) -> Link | Refusal:
        cache = self.site.cache
        if not cache.place.is_host:
            return Refusal(f"the cache is in {cache.place}: tcp receives into host memory")
        if cache.layout.packing is not None and any(
            rank.layout.block_size != cache.layout.block_size for rank in engine.engine.ranks
        ):
            return Refusal("packed blocks of another block size are read whole and regrouped")
        plan = engine.plan(cache.layout, cache.regions, min_direct_run_bytes=0)  # rows of any size land in place
        ranks = [engine.rank(source.remote_rank) for source in plan.sources]
        missing = [rank.tp_rank for rank in ranks if rank.offer(NAME) is None]
        if missing:
            return Refusal(f"ranks {missing} offer no {NAME}")
        connections: list[TcpConnection] = []
        try:
            for rank in ranks:
                connections.append(self.connect(engine, rank))
        except BaseException:
            for connection in connections:
                connection.close()
            raise
        sources = [self.source_of(rank, connection) for rank, connection in zip(ranks, connections, strict=True)]
        return TcpLink(plan, sources, connections, self, engine)

    def connect(self, engine: OfferedEngine, rank: RankMetadata) -> TcpConnection:
        """A connection to ``rank`` of ``engine`` (``PeerDisconnected`` if it cannot be made; ``TransferError`` for an
        offer that is none)."""
        payload = engine.offer(rank.tp_rank, NAME)
        if payload is None:
            raise TransferError(f"rank {rank.tp_rank} of engine {engine.engine.engine_id} offers no {NAME}")
        try:
            offer = decode_offer(payload)
        except BadFrame as error:
            raise TransferError(f"rank {rank.tp_rank} of engine {engine.engine.engine_id}: {error}") from None
        return TcpConnection(self.site, rank.agent_name, (engine.host, offer.port))

    def source_of(self, rank: RankMetadata, connection: TcpConnection) -> Source:
        readers = expected_readers(rank.tp_rank, rank.layout, self.site.cache.layout.tp_size)
        return Source(remote_rank=rank.tp_rank, peer=rank.agent_name, expected_readers=readers, courier=connection)

    def take(self, peer: str, message: messages.PeerMessage) -> bool:
        return False  # the prefill's messages come in on the connections

    def close(self) -> None:
        pass
