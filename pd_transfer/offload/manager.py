"""The scheduler side of one offload tier: which blocks the tier holds, which are in flight, what to evict.

A pure state machine (no I/O, no threads of its own; thread-safe behind one lock). Each block is named by
its :mod:`key <pd_transfer.offload.keys>` and occupies one *row* of the tier: a row of the host pool, or,
for the disk tier, one unit of this manager's byte budget. A block is in one of three states:

* absent;
* ``storing`` from :meth:`prepare_store` until :meth:`complete_store` (then ``ready``, or absent on
  failure);
* ``ready``: loadable; :meth:`prepare_load` pins it until the matching :meth:`complete_load`.

Invariants (checked by tests/unit/test_offload_manager.py after every operation):

* ``blocks_held * block_bytes == bytes_held <= capacity_bytes``; each row belongs to at most one block;
* a block that is ``storing`` or pinned by a load is never evicted: when no other block can make room,
  :meth:`prepare_store` returns None and changes nothing;
* eviction takes the least recently used ready, unpinned block first (lookups, loads and repeated stores
  count as use);
* every block that became ready is announced once by a :class:`BlocksStored` event, and every announced
  block that leaves is announced once by a :class:`BlocksEvicted` event (:meth:`take_events`).

Bad calls (a load of a block that is not ready, completing what was never prepared) raise
:class:`OffloadStateError` before anything changes.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from .errors import OffloadInputError, OffloadStateError
from .keys import BlockKey, check_key, short
from .metrics import OffloadMetrics
from .specs import BlocksEvicted, BlocksStored, OffloadEvent, TierBlocks, TierName

BlockState = Literal["absent", "storing", "ready", "loading"]


@dataclass
class _Entry:
    row: int
    storing: bool
    loads: int = 0  # prepare_load calls not yet completed


@dataclass(frozen=True)
class StorePlan:
    """What :meth:`OffloadManager.prepare_store` decided: store ``blocks`` (a subset of the keys asked,
    in their order: the others are stored or being stored already); ``evicted`` left the tier to make room."""

    blocks: TierBlocks
    evicted: tuple[BlockKey, ...]


class OffloadManager:
    """Index, LRU order and byte budget of one tier, for one engine's scheduler."""

    def __init__(
        self,
        tier: TierName,
        capacity_bytes: int,
        block_bytes: int,
        *,
        first_row: int = 0,
        probe: Callable[[BlockKey, BlockKey], bool] | None = None,
        metrics: OffloadMetrics | None = None,
    ) -> None:
        """``capacity_bytes // block_bytes`` blocks fit, in rows ``first_row ..`` (engines sharing one host
        pool each take their own range). ``probe(key, file key)``, if
        given, is asked about keys this manager does not know (the disk tier: another process may have
        stored them; the file key is the one :meth:`lookup` was given, else the key itself); a True adopts
        the block as ready, if there is room."""
        if block_bytes <= 0 or capacity_bytes < block_bytes or first_row < 0:
            raise OffloadInputError(f"need 0 < block_bytes <= capacity_bytes, got {block_bytes}, {capacity_bytes}")
        self.tier: TierName = tier
        self.block_bytes = int(block_bytes)
        self.capacity_blocks = int(capacity_bytes) // self.block_bytes
        self._probe = probe
        self._metrics = metrics
        self._lock = threading.Lock()
        self._entries: OrderedDict[BlockKey, _Entry] = OrderedDict()  # least recently used first
        self._free_rows = list(range(first_row + self.capacity_blocks - 1, first_row - 1, -1))
        self._events: list[OffloadEvent] = []

    @property
    def capacity_bytes(self) -> int:
        return self.capacity_blocks * self.block_bytes

    # ------------------------------------------------------------------ operations
    def lookup(self, keys: Sequence[BlockKey], files: Sequence[BlockKey] = ()) -> int:
        """How many leading blocks of ``keys`` are ready to load (stops at the first that is not). ``files``
        (optional, one per key): the key of the file holding each block, for the probe (the disk tier's groups)."""
        keys = [check_key(key) for key in keys]
        if files and len(files) != len(keys):
            raise OffloadInputError(f"{len(files)} file keys for {len(keys)} keys")
        with self._lock:
            hits = 0
            for index, key in enumerate(keys):
                entry = self._entries.get(key)
                if entry is None and not self._adopt(key, files[index] if files else key):
                    break
                entry = self._entries[key]
                if entry.storing:
                    break
                self._entries.move_to_end(key)
                hits += 1
            if self._metrics is not None:
                self._metrics.hits.labels(self.tier).inc(hits)
                self._metrics.misses.labels(self.tier).inc(len(keys) - hits)
            return hits

    def prepare_load(self, keys: Sequence[BlockKey]) -> TierBlocks:
        """Pin ready blocks against eviction until :meth:`complete_load`; returns where they are."""
        keys = [check_key(key) for key in keys]
        with self._lock:
            for key in keys:
                entry = self._entries.get(key)
                if entry is None or entry.storing:
                    raise OffloadStateError(f"block {short(key)} is not ready to load in the {self.tier} tier")
            for key in keys:
                self._entries[key].loads += 1
                self._entries.move_to_end(key)
            return TierBlocks(tier=self.tier, keys=tuple(keys), rows=tuple(self._entries[k].row for k in keys))

    def complete_load(self, keys: Iterable[BlockKey]) -> None:
        """Unpin blocks pinned by :meth:`prepare_load` (once per key per prepare)."""
        keys = [check_key(key) for key in keys]
        with self._lock:
            for key, count in _counts(keys).items():
                entry = self._entries.get(key)
                if entry is None or entry.loads < count:
                    raise OffloadStateError(f"block {short(key)} has no load in flight in the {self.tier} tier")
            for key in keys:
                self._entries[key].loads -= 1

    def prepare_store(self, keys: Sequence[BlockKey]) -> StorePlan | None:
        """Reserve rows for the blocks of ``keys`` the tier does not hold, evicting least recently used ready
        blocks if needed. None (and nothing changes) if the room cannot be made without evicting blocks in
        flight; an empty plan if every block is held already."""
        keys = list(dict.fromkeys(check_key(key) for key in keys))
        with self._lock:
            new = [key for key in keys if key not in self._entries]
            for key in keys:
                if key in self._entries:
                    self._entries.move_to_end(key)
            shortfall = len(new) - len(self._free_rows)
            victims = self._victims(shortfall) if shortfall > 0 else []
            if len(victims) < shortfall:
                return None
            for key in victims:
                self._remove(key, announce=True)
            rows = []
            for key in new:
                row = self._free_rows.pop()
                self._entries[key] = _Entry(row=row, storing=True)
                rows.append(row)
            self._update_held()
            return StorePlan(TierBlocks(tier=self.tier, keys=tuple(new), rows=tuple(rows)), tuple(victims))

    def complete_store(self, keys: Iterable[BlockKey], success: bool = True) -> None:
        """Blocks prepared by :meth:`prepare_store` are stored (now loadable) or, if not ``success``, dropped."""
        keys = list(dict.fromkeys(check_key(key) for key in keys))
        with self._lock:
            for key in keys:
                entry = self._entries.get(key)
                if entry is None or not entry.storing:
                    raise OffloadStateError(f"block {short(key)} has no store in flight in the {self.tier} tier")
            for key in keys:
                if success:
                    self._entries[key].storing = False
                else:
                    self._remove(key, announce=False)
            if success and keys:
                self._events.append(BlocksStored(tier=self.tier, keys=tuple(keys)))
            self._update_held()

    def invalidate(self, keys: Iterable[BlockKey]) -> list[BlockKey]:
        """Forget ready, unpinned blocks the worker found missing or damaged; returns those dropped (blocks in
        flight are kept: call again after their transfer completes)."""
        keys = list(dict.fromkeys(check_key(key) for key in keys))
        with self._lock:
            dropped = []
            for key in keys:
                entry = self._entries.get(key)
                if entry is not None and not entry.storing and entry.loads == 0:
                    self._remove(key, announce=True)
                    dropped.append(key)
            self._update_held()
            return dropped

    def take_events(self) -> list[OffloadEvent]:
        """Events since the last call, in order (each returned once)."""
        with self._lock:
            events, self._events = self._events, []
            return events

    # ------------------------------------------------------------------ queries
    def state(self, key: BlockKey) -> BlockState:
        with self._lock:
            entry = self._entries.get(check_key(key))
            if entry is None:
                return "absent"
            if entry.storing:
                return "storing"
            return "loading" if entry.loads else "ready"

    @property
    def blocks_held(self) -> int:
        """Blocks ready or being stored."""
        with self._lock:
            return len(self._entries)

    @property
    def bytes_held(self) -> int:
        return self.blocks_held * self.block_bytes

    def rows(self) -> dict[BlockKey, int]:
        """Row of every held block (a snapshot, for checks and tests)."""
        with self._lock:
            return {key: entry.row for key, entry in self._entries.items()}

    # ------------------------------------------------------------------ internals (lock held)
    def _victims(self, count: int) -> list[BlockKey]:
        victims: list[BlockKey] = []
        for key, entry in self._entries.items():
            if len(victims) == count:
                break
            if not entry.storing and entry.loads == 0:
                victims.append(key)
        return victims

    def _adopt(self, key: BlockKey, file: BlockKey) -> bool:
        if self._probe is None or not self._probe(key, file):
            return False
        if not self._free_rows:
            victims = self._victims(1)
            if not victims:
                return False
            self._remove(victims[0], announce=True)
        self._entries[key] = _Entry(row=self._free_rows.pop(), storing=False)
        self._events.append(BlocksStored(tier=self.tier, keys=(key,)))
        self._update_held()
        return True

    def _remove(self, key: BlockKey, *, announce: bool) -> None:
        entry = self._entries.pop(key)
        self._free_rows.append(entry.row)
        if announce:
            self._events.append(BlocksEvicted(tier=self.tier, keys=(key,)))
            if self._metrics is not None:
                self._metrics.evictions.labels(self.tier).inc()

    def _update_held(self) -> None:
        if self._metrics is not None:
            self._metrics.held_bytes.labels(self.tier).set(len(self._entries) * self.block_bytes)


def _counts(keys: list[BlockKey]) -> dict[BlockKey, int]:
    counts: dict[BlockKey, int] = {}
    for key in keys:
        counts[key] = counts.get(key, 0) + 1
    return counts
