"""A prefill engine opened for NIXL reads (:class:`NixlEngine`): its plan, and each source rank added as a NIXL peer
with its descriptor lists prepared once (remote and local grids, in the memory each side's cache is in; for plans
that fix layouts up, the staging area's rows too), its connection warmed up by a one-unit read into scratch memory so
the first request does not pay for connection setup.

Descriptor lists name the memory they are in: a GPU's ("VRAM", with its device index) or the host's. A failed open
removes the peers it added.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pd_transfer.connector.cache import KVCache
from pd_transfer.spec import memory_of, planes_of
from pd_transfer.topology import PeerPlan, expected_readers
from pd_transfer.topology.plan import SourcePlan
from pd_transfer.transfer import sever
from pd_transfer.transfer.agent import DescriptorList
from pd_transfer.transfer.agent_protocol import Agent

from ..courier import remove_peers, warm_up
from ..seam import OfferedEngine, Source
from .packed_staging import PackedStaging
from .staging import StagingArea


@dataclass(kw_only=True)
class SourceRank(Source):
    """One prefill rank a plan reads from, with its descriptor lists prepared (told through the agent)."""

    local: DescriptorList  # the plan's local grid: final places, or the packed staging cache
    remote: DescriptorList  # the plan's remote grid
    staging: DescriptorList | None = None  # this source's units in every staging slot (plans that fix layouts up)

    def release(self) -> None:
        """Release its descriptor lists."""
        for prepared in (self.local, self.remote, self.staging):
            if prepared is not None:
                prepared.release()


@dataclass
class NixlEngine:
    """A prefill engine read with NIXL: its side channel's ``host``, the ``plan``, its ``sources`` (in the order of
    ``plan.sources``), and where reads that fix up land first (``staging``) or packed blocks of another block size
    land whole (``packed``)."""

    host: str
    plan: PeerPlan
    sources: list[SourceRank]
    staging: StagingArea | None = None
    packed: PackedStaging | None = None


def add_sources(
    agent: Agent,
    cache: KVCache,
    engine: OfferedEngine,
    plan: PeerPlan,
    *,
    staging: StagingArea | None,
    timeout_s: float,
) -> list[SourceRank]:
    """Each source rank of ``plan`` added as a peer of ``agent``, its descriptor lists prepared (into ``staging``'s
    slots too, if given) and its connection warmed up (each read bounded by ``timeout_s``); on failure, the peers
    added so far are removed and the error raised."""
    sources: list[SourceRank] = []
    try:
        for source in plan.sources:
            added = _add_source(agent, cache, engine, source, staging)
            sources.append(added)
            warm_up(agent, added.remote, source, timeout_s)
    except Exception:
        release(agent, sources)
        raise
    return sources


def _add_source(
    agent: Agent, cache: KVCache, engine: OfferedEngine, source: SourcePlan, staging: StagingArea | None
) -> SourceRank:
    """``source``'s rank added as a peer of ``agent``, its lists prepared; on failure the peer is removed."""
    rank = engine.rank(source.remote_rank)
    peer = agent.add_peer(rank.agent_metadata)
    sever.note_peer(peer, engine.host)  # where a stalled read from it is severed
    try:
        remote = agent.prepare_remote(peer, source.remote_grid, memory_of(list(rank.regions)))
        local = agent.prepare_local(source.local_grid, cache.place)
        staged = None if staging is None else _prepare_staging(agent, cache, staging, source)
    except Exception:
        agent.remove_peer(peer)  # and the lists prepared for it
        raise
    return SourceRank(
        remote_rank=source.remote_rank,
        peer=peer,
        expected_readers=expected_readers(source.remote_rank, rank.layout, cache.layout.tp_size),
        courier=agent,
        local=local,
        remote=remote,
        staging=staged,
    )


def _prepare_staging(agent: Agent, cache: KVCache, staging: StagingArea, source: SourcePlan) -> DescriptorList:
    """Descriptor rows of ``source``'s units in every slot of ``staging``."""
    first_plane = planes_of(list(cache.regions))[0].base_address
    rows: np.ndarray = staging.source_rows(source, first_plane)
    return agent.prepare_local(rows, staging.place)


def release(agent: Agent, sources: list[SourceRank]) -> None:
    """Release the sources' descriptor lists and remove their peers."""
    for source in sources:
        source.release()
    remove_peers(agent, list(sources))
