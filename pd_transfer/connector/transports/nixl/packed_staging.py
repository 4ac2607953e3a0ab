"""Where a decode rank lands packed blocks of another block size before regrouping them.

Caches whose blocks are packed by the engine (:attr:`KVCacheLayout.packing`) cannot be read into place
across block sizes. Such a pull reads whole remote (block, head) chunks, exactly as a homogeneous pull would,
into a registered staging cache shaped like the local cache but with the remote block size, then
:class:`~pd_transfer.topology.packed.PackedRegroup` writes them into the local blocks.
"""

from __future__ import annotations

import msgspec
import torch

from pd_transfer.connector.cache import KVCache
from pd_transfer.spec import KVCacheLayout
from pd_transfer.topology.packed import PackedBlockFormat, PackedRegroup
from pd_transfer.transfer.agent_protocol import Agent


class PackedStaging:
    """``slots`` remote-sized blocks of every layer of a local cache, on the cache's device, registered with
    ``agent``.

    ``cache`` describes the staging area as a cache of ``slots`` blocks (the local layout with the remote
    block size), so the ordinary planner reads whole remote chunks into it; ``planes[i]`` is layer ``i``'s
    staging as (slots, heads, remote chunk elements), and ``local_planes[i]`` the local cache's layer ``i``
    as (num_blocks, heads, local chunk elements).
    """

    def __init__(
        self,
        agent: Agent,
        local: KVCache,
        remote_format: PackedBlockFormat,
        local_format: PackedBlockFormat,
        staging_bytes: int,
    ) -> None:
        layout = local.layout
        self.regroup = PackedRegroup(remote_format, local_format)
        self.layout: KVCacheLayout = msgspec.structs.replace(layout, block_size=remote_format.block_size)
        if any(len(region.kinds) != 1 for region in local.regions):
            raise ValueError("packed caches are described as one plane per layer")
        heads = layout.num_local_heads
        dtype = local.tensors[0].dtype
        slot_bytes = len(local.regions) * heads * remote_format.chunk_elements * local.tensors[0].element_size()
        per_group = self.regroup.remote_blocks_per_group
        self.slots = max(per_group, staging_bytes // slot_bytes // per_group * per_group)
        device = local.tensors[0].device
        buffer = torch.empty(
            (len(local.regions), self.slots, heads, remote_format.chunk_elements), dtype=dtype, device=device
        )
        self.planes = list(buffer.unbind(0))
        self.cache = KVCache.from_tensors(
            self.layout, self.planes, [("k",)] * len(self.planes), [region.layer for region in local.regions]
        )
        self.local_planes = [tensor.view(tensor.shape[0], heads, -1) for tensor in local.tensors]
        for plane in self.local_planes:
            if plane.shape[2] != local_format.chunk_elements:
                raise ValueError(
                    f"local blocks hold {plane.shape[2]} elements per head,"
                    f" the packing says {local_format.chunk_elements}"
                )
        self._buffer = buffer
        self.registration = agent.register_regions(self.cache.regions)

    @property
    def tokens_per_chunk(self) -> int:
        """Tokens one fill of the staging area carries (whole regroup groups)."""
        return self.slots // self.regroup.remote_blocks_per_group * self.regroup.group_tokens

    def regroup_into_place(self, local_block_ids: torch.Tensor, num_tokens: int) -> None:
        """Regroup the staged ``num_tokens`` tokens of every layer into ``local_block_ids``."""
        for staged, plane in zip(self.planes, self.local_planes, strict=True):
            self.regroup.apply(staged, plane, local_block_ids, num_tokens)
