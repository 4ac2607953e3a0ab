"""NIXL as the courier of the lease protocol: how a link's sources are reached through the decode rank's NIXL agent
(its notifications carry ``ReadDone`` and the other reports, and the prefill's ``LeaseConfirm`` comes back the same
way), for the transports that read with NIXL and those that only send through it (same-host IPC).

A prefill rank is added as a peer of the agent once per connected engine; where asked, the connection is warmed up by
one read of one row into scratch memory (the first read to a peer pays for its setup, 25-36 ms), so neither the first
request nor a decode closing right after it waits for that. A transport that carries its reports itself uses none of
this: it adds no peer and reads nothing with NIXL.
"""

from __future__ import annotations

import numpy as np
import torch

from pd_transfer.spec import memory_of
from pd_transfer.topology import PeerPlan, expected_readers
from pd_transfer.topology.plan import SourcePlan
from pd_transfer.transfer import late_landing, sever
from pd_transfer.transfer.agent import DescriptorList
from pd_transfer.transfer.agent_protocol import Agent
from pd_transfer.transfer.errors import TransferTimeout

from .seam import OfferedEngine, Source


def reach(agent: Agent, engine: OfferedEngine, tp_rank: int, tp_size: int) -> Source:
    """Rank ``tp_rank`` of ``engine`` as a source of a decode of TP size ``tp_size``, told through ``agent`` (added as
    its peer if it is not one yet)."""
    rank = engine.rank(tp_rank)
    peer = rank.agent_name if agent.has_peer(rank.agent_name) else agent.add_peer(rank.agent_metadata)
    sever.note_peer(peer, engine.host)  # where a stalled transfer with it is severed
    readers = expected_readers(tp_rank, rank.layout, tp_size)
    return Source(remote_rank=tp_rank, peer=peer, expected_readers=readers, courier=agent)


def notified_sources(
    agent: Agent, engine: OfferedEngine, plan: PeerPlan, tp_size: int, *, warm: bool, timeout_s: float
) -> list[Source]:
    """The ranks ``plan`` reads, each added as a peer of ``agent`` and told through it; with ``warm``, each connection
    warmed up by a read of the rank's first row (bounded by ``timeout_s``). On failure the peers added so far are
    removed and the error raised."""
    sources: list[Source] = []
    try:
        for source in plan.sources:
            added = reach(agent, engine, source.remote_rank, tp_size)
            sources.append(added)
            if warm:
                rank = engine.rank(source.remote_rank)
                first = agent.prepare_remote(added.peer, source.remote_grid[:1], memory_of(list(rank.regions)))
                try:
                    warm_up(agent, first, source, timeout_s)
                finally:
                    first.release()
    except Exception:
        remove_peers(agent, sources)
        raise
    return sources


def warm_up(agent: Agent, remote: DescriptorList, source: SourcePlan, timeout_s: float) -> None:
    """Read row 0 of ``remote`` (one unit of ``source``) into registered scratch memory once (bounded by
    ``timeout_s``); the cache is not touched. After a timeout the scratch memory is kept, never freed
    (:mod:`pd_transfer.transfer.late_landing`)."""
    scratch = torch.empty(source.unit_bytes, dtype=torch.uint8)
    registration = agent.register_spans([(scratch.data_ptr(), scratch.data_ptr() + source.unit_bytes)])
    local: DescriptorList | None = None
    try:
        local = agent.prepare_local(np.array([[scratch.data_ptr(), source.unit_bytes, 0]], dtype=np.uint64))
        zero = np.zeros(1, dtype=np.int32)
        agent.read(local, zero, remote, zero, timeout_s=timeout_s)
    except TransferTimeout:  # the read may still land in scratch (the wire came back): it is never freed
        late_landing.keep(scratch, registration, local)
        raise
    except BaseException:
        _free(agent, registration, local)
        raise
    _free(agent, registration, local)


def _free(agent: Agent, registration: object, local: DescriptorList | None) -> None:
    if local is not None:
        local.release()
    agent.deregister(registration)


def remove_peers(agent: Agent, sources: list[Source]) -> None:
    """Remove the peers of ``sources`` from ``agent`` (a link closed)."""
    for source in sources:
        agent.remove_peer(source.peer)
