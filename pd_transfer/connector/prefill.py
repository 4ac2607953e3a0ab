"""The sending side: one prefill TP rank whose blocks decode ranks read, and the server that
publishes an engine's ranks on the side channel."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from pd_transfer.handshake.messages import EngineMetadata, RankMetadata
from pd_transfer.handshake.server import HandshakeServer
from pd_transfer.transfer.agent import TransferAgent

from . import messages
from .cache import KVCache

logger = logging.getLogger(__name__)

#: Called once per request when every expected decode reader has reported: (request_id, readers).
ReleaseHandler = Callable[[str, list[messages.PeerMessage]], None]


@dataclass
class _ReaderTally:
    expected: int = 0
    reports: dict[tuple[str, int], messages.PeerMessage] = field(default_factory=dict)


class PrefillRank:
    """One prefill TP rank: its cache registered with NIXL, counting the decode readers of each request.

    A request is *released* when as many distinct decode ranks as they said to expect have reported
    (read done or given up); ``on_release`` then fires once, on the progress thread.
    """

    def __init__(
        self,
        engine_id: str,
        cache: KVCache,
        *,
        on_release: ReleaseHandler | None = None,
        agent_name: str | None = None,
    ) -> None:
        self.engine_id = engine_id
        self.cache = cache
        self._on_release = on_release
        rank = cache.layout.tp_rank
        self.agent = TransferAgent(
            agent_name or f"{engine_id}-prefill-tp{rank}-{uuid.uuid4().hex[:8]}",
            on_notification=self._on_notification,
        )
        self.agent.register_regions(cache.regions)
        self._tallies: dict[str, _ReaderTally] = {}
        self._released: dict[str, list[messages.PeerMessage]] = {}
        self._cond = threading.Condition()
        self.malformed_notifications = 0

    @property
    def rank_metadata(self) -> RankMetadata:
        return RankMetadata(
            tp_rank=self.cache.layout.tp_rank,
            agent_name=self.agent.name,
            agent_metadata=self.agent.metadata,
            layout=self.cache.layout,
            regions=list(self.cache.regions),
        )

    def expect(self, request_id: str) -> None:
        """A request's blocks are held for decode readers: progress promptly until it is released."""
        with self._cond:
            self._tallies.setdefault(request_id, _ReaderTally())
            self.agent.set_expecting_reads(True)

    def _on_notification(self, peer: str, payload: bytes) -> None:
        try:
            message = messages.decode(payload)
        except Exception as error:
            self.malformed_notifications += 1
            logger.warning("prefill %s: malformed notification from %s dropped: %s", self.agent.name, peer, error)
            return
        released: list[messages.PeerMessage] | None = None
        with self._cond:
            if message.request_id in self._released:
                logger.info(
                    "prefill %s: late report for released request %s from %s", self.agent.name, message.request_id, peer
                )
                return
            tally = self._tallies.setdefault(message.request_id, _ReaderTally())
            tally.expected = max(tally.expected, message.expected_readers)
            tally.reports[(message.reader_engine_id, message.reader_rank)] = message
            if isinstance(message, messages.ReadFailed):
                logger.warning(
                    "prefill %s: request %s: decode %s rank %d gave up: %s",
                    self.agent.name,
                    message.request_id,
                    message.reader_engine_id,
                    message.reader_rank,
                    message.reason,
                )
            if len(tally.reports) >= tally.expected:
                released = list(tally.reports.values())
                del self._tallies[message.request_id]
                self._released[message.request_id] = released
                self._cond.notify_all()
                if not self._tallies:
                    self.agent.set_expecting_reads(False)
        if released is not None:
            logger.debug(
                "prefill %s: request %s released by %d readers", self.agent.name, message.request_id, len(released)
            )
            if self._on_release is not None:
                self._on_release(message.request_id, released)

    def wait_released(self, request_id: str, timeout_s: float) -> list[messages.PeerMessage] | None:
        """The readers' reports once ``request_id`` is released, or None after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while request_id not in self._released:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._cond.wait(remaining)
            return self._released[request_id]

    def forget(self, request_id: str) -> None:
        """Drop what is known of a request (after the engine freed its blocks)."""
        with self._cond:
            self._released.pop(request_id, None)
            self._tallies.pop(request_id, None)
            if not self._tallies:
                self.agent.set_expecting_reads(False)

    def close(self) -> None:
        self.agent.close()


def serve_engine(
    engine_id: str,
    ranks: list[RankMetadata],
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    secret: bytes | str | None = None,
) -> HandshakeServer:
    """Start the side channel for an engine whose ranks are ``ranks`` (all of one fingerprint)."""
    if not ranks:
        raise ValueError("an engine needs at least one rank")
    fingerprint = ranks[0].layout.fingerprint
    tp_size = ranks[0].layout.tp_size
    for rank in ranks:
        if rank.layout.fingerprint != fingerprint or rank.layout.tp_size != tp_size:
            raise ValueError(f"rank {rank.tp_rank} of engine {engine_id} disagrees with rank {ranks[0].tp_rank}")
    engine = EngineMetadata(
        engine_id=engine_id,
        fingerprint=fingerprint,
        tp_size=tp_size,
        ranks=sorted(ranks, key=lambda r: r.tp_rank),
    )
    server = HandshakeServer(engine, host=host, port=port, secret=secret)
    server.start()
    logger.info("engine %s serves %d rank(s) on %s", engine_id, len(ranks), server.address)
    return server
