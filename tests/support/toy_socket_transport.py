"""A toy transport written only here, plugged in through configuration alone (``transport:
"toy_socket_transport:TOY"``, or ``"toy_socket_transport:TOY, nixl"`` to fall back on NIXL): the proof that a transport
is one plug-in (docs/architecture.md, "Adding a transport"). No module of ``pd_transfer`` names it.

Each prefill rank listens on a TCP socket of its own and offers its address under the name ``toy_socket``. A decode
rank opens an engine by connecting to each rank it reads; a pull sends each rank the rows of its plan (remote address
and length) and writes what comes back into place with ``memmove``. The lease protocol's messages (``ReadDone``, the
prefill's ``LeaseConfirm``, heartbeats, ...) travel on the same connection, so the engine gets no NIXL peer and no
NIXL read. Frames: a 4-byte length, then msgpack ``[kind, ...]``:

* ``["hello", decode_name]``: the decode rank's name (its agent's), first on a connection;
* ``["read", rows]`` -> ``["rows", data]`` | ``["error", reason]``: ``rows`` int64 pairs (address, length), each
  checked to lie in the prefill's cache;
* ``["message", payload]``: an encoded :mod:`pd_transfer.connector.messages` message, either way.

A toy: one read in flight per connection, rows copied one ``memmove`` at a time, no plan with a fix-up after the reads
(such engines are refused, and the next transport the decode prefers opens them).
"""

from __future__ import annotations

import ctypes
import json
import logging
import queue
import socket
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from pd_transfer.connector import messages
from pd_transfer.connector.transports.requests import PullRequest, ReadTotals
from pd_transfer.connector.transports.seam import (
    DecodeSite,
    Link,
    OfferedEngine,
    PrefillSite,
    Refusal,
    Source,
)
from pd_transfer.handshake.messages import RankMetadata
from pd_transfer.topology import PeerPlan, expected_readers
from pd_transfer.transfer.dlists import merged_spans
from pd_transfer.transfer.errors import PeerDisconnected, TransferError, TransferTimeout

logger = logging.getLogger(__name__)

NAME = "toy_socket"
_HEADER = struct.Struct("!I")
MAX_FRAME = 256 * 2**20
CONNECT_TIMEOUT_S = 5.0


def _send(sock: socket.socket, lock: threading.Lock, frame: list[Any]) -> None:
    payload = msgspec.msgpack.encode(frame)
    with lock:
        sock.sendall(_HEADER.pack(len(payload)) + payload)


def _receive(sock: socket.socket) -> list[Any] | None:
    """The next frame, or None once the peer closed."""
    header = _exactly(sock, _HEADER.size)
    if header is None:
        return None
    (length,) = _HEADER.unpack(header)
    if length > MAX_FRAME:
        raise ValueError(f"a frame of {length} bytes")
    payload = _exactly(sock, length)
    if payload is None:
        return None
    frame = msgspec.msgpack.decode(payload)
    if not isinstance(frame, list) or not frame or not isinstance(frame[0], str):
        raise ValueError("a frame is a list that starts with its kind")
    return frame


def _shut(sock: socket.socket) -> None:
    """Wake whatever waits on ``sock`` (``shutdown``), then close it."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # not connected (a listener), or closed already
    sock.close()


def _exactly(sock: socket.socket, count: int) -> bytes | None:
    chunks, left = [], count
    while left:
        chunk = sock.recv(min(left, 4 * 2**20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


# ---------------------------------------------------------------- the prefill's end


class ToyPrefillEnd:
    """Serves its rank's cache rows and takes the decodes' messages on a socket of its own."""

    def __init__(self, site: PrefillSite) -> None:
        self.site = site
        self.spans = merged_spans(site.cache.regions)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._closed = threading.Event()
        self._connections: list[socket.socket] = []
        self._lock = threading.Lock()
        self.rows_served = 0
        self._thread = threading.Thread(target=self._accept, name="toy-accept", daemon=True)
        self._thread.start()

    def offer(self) -> bytes | None:
        host, port = self._listener.getsockname()[:2]
        return json.dumps({"host": host, "port": port}).encode()

    def take(self, peer: str, message: messages.PeerMessage) -> bool:
        return False  # nothing is written into decodes: no writer

    def close(self) -> None:
        self._closed.set()
        _shut(self._listener)
        with self._lock:
            connections, self._connections = self._connections, []
        for connection in connections:
            _shut(connection)
        self._thread.join(timeout=5.0)

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self._connections.append(connection)
            threading.Thread(target=self._serve, args=(connection,), name="toy-serve", daemon=True).start()

    def _serve(self, connection: socket.socket) -> None:
        send_lock = threading.Lock()
        peer = ""
        try:
            while (frame := _receive(connection)) is not None:
                kind = frame[0]
                if kind == "hello":
                    peer = str(frame[1])[:200]
                elif kind == "read":
                    _send(connection, send_lock, self._read(frame[1]))
                elif kind == "message" and peer:

                    def answer(payload: bytes) -> None:
                        _send(connection, send_lock, ["message", payload])

                    self.site.receive(peer, messages.decode(frame[1]), answer)
        except (OSError, ValueError, msgspec.DecodeError) as error:
            logger.info("toy prefill: connection from %s ends: %s", peer or "?", error)
        finally:
            connection.close()

    def _read(self, packed: bytes) -> list[Any]:
        rows = np.frombuffer(packed, dtype=np.int64).reshape(-1, 2)
        for address, length in rows.tolist():
            if not any(start <= address and address + length <= end for start, end in self.spans):
                return ["error", f"row {address:#x}+{length} is outside the cache"]
        data = b"".join(ctypes.string_at(address, length) for address, length in rows.tolist())
        self.rows_served += len(rows)
        return ["rows", data]


# ---------------------------------------------------------------- the decode's end


class ToyConnection:
    """A decode rank's connection to one prefill rank: reads answered in turn, messages handed to the site."""

    def __init__(self, site: DecodeSite, peer: str, offer: dict[str, Any]) -> None:
        self.site, self.peer = site, peer
        self.sock = socket.create_connection((offer["host"], int(offer["port"])), timeout=CONNECT_TIMEOUT_S)
        self.sock.settimeout(None)
        self._send_lock = threading.Lock()
        self._read_lock = threading.Lock()  # one read in flight
        self._answers: queue.Queue[list[Any] | None] = queue.Queue()
        _send(self.sock, self._send_lock, ["hello", site.agent.name])
        self._thread = threading.Thread(target=self._listen, name="toy-listen", daemon=True)
        self._thread.start()

    def notify(self, peer: str, payload: bytes) -> None:
        """A courier: ``payload`` to the prefill rank on this connection."""
        try:
            _send(self.sock, self._send_lock, ["message", payload])
        except OSError as error:
            raise PeerDisconnected(f"toy connection to {peer}: {error}") from None

    def read(self, rows: np.ndarray, deadline: float) -> bytes:
        """The bytes of ``rows`` ((address, length) pairs of the prefill's memory), in order."""
        with self._read_lock:
            try:
                _send(self.sock, self._send_lock, ["read", rows.astype(np.int64).tobytes()])
            except OSError as error:
                raise PeerDisconnected(f"toy connection to {self.peer}: {error}") from None
            try:
                answer = self._answers.get(timeout=max(0.0, deadline - time.perf_counter()))
            except queue.Empty:
                raise TransferTimeout(f"toy read from {self.peer} not answered in time") from None
        if answer is None:
            raise PeerDisconnected(f"toy connection to {self.peer} closed")
        if answer[0] != "rows":
            raise TransferError(f"toy read from {self.peer} refused: {answer[1]}")
        return bytes(answer[1])

    def close(self) -> None:
        _shut(self.sock)
        self._thread.join(timeout=5.0)

    def _listen(self) -> None:
        try:
            while (frame := _receive(self.sock)) is not None:
                if frame[0] == "message":
                    self.site.deliver(self.peer, messages.decode(frame[1]))
                else:
                    self._answers.put(frame)
        except (OSError, ValueError, msgspec.DecodeError):
            pass
        self._answers.put(None)  # whoever waits: the connection is gone


@dataclass
class ToyLink:
    """An engine opened by the toy transport."""

    plan: PeerPlan
    sources: Sequence[Source]
    connections: list[ToyConnection]
    end: ToyDecodeEnd
    offered: OfferedEngine
    transport: str = NAME
    reached: list[ToyConnection] = field(default_factory=list)

    def read(self, request: PullRequest, deadline: float) -> ReadTotals:
        started = time.perf_counter()
        rows = [
            plan.addresses(request.remote_block_ids, request.local_block_ids, request.num_tokens)
            for plan in self.plan.sources
        ]  # all of them first: block ids that do not fit the plan raise before anything moves
        moved = 0
        for plan, (local, remote), connection in zip(self.plan.sources, rows, self.connections, strict=True):
            length = plan.unit_bytes
            wanted = np.stack([remote.astype(np.int64), np.full(len(remote), length, dtype=np.int64)], axis=1)
            data = connection.read(wanted, deadline)
            buffer = ctypes.create_string_buffer(data, len(data))
            base = ctypes.addressof(buffer)
            for index, target in enumerate(local.tolist()):
                ctypes.memmove(target, base + index * length, length)
            moved += len(data)
        self.end.site.tell_read(self.sources, request.request_id)
        self.end.requests.append(request.request_id)
        return ReadTotals(
            bytes=moved,
            descriptors=sum(len(local) for local, _ in rows),
            read_seconds=time.perf_counter() - started,
            postprocess_seconds=0.0,
            postprocess_exposed_seconds=0.0,
        )

    def reach(self, rank: RankMetadata) -> Source:
        connection = self.end.connect(self.offered, rank)
        self.reached.append(connection)
        return self.end.source_of(rank, connection)

    def push_ready(self, timeout_s: float) -> bool:
        return False

    def close(self) -> None:
        for connection in [*self.connections, *self.reached]:
            connection.close()


class ToyDecodeEnd:
    """Opens engines whose every rank read offers ``toy_socket`` and whose plan needs no fix-up."""

    def __init__(self, site: DecodeSite) -> None:
        self.site = site
        self.requests: list[str] = []  # read so far, in order
        self.closed = False

    def open(self, engine: OfferedEngine) -> Link | Refusal:
        cache = self.site.cache
        plan = engine.plan(cache.layout, cache.regions, min_direct_run_bytes=0)
        if plan.postprocess is not None:
            return Refusal("the toy moves rows straight into place only")
        ranks = [engine.rank(source.remote_rank) for source in plan.sources]
        missing = [rank.tp_rank for rank in ranks if rank.offer(NAME) is None]
        if missing:
            return Refusal(f"ranks {missing} offer no {NAME}")
        connections: list[ToyConnection] = []
        try:
            for rank in ranks:
                connections.append(self.connect(engine, rank))
        except BaseException:
            for connection in connections:
                connection.close()
            raise
        sources = [self.source_of(rank, connection) for rank, connection in zip(ranks, connections, strict=True)]
        return ToyLink(plan, sources, connections, self, engine)

    def connect(self, engine: OfferedEngine, rank: RankMetadata) -> ToyConnection:
        offer = engine.offer(rank.tp_rank, NAME)
        if offer is None:
            raise TransferError(f"rank {rank.tp_rank} of engine {engine.engine.engine_id} offers no {NAME}")
        try:
            return ToyConnection(self.site, rank.agent_name, json.loads(offer))
        except OSError as error:
            raise PeerDisconnected(f"toy: cannot reach rank {rank.tp_rank}: {error}") from None

    def source_of(self, rank: RankMetadata, connection: ToyConnection) -> Source:
        readers = expected_readers(rank.tp_rank, rank.layout, self.site.cache.layout.tp_size)
        return Source(remote_rank=rank.tp_rank, peer=rank.agent_name, expected_readers=readers, courier=connection)

    def take(self, peer: str, message: messages.PeerMessage) -> bool:
        return False

    def close(self) -> None:
        self.closed = True


class ToySocketTransport:
    """The toy transport, both ends."""

    name = NAME
    same_host = False  # the address is a loopback one here, but nothing about it needs a host proof

    def prefill_end(self, site: PrefillSite) -> ToyPrefillEnd:
        return ToyPrefillEnd(site)

    def decode_end(self, site: DecodeSite) -> ToyDecodeEnd:
        return ToyDecodeEnd(site)


TOY = ToySocketTransport()
