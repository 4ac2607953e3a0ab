"""A prefill engine read in place with ``process_vm_readv`` (:mod:`pd_transfer.connector.transports.ipc.cma_reads`
reads it): opened once per engine.

Each source rank offered its cache (a :class:`~pd_transfer.handshake.messages.CmaSegment`); we watch its process (a
pidfd: we share its pid namespace) and read its probe back (:func:`~.opening.check_probe`), so its pid is known to
be the prefill. The plan read by is one whose rows land in place (direct) where those rows are at least
:data:`MIN_DIRECT_ROW_BYTES`: a block-size regroup is then done by the copy itself, a remote block landing as a piece
per head; else the engine's own plan, with its fix-up after the reads.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pd_transfer.handshake.messages import CmaSegment, RankIpc
from pd_transfer.topology import PeerPlan, SourcePlan
from pd_transfer.transfer.cma import CmaCall, plan_calls

from .common import IpcUnavailable
from .opening import OwnerWatch, WatchedSources, check_probe

#: Rows of a direct plan at least this long are read in place (a block-size regroup done by the copy); shorter
#: ones (a layout change, a head per token) cost the kernel more per byte than the engine plan's fix-up.
MIN_DIRECT_ROW_BYTES = 4096


@dataclass(frozen=True, eq=False)
class CmaSource:
    """One source rank of the plan and its process."""

    pid: int
    plan: SourcePlan

    def calls(
        self, remote_block_ids: list[int], local_block_ids: list[int], num_tokens: int
    ) -> tuple[list[CmaCall], int]:
        """(the calls that read a request's blocks from this source, the rows they read): ``num_tokens`` tokens from
        ``remote_block_ids`` into ``local_block_ids``; ``ValueError`` for block ids that do not fit the plan."""
        local, remote = self.plan.addresses(remote_block_ids, local_block_ids, num_tokens)
        return plan_calls(self.pid, local, remote, self.plan.unit_bytes), len(local)


class CmaEngine(WatchedSources[CmaSource]):
    """A prefill engine read in place: the plan read by (``plan``), a :class:`CmaSource` per source of it and a
    watch on each source's process (``owners``). ``close`` releases the watches."""

    def __init__(self, engine_id: str, plan: PeerPlan, sources: list[CmaSource], owners: list[OwnerWatch]) -> None:
        super().__init__(sources, owners)
        self.engine_id = engine_id
        self.plan = plan

    @classmethod
    def open(cls, engine_id: str, offers: Mapping[int, RankIpc], plan: PeerPlan) -> CmaEngine:
        """Watch and probe each rank ``plan`` reads (its offer in ``offers``, by TP rank); ``IpcUnavailable`` where one
        cannot be read in place."""
        sources: list[CmaSource] = []
        owners: list[OwnerWatch] = []
        try:
            for source in plan.sources:
                offer = offers.get(source.remote_rank)
                segment = offer.segments[0] if offer is not None and offer.segments else None
                if offer is None or not isinstance(segment, CmaSegment):
                    raise IpcUnavailable(f"prefill rank {source.remote_rank} offers no memory to read in place")
                owner = OwnerWatch(offer)
                owners.append(owner)
                if not owner.watching:
                    raise IpcUnavailable(f"prefill rank {source.remote_rank}: its process cannot be watched here")
                check_probe(offer, segment)
                sources.append(CmaSource(offer.pid, source))
        except BaseException:
            for owner in owners:
                owner.close()
            raise
        return cls(engine_id, plan, sources, owners)
