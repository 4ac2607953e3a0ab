"""The ``tcp`` transport's prefill end: a listener at the side channel's host whose connections send decode ranks the
rows they ask for, straight out of the rank's host cache (:func:`~pd_transfer.transfer.socket_rows.send_rows`), and
bring their lease-protocol messages to the rank; requests streamed while they are computed: :mod:`.stream_sender`.

Every row asked for is checked to lie inside the cache's registered memory before a byte is sent; a read that names
any other memory is refused (``["refused", read_id, reason]``) and the connection goes on. Which of the cache's blocks
a decode reads is its plan's business, as with a NIXL read. A connection whose hello does not prove the side channel's
secret (where one is set) is refused and closed; a malformed frame ends its connection; a send that moves nothing for
:data:`SEND_STALL_S` (a decode that stopped reading) ends it too. Nothing a decode sends grows memory beyond one frame
(:data:`~.frames.MAX_FRAME`).
"""

from __future__ import annotations

import logging
import socket
import threading
from typing import Any

import msgspec
import numpy as np

from pd_transfer.connector import messages
from pd_transfer.handshake.auth import as_secret, connection_mac, new_nonce, verify
from pd_transfer.transfer.cma import IOVEC
from pd_transfer.transfer.digests import rows_digest
from pd_transfer.transfer.dlists import merged_spans
from pd_transfer.transfer.errors import TransferError
from pd_transfer.transfer.socket_rows import send_rows, set_send_timeout

from ..seam import PrefillSite
from .frames import BadFrame, encode_offer, expect, fields, receive_frame, send_frame, shut, wake
from .stream_sender import StreamConnection

logger = logging.getLogger(__name__)

#: A send to a decode that moves nothing for this long (s) ends the connection.
SEND_STALL_S = 30.0
#: How long (s) a new connection has to say hello.
HELLO_TIMEOUT_S = 10.0


class TcpPrefillEnd:
    """Serves a prefill rank's host cache to decode ranks over connections of its own (a :class:`~..seam.PrefillEnd`).
    A cache on a GPU is not offered (logged)."""

    def __init__(self, site: PrefillSite) -> None:
        self.site = site
        self.name = site.agent.name
        self._secret = as_secret(site.options.secret)
        spans = np.array(merged_spans(site.cache.regions), dtype=np.uint64).reshape(-1, 2)
        self._starts, self._ends = spans[:, 0].copy(), spans[:, 1].copy()
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self.bytes_sent = 0  # rows' bytes sent so far, every connection
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self.held = site.held  # each request digested as its hold finds it: checked rows are re-checked
        if not site.cache.place.is_host:
            logger.info("prefill %s: cache in %s not offered as tcp: it sends host memory", self.name, site.cache.place)
            return
        host = site.options.listen_host
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, 0), family=family, backlog=64)
        self._thread = threading.Thread(target=self._accept, name=f"{self.name}-tcp-accept", daemon=True)
        self._thread.start()
        logger.info("prefill %s: cache offered as tcp at %s:%d", self.name, host, self.port)

    @property
    def port(self) -> int:
        """The port the end listens on (0: none, the cache is not offered)."""
        return 0 if self._listener is None else int(self._listener.getsockname()[1])

    def offer(self) -> bytes | None:
        return None if self._listener is None else encode_offer(self.port)

    def take(self, peer: str, message: messages.PeerMessage) -> bool:
        return False  # decodes' messages come in on its connections

    def close(self) -> None:
        self._closed.set()
        if self._listener is not None:
            wake(self._listener)
        with self._lock:
            connections, self._connections = list(self._connections), set()
        for connection in connections:
            wake(connection)  # its thread closes it
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        if self._listener is not None:
            self._listener.close()

    # ------------------------------------------------------------------ connections
    def _accept(self) -> None:
        assert self._listener is not None
        while not self._closed.is_set():
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self._closed.is_set():
                    shut(connection)
                    return
                self._connections.add(connection)
            threading.Thread(target=self._serve, args=(connection,), name=f"{self.name}-tcp", daemon=True).start()

    def _serve(self, connection: socket.socket) -> None:
        send_lock = threading.Lock()
        peer = ""
        try:
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            peer = self._greet(connection)
            connection.settimeout(None)
            set_send_timeout(connection, SEND_STALL_S)
            streams = StreamConnection(
                connection,
                send_lock,
                self.site.streams,
                self._refusal,
                self._count_sent,
                peer,
                self.name,
                self.site.metrics,
                self._changed,
            )
            while (frame := receive_frame(connection)) is not None:
                if frame[0] in ("watch", "stream"):
                    streams.take(frame)
                else:
                    self._take(connection, send_lock, peer, frame)
        except (OSError, BadFrame, TransferError) as error:
            if not self._closed.is_set():
                logger.info("prefill %s: tcp connection from %s ends: %s", self.name, peer[:80] or "?", error)
        finally:
            with self._lock:
                self._connections.discard(connection)
            wake(connection)
            with send_lock:  # no row is being sent from it: its number cannot be another connection's mid-send
                connection.close()

    def _greet(self, connection: socket.socket) -> str:
        """The hello of a new connection: the decode rank's name once it proved the secret (``BadFrame`` if not)."""
        connection.settimeout(HELLO_TIMEOUT_S)
        nonce = new_nonce()
        send_frame(connection, ["challenge", nonce])
        name, mac = expect(receive_frame(connection), "hello", str, bytes)
        if self._secret is not None and not verify(connection_mac(self._secret, nonce, name.encode()), mac):
            send_frame(connection, ["refused", "the hello does not prove the side channel's secret"])
            raise BadFrame(f"a hello from {name[:80]!r} without the side channel's secret")
        send_frame(connection, ["welcome", self.name])
        return str(name)

    def _take(self, connection: socket.socket, send_lock: threading.Lock, peer: str, frame: list[Any]) -> None:
        kind = frame[0]
        if kind == "read":  # a fourth field: rows of them whose digest the decode checks
            read_id, packed, *check = fields(frame, int, bytes, bytes) if len(frame) == 4 else fields(frame, int, bytes)
            self._send_rows(connection, send_lock, read_id, packed, check[0] if check else None)
        elif kind == "message":
            (payload,) = fields(frame, bytes)
            try:
                message = messages.decode(payload)
            except (ValueError, msgspec.DecodeError) as error:
                raise BadFrame(f"a message that does not decode: {str(error)[:200]}") from None

            def answer(reply: bytes) -> None:
                with send_lock:
                    send_frame(connection, ["message", reply])

            self.site.receive(peer, message, answer)
        else:
            raise BadFrame(f"a frame of kind {str(kind)[:40]!r}")

    def _send_rows(
        self, connection: socket.socket, send_lock: threading.Lock, read_id: int, packed: bytes, check: bytes | None
    ) -> None:
        """Send the rows ``packed`` names (``["rows", read_id, nbytes]`` and their bytes); with ``check`` (rows of
        the cache too), their digest as the cache holds them now goes in the frame, before the bytes, once the blocks
        holding them are found as their hold left them (else ``["changed", read_id, reason]``, nothing sent)."""
        why_not = self._refusal(packed) or (self._refusal(check) if check is not None else "")
        checked = None if check is None or why_not else np.frombuffer(check, dtype=IOVEC)
        digest = None if checked is None else rows_digest(checked)  # first: a change after it shows on either side
        changed = "" if checked is None else self._changed(checked)
        with send_lock:
            if why_not:
                send_frame(connection, ["refused", read_id, why_not])
                return
            if changed:
                send_frame(connection, ["changed", read_id, changed])
                return
            rows = np.frombuffer(packed, dtype=IOVEC)
            frame: list[Any] = ["rows", read_id, int(rows["length"].sum())]
            if digest is not None:
                frame.append(digest)
            send_frame(connection, frame)
            self._count_sent(send_rows(connection, rows))

    def _changed(self, rows: np.ndarray) -> str:
        """Why checked ``rows`` are not sent: a block holding them changed since its request was held (logged)."""
        why = "" if self.held is None else self.held.changed(rows)
        if why:
            logger.error("prefill %s: a read's checked rows not sent: %s", self.name, why)
        return why

    def _count_sent(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_sent += nbytes

    def _refusal(self, packed: bytes) -> str:
        """Why the rows in ``packed`` are not sent ("" where every one lies inside the cache)."""
        if len(packed) % IOVEC.itemsize:
            return f"rows of {len(packed)} bytes are no whole number of entries"
        rows = np.frombuffer(packed, dtype=IOVEC)
        starts, lengths = rows["base"], rows["length"]
        ends = starts + lengths
        span = np.searchsorted(self._starts, starts, side="right") - 1
        inside = (span >= 0) & (ends >= starts) & (ends <= self._ends[np.maximum(span, 0)])
        if not inside.all():
            first = int(np.flatnonzero(~inside)[0])
            return f"row {first} ({int(starts[first]):#x}+{int(lengths[first])}) is outside the cache"
        return ""
