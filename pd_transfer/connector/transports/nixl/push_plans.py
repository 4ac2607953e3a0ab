"""A source plan on the wire, for a prefill rank that writes what a decode rank would read (push).

The decode rank made the plan (:class:`~pd_transfer.topology.plan.SourcePlan`) from both sides' layouts; the prefill
rank does not replan, it takes the plan's scalars and both descriptor grids as sent, checks them and computes each
order's rows with the same :meth:`SourcePlan.indices`. A grid is N x 3 uint64 rows ``(address, length, 0)``; packed,
its addresses are stored as differences (mostly one stride repeated) and compressed, so a 32,768-row grid takes
well under a kilobyte and fits a notification.
"""

from __future__ import annotations

import zlib

import numpy as np

from pd_transfer.connector.messages import PushPlan
from pd_transfer.topology.plan import SourcePlan
from pd_transfer.topology.units import UnitShape

#: Most rows a grid sent for pushing may have (each costs 24 bytes once unpacked).
MAX_PUSH_ROWS = 1 << 22
_ROW_BYTES = 16  # packed: an int64 address difference and a uint64 length


class PushPlanError(ValueError):
    """A plan sent for pushing is malformed or does not fit the rank it names; the message says how."""


def pack_rows(rows: np.ndarray) -> bytes:
    """``rows`` (N x 3 uint64, third column 0) packed: address differences and lengths, zlib-compressed."""
    rows = np.ascontiguousarray(rows, dtype=np.uint64)
    addresses = rows[:, 0].astype(np.int64)
    differences = np.diff(addresses, prepend=np.int64(0))
    return zlib.compress(differences.tobytes() + rows[:, 1].tobytes(), 6)


def unpack_rows(packed: bytes, num_rows: int) -> np.ndarray:
    """The N x 3 uint64 rows of :func:`pack_rows`, ``num_rows`` of them. Raises :class:`PushPlanError` when the
    bytes do not unpack to exactly that many rows (never inflating more than that: no zip bomb)."""
    if not 0 < num_rows <= MAX_PUSH_ROWS:
        raise PushPlanError(f"a grid of {num_rows} rows (1 to {MAX_PUSH_ROWS} expected)")
    expected = num_rows * _ROW_BYTES
    inflater = zlib.decompressobj()
    try:
        raw = inflater.decompress(packed, expected)
    except zlib.error as error:
        raise PushPlanError(f"a grid does not unpack: {error}") from None
    if len(raw) != expected or inflater.unconsumed_tail or not inflater.eof:
        raise PushPlanError(f"a grid does not unpack to {num_rows} rows")
    differences = np.frombuffer(raw[: num_rows * 8], dtype=np.int64)
    rows = np.zeros((num_rows, 3), dtype=np.uint64)
    rows[:, 0] = np.cumsum(differences).astype(np.uint64)
    rows[:, 1] = np.frombuffer(raw[num_rows * 8 :], dtype=np.uint64)
    return rows


def plan_to_wire(plan: SourcePlan) -> PushPlan:
    """The wire form of ``plan``."""
    return PushPlan(
        remote_rank=plan.remote_rank,
        first_global_head=plan.first_global_head,
        num_heads=plan.num_heads,
        unit_heads=plan.unit.heads,
        unit_tokens=plan.unit.tokens,
        head_size=plan.unit.head_size,
        unit_bytes=plan.unit_bytes,
        num_planes=plan.num_planes,
        local_block_size=plan.local_block_size,
        remote_block_size=plan.remote_block_size,
        local_num_blocks=plan.local_num_blocks,
        remote_num_blocks=plan.remote_num_blocks,
        local_rows=pack_rows(plan.local_grid),
        remote_rows=pack_rows(plan.remote_grid),
    )


def plan_from_wire(wire: PushPlan) -> SourcePlan:
    """The plan ``wire`` describes, checked for consistency (not yet against any memory: see
    :func:`check_rows_inside`). Raises :class:`PushPlanError`."""
    for name in ("num_heads", "unit_heads", "unit_tokens", "head_size", "unit_bytes", "num_planes"):
        if getattr(wire, name) <= 0:
            raise PushPlanError(f"{name} must be positive, got {getattr(wire, name)}")
    for side in ("local", "remote"):
        block_size, num_blocks = getattr(wire, f"{side}_block_size"), getattr(wire, f"{side}_num_blocks")
        if block_size <= 0 or num_blocks <= 0 or block_size % wire.unit_tokens:
            raise PushPlanError(f"{num_blocks} {side} blocks of {block_size} tokens, units of {wire.unit_tokens}")
    if wire.num_heads % wire.unit_heads or wire.first_global_head < 0 or wire.remote_rank < 0:
        raise PushPlanError(f"{wire.num_heads} heads from head {wire.first_global_head} in units of {wire.unit_heads}")
    head_units = wire.num_heads // wire.unit_heads
    grids = []
    for side in ("local", "remote"):
        per_block = head_units * (getattr(wire, f"{side}_block_size") // wire.unit_tokens)
        num_rows = wire.num_planes * getattr(wire, f"{side}_num_blocks") * per_block
        grid = unpack_rows(getattr(wire, f"{side}_rows"), num_rows)
        if np.any(grid[:, 1] != wire.unit_bytes):
            raise PushPlanError(f"{side} rows are not all {wire.unit_bytes} bytes long")
        grids.append(grid)
    return SourcePlan(
        remote_rank=wire.remote_rank,
        first_global_head=wire.first_global_head,
        num_heads=wire.num_heads,
        unit=UnitShape(wire.unit_heads, wire.unit_tokens, wire.head_size),
        unit_bytes=wire.unit_bytes,
        local_grid=grids[0],
        remote_grid=grids[1],
        num_planes=wire.num_planes,
        local_block_size=wire.local_block_size,
        remote_block_size=wire.remote_block_size,
        local_num_blocks=wire.local_num_blocks,
        remote_num_blocks=wire.remote_num_blocks,
    )


def check_rows_inside(rows: np.ndarray, spans: list[tuple[int, int]], what: str) -> None:
    """Raise :class:`PushPlanError` unless every row ``(address, length, 0)`` lies inside one of ``spans`` ((start,
    end) byte addresses, sorted and disjoint, as :func:`~pd_transfer.transfer.dlists.merged_spans` gives)."""
    if not spans:
        raise PushPlanError(f"{what}: no memory to check the rows against")
    starts = np.array([start for start, _ in spans], dtype=np.uint64)
    ends = np.array([end for _, end in spans], dtype=np.uint64)
    begin = rows[:, 0]
    finish = begin + rows[:, 1]
    index = np.searchsorted(starts, begin, side="right").astype(np.int64) - 1
    inside = (index >= 0) & (finish >= begin)
    clipped = np.clip(index, 0, len(spans) - 1)
    inside &= (begin >= starts[clipped]) & (finish <= ends[clipped])
    if not np.all(inside):
        first = int(np.argmin(inside))
        raise PushPlanError(f"{what}: row {first} lies outside the registered cache")
