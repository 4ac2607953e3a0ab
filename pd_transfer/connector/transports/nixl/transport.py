"""The NIXL transport, both ends: a decode reads a prefill's blocks with one-sided NIXL READs (in place, staged or
packed: :mod:`.reads`), or, where reads would go over TCP, has the prefill write them (push: its target
:mod:`.push_orders`, the prefill's writer :mod:`.push_writer`).

A prefill rank offers nothing beyond its rank metadata (its agent's, whose memory holds the cache): every decode can
read it, so NIXL opens any engine the others refused (engine-packed blocks of another block size only with the
packing known). Its prefill end is the writer, which takes the decode's ``PushSetup`` and ``PushOrder``; its decode end
opens an engine (:mod:`.sources`: peers, descriptor lists, warm-up), offers push to it, and takes the writer's answers
(``PushReady``, ``PushOutcome``). The staging areas (for plans that fix layouts up, and for packed blocks) are the
decode end's, made on first use and shared by its engines.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from pd_transfer.connector import messages
from pd_transfer.connector.messages import PeerMessage
from pd_transfer.handshake.messages import RankMetadata
from pd_transfer.topology import PeerPlan, plane_views
from pd_transfer.topology.mapping import TopologyError
from pd_transfer.topology.plan import DEFAULT_MIN_DIRECT_RUN_BYTES
from pd_transfer.transfer.dlists import merged_spans

from ..courier import reach
from ..requests import PullRequest, ReadTotals
from ..seam import DecodeSite, Link, OfferedEngine, PrefillSite, Refusal, Source
from .packed_staging import PackedStaging
from .push_orders import PushOrders
from .push_staging import LandingArea, PushStager
from .push_writer import PushWriter
from .reads import BlockReader
from .sources import NixlEngine, add_sources, release
from .staging import StagingArea

logger = logging.getLogger(__name__)


@dataclass
class NixlLink:
    """An engine opened for NIXL reads (a :class:`~..seam.Link`): ``engine`` read by ``end``'s reader."""

    engine: NixlEngine
    end: NixlDecodeEnd
    offered: OfferedEngine
    transport: str = "nixl"

    @property
    def plan(self) -> PeerPlan:
        return self.engine.plan

    @property
    def sources(self) -> Sequence[Source]:
        return self.engine.sources

    def read(self, request: PullRequest, deadline: float) -> ReadTotals:
        return self.end.reader.read(self.engine, request, deadline)

    def reach(self, rank: RankMetadata) -> Source:
        site = self.end.site
        return reach(site.agent, self.offered, rank.tp_rank, site.cache.layout.tp_size)

    def push_ready(self, timeout_s: float) -> bool:
        pushes = self.end.pushes
        return pushes is not None and pushes.wait_ready([source.peer for source in self.engine.sources], timeout_s)

    def close(self) -> None:
        if self.end.pushes is not None:
            self.end.pushes.forget([source.peer for source in self.engine.sources])
        release(self.end.site.agent, self.engine.sources)


class NixlDecodeEnd:
    """The NIXL transport on a decode rank: its reader, its push target (unless push is off here), its staging areas."""

    def __init__(self, site: DecodeSite) -> None:
        self.site = site
        options, cache = site.options, site.cache
        self.min_direct_run_bytes = (
            DEFAULT_MIN_DIRECT_RUN_BYTES if options.min_direct_run_bytes is None else options.min_direct_run_bytes
        )
        mode = options.push_mode
        landed = not cache.place.is_host if options.push_staging is None else options.push_staging
        if not cache.place.is_host and not landed:
            mode = "off"
        self.pushes: PushOrders | None = None
        if mode != "off":
            landing = None
            if landed:
                landing = LandingArea(cache.tensors, landing_bytes=options.push_landing_bytes)
                site.agent.register_spans([landing.span], huge_pages=False)
            self.pushes = PushOrders(site.agent, site.engine_id, cache.layout.tp_rank, mode=mode, landing=landing)
        self.reader = BlockReader(
            site.agent,
            cache,
            site.planes,
            pipeline_groups=options.pipeline_groups,
            done_message=site.read_done,
            pushes=self.pushes,
            staged_jobs_per_lane=options.staged_jobs_per_lane,
        )
        self._staging_lock = threading.Lock()  # guards the staging areas
        self._staging: StagingArea | None = None
        self._packed_staging: dict[int, PackedStaging] = {}  # remote block size (tokens) -> its staging area

    def open(self, engine: OfferedEngine) -> Link | Refusal:
        cache = self.site.cache
        packed = self._packed_staging_if_needed(engine)
        target = cache if packed is None else packed.cache
        plan = engine.plan(target.layout, target.regions, min_direct_run_bytes=self.min_direct_run_bytes)
        staging = self._staging_area() if plan.postprocess is not None else None
        timeout_s = self.site.options.read_timeout_s
        sources = add_sources(self.site.agent, cache, engine, plan, staging=staging, timeout_s=timeout_s)
        opened = NixlEngine(engine.host, plan, sources, staging=staging, packed=packed)
        if self.pushes is not None:
            self.pushes.offer(opened)
        return NixlLink(opened, self, engine)

    def take(self, peer: str, message: PeerMessage) -> bool:
        return self.pushes is not None and self.pushes.take(message)

    def close(self) -> None:
        self.reader.close()

    def _packed_staging_if_needed(self, engine: OfferedEngine) -> PackedStaging | None:
        """A packed staging area when our blocks are packed and the engine's block size differs, else None."""
        local = self.site.cache.layout
        ranks = engine.engine.ranks
        remote_block_size = ranks[0].layout.block_size if ranks else local.block_size
        if local.packing is None or remote_block_size == local.block_size:
            return None
        formats = self.site.packed_formats
        if formats is None:
            raise TopologyError(
                f"blocks packed as {local.packing!r}: a prefill of {remote_block_size}-token blocks needs a regroup"
                f" that knows the packing, and this decode rank ({local.block_size}-token blocks) was given none"
            )
        with self._staging_lock:
            staging = self._packed_staging.get(remote_block_size)
            if staging is None:
                staging = self._packed_staging[remote_block_size] = PackedStaging(
                    self.site.agent,
                    self.site.cache,
                    formats(remote_block_size),
                    formats(local.block_size),
                    self.site.options.packed_staging_bytes,
                )
            return staging

    def _staging_area(self) -> StagingArea | None:
        """The staging area for plans that fix layouts up (made on first use); None when ``staging_bytes`` is 0."""
        group_bytes = self.site.options.staging_bytes
        if group_bytes <= 0:
            return None
        cache = self.site.cache
        with self._staging_lock:
            if self._staging is None:
                plane = plane_views(cache.tensors, cache.regions)[0]
                self._staging = StagingArea(
                    self.site.agent, cache.regions[0].plane_block_len, group_bytes, plane.dtype, device=plane.device
                )
            return self._staging


class NixlPrefillEnd:
    """The NIXL transport on a prefill rank: no offer beyond the rank's metadata; the writer (:attr:`writer`) that
    pushes into decodes which ask, through host memory where the cache is on a GPU (or ``push_staging`` says so)."""

    def __init__(self, site: PrefillSite) -> None:
        options, cache = site.options, site.cache
        accepting = options.push_mode != "off"  # a bad mode was refused when the options were made
        staged = not cache.place.is_host if options.push_staging is None else options.push_staging
        stager = PushStager(cache.tensors, chunk_bytes=options.push_chunk_bytes) if staged and accepting else None
        self.writer = PushWriter(
            site.agent,
            site.ledger,
            cache.layout.tp_rank,
            merged_spans(cache.regions),
            on_written=lambda peer, done: site.receive(peer, done, None),
            on_freed=site.freed,
            accepting=accepting and (cache.place.is_host or stager is not None),
            staging=stager,
            agent_factory=site.agent_factory,
        )

    def offer(self) -> bytes | None:
        return None

    def take(self, peer: str, message: PeerMessage) -> bool:
        if isinstance(message, messages.PushSetup | messages.PushOrder):
            self.writer.on_message(peer, message)
            return True
        return False

    def close(self) -> None:
        self.writer.close()


class NixlTransport:
    """NIXL reads and pushes (a :class:`~..seam.Transport`)."""

    name = "nixl"
    same_host = False

    def prefill_end(self, site: PrefillSite) -> NixlPrefillEnd:
        return NixlPrefillEnd(site)

    def decode_end(self, site: DecodeSite) -> NixlDecodeEnd:
        return NixlDecodeEnd(site)


NIXL = NixlTransport()
