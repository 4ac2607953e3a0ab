"""A prefill engine's memory opened through same-host IPC (:mod:`.opening`), and the row copies out of it.

**Opening** (:meth:`IpcEngine.open`, once per engine): each source rank's segments are opened, and every row of the
plan's two descriptor grids is located: in which segment (the prefill's opened segments for the remote grid, our
cache's storages for the local grid) and at which chunk. A chunk is the largest size dividing every row's offset and
the row length (``unit_bytes``), so each segment is viewed as a (chunks, chunk) matrix (of the widest integer type
its alignment allows) and a row is ``unit_bytes / chunk`` consecutive chunks of it (one, for whole plane blocks).

**Copying** (:meth:`IpcSource.copies`, :func:`run_copies`): a request's rows grouped by (remote segment, local
segment), one copy per group, never one per block: slice copies where the rows make few runs, or long ones,
consecutive on both sides (a plane's blocks in a row, say), else a gather straight into place (``index_select`` into
a slice) or a scatter from a slice (``index_copy_``) where one side is one run, else a gather and a scatter; the
chunk indices of the whole request go to the device in one upload.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pd_transfer.handshake.messages import CudaSegment, EngineMetadata, HostSegment
from pd_transfer.spec import MemoryPlace, Transport
from pd_transfer.topology import PeerPlan, SourcePlan
from pd_transfer.topology.row_copy import RowAddresses, copy_rows

from .common import IpcUnavailable
from .opening import OwnerWatch, WatchedSources, open_segments

_ELEMENT_TYPES = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


@dataclass(frozen=True)
class RowMap:
    """Where each row of a descriptor grid lies: ``segment[i]`` and the first ``chunk[i]`` of row ``i`` in it."""

    segment: np.ndarray  # int64
    chunk: np.ndarray  # int64


def locate(addresses: np.ndarray, length: int, bases: Sequence[int], sizes: Sequence[int]) -> tuple[np.ndarray, ...]:
    """(segment index, byte offset) of each row of ``length`` bytes at ``addresses`` in the segments ``[bases[s],
    bases[s] + sizes[s])``; ``IpcUnavailable`` for a row that lies in none of them whole."""
    order = np.argsort(np.asarray(bases, dtype=np.int64))
    starts = np.asarray(bases, dtype=np.int64)[order]
    ends = starts + np.asarray(sizes, dtype=np.int64)[order]
    rows = addresses.astype(np.int64)
    position = np.searchsorted(starts, rows, side="right") - 1
    inside = (position >= 0) & (rows + length <= ends[np.maximum(position, 0)])
    if not inside.all():
        bad = int(np.flatnonzero(~inside)[0])
        raise IpcUnavailable(f"row {bad} ({length} bytes at {int(rows[bad]):#x}) lies outside the shared memory")
    return order[position].astype(np.int64), rows - starts[position]


@dataclass
class IpcSource:
    """One prefill rank opened through IPC: its segments and ours as (chunks, chunk) matrices, and where every row of
    the plan's grids lies in them (``chunks_per_row`` chunks per row)."""

    remote_segments: list[torch.Tensor]
    local_segments: list[torch.Tensor]
    remote_rows: RowMap
    local_rows: RowMap
    chunks_per_row: int
    chunk_bytes: int

    @classmethod
    def open(
        cls, remote: list[torch.Tensor], bases: list[int], plan: SourcePlan, local: list[torch.Tensor]
    ) -> IpcSource:
        """Map ``plan``'s grids onto ``remote`` (opened segments, whose first bytes are at ``bases`` in the
        prefill's process) and ``local`` (our storages, as uint8 tensors)."""
        unit = int(plan.unit_bytes)
        remote_segment, remote_offset = locate(plan.remote_grid[:, 0], unit, bases, [t.numel() for t in remote])
        local_segment, local_offset = locate(
            plan.local_grid[:, 0], unit, [t.data_ptr() for t in local], [t.numel() for t in local]
        )
        chunk = math.gcd(unit, int(np.gcd.reduce(remote_offset)), int(np.gcd.reduce(local_offset)))
        element, dtype = next(
            (size, dtype)
            for size, dtype in _ELEMENT_TYPES
            if chunk % size == 0 and all(t.data_ptr() % size == 0 for t in (*remote, *local))
        )
        return cls(
            remote_segments=[_chunks(t, chunk, element, dtype) for t in remote],
            local_segments=[_chunks(t, chunk, element, dtype) for t in local],
            remote_rows=RowMap(remote_segment, remote_offset // chunk),
            local_rows=RowMap(local_segment, local_offset // chunk),
            chunks_per_row=unit // chunk,
            chunk_bytes=chunk,
        )

    def copies(self, local_rows: np.ndarray, remote_rows: np.ndarray) -> list[ChunkCopy]:
        """The copies that move remote rows ``remote_rows`` into local rows ``local_rows``: one per (remote segment,
        local segment) the rows touch."""
        remote_segment = self.remote_rows.segment[remote_rows]
        local_segment = self.local_rows.segment[local_rows]
        key = remote_segment * len(self.local_segments) + local_segment
        order = np.argsort(key, kind="stable")
        edges = np.flatnonzero(np.diff(key[order])) + 1
        copies = []
        for group in np.split(order, edges):
            if not len(group):
                continue
            first = group[0]
            copies.append(
                ChunkCopy(
                    source=self.remote_segments[int(remote_segment[first])],
                    target=self.local_segments[int(local_segment[first])],
                    source_chunks=self.remote_rows.chunk[remote_rows[group]],
                    target_chunks=self.local_rows.chunk[local_rows[group]],
                    chunks_per_row=self.chunks_per_row,
                )
            )
        return copies


def _chunks(segment: torch.Tensor, chunk: int, element: int, dtype: torch.dtype) -> torch.Tensor:
    """``segment`` (uint8) as a (chunks, chunk / element) matrix of ``dtype`` (its tail past the last chunk cut)."""
    count = segment.numel() // chunk
    return segment[: count * chunk].view(dtype).view(count, chunk // element)


#: A group's rows are copied run by run (slices where both sides advance together) when it has at most this many
#: runs, or its runs average at least ``_RUN_BYTES``: each slice copy costs a launch (a few microseconds on a GPU),
#: a gather and a scatter cost a second pass over the bytes.
_FEW_RUNS = 4
_RUN_BYTES = 1 << 20


@dataclass
class ChunkCopy:
    """Rows of ``chunks_per_row`` chunks from ``source`` (starting at ``source_chunks``) to ``target``."""

    source: torch.Tensor
    target: torch.Tensor
    source_chunks: np.ndarray
    target_chunks: np.ndarray
    chunks_per_row: int

    @property
    def chunks(self) -> int:
        return len(self.source_chunks) * self.chunks_per_row

    @property
    def nbytes(self) -> int:
        return self.chunks * self.target.shape[1] * self.target.element_size()

    def runs(self) -> list[tuple[int, int, int]] | None:
        """(source chunk, target chunk, chunks) of each run of rows consecutive on both sides, when copying run by
        run pays (few runs, or long ones); else None."""
        step = self.chunks_per_row
        breaks = np.flatnonzero((np.diff(self.source_chunks) != step) | (np.diff(self.target_chunks) != step)) + 1
        count = len(breaks) + 1
        if count > _FEW_RUNS and self.nbytes < count * _RUN_BYTES:
            return None
        edges = [0, *breaks.tolist(), len(self.source_chunks)]
        return [
            (int(self.source_chunks[a]), int(self.target_chunks[a]), (b - a) * step)
            for a, b in itertools.pairwise(edges)
        ]

    def run_start(self, starts: np.ndarray) -> int | None:
        """The first chunk when rows ``starts`` are one run of consecutive chunks, else None."""
        if len(starts) > 1 and not bool(np.all(np.diff(starts) == self.chunks_per_row)):
            return None
        return int(starts[0])

    def indices(self, starts: np.ndarray) -> np.ndarray:
        """Every chunk of the rows that start at ``starts``, in order."""
        return (starts[:, None] + np.arange(self.chunks_per_row, dtype=np.int64)[None, :]).reshape(-1)

    def addresses(self) -> RowAddresses:
        """The copy's rows as addresses in this process (the segments' own: opened IPC memory is mapped here)."""
        chunk_bytes = self.source.shape[1] * self.source.element_size()
        return RowAddresses(
            self.source.data_ptr() + self.source_chunks * chunk_bytes,
            self.target.data_ptr() + self.target_chunks * chunk_bytes,
            chunk_bytes * self.chunks_per_row,
        )

    def run(self, source: int | torch.Tensor, target: int | torch.Tensor) -> None:
        """Queue the copy; each side is a run's first chunk (an int) or the index of every chunk (a tensor)."""
        count = self.chunks
        if isinstance(target, int):
            into = self.target[target : target + count]
            if isinstance(source, int):
                into.copy_(self.source[source : source + count])
            else:
                torch.index_select(self.source, 0, source, out=into)
        elif isinstance(source, int):
            self.target.index_copy_(0, target, self.source[source : source + count])
        else:
            self.target.index_copy_(0, target, self.source.index_select(0, source))


def run_copies(
    copies: Sequence[ChunkCopy], upload: Callable[[np.ndarray], torch.Tensor], *, one_kernel: bool = False
) -> int:
    """Queue ``copies`` on the current stream; returns the copy calls (kernel launches) made. ``one_kernel``: every
    row of every copy by :func:`~pd_transfer.topology.row_copy.copy_rows`, one launch per row size (a CUDA device
    with Triton); else with torch, run by run where that pays, else by chunk indices (for a side that is not one
    run): a call per run where a copy's rows make few runs or long ones (:meth:`ChunkCopy.runs`), else at most two
    per copy (pair of segments). ``upload`` (int64 array -> tensor) puts the indices or
    addresses on the copies' device, all at once."""
    if one_kernel:
        return sum(copy_rows(rows, upload) for rows in rows_by_size(copies))
    calls = 0
    wanted: list[np.ndarray] = []
    sides: list[list[int | None]] = []  # per indexed copy, (source, target): a run's first chunk, or None: indexed
    indexed: list[ChunkCopy] = []
    for copy in copies:
        runs = copy.runs()
        if runs is not None:
            for first, into, count in runs:
                copy.target[into : into + count].copy_(copy.source[first : first + count])
            calls += len(runs)
            continue
        starts = [copy.run_start(copy.source_chunks), copy.run_start(copy.target_chunks)]
        for start, chunks in zip(starts, (copy.source_chunks, copy.target_chunks), strict=True):
            if start is None:
                wanted.append(copy.indices(chunks))
        sides.append(starts)
        indexed.append(copy)
    uploaded: list[torch.Tensor] = []
    if wanted:
        flat = upload(np.concatenate(wanted))
        uploaded = list(torch.split(flat, [len(part) for part in wanted]))
    indices = iter(uploaded)
    for copy, (source, target) in zip(indexed, sides, strict=True):
        copy.run(next(indices) if source is None else source, next(indices) if target is None else target)
        calls += 2 if source is None and target is None else 1
    return calls


def rows_by_size(copies: Sequence[ChunkCopy]) -> list[RowAddresses]:
    """Every row of ``copies`` as addresses, one list per row size (one for every plan of one cache): what the
    kernel copies in one launch each."""
    by_size: dict[int, list[RowAddresses]] = {}
    for copy in copies:
        rows = copy.addresses()
        by_size.setdefault(rows.row_bytes, []).append(rows)
    return [RowAddresses.concat(parts) for parts in by_size.values()]


class IpcEngine(WatchedSources[IpcSource]):
    """A prefill engine's memory opened through IPC, one :class:`IpcSource` per source of the plan (in its order),
    and a watch on each source's process (``owners``). ``close`` drops every opened segment (the handles close once
    no copy holds them any more)."""

    def __init__(
        self, transport: Transport, sources: list[IpcSource], owners: list[OwnerWatch], plan: PeerPlan
    ) -> None:
        super().__init__(sources, owners)
        self.transport = transport
        self.plan = plan  # what its requests are copied by (rows into place: no fix-up, see ``open``)

    @classmethod
    def open(
        cls,
        transport: Transport,
        engine: EngineMetadata,
        plan: PeerPlan,
        tensors: list[torch.Tensor],
        place: MemoryPlace,
    ) -> IpcEngine:
        """Open the segments of each rank ``plan`` reads and map its grids; ``IpcUnavailable`` if that fails.
        ``plan`` should land every row in place (a direct plan, no fix-up): a copy writes rows anywhere, so a
        block-size regroup, a TP head slice or a layout change is done by the copy itself, with no second pass."""
        by_rank = {rank.tp_rank: rank for rank in engine.ranks}
        local = storages(tensors)
        sources: list[IpcSource] = []
        owners: list[OwnerWatch] = []
        try:
            for source in plan.sources:
                offer = by_rank[source.remote_rank].ipc
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
        return cls(transport, sources, owners, plan)


def storages(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The storages behind ``tensors`` (a cache's), each once, as uint8 tensors of their bytes."""
    found: dict[int, torch.Tensor] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in found:
            whole = torch.empty(0, dtype=torch.uint8, device=tensor.device)
            found[storage.data_ptr()] = whole.set_(storage, 0, (storage.nbytes(),), (1,))
    return list(found.values())
