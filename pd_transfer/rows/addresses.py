"""Rows of bytes given by their addresses (:class:`RowAddresses`), and the widest integer element their alignment
allows (:data:`ELEMENT_TYPES`, :func:`widest_element`): the one width table both the kernel and torch's fallback
copy by.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

#: Element size in bytes -> the integer type a row is copied as, widest first (the kernel's type of the same width is
#: ``int{8 * size}``).
ELEMENT_TYPES: dict[int, torch.dtype] = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def widest_element(alignment: int) -> int:
    """The widest element size (8, 4, 2 or 1 bytes) dividing ``alignment`` (row sizes and addresses OR-ed together:
    the size divides each of them exactly when it divides the OR; 0 gives 8)."""
    return next(size for size in ELEMENT_TYPES if alignment % size == 0)


@dataclass(frozen=True)
class RowAddresses:
    """Rows of ``row_bytes`` bytes to copy: ``sources[i]`` to ``targets[i]`` (int64 addresses in this process,
    device addresses for CUDA memory), all in memory that stays alive and mapped until the copy completed. Targets
    must not overlap one another."""

    sources: np.ndarray
    targets: np.ndarray
    row_bytes: int

    def __post_init__(self) -> None:
        if self.sources.shape != self.targets.shape or self.sources.ndim != 1:
            raise ValueError(f"sources {self.sources.shape} and targets {self.targets.shape}: one address per row")
        if self.row_bytes <= 0:
            raise ValueError(f"row_bytes must be positive, got {self.row_bytes}")

    @property
    def rows(self) -> int:
        return len(self.sources)

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes

    def element_bytes(self) -> int:
        """The widest element (8, 4, 2 or 1 bytes) dividing the row size and every address."""
        every = np.bitwise_or.reduce(np.concatenate([self.sources, self.targets]).astype(np.int64)) if self.rows else 0
        return widest_element(int(every) | self.row_bytes)

    @classmethod
    def concat(cls, parts: list[RowAddresses]) -> RowAddresses:
        """One list of the rows of ``parts`` (all of one row size), in order."""
        sizes = {part.row_bytes for part in parts}
        if len(sizes) != 1:
            raise ValueError(f"rows of one size only, got {sorted(sizes)}")
        return cls(np.concatenate([p.sources for p in parts]), np.concatenate([p.targets for p in parts]), sizes.pop())
