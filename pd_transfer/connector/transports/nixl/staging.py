"""The staging area of a decode rank: where staged plans land their reads before the fix-up.

``groups`` slot groups of ``slots`` plane blocks each, in one buffer on the cache's device, registered with the
rank's NIXL agent once (host memory is mirrored on its read lanes; a GPU's is registered as its VRAM and read by the
agent alone). A staged pull hands each read lane groups of its own: the lane reads a chunk of (plane, block) pairs
into one of them and scatters it, regrouped and permuted, into its final blocks of the cache right away, on the same
thread, while the other lanes read theirs. A group is small enough
to stay in the core's cache between the read and the scatter, so the cache itself is written once, as by a
homogeneous read. On an accelerator the scatter is queued on the lane's stream (:class:`~.slot_fences.SlotFences`),
and a lane reads into a group again only once the scatter that last read from it has finished.
"""

from __future__ import annotations

import numpy as np
import torch

from pd_transfer.spec import place_of_tensor
from pd_transfer.topology.plan import SourcePlan
from pd_transfer.topology.postprocess import Restage, RunScatter
from pd_transfer.transfer.agent_protocol import Agent

from .slot_fences import SlotFences

#: Slot groups of a staging area: enough for the default read lanes (and their owner) on any device.
STAGING_GROUPS = 8


class StagingArea:
    """``groups`` slot groups of ``slots`` staged plane blocks of ``plane_block_bytes`` each, on ``device``,
    registered with ``agent``.

    ``group_bytes`` is the most a group holds (at least one plane block). Slot ``s`` of group ``g`` is row
    ``g * slots + s`` of :attr:`blocks`. ``fences`` order the reads into a group after the scatter that last read
    from it (trivial on the CPU, where the scatter runs before the lane reads again).
    """

    def __init__(
        self,
        agent: Agent,
        plane_block_bytes: int,
        group_bytes: int,
        dtype: torch.dtype,
        *,
        groups: int = STAGING_GROUPS,
        device: torch.device | str = "cpu",
    ) -> None:
        self.plane_block_bytes = plane_block_bytes
        self.slots = max(1, group_bytes // plane_block_bytes)  # per group
        self.groups = groups
        self.device = torch.device(device)
        self._buffer = torch.empty(groups * self.slots * plane_block_bytes, dtype=torch.uint8, device=self.device)
        self.place = place_of_tensor(self._buffer)  # host memory, or a GPU's (read by the agent alone, not lanes)
        start = self._buffer.data_ptr()
        agent.register_spans([(start, start + self._buffer.numel())], place=self.place)
        self.blocks = self._buffer.view(dtype).view(groups * self.slots, -1)  # one staged plane block per row
        self.fences = SlotFences(self.device, groups)
        self._scatters: dict[tuple[Restage, int], tuple[list[torch.Tensor], RunScatter]] = {}

    def source_rows(self, source: SourcePlan, first_plane_address: int) -> np.ndarray:
        """:meth:`descriptor_rows` of ``source``'s units: where its local grid puts them in a plane block (the grid's
        first ``local_units_per_block`` rows, block 0 of the first plane, which starts at ``first_plane_address``)."""
        unit_offsets = source.local_grid[: source.local_units_per_block, 0].astype(np.int64) - first_plane_address
        return self.descriptor_rows(unit_offsets, source.unit_bytes)

    def descriptor_rows(self, unit_offsets: np.ndarray, unit_bytes: int) -> np.ndarray:
        """Rows (address, unit_bytes, 0) of every unit in every slot; unit ``u`` of slot ``s`` (counted over all
        groups) is row ``s * len(unit_offsets) + u``, at byte ``unit_offsets[u]`` of the slot."""
        all_slots = self.groups * self.slots
        slot_starts = self._buffer.data_ptr() + np.arange(all_slots, dtype=np.int64) * self.plane_block_bytes
        rows = np.zeros((all_slots * len(unit_offsets), 3), dtype=np.uint64)
        rows[:, 0] = (slot_starts[:, None] + unit_offsets.astype(np.int64)[None, :]).ravel()
        rows[:, 1] = unit_bytes
        return rows

    def scatter_for(self, restage: Restage, planes: list[torch.Tensor]) -> RunScatter:
        """The scatter of this area's slots into ``planes`` (num_blocks, ...) by ``restage`` (prepared once per plan
        and cache: the same ``planes`` list each time)."""
        key = (restage, id(planes))
        known = self._scatters.get(key)
        if known is not None and known[0] is planes:
            return known[1]
        runs = RunScatter([plane.view(plane.shape[0], -1) for plane in planes], self.blocks, restage)
        self._scatters[key] = (planes, runs)  # the list is kept: its id is not reused while it is a key
        return runs

    def scatter(
        self, runs: RunScatter, group: int, segments: list[tuple[int, int, int]], block_ids: torch.Tensor
    ) -> None:
        """Scatter the chunk in ``group`` with ``runs`` (:meth:`scatter_for`): its slots ``first:end`` hold blocks
        ``block_ids[first:end]`` (int64, on the planes' device) of plane ``plane``, for each ``(plane, first,
        end)`` of ``segments``. On an accelerator the work is queued on the current stream."""
        for plane, first, end in segments:
            runs(plane, block_ids[first:end], group * self.slots + first)
