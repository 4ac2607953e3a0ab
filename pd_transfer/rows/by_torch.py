"""The row mover's fallback where its kernel does not run: rows moved by torch, one group per pair of storages they
touch (source storage, target storage), never one call per row.

A group's rows are copied as units of the widest integer element that the row size, the addresses and the two
storages' starts allow. Each side of a group is a strided view of its storage: where the rows of a side lie at
multiples of at least a row apart (whole blocks at a block stride, a head's slice of each block, staging rows back
to back) a row is one unit and the view's stride is that multiple; otherwise the rows are cut into chunks of the
largest size dividing the row size and every row's distance from the side's first row, and a row is that many
consecutive chunks. Then, per group: slice copies where the rows make few runs (consecutive on both sides) or long
ones; else a gather straight into place (``index_select`` into a run) or a scatter from a run (``index_copy_``) where
one side is one run; else a gather and a scatter. The unit indices of every group of a call go to the device in one
upload. On a GPU the calls are queued on the current stream; on the CPU they are done when this returns.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .addresses import ELEMENT_TYPES, RowAddresses, widest_element
from .memory import RowCopy, RowMemory

#: A group's rows are copied run by run (slices where both sides advance together) when it has at most this many
#: runs, or its runs average at least ``RUN_BYTES``: each slice copy costs a launch (a few microseconds on a GPU), a
#: gather and a scatter cost a second pass over the bytes.
FEW_RUNS = 4
RUN_BYTES = 1 << 20


@dataclass(frozen=True)
class _Side:
    """One side of a group: ``view``, a (slots, unit elements) strided view of its storage, and the first slot of
    each row (a row is ``units_per_row`` consecutive slots)."""

    view: torch.Tensor
    starts: np.ndarray  # int64, one per row

    def run_start(self, units_per_row: int) -> int | None:
        """The first slot when the rows are one run of consecutive slots, else None."""
        if len(self.starts) > 1 and not bool(np.all(np.diff(self.starts) == units_per_row)):
            return None
        return int(self.starts[0])

    def slots(self, units_per_row: int) -> np.ndarray:
        """Every slot of the rows, row by row."""
        return (self.starts[:, None] + np.arange(units_per_row, dtype=np.int64)[None, :]).reshape(-1)


@dataclass(frozen=True)
class _Group:
    """Rows of one (source storage, target storage) pair, as slots of the two sides' views."""

    source: _Side
    target: _Side
    units_per_row: int
    nbytes: int

    def runs(self) -> list[tuple[int, int, int]] | None:
        """(source slot, target slot, slots) of each run of rows consecutive on both sides, when copying run by run
        pays (few runs, or long ones); else None."""
        step = self.units_per_row
        breaks = np.flatnonzero((np.diff(self.source.starts) != step) | (np.diff(self.target.starts) != step)) + 1
        count = len(breaks) + 1
        if count > FEW_RUNS and self.nbytes < count * RUN_BYTES:
            return None
        edges = [0, *breaks.tolist(), len(self.source.starts)]
        return [
            (int(self.source.starts[a]), int(self.target.starts[a]), (b - a) * step)
            for a, b in itertools.pairwise(edges)
        ]

    def copy(self, source: int | torch.Tensor, target: int | torch.Tensor) -> int:
        """Queue the copy; each side is a run's first slot (an int) or the index of every slot (a tensor). Returns
        the torch calls made."""
        count = len(self.source.starts) * self.units_per_row
        into, out_of = self.target.view, self.source.view
        if isinstance(target, int):
            if isinstance(source, int):
                into[target : target + count].copy_(out_of[source : source + count])
            else:
                torch.index_select(out_of, 0, source, out=into[target : target + count])
            return 1
        if isinstance(source, int):
            into.index_copy_(0, target, out_of[source : source + count])
            return 1
        into.index_copy_(0, target, out_of.index_select(0, source))
        return 2


def move_by_torch(copies: Sequence[RowCopy], upload: Callable[[np.ndarray], torch.Tensor]) -> int:
    """Queue the copy of every row of ``copies`` on the current stream with torch; ``upload`` puts an int64 array on
    the memory's device (called once, for every index of the call; not at all where every group is copied by runs).
    Returns the torch calls made. :class:`~.memory.RowsOutside` for a row outside its memory."""
    groups = [group for copy in copies if copy.addresses.rows for group in _groups(copy.addresses, copy.memory)]
    calls = 0
    wanted: list[np.ndarray] = []
    sides: list[tuple[int | None, int | None]] = []  # per indexed group: a run's first slot, or None: indexed
    indexed: list[_Group] = []
    for group in groups:
        runs = group.runs()
        if runs is not None:
            for first, into, count in runs:
                group.target.view[into : into + count].copy_(group.source.view[first : first + count])
            calls += len(runs)
            continue
        step = group.units_per_row
        starts = (group.source.run_start(step), group.target.run_start(step))
        for start, side in zip(starts, (group.source, group.target), strict=True):
            if start is None:
                wanted.append(side.slots(step))
        sides.append(starts)
        indexed.append(group)
    uploaded: list[torch.Tensor] = []
    if wanted:
        flat = upload(np.concatenate(wanted))
        uploaded = list(torch.split(flat, [len(part) for part in wanted]))
    indices = iter(uploaded)
    for group, (source, target) in zip(indexed, sides, strict=True):
        calls += group.copy(next(indices) if source is None else source, next(indices) if target is None else target)
    return calls


def _groups(rows: RowAddresses, memory: RowMemory) -> list[_Group]:
    """``rows`` by (source storage, target storage), in the order of each pair's first row."""
    source_storage, source_offset = memory.locate(rows.sources, rows.row_bytes)
    target_storage, target_offset = memory.locate(rows.targets, rows.row_bytes)
    key = source_storage * len(memory.storages) + target_storage
    order = np.argsort(key, kind="stable")
    edges = np.flatnonzero(np.diff(key[order])) + 1
    element = rows.element_bytes()
    groups = []
    for positions in sorted(np.split(order, edges), key=lambda part: int(part[0])):
        source = memory.storages[int(source_storage[positions[0]])]
        target = memory.storages[int(target_storage[positions[0]])]
        width = widest_element(element | source.data_ptr() | target.data_ptr())
        groups.append(_group(source, source_offset[positions], target, target_offset[positions], rows.row_bytes, width))
    return groups


def _group(
    source: torch.Tensor,
    source_offsets: np.ndarray,
    target: torch.Tensor,
    target_offsets: np.ndarray,
    row_bytes: int,
    element: int,
) -> _Group:
    """The views and slots of rows at ``source_offsets`` of storage ``source`` and ``target_offsets`` of ``target``
    (byte offsets, each a multiple of ``element``, as are ``row_bytes`` and both storages' addresses)."""
    steps = (_spacing(source_offsets), _spacing(target_offsets))
    if all(step == 0 or step >= row_bytes for step in steps):  # a row is one unit, a side's view strided by its spacing
        unit, strides = row_bytes, tuple(step or row_bytes for step in steps)
    else:  # rows closer than their length on a side: chunks of a size dividing the row size and every spacing
        unit = math.gcd(row_bytes, *steps)
        strides = (unit, unit)
    units_per_row = row_bytes // unit
    sides = [
        _side(storage, offsets, stride, unit, units_per_row, element)
        for storage, offsets, stride in zip((source, target), (source_offsets, target_offsets), strides, strict=True)
    ]
    return _Group(sides[0], sides[1], units_per_row, len(source_offsets) * row_bytes)


def _spacing(offsets: np.ndarray) -> int:
    """The largest distance of which every row's distance from the lowest is a multiple, and so is the distance
    between any two (the gcd of the distances; 0 when all rows are at one place)."""
    return int(np.gcd.reduce(offsets - offsets.min()))


def _side(
    storage: torch.Tensor, offsets: np.ndarray, stride: int, unit: int, units_per_row: int, element: int
) -> _Side:
    """``storage`` (1-D uint8) from its first row on as (slots, ``unit`` bytes) of ``element``-byte integers, a slot
    every ``stride`` bytes, and the first slot of each row at ``offsets``."""
    base = int(offsets.min())
    starts = (offsets - base) // stride
    slots = int(starts.max()) + units_per_row
    view = torch.empty(0, dtype=ELEMENT_TYPES[element], device=storage.device)
    view.set_(storage.untyped_storage(), base // element, (slots, unit // element), (stride // element, 1))
    return _Side(view, starts.astype(np.int64))
