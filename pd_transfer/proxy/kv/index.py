"""The ``kv_aware`` policy's index: which engine holds which prefix block, in which tier, from the engines' KV events.

Per engine, a dict from block key (:func:`pd_transfer.proxy.kv.block_hash.block_key`) to a small bit mask of the tiers
holding it there: the engine's own KV cache (``medium`` GPU, or none: vLLM's own blocks), its host tier (CPU) and a
local disk. Blocks in the shared directory tier (``medium`` DISK from this project's offload connector, when the
directory is shared: ``shared_disk``) go to one directory dict instead, with the mask of the engines that reported
them: a shared directory is read by every engine that mounts it, so such a block credits all of them. An engine
mounts the directory once it reported a block stored there; one that never did (no offload tier, or another
directory) is not credited with it.

Blocks a request was just routed to (:meth:`KvIndex.routed`) count as that engine's own for ``routed_ttl_s``
seconds: its events report them only once it computed them, and a request with the same prefix routed meanwhile (the
second user of a new system prompt) should go where the first went. Each (engine, block) pair is kept apart: a block
routed to a prefill and then to a decode (which receives it) credits both.

A worker's score for a request is the credit of its longest prefix of the request's blocks that it can reach, each
block credited by the best tier it can reach it in: the engine's own cache 1.0, its host tier ``host``, the shared
directory ``shared``, a local disk ``disk`` (vLLM's router's defaults: 0.8, 0.6, 0.3).

Memory is bounded: at most ``max_blocks`` (engine, block) entries and directory blocks together (and as many routed
blocks, each kept seconds; past the bound the oldest go); past it each engine
loses the oldest eighth of its entries (by the time they were stored), which is what a lost removal event would have
left behind anyway. A dropped engine (restarted, silent, out of rotation) loses its dict in O(1) and its bits in the
directory dict in one pass. Values are small ints (CPython keeps those once), keys 60-bit ints: about 90 bytes per
entry in all (``tests/unit/test_kv_index.py`` measures it).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from pd_transfer.proxy.kv.block_hash import block_key

ENGINE = 1  # the engine's own KV cache (vLLM's GPU blocks)
HOST = 2  # the engine's host-memory tier
DISK = 4  # a disk tier only this engine reads
SHARED = 8  # the shared directory (a pseudo tier: held in the directory dict)
ROUTED = 16  # routed to the engine, not reported yet (a pseudo tier: held in the routed dict, credited as ENGINE)
TIER_NAMES = {ENGINE: "engine", HOST: "host", DISK: "disk", SHARED: "shared", ROUTED: "routed"}
TIERS = tuple(TIER_NAMES.values())

#: vLLM's ``medium`` strings -> our tier bit; ``DISK`` (this project's directory tier) is SHARED when configured so.
MEDIA = {None: ENGINE, "GPU": ENGINE, "CPU": HOST, "DISK": DISK, "STORAGE": DISK}


@dataclass(frozen=True)
class Credits:
    """What a block is worth by where it is, relative to the engine's own cache (1.0)."""

    host: float = 0.8
    shared: float = 0.6
    disk: float = 0.3

    def __post_init__(self) -> None:
        for name in ("host", "shared", "disk"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"the {name} tier's credit must be within [0, 1], got {value}")

    def of(self, tier: int) -> float:
        return {ENGINE: 1.0, ROUTED: 1.0, HOST: self.host, SHARED: self.shared, DISK: self.disk}[tier]


@dataclass
class Match:
    """A worker's reachable prefix of a request: its length in blocks, by tier, and its credit."""

    blocks: int = 0
    score: float = 0.0
    by_tier: dict[str, int] = field(default_factory=dict)


class KvIndex:
    """Engines' blocks by tier. ``shared_disk``: a ``DISK`` medium is the shared directory tier (credits every
    engine that mounts it); else a disk only its engine reads. ``routed_ttl_s``: how long a block routed to an
    engine counts as its own before its events report it (0: not at all); ``clock`` in seconds."""

    def __init__(
        self,
        max_blocks: int = 4_000_000,
        credits: Credits | None = None,
        shared_disk: bool = True,
        routed_ttl_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_blocks < 8:
            raise ValueError(f"the KV index needs room for at least 8 blocks, got {max_blocks}")
        if not (routed_ttl_s >= 0 and math.isfinite(routed_ttl_s)):
            raise ValueError(f"the routed blocks' time to live must be finite and >= 0 s, got {routed_ttl_s}")
        self.max_blocks = max_blocks
        self.credits = credits or Credits()
        self.shared_disk = shared_disk
        self.routed_ttl_s = routed_ttl_s
        self._clock = clock
        self._engines: dict[str, dict[int, int]] = {}
        self._slots: dict[str, int] = {}  # engine -> its bit in the directory dict's masks
        self._directory: dict[int, int] = {}
        self._mounts = 0  # the bits of the engines that stored a block in the directory
        self._routed: dict[tuple[str, int], float] = {}  # (engine, block key) -> until, the oldest first
        self._size = 0
        self.trimmed = 0  # entries dropped to stay within max_blocks

    # ---- what the engines report ----

    def slot(self, engine: str) -> int:
        """The engine's bit position in the directory masks (given on first sight, kept while it is known)."""
        slot = self._slots.get(engine)
        if slot is None:
            used = set(self._slots.values())
            slot = next(i for i in itertools.count() if i not in used)
            self._slots[engine] = slot
        return slot

    def __len__(self) -> int:
        return self._size

    def blocks_of(self, engine: str) -> int:
        return len(self._engines.get(engine, ()))

    def tier_of(self, medium: str | None) -> int:
        tier = MEDIA.get(medium.upper() if medium else None, ENGINE)
        return SHARED if tier == DISK and medium and medium.upper() == "DISK" and self.shared_disk else tier

    def stored(self, engine: str, hashes: Iterable[bytes | int], medium: str | None) -> None:
        tier = self.tier_of(medium)
        if tier == SHARED:
            bit = 1 << self.slot(engine)
            self._mounts |= bit
            directory = self._directory
            for h in hashes:
                key = block_key(h)
                mask = directory.get(key)
                if mask is None:
                    directory[key] = bit
                    self._size += 1
                else:
                    directory[key] = mask | bit
        else:
            self.slot(engine)
            blocks = self._engines.setdefault(engine, {})
            routed = self._routed if tier == ENGINE else {}
            for h in hashes:
                key = block_key(h)
                mask = blocks.pop(key, None)  # re-inserted last: the dict's order is the order of storing
                if mask is None:
                    self._size += 1
                    mask = 0
                blocks[key] = mask | tier
                if routed:
                    routed.pop((engine, key), None)  # reported: the engine tier from now on
        if self._size > self.max_blocks:
            self._trim()

    def removed(self, engine: str, hashes: Iterable[bytes | int], medium: str | None) -> None:
        tier = self.tier_of(medium)
        if tier == SHARED:
            slot = self._slots.get(engine)
            if slot is None:
                return
            self._size -= _clear_bit(self._directory, hashes, 1 << slot)
            return
        if tier == ENGINE:  # evicted: no longer credited as routed there either
            routed = self._routed
            hashes = list(hashes)
            for key in map(block_key, hashes):
                routed.pop((engine, key), None)
        blocks = self._engines.get(engine)
        if blocks is not None:
            self._size -= _clear_bit(blocks, hashes, tier)

    def cleared(self, engine: str) -> None:
        """The engine's own cache was emptied (``AllBlocksCleared``): its ENGINE tier bits go, other tiers stay."""
        blocks = self._engines.get(engine)
        if not blocks:
            return
        kept = {key: mask & ~ENGINE for key, mask in blocks.items() if mask & ~ENGINE}
        self._size -= len(blocks) - len(kept)
        self._engines[engine] = kept

    def drop(self, engine: str) -> None:
        """Forget everything the engine reported (it restarted, went silent, or left rotation)."""
        blocks = self._engines.pop(engine, None)
        if blocks:
            self._size -= len(blocks)
        for pair in [pair for pair in self._routed if pair[0] == engine]:
            del self._routed[pair]
        slot = self._slots.pop(engine, None)
        if slot is None:
            return
        bit = 1 << slot
        self._mounts &= ~bit
        directory = self._directory
        gone = [key for key, mask in directory.items() if mask == bit]
        for key in gone:
            del directory[key]
        self._size -= len(gone)
        for key, mask in directory.items():
            if mask & bit:
                directory[key] = mask & ~bit

    def _trim(self) -> None:
        """Drop the oldest eighth of each engine's entries (and of the directory's) until within the bound."""
        while self._size > self.max_blocks:
            tables = [t for t in [*self._engines.values(), self._directory] if t]
            if not tables:
                return
            largest = max(tables, key=len)
            cut = max(1, len(largest) // 8)
            kept = dict(itertools.islice(largest.items(), cut, None))
            largest.clear()
            largest.update(kept)
            self._size -= cut
            self.trimmed += cut

    # ---- what a request can reuse ----

    def routed(self, engine: str, keys: Sequence[int]) -> None:
        """A request of the blocks ``keys`` was routed to ``engine``: they count as its own until its events report
        them stored or removed, or ``routed_ttl_s`` passes. At most ``max_blocks`` such blocks (the oldest forgotten
        first)."""
        if not self.routed_ttl_s:
            return
        routed = self._routed
        now = self._clock()
        until = now + self.routed_ttl_s
        for key in keys:
            pair = (engine, key)
            routed.pop(pair, None)  # re-inserted last: the dict's order is the order of expiry
            routed[pair] = until
        while routed:
            pair, first_until = next(iter(routed.items()))
            if first_until > now and len(routed) <= self.max_blocks:
                break
            del routed[pair]

    def routed_blocks(self) -> int:
        return len(self._routed)

    def match(self, keys: Sequence[int], engines: Sequence[str]) -> dict[str, Match]:
        """Each engine's reachable prefix of the blocks ``keys`` (:func:`block_key` values), with its credit."""
        credits = self.credits
        directory, routed, now = self._directory, self._routed, self._clock()
        out: dict[str, Match] = {}
        for engine in engines:
            blocks = self._engines.get(engine, {})
            slot = self._slots.get(engine)
            mounts = slot is not None and bool(self._mounts >> slot & 1)
            match = Match()
            for key in keys:
                mask = blocks.get(key, 0)
                if mask & ENGINE:
                    tier = ENGINE
                elif routed.get((engine, key), 0.0) > now:
                    tier = ROUTED
                elif mask & HOST:
                    tier = HOST
                elif mounts and key in directory:
                    tier = SHARED
                elif mask & DISK:
                    tier = DISK
                else:
                    break
                name = TIER_NAMES[tier]
                match.by_tier[name] = match.by_tier.get(name, 0) + 1
                match.blocks += 1
                match.score += credits.of(tier)
            out[engine] = match
        return out


def _clear_bit(table: dict[int, int], hashes: Iterable[bytes | int], bit: int) -> int:
    """Clear ``bit`` of each of ``hashes``' masks in ``table``; an entry left with no bit goes (how many went)."""
    gone = 0
    for h in hashes:
        key = block_key(h)
        mask = table.get(key)
        if mask is not None and mask & bit:
            if mask == bit:
                del table[key]
                gone += 1
            else:
                table[key] = mask & ~bit
    return gone
