"""Free block ids of one stand-in engine's KV cache, taken and given back in whole requests."""

from __future__ import annotations

from collections.abc import Sequence


class BlockPool:
    """Free block ids of one cache."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def free(self) -> int:
        return len(self._free)

    def take(self, count: int) -> list[int] | None:
        """``count`` free block ids, lowest first, or None (nothing taken) when fewer are free."""
        if count > len(self._free):
            return None
        return [self._free.pop() for _ in range(count)]

    def give(self, block_ids: Sequence[int]) -> None:
        """Free ``block_ids`` again (ids taken before)."""
        self._free.extend(reversed(block_ids))
