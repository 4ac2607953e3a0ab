"""The transport seam: what one way of moving a request's KV between prefill and decode ranks provides, at both ends,
and what each end is handed by its rank. Transports register by name (:mod:`.registry`); a connector's ``transport``
setting picks them. Adding one: docs/architecture.md, "Adding a transport".

* **Prefill end** (:class:`PrefillEnd`, one per prefill rank and transport, made with the rank): what the rank
  publishes for decodes under the transport's name in its side-channel metadata (``offer``: the transport's own bytes,
  e.g. CUDA IPC handles; None: nothing to publish), and the transport's writer, which takes a decode's messages meant
  for it (a push target set up, a write ordered: ``take``).
* **Decode end** (:class:`DecodeEnd`, one per decode rank and transport, made with the rank): ``open`` a prefill
  engine at connect (its metadata, every rank's offers in it) into a :class:`Link`, or refuse it saying why (the rank
  then asks the next transport it prefers); ``take`` the prefill ends' answers meant for it.
* **Link** (one per connected engine): its ``plan`` and its ``sources`` (each prefill rank it reads: who it is and how
  to tell it our reports), ``read`` a request into the cache and tell the sources (``ReadDone``), ``reach`` a rank it
  does not read (to free what that rank holds), whether its sources agreed to write into it (``push_ready``: its push
  target), ``close``.

Control messages (the lease protocol's reports and answers, :mod:`pd_transfer.connector.messages`) go through a
source's :class:`Courier`: the rank's NIXL agent (:mod:`.courier`), or a transport's own connection; a transport that
carries them itself hands what it receives to its site (:attr:`DecodeSite.deliver`, :attr:`PrefillSite.receive`).
A transport that neither reads with NIXL nor sends through it adds no NIXL peer and makes no NIXL read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from pd_transfer.connector.cache import KVCache
from pd_transfer.connector.held_digests import HeldDigests
from pd_transfer.connector.leases import Freed, LeaseLedger
from pd_transfer.connector.messages import PeerMessage
from pd_transfer.connector.options import DecodeOptions, PrefillOptions
from pd_transfer.connector.streams import StreamBoard
from pd_transfer.handshake.messages import EngineMetadata, RankMetadata
from pd_transfer.metrics import TransferMetrics
from pd_transfer.spec import KVCacheLayout, KVRegion
from pd_transfer.topology import PeerPlan
from pd_transfer.topology.packed import PackedBlockFormat
from pd_transfer.transfer.agent_protocol import Agent, AgentFactory
from pd_transfer.transfer.errors import TransferError

from .requests import PullRequest, ReadTotals, StreamRequest

#: How an answer reaches the decode rank that sent a report (an encoded message in; a transport's own connection).
Answer = Callable[[bytes], None]


class NoTransport(TransferError):
    """No transport the decode rank prefers opens an engine; the message says why each refused."""


class Courier(Protocol):
    """How control messages reach prefill ranks (a NIXL agent is one: its notifications)."""

    def notify(self, peer: str, payload: bytes) -> None:
        """Send ``payload`` (an encoded message) to ``peer``; ``TransferError`` if it cannot be sent
        (``PeerDisconnected`` for a peer gone)."""


@dataclass(kw_only=True)
class Source:
    """One prefill rank of an engine as a link knows it: ``remote_rank``, its name ``peer`` (its NIXL agent's name,
    whatever the transport: reports and answers are told apart by it), the decode ranks of our TP size that read from
    it (``expected_readers``; 0 for a rank reached only to free what it holds), and the ``courier`` that tells it our
    reports."""

    remote_rank: int
    peer: str
    expected_readers: int
    courier: Courier

    def tell(self, payload: bytes) -> None:
        """Send this rank ``payload`` (an encoded message); ``TransferError`` if it cannot be sent."""
        self.courier.notify(self.peer, payload)


@dataclass(frozen=True)
class Refusal:
    """A decode end does not open an engine, and why (logged, and named when no transport opens it)."""

    reason: str


@dataclass(frozen=True)
class OfferedEngine:
    """A prefill engine as a decode end opens it: its metadata (each rank with the offers it published) and its side
    channel's address."""

    engine: EngineMetadata
    host: str
    port: int

    def rank(self, tp_rank: int) -> RankMetadata:
        """The engine's rank ``tp_rank`` (``KeyError`` if the side channel did not send it)."""
        for rank in self.engine.ranks:
            if rank.tp_rank == tp_rank:
                return rank
        raise KeyError(f"engine {self.engine.engine_id} sent no rank {tp_rank}")

    def offer(self, tp_rank: int, transport: str) -> bytes | None:
        """What rank ``tp_rank`` offers under ``transport``'s name (None: nothing)."""
        return self.rank(tp_rank).offer(transport)

    def plan(self, layout: KVCacheLayout, regions: Sequence[KVRegion], *, min_direct_run_bytes: int) -> PeerPlan:
        """The plan that reads this engine's ranks into a cache of ``layout`` at ``regions``: rows straight into place
        where they are at least ``min_direct_run_bytes`` long."""
        by_rank = {rank.tp_rank: rank for rank in self.engine.ranks}
        return PeerPlan.build(
            layout,
            list(regions),
            {r: by_rank[r].layout for r in by_rank},
            {r: list(by_rank[r].regions) for r in by_rank},
            min_direct_run_bytes=min_direct_run_bytes,
        )


class Link(Protocol):
    """A prefill engine opened by one transport: what a decode rank reads it with until it forgets it."""

    @property
    def transport(self) -> str:
        """The transport's name: the pulls' ``transport`` label."""
        ...

    @property
    def plan(self) -> PeerPlan:
        """What it reads: each source's rows, the fix-up after (if any)."""
        ...

    @property
    def sources(self) -> Sequence[Source]:
        """The ranks ``plan.sources`` reads, in that order."""
        ...

    def read(self, request: PullRequest, deadline: float) -> ReadTotals:
        """Move ``request`` into the cache, fixed up into our layout, and tell its sources (``ReadDone``, or a write
        that stands for it), all by ``deadline`` (``time.perf_counter`` time). Block ids that do not fit the plan raise
        ``ValueError`` before anything moves; a prefill process gone ``PeerDisconnected``; any other failure a
        ``TransferError``."""
        ...

    def reach(self, rank: RankMetadata) -> Source:
        """A way to tell ``rank`` (of this engine, not read by this decode rank) our reports: ``ReleaseUnread`` and
        heartbeats, so that it frees what it holds for us."""
        ...

    def push_ready(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until every source answered whether it writes into us; True when all will (False
        at once for a transport that is never written into)."""
        ...

    def close(self) -> None:
        """Release what the link holds (peers, handles, connections); reads in flight may fail."""
        ...


@runtime_checkable
class StreamingLink(Link, Protocol):
    """A link that can also stream a request while the prefill computes it."""

    def stream(self, request: StreamRequest, deadline: float) -> ReadTotals:
        """Learn ``request``'s blocks from its sources, then receive each layer's rows as the prefill writes them, fix
        them up, tell the sources (``ReadDone``): the request computing or held by ``deadline``, then each layer and
        the end within that same span of the step before (a stream lasts as long as it moves). The prefill confirms
        the stream ended well (the request held, in the generation streamed): no confirmation is asked after. A
        request its sources do not know in time, one that ended or was computed again raises a ``TransferError`` (its
        bytes must not be used); block ids that do not fit the plan ``ValueError``."""
        ...


class DecodeEnd(Protocol):
    """A transport's end on one decode rank."""

    def open(self, engine: OfferedEngine) -> Link | Refusal:
        """Open ``engine`` (every rank compatible with our cache: checked before) or say why not. A failure of
        something that should have worked (a NIXL peer that cannot be added) raises."""
        ...

    def take(self, peer: str, message: PeerMessage) -> bool:
        """A message from prefill rank ``peer``: True when it was meant for this transport (and taken)."""
        ...

    def close(self) -> None:
        """Release what the end holds (threads, pools); requests in flight finish first."""
        ...


class PrefillEnd(Protocol):
    """A transport's end on one prefill rank."""

    def offer(self) -> bytes | None:
        """What the rank publishes for decodes under the transport's name (None: nothing); asked once."""
        ...

    def take(self, peer: str, message: PeerMessage) -> bool:
        """A message from decode rank ``peer``: True when it was meant for this transport's writer (and taken)."""
        ...

    def close(self) -> None:
        """Stop writing, release what the end holds."""
        ...


@dataclass(frozen=True)
class DecodeSite:
    """What a decode rank hands each transport's decode end, once.

    ``agent``: the rank's NIXL agent (its cache registered; it carries the notifications). ``planes``: the cache's plane
    views. ``packed_formats(block_size)``: the packing of a (block, head) for caches whose layout names one (None:
    such caches refuse engines of another block size). ``read_done(request_id, source)``: the encoded ``ReadDone`` of a
    request for a source (it carries ``reply_to`` while the request's confirmation is awaited). ``tell_read(sources,
    request_id)``: send each source its ``ReadDone``. ``deliver(peer, message)``: a message a transport received from
    prefill rank ``peer`` on its own connection (answers, confirmations).
    """

    engine_id: str
    cache: KVCache
    planes: list[torch.Tensor]
    agent: Agent
    options: DecodeOptions
    metrics: TransferMetrics
    packed_formats: Callable[[int], PackedBlockFormat] | None
    read_done: Callable[[str, Source], bytes]
    tell_read: Callable[[Sequence[Source], str], None]
    deliver: Callable[[str, PeerMessage], None]


@dataclass(frozen=True)
class PrefillSite:
    """What a prefill rank hands each transport's prefill end, once.

    ``agent``: the rank's NIXL agent (its cache registered, serving reads). ``ledger``: the requests the rank holds
    (a writer pins and unpins them). ``agent_factory``: makes agents (a writer's own). ``receive(peer, message,
    answer)``: a message from decode rank ``peer`` (a report: counted towards freeing its request; a heartbeat);
    ``answer``, if given, is how a ``LeaseConfirm`` reaches that reader (else by NIXL, to the ``reply_to`` it sent).
    ``freed(freed)``: a request an unpin freed. ``streams``: how far the rank's requests are written (for writers that
    stream a request's layers while it is computed). ``metrics``: where the rank records. ``held``: the digests of the
    rank's held requests as their holds found them (a host cache's; None for a cache on a GPU): a writer that sends
    checked rows re-checks their blocks against them.
    """

    engine_id: str
    cache: KVCache
    agent: Agent
    options: PrefillOptions
    ledger: LeaseLedger
    agent_factory: AgentFactory
    receive: Callable[[str, PeerMessage, Answer | None], None]
    freed: Callable[[Freed], None]
    streams: StreamBoard
    held: HeldDigests | None
    metrics: TransferMetrics


class Transport(Protocol):
    """One way of moving KV, both ends. ``name``: how configuration names it, the key of its offers in a rank's
    metadata, the pulls' ``transport`` label (lowercase letters, digits, ``_``). ``same_host``: its offers are for
    decodes on the prefill's host only (the side channel sends them only to a decode that proved it runs there)."""

    @property
    def name(self) -> str: ...

    @property
    def same_host(self) -> bool: ...

    def prefill_end(self, site: PrefillSite) -> PrefillEnd:
        """Its end on a prefill rank."""
        ...

    def decode_end(self, site: DecodeSite) -> DecodeEnd:
        """Its end on a decode rank."""
        ...
