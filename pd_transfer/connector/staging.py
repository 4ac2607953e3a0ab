"""The staging area of a decode rank: where staged plans land their reads before the fix-up.

Two halves of ``slots`` plane blocks each, registered with the rank's NIXL agent once. A staged pull
reads a chunk of (plane, block) pairs into one half while a worker thread scatters the other half's
chunk, regrouped and permuted, into its final blocks of the cache. Small enough to stay in the CPU
cache, so the cache itself is written once, as by a homogeneous read.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from pd_transfer.topology.postprocess import Restage, scatter_staged
from pd_transfer.transfer.agent import TransferAgent


class StagingArea:
    """``2 * slots`` staged plane blocks of ``plane_block_bytes`` each, in registered host memory."""

    def __init__(self, agent: TransferAgent, plane_block_bytes: int, half_bytes: int, dtype: torch.dtype) -> None:
        self.plane_block_bytes = plane_block_bytes
        self.slots = max(1, half_bytes // plane_block_bytes)  # per half
        self._buffer = torch.empty(2 * self.slots * plane_block_bytes, dtype=torch.uint8)
        start = self._buffer.data_ptr()
        agent.register_spans([(start, start + self._buffer.numel())])
        self.blocks = self._buffer.view(dtype).view(2 * self.slots, -1)  # one staged plane block per row

    def descriptor_rows(self, unit_offsets: np.ndarray, unit_bytes: int) -> np.ndarray:
        """Rows (address, unit_bytes, 0) of every unit in every slot; unit ``u`` of slot ``s`` is row
        ``s * len(unit_offsets) + u``, at byte ``unit_offsets[u]`` of the slot."""
        slot_starts = self._buffer.data_ptr() + np.arange(2 * self.slots, dtype=np.int64) * self.plane_block_bytes
        rows = np.zeros((2 * self.slots * len(unit_offsets), 3), dtype=np.uint64)
        rows[:, 0] = (slot_starts[:, None] + unit_offsets.astype(np.int64)[None, :]).ravel()
        rows[:, 1] = unit_bytes
        return rows

    def scatter(
        self,
        restage: Restage,
        plane_blocks: np.ndarray,
        half: int,
        planes: list[torch.Tensor],
        num_blocks: int,
    ) -> None:
        """Scatter the chunk in ``half``: its slot ``i`` holds (plane, block) ``plane_blocks[i]`` (encoded as
        ``plane * num_blocks + block``, sorted), written into ``planes`` in the local layout."""
        staged = self.blocks[half * self.slots : half * self.slots + len(plane_blocks)]
        plane_of = plane_blocks // num_blocks
        edges = np.flatnonzero(np.diff(plane_of)) + 1
        for first, end in itertools.pairwise([0, *edges.tolist(), len(plane_of)]):
            plane = planes[int(plane_of[first])]
            block_ids = torch.from_numpy(plane_blocks[first:end] % num_blocks)
            scatter_staged(plane.view(num_blocks, -1), block_ids, staged[first:end], restage)
