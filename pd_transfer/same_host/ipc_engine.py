"""A prefill engine's memory opened through same-host IPC (:mod:`.opening`), and a request's rows out of it.

**Opening** (:meth:`IpcEngine.open`, once per engine): each source rank's segments are opened, and every row of the
plan's two descriptor grids is located: the remote grid's rows in the prefill's opened segments (their addresses in
the prefill's process turned into addresses in ours), the local grid's in our cache's storages. A row outside them
refuses the engine (:class:`~.common.IpcUnavailable`).

**Copying** (:meth:`IpcSource.copies`): a request's rows as the row mover's copies (:mod:`pd_transfer.rows`: its
sources in the opened segments, its targets in our cache, and the memory of both), which the decode's IPC reader
moves with :func:`~pd_transfer.rows.move_rows`: one kernel launch for every row of a request on a GPU with Triton,
else torch's calls per pair of segments the rows touch, never one per block.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pd_transfer.handshake.messages import CudaSegment, HostSegment, RankIpc
from pd_transfer.rows import RowAddresses, RowCopy, RowMemory, RowsOutside, storages
from pd_transfer.rows import locate as locate_rows
from pd_transfer.spec import MemoryPlace
from pd_transfer.topology import PeerPlan, SourcePlan

from .common import IpcUnavailable
from .opening import OwnerWatch, WatchedSources, open_segments


def locate(addresses: np.ndarray, length: int, bases: Sequence[int], sizes: Sequence[int]) -> tuple[np.ndarray, ...]:
    """(segment index, byte offset) of each row of ``length`` bytes at ``addresses`` in the segments ``[bases[s],
    bases[s] + sizes[s])``; ``IpcUnavailable`` for a row that lies in none of them whole."""
    try:
        return locate_rows(addresses, length, bases, sizes, "the shared memory")
    except RowsOutside as error:
        raise IpcUnavailable(str(error)) from error


@dataclass
class IpcSource:
    """One prefill rank opened through IPC: its opened segments (``remote_segments``, uint8), the memory of those
    and of our cache (``memory``), and each grid row's address in this process: ``remote_at[i]`` for row ``i`` of the
    plan's remote grid (in an opened segment), ``local_at[i]`` for row ``i`` of its local grid (in our cache); rows
    of ``row_bytes``."""

    remote_segments: list[torch.Tensor]
    memory: RowMemory
    remote_at: np.ndarray  # int64
    local_at: np.ndarray  # int64
    row_bytes: int

    @classmethod
    def open(
        cls, remote: list[torch.Tensor], bases: list[int], plan: SourcePlan, local: list[torch.Tensor]
    ) -> IpcSource:
        """Map ``plan``'s grids onto ``remote`` (opened segments, whose first bytes are at ``bases`` in the
        prefill's process) and ``local`` (our storages, as uint8 tensors); ``IpcUnavailable`` for a row outside
        them."""
        unit = int(plan.unit_bytes)
        segment, offset = locate(plan.remote_grid[:, 0], unit, bases, [t.numel() for t in remote])
        local_at = plan.local_grid[:, 0].astype(np.int64)
        locate(local_at, unit, [t.data_ptr() for t in local], [t.numel() for t in local])
        mapped = np.array([t.data_ptr() for t in remote], dtype=np.int64)
        return cls(remote, RowMemory([*remote, *local]), mapped[segment] + offset, local_at, unit)

    def copies(self, local_rows: np.ndarray, remote_rows: np.ndarray) -> list[RowCopy]:
        """The copies that move remote rows ``remote_rows`` into local rows ``local_rows`` (grid row indices): one,
        for the row mover."""
        rows = RowAddresses(self.remote_at[remote_rows], self.local_at[local_rows], self.row_bytes)
        return [RowCopy(rows, self.memory)]


class IpcEngine(WatchedSources[IpcSource]):
    """A prefill engine's memory opened through IPC, one :class:`IpcSource` per source of the plan (in its order),
    and a watch on each source's process (``owners``). ``close`` drops every opened segment (the handles close once
    no copy holds them any more)."""

    def __init__(self, engine_id: str, sources: list[IpcSource], owners: list[OwnerWatch], plan: PeerPlan) -> None:
        super().__init__(sources, owners)
        self.engine_id = engine_id
        self.plan = plan  # what its requests are copied by (rows into place: no fix-up, see ``open``)

    @classmethod
    def open(
        cls,
        engine_id: str,
        offers: Mapping[int, RankIpc],
        plan: PeerPlan,
        tensors: list[torch.Tensor],
        place: MemoryPlace,
    ) -> IpcEngine:
        """Open the segments each rank ``plan`` reads offered (``offers``, by TP rank) and map its grids;
        ``IpcUnavailable`` if that fails. ``plan`` should land every row in place (a direct plan, no fix-up): a copy
        writes rows anywhere, so a block-size regroup, a TP head slice or a layout change is done by the copy itself,
        with no second pass."""
        local = storages(tensors)
        sources: list[IpcSource] = []
        owners: list[OwnerWatch] = []
        try:
            for source in plan.sources:
                offer = offers.get(source.remote_rank)
                if offer is None:
                    raise IpcUnavailable(f"prefill rank {source.remote_rank} offers no IPC")
                owners.append(OwnerWatch(offer))
                opened = open_segments(offer, place)
                bases = [s.base_address for s in offer.segments if isinstance(s, CudaSegment | HostSegment)]
                sources.append(IpcSource.open(opened, bases, source, local))
        except BaseException:
            for owner in owners:
                owner.close()
            raise
        return cls(engine_id, sources, owners, plan)
