"""The ``cache_aware`` policy's memory of what was routed where: a prefix tree over request prefixes, bounded.

A request's prompt is cut into chunks (``chunk`` characters of its text, or tokens of a token-id prompt); chunk ``i``
is named by a 64-bit chained hash of chunks ``0..i`` (XXH3 seeded with its parent's name), so a name stands for a
whole prefix: the nodes of a prefix tree, each found in one dict lookup without walking from the root. A node holds
the set of workers (a bit mask of worker slots) that were sent a request with that prefix.

Bounded: at most ``max_entries`` nodes; inserting past that evicts the least recently used (a lookup that matches a
node, or an insert through it, makes it recent). Per worker the count of nodes naming it is kept, which is how much
of the tree each worker holds (the tie-break toward the least loaded cache when nothing matches).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import xxhash

#: Bytes of one chunk of a text prompt; a token-id prompt is cut every ``CHUNK_TOKENS`` tokens.
CHUNK_CHARS = 64
CHUNK_TOKENS = 16
#: The longest prefix the tree looks at (chunks): 4,096 chunks = 256 KiB of text; past it prompts share nothing new.
MAX_CHUNKS = 4096


def text_chunks(text: str, chunk: int = CHUNK_CHARS, max_chunks: int = MAX_CHUNKS) -> list[int]:
    """The chained names of ``text``'s chunks (a partial last chunk included: text prefixes differ anywhere)."""
    raw = text.encode("utf-8", "surrogatepass")
    names: list[int] = []
    parent = 0
    for start in range(0, min(len(raw), chunk * max_chunks), chunk):
        parent = xxhash.xxh3_64_intdigest(raw[start : start + chunk], parent)
        names.append(parent)
    return names


def token_chunks(tokens: Sequence[int], chunk: int = CHUNK_TOKENS, max_chunks: int = MAX_CHUNKS) -> list[int]:
    """The chained names of a token-id prompt's chunks of ``chunk`` tokens."""
    names: list[int] = []
    parent = 0
    for start in range(0, min(len(tokens), chunk * max_chunks), chunk):
        part = tokens[start : start + chunk]
        raw = b"".join(t.to_bytes(4, "little", signed=False) if 0 <= t < 2**32 else b"\xff" * 4 for t in part)
        parent = xxhash.xxh3_64_intdigest(raw, parent)
        names.append(parent)
    return names


class PrefixTree:
    """Chained chunk names -> worker slots (bit masks), LRU-bounded to ``max_entries`` nodes."""

    def __init__(self, max_entries: int) -> None:
        if max_entries < 1:
            raise ValueError(f"the prefix tree needs room for at least one entry, got {max_entries}")
        self.max_entries = max_entries
        self._nodes: OrderedDict[int, int] = OrderedDict()
        self._held: dict[int, int] = {}  # worker slot -> nodes naming it
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._nodes)

    def held(self, slot: int) -> int:
        """How many nodes name worker ``slot``."""
        return self._held.get(slot, 0)

    def match(self, names: Sequence[int], slots: Sequence[int]) -> dict[int, int]:
        """For each of ``slots``, how many leading chunks of ``names`` it was sent; matched nodes become recent."""
        out = dict.fromkeys(slots, 0)
        wanted = 0
        for slot in slots:
            wanted |= 1 << slot
        alive = wanted
        nodes = self._nodes
        depth = 0
        for name in names:
            mask = nodes.get(name)
            if mask is None:
                break
            nodes.move_to_end(name)
            still = alive & mask
            for slot in slots:
                if alive >> slot & 1 and not still >> slot & 1:
                    out[slot] = depth
            alive = still
            if not alive:
                return out
            depth += 1
        for slot in slots:
            if alive >> slot & 1:
                out[slot] = depth
        return out

    def insert(self, names: Sequence[int], slot: int) -> None:
        """Worker ``slot`` was sent a prompt with these chunk names; evicts the least recent nodes past the bound."""
        bit = 1 << slot
        nodes = self._nodes
        added = 0
        for name in names:
            mask = nodes.get(name, 0)
            if not mask & bit:
                nodes[name] = mask | bit
                added += 1
            nodes.move_to_end(name)
        if added:
            self._held[slot] = self._held.get(slot, 0) + added
        while len(nodes) > self.max_entries:
            _, mask = nodes.popitem(last=False)
            self._forget(mask)
            self.evicted += 1

    def remove_worker(self, slot: int) -> None:
        """Forget every prefix sent to worker ``slot`` (it restarted or was replaced): one pass over the tree."""
        bit = 1 << slot
        nodes = self._nodes
        empty = []
        for name, mask in nodes.items():
            if mask & bit:
                rest = mask & ~bit
                if rest:
                    nodes[name] = rest
                else:
                    empty.append(name)
        for name in empty:
            del nodes[name]
        self._held.pop(slot, None)

    def _forget(self, mask: int) -> None:
        while mask:
            low = mask & -mask
            slot = low.bit_length() - 1
            self._held[slot] -= 1
            mask ^= low
