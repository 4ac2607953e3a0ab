"""The ``tcp`` transport's decode end: a connection (:mod:`.connection`) to each prefill rank an engine's plan reads,
over which a pull asks for its rows and receives them straight into place in the host cache
(:func:`~pd_transfer.transfer.socket_rows.receive_rows`), and the lease protocol's messages go both ways; a request
streamed while the prefill computes it: :mod:`.stream_reader`.

**Per request** (:meth:`TcpLink.read`): the plan's rows as addresses on both sides (block ids that do not fit the plan
raise ``ValueError`` before anything moves), rows adjacent on a side merged; every source asked at once, each
connection's listener receiving its rows in order; the fix-up, if the plan has one; then each source hears ``ReadDone``.
A read past its deadline shuts its connection down (the listener stops writing into the cache before the read
returns), and the next use of the connection connects afresh to the same rank (another incarnation there is refused:
its memory is not the one planned for).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from pd_transfer.connector import messages
from pd_transfer.handshake.messages import RankMetadata
from pd_transfer.topology import PeerPlan, expected_readers
from pd_transfer.transfer.cma import merged_rows
from pd_transfer.transfer.digests import next_turn, sampled
from pd_transfer.transfer.errors import TransferError

from ..requests import PullRequest, ReadTotals, StreamRequest
from ..seam import DecodeSite, Link, OfferedEngine, Refusal, Source
from .connection import TcpConnection, digest_checks_counted
from .frames import BadFrame, decode_offer
from .stream_reader import stream_request

NAME = "tcp"


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
    checks_reads: ClassVar[bool] = True  # its reads carry digests of their own: no read checks by the decode rank

    def read(self, request: PullRequest, deadline: float) -> ReadTotals:
        planned = [
            plan.addresses(request.remote_block_ids, request.local_block_ids, request.num_tokens)
            for plan in self.plan.sources
        ]  # every source's first: block ids that do not fit the plan raise before anything moves
        started = time.perf_counter()
        verify = self.end.site.options.verify
        posted = [
            connection.post(
                merged_rows(local, plan.unit_bytes),
                merged_rows(remote, plan.unit_bytes),
                _checked(local, remote, plan.unit_bytes, verify) if connection.digests else None,
            )
            for plan, (local, remote), connection in zip(self.plan.sources, planned, self.connections, strict=True)
        ]
        with digest_checks_counted(self.end.site.metrics, posted):
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

    def stream(self, request: StreamRequest, deadline: float) -> ReadTotals:
        if self.plan.postprocess is not None:
            raise TransferError("a plan with a fix-up after its reads is not streamed")  # tcp opens none such
        totals, _ = stream_request(self.end.site, self.plan.sources, self.connections, self.sources, request, deadline)
        return totals

    def reach(self, rank: RankMetadata) -> Source:
        connection = self.end.connect(self.offered, rank)
        self.reached.append(connection)
        return self.end.source_of(rank, connection)

    def push_ready(self, timeout_s: float) -> bool:
        return False  # the prefill sends what the decode asks for: nothing to set up

    def close(self) -> None:
        for connection in [*self.connections, *self.reached]:
            connection.close()


def _checked(
    local: np.ndarray, remote: np.ndarray, unit_bytes: int, verify: str
) -> tuple[np.ndarray, np.ndarray] | None:
    """The rows of a read (``local`` and ``remote`` unit addresses, aligned) whose digests are compared under
    ``verify`` (:func:`~pd_transfer.transfer.digests.sampled`: every unit, or an eighth of them, adjacent ones, the
    next eighth for the next read), merged on each side; None: none."""
    chosen = sampled(verify, len(local), next_turn())
    if chosen is None:
        return None
    return merged_rows(local[chosen], unit_bytes), merged_rows(remote[chosen], unit_bytes)


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
        return TcpConnection(self.site, rank.agent_name, (engine.host, offer.port), digests=offer.digests)

    def source_of(self, rank: RankMetadata, connection: TcpConnection) -> Source:
        readers = expected_readers(rank.tp_rank, rank.layout, self.site.cache.layout.tp_size)
        return Source(remote_rank=rank.tp_rank, peer=rank.agent_name, expected_readers=readers, courier=connection)

    def take(self, peer: str, message: messages.PeerMessage) -> bool:
        return False  # the prefill's messages come in on the connections

    def close(self) -> None:
        pass
