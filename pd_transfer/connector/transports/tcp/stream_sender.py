"""The ``tcp`` transport's prefill side of a streamed request (issue 41): a decode that asked for a request before, or
while, the prefill computes it is told its blocks (``watch``), then sent each layer's rows as soon as the engine says
that layer is written (``stream``), and told whether the stream ended well (``end``) once the request is held.

On a connection (:mod:`.frames` has the rest of the protocol):

* decode -> prefill ``["watch", watch_id, name, wait_s]`` (``name``: the request's id, or an alias of it: the stream id)
  -> ``["blocks", watch_id, block_ids, generation, request_id]`` once the request is computing or held (within
  ``wait_s``, at most :data:`MAX_WAIT_S`), or ``["refused", watch_id, reason]``; the decode names the request by
  ``request_id`` from then on (its stream, its reports);
* decode -> prefill ``["stream", read_id, request_id, generation, rows, group_ends, group_layers, wait_s]``: ``rows``
  the prefill's rows (:data:`~pd_transfer.transfer.cma.IOVEC`) cut into groups (``group_ends``: where each ends, in
  entries), group ``g`` holding layer ``group_layers[g]`` (its index in the cache's layer order) -> for each group in
  order, once its layer is written, ``["layer", read_id, g, nbytes]`` and its bytes; then ``["end", read_id]`` once
  the request is held with every layer written, in the generation the stream began with; or ``["refused", read_id,
  reason]`` at any point (the request ended, was computed again elsewhere, or took longer than ``wait_s`` between two
  steps). A refused stream's bytes must not be used.
* the same ``stream`` frame with a ninth field, ``verify``: the indices of groups whose digests the decode checks
  (a decode asks so only of a prefill whose offer says ``digests``) -> before ``end``, ``["digests", read_id,
  values]``: for each of them in order, :func:`~pd_transfer.transfer.digests.rows_digest` of its rows here, computed
  once the request is held (its forward completed: the bytes as the engine left them, which every layer sent before
  must equal); or ``["changed", read_id, reason]`` instead of both, where a block holding them changed since the
  hold (:mod:`pd_transfer.connector.held_digests`): the decode fails the stream as a mismatch.

Each watch and each stream runs on a thread of its own while it waits (at most :data:`MAX_WAITING` a connection;
more are refused); a layer's bytes go out under the connection's send lock, other frames between layers.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from pd_transfer.connector.streams import Progress, StreamBoard
from pd_transfer.metrics import TransferMetrics
from pd_transfer.transfer.cma import IOVEC
from pd_transfer.transfer.digests import rows_digest
from pd_transfer.transfer.errors import TransferError
from pd_transfer.transfer.socket_rows import send_rows

from .frames import fields, send_frame

logger = logging.getLogger(__name__)

#: The longest a watch or a stream waits for the next step of a request (s).
MAX_WAIT_S = 120.0
#: Watches and streams waiting at once on one connection.
MAX_WAITING = 256


@dataclass
class StreamConnection:
    """What a connection's streams share: its socket and send lock, the board they wait on, how they check rows
    (``refusal(packed)``: why rows are not sent, "" if they are), what they count (``sent(nbytes)``; ``metrics``: the
    bytes sent while the request was computing or once held)."""

    sock: socket.socket
    send_lock: threading.Lock
    board: StreamBoard
    refusal: Callable[[bytes], str]
    sent: Callable[[int], None]
    peer: str
    name: str
    metrics: TransferMetrics
    changed: Callable[[np.ndarray], str]  # why checked rows are not as their request's hold left them ("": they are)

    def __post_init__(self) -> None:
        self._waiting = threading.Semaphore(MAX_WAITING)

    def take(self, frame: list[Any]) -> None:
        """A ``watch`` or ``stream`` frame: checked here (``BadFrame``), served on a thread of its own."""
        if frame[0] == "watch":
            watch_id, request_id, wait_s = fields(frame, int, str, float)
            self._start(watch_id, self._watch, watch_id, request_id, wait_s)
        else:
            kinds: tuple[type, ...] = (int, str, int, bytes, list, list, float)
            values = fields(frame, *kinds, list) if len(frame) == len(kinds) + 2 else fields(frame, *kinds)
            read_id, request_id, generation, packed, ends, layers, wait_s = values[: len(kinds)]
            verify: list[Any] = values[len(kinds)] if len(values) > len(kinds) else []
            groups = self._groups(packed, ends, layers)
            if isinstance(groups, str) or not _checkable(verify, len(groups)):
                why = groups if isinstance(groups, str) else "verify names groups the stream does not have, or twice"
                self._send(["refused", read_id, why])
                return
            self._start(read_id, self._stream, read_id, request_id, generation, groups, wait_s, verify)

    def _start(self, frame_id: int, work: Callable[..., None], *args: Any) -> None:
        if not self._waiting.acquire(blocking=False):
            self._send(["refused", frame_id, f"more than {MAX_WAITING} watches and streams at once"])
            return

        def run() -> None:
            try:
                work(*args)
            except (OSError, TransferError) as error:
                logger.info("prefill %s: stream to %s ends: %s", self.name, self.peer[:80], error)
            finally:
                self._waiting.release()

        threading.Thread(target=run, name=f"{self.name}-stream", daemon=True).start()

    def _watch(self, watch_id: int, request_id: str, wait_s: float) -> None:
        progress = self.board.wait(request_id, lambda _: True, _bounded(wait_s))
        if progress is None or progress.ended is not None:
            self._send(["refused", watch_id, _why(request_id, progress)])
            return
        self._send(["blocks", watch_id, list(progress.block_ids), progress.generation, self.board.resolve(request_id)])

    def _stream(
        self,
        read_id: int,
        request_id: str,
        generation: int,
        groups: list[tuple[np.ndarray, int]],
        wait_s: float,
        verify: list[int],
    ) -> None:
        wait = _bounded(wait_s)
        for index, (rows, layer) in enumerate(groups):
            progress = self.board.wait(request_id, _past(layer, generation), wait)
            if progress is None or progress.ended is not None or progress.generation != generation:
                self._send(["refused", read_id, _why(request_id, progress, generation)])
                return
            with self.send_lock:
                send_frame(self.sock, ["layer", read_id, index, int(rows["length"].sum())])
                sent = send_rows(self.sock, rows)
            self.sent(sent)
            self.metrics.streamed_bytes.labels("held" if progress.held else "computing").inc(sent)
        progress = self.board.wait(request_id, lambda p: p.held or p.generation != generation, wait)
        if progress is None or not self.board.complete(request_id, generation):
            self._send(["refused", read_id, _why(request_id, progress, generation)])
            return
        if verify:  # held: the lease keeps these blocks as they are until the decode reports
            digests = [rows_digest(groups[index][0]) for index in verify]  # first: a change after it shows too
            why = self.changed(np.concatenate([groups[index][0] for index in verify]))
            if why:  # changed since the hold: whatever was sent of them, the cache no longer holds the forward's KV
                self._send(["changed", read_id, why])
                return
            self._send(["digests", read_id, digests])
        self._send(["end", read_id])

    def _groups(self, packed: bytes, ends: list[Any], layers: list[Any]) -> list[tuple[np.ndarray, int]] | str:
        """The stream's groups of rows, each with its layer; or why they are refused."""
        why_not = self.refusal(packed)
        if why_not:
            return why_not
        rows = np.frombuffer(packed, dtype=IOVEC)
        count = len(rows)
        if (
            len(ends) != len(layers)
            or not all(isinstance(x, int) for x in (*ends, *layers))
            or any(b < a for a, b in zip([0, *ends], ends, strict=False))
            or (ends and ends[-1] != count)
            or (not ends and count)
            or any(not 0 <= layer < self.board.num_layers for layer in layers)
        ):
            return "groups that do not cut the rows in order, or name a layer the cache does not have"
        return [(rows[start:end], layer) for start, end, layer in zip([0, *ends], ends, layers, strict=False)]

    def _send(self, frame: list[Any]) -> None:
        with self.send_lock:
            send_frame(self.sock, frame)


def _checkable(verify: list[Any], groups: int) -> bool:
    """Whether ``verify`` names groups of a stream of ``groups``, each at most once."""
    return all(type(index) is int and 0 <= index < groups for index in verify) and len(set(verify)) == len(verify)


def _bounded(wait_s: float) -> float:
    return max(0.0, min(float(wait_s), MAX_WAIT_S))


def _past(layer: int, generation: int) -> Callable[[Progress], bool]:
    """Whether a request's progress has layer ``layer`` written, or left ``generation``."""
    return lambda progress: progress.layers > layer or progress.generation != generation


def _why(request_id: str, progress: Progress | None, generation: int | None = None) -> str:
    if progress is None:
        return f"request {request_id[:80]} did not come in time"
    if progress.ended is not None:
        return f"request {request_id[:80]} ended ({progress.ended})"
    if generation is not None and progress.generation != generation:
        return f"request {request_id[:80]} is computed again (its blocks changed)"
    return f"request {request_id[:80]} is not held with every layer written"
