"""The built-in same-host transports, both ends: ``cuda_ipc`` (a GPU cache copied through CUDA IPC handles),
``host_ipc`` (a host cache in a memfd, copied from its mapping) and ``host_cma`` (any host cache read in place with
``process_vm_readv``). The mechanisms are :mod:`pd_transfer.same_host`'s; the readers :mod:`.ipc_reads` and
:mod:`.cma_reads`; when each can read an engine :mod:`.choice`.

A prefill rank offers its cache as each kind it can (made once, with the rank), sent only to decodes that proved they
run on its host. A decode end opens an engine whose every rank read offered its kind: the memory opened (or the
processes probed), once, with a plan whose rows land in place where they can (a block-size regroup, a TP head slice or
a layout change done by the copy itself). NIXL still carries the notifications (:mod:`..courier`): the source ranks
are added as peers of the decode rank's agent, and for host caches the connection they go over is warmed up.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from pd_transfer.connector.messages import PeerMessage
from pd_transfer.handshake.host_identity import local_boot_id
from pd_transfer.handshake.messages import RankIpc, RankMetadata, decode_rank_ipc, encode_rank_ipc
from pd_transfer.same_host import (
    MIN_DIRECT_ROW_BYTES,
    CmaEngine,
    ExportKind,
    IpcEngine,
    IpcUnavailable,
    export_cache,
    gpu_reach,
    pid_namespace,
)
from pd_transfer.topology import PeerPlan
from pd_transfer.topology.plan import DEFAULT_MIN_DIRECT_RUN_BYTES

from ..courier import notified_sources, reach, remove_peers
from ..requests import PullRequest, ReadTotals
from ..seam import DecodeSite, Link, OfferedEngine, PrefillSite, Refusal, Source
from .choice import SameHostKind, refusal
from .cma_reads import CmaReader
from .ipc_reads import IpcReader

logger = logging.getLogger(__name__)

#: What each kind offers the cache as (:func:`pd_transfer.same_host.export_cache`).
_EXPORTS: dict[SameHostKind, ExportKind] = {"cuda_ipc": "cuda", "host_ipc": "memfd", "host_cma": "cma"}


@dataclass
class SameHostLink:
    """An engine opened by a same-host transport (a :class:`~..seam.Link`): its memory ``opened`` (or its processes
    probed), read by ``end``; its ``sources`` told through the decode rank's NIXL agent."""

    transport: str
    opened: IpcEngine | CmaEngine
    sources: Sequence[Source]
    end: SameHostDecodeEnd
    offered: OfferedEngine

    @property
    def plan(self) -> PeerPlan:
        return self.opened.plan

    def read(self, request: PullRequest, deadline: float) -> ReadTotals:
        return self.end.read(self.opened, self.sources, request)

    def reach(self, rank: RankMetadata) -> Source:
        site = self.end.site
        return reach(site.agent, self.offered, rank.tp_rank, site.cache.layout.tp_size)

    def push_ready(self, timeout_s: float) -> bool:
        return False  # a copy out of the prefill's memory: nothing writes into us

    def close(self) -> None:
        self.opened.close()
        remove_peers(self.end.site.agent, list(self.sources))


class SameHostDecodeEnd:
    """A same-host transport of ``kind`` on a decode rank: its reader, and the opening of engines offering ``kind``."""

    def __init__(self, kind: SameHostKind, site: DecodeSite) -> None:
        self.kind = kind
        self.site = site
        options = site.options
        self.min_direct_run_bytes = (
            DEFAULT_MIN_DIRECT_RUN_BYTES if options.min_direct_run_bytes is None else options.min_direct_run_bytes
        )
        self.ipc_reader: IpcReader | None = None
        self.cma_reader: CmaReader | None = None
        if kind == "host_cma":
            self.cma_reader = CmaReader(
                site.agent.name,
                site.planes,
                threads=options.lane_count,
                timeout_s=options.read_timeout_s,
                tell_read=site.tell_read,
            )
        else:
            self.ipc_reader = IpcReader(site.cache, site.planes, tell_read=site.tell_read)

    def open(self, engine: OfferedEngine) -> Link | Refusal:
        cache = self.site.cache
        packed = cache.layout.packing is not None and any(
            rank.layout.block_size != cache.layout.block_size for rank in engine.engine.ranks
        )
        if packed:
            return Refusal("packed blocks of another block size are read whole and regrouped")
        plan = self._plan(engine)
        offers = [(source.remote_rank, self._offer(engine, source.remote_rank)) for source in plan.sources]
        why_not = refusal(
            self.kind, cache.place, offers, local_boot_id(), reach=gpu_reach, pid_namespace=pid_namespace()
        )
        if why_not:
            return Refusal(why_not)
        offered = {tp_rank: offer for tp_rank, offer in offers if offer is not None}
        try:
            opened: IpcEngine | CmaEngine = (
                CmaEngine.open(engine.engine.engine_id, offered, plan)
                if self.kind == "host_cma"
                else IpcEngine.open(engine.engine.engine_id, offered, plan, cache.tensors, cache.place)
            )
        except IpcUnavailable as error:
            return Refusal(f"failed to open: {error}")
        try:
            sources = notified_sources(
                self.site.agent,
                engine,
                plan,
                cache.layout.tp_size,
                warm=cache.place.is_host,  # the read sets up the connection ReadDone goes over
                timeout_s=self.site.options.read_timeout_s,
            )
        except BaseException:
            opened.close()
            raise
        return SameHostLink(self.kind, opened, sources, self, engine)

    def _plan(self, engine: OfferedEngine) -> PeerPlan:
        """The engine's plan, or, where it fixes up after the reads, one whose rows land in place (of any size for a
        copy out of mapped memory; at least :data:`~pd_transfer.same_host.MIN_DIRECT_ROW_BYTES` for reads in place,
        whose kernel costs more per byte on shorter rows than the fix-up)."""
        cache = self.site.cache
        plan = engine.plan(cache.layout, cache.regions, min_direct_run_bytes=self.min_direct_run_bytes)
        if plan.postprocess is None:
            return plan
        direct = MIN_DIRECT_ROW_BYTES if self.kind == "host_cma" else 0
        return engine.plan(cache.layout, cache.regions, min_direct_run_bytes=direct)

    def _offer(self, engine: OfferedEngine, tp_rank: int) -> RankIpc | None:
        """Rank ``tp_rank``'s offer of this kind (None: none, or one that does not decode: logged)."""
        payload = engine.offer(tp_rank, self.kind)
        if payload is None:
            return None
        try:
            return decode_rank_ipc(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as error:
            logger.warning(
                "decode %s: engine %s rank %d: malformed %s offer ignored: %s",
                self.site.agent.name,
                engine.engine.engine_id,
                tp_rank,
                self.kind,
                str(error)[:200],
            )
            return None

    def read(self, opened: IpcEngine | CmaEngine, sources: Sequence[Source], request: PullRequest) -> ReadTotals:
        """``request`` copied or read in place out of ``opened``, then ``sources`` told."""
        if isinstance(opened, CmaEngine):
            assert self.cma_reader is not None
            return self.cma_reader.read(opened, sources, request)
        assert self.ipc_reader is not None
        return self.ipc_reader.read(opened, sources, request)

    def take(self, peer: str, message: PeerMessage) -> bool:
        return False

    def close(self) -> None:
        if self.cma_reader is not None:
            self.cma_reader.close()


class SameHostPrefillEnd:
    """A same-host transport of ``kind`` on a prefill rank: the cache offered as ``kind`` where it can be (made once;
    where it cannot, logged with why), and no writer."""

    def __init__(self, kind: SameHostKind, site: PrefillSite) -> None:
        cache = site.cache
        ipc, why_not = export_cache(cache.tensors, cache.regions, _EXPORTS[kind])
        self._offer = None if ipc is None else encode_rank_ipc(ipc)
        if ipc is None:
            worth_saying = kind == "cuda_ipc" and not cache.place.is_host  # a GPU cache NIXL moves instead
            (logger.info if worth_saying else logger.debug)(
                "prefill %s: cache in %s not offered as %s: %s", site.agent.name, cache.place, kind, why_not
            )
        else:
            logger.info("prefill %s: cache in %s offered as %s", site.agent.name, cache.place, kind)

    def offer(self) -> bytes | None:
        return self._offer

    def take(self, peer: str, message: PeerMessage) -> bool:
        return False

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class SameHostTransport:
    """A built-in same-host transport (a :class:`~..seam.Transport`)."""

    name: SameHostKind
    same_host: bool = True

    def prefill_end(self, site: PrefillSite) -> SameHostPrefillEnd:
        return SameHostPrefillEnd(self.name, site)

    def decode_end(self, site: DecodeSite) -> SameHostDecodeEnd:
        return SameHostDecodeEnd(self.name, site)


CUDA_IPC = SameHostTransport("cuda_ipc")
HOST_IPC = SameHostTransport("host_ipc")
HOST_CMA = SameHostTransport("host_cma")
