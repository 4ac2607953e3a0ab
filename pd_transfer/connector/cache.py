"""A rank's paged KV cache as tensors plus their region descriptions, in host memory or on one GPU."""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

from pd_transfer.same_host import shareable_host_buffer
from pd_transfer.spec import KVCacheLayout, KVRegion, MemoryPlace, memory_of, region_from_tensor
from pd_transfer.transfer.huge_pages import advise_huge_pages


@dataclass
class KVCache:
    """The tensors a rank registers, with ``regions[i]`` describing ``tensors[i]`` (dim 0: block), all in one memory
    (host, or one GPU)."""

    layout: KVCacheLayout
    tensors: list[torch.Tensor]
    regions: list[KVRegion]

    def __post_init__(self) -> None:
        memory_of(self.regions)  # raises ValueError for a cache spread over several memories

    @property
    def place(self) -> MemoryPlace:
        """Where the cache's bytes are."""
        return memory_of(self.regions)

    @property
    def num_blocks(self) -> int:
        return self.regions[0].num_blocks

    @property
    def nbytes(self) -> int:
        return sum(region.num_blocks * region.block_len for region in self.regions)

    @classmethod
    def from_tensors(
        cls, layout: KVCacheLayout, tensors: list[torch.Tensor], kinds: list[tuple[str, ...]], layers: list[int]
    ) -> KVCache:
        """Describe existing engine tensors: ``tensors[i]`` holds ``kinds[i]`` of layer ``layers[i]``."""
        regions = [region_from_tensor(t, layer, k) for t, layer, k in zip(tensors, layers, kinds, strict=True)]  # type: ignore[arg-type]
        return cls(layout=layout, tensors=tensors, regions=regions)

    @classmethod
    def allocate(
        cls,
        layout: KVCacheLayout,
        num_blocks: int,
        *,
        kv_split: bool = True,
        device: str | torch.device = "cpu",
        shareable: bool = False,
        huge_pages: bool = True,
    ) -> KVCache:
        """A zeroed cache shaped like an engine's, on ``device`` (host memory by default: in huge pages, or, with
        ``shareable``, in a memfd that same-host readers may map): per layer, K and V as separate block-indexed
        tensors (``kv_split``) or one tensor with K and V inside each block; MLA: one latent per layer. Host memory
        starts in huge pages unless ``huge_pages`` is False (``Settings.own_huge_pages``, :func:`zeroed_host_tensor`).

        Block shape: (heads, block_size, head_size) for HND, (block_size, heads, head_size) for NHD. A layout
        with a ``packing`` gets one tensor per layer (kind ``"k"``), each (block, head) of ``block_size *
        head_size`` elements packed as the engine packs it (both K and V: ``head_size`` counts both), as vLLM's
        CPU caches are described.
        """
        fp = layout.fingerprint
        dtype = getattr(torch, fp.dtype)
        heads, tokens, dim = layout.num_local_heads, layout.block_size, fp.head_size
        block_shape = (heads, tokens, dim) if layout.layout == "HND" else (tokens, heads, dim)
        tensors: list[torch.Tensor] = []
        kinds: list[tuple[str, ...]] = []
        layers: list[int] = []

        def zeroed(shape: tuple[int, ...]) -> torch.Tensor:
            if torch.device(device).type != "cpu":
                return torch.zeros(shape, dtype=dtype, device=device)
            if shareable:
                nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
                return shareable_host_buffer(nbytes).view(dtype).view(shape)
            return zeroed_host_tensor(shape, dtype, huge_pages)

        if fp.use_mla or layout.packing is not None:
            storage = zeroed((fp.num_layers, num_blocks, *block_shape))
            for layer in range(fp.num_layers):
                tensors.append(storage[layer])
                kinds.append(("latent",) if fp.use_mla else ("k",))
                layers.append(layer)
        elif kv_split:
            storage = zeroed((fp.num_layers, 2, num_blocks, *block_shape))
            for layer in range(fp.num_layers):
                for index, kind in enumerate(("k", "v")):
                    tensors.append(storage[layer, index])
                    kinds.append((kind,))
                    layers.append(layer)
        else:
            storage = zeroed((fp.num_layers, num_blocks, 2, *block_shape))
            for layer in range(fp.num_layers):
                tensors.append(storage[layer])
                kinds.append(("k", "v"))
                layers.append(layer)
        return cls.from_tensors(layout, tensors, kinds, layers)


_HUGE_PAGE_BYTES = 2 * 2**20


def zeroed_host_tensor(shape: tuple[int, ...], dtype: torch.dtype, huge_pages: bool = True) -> torch.Tensor:
    """A zeroed CPU tensor whose memory was advised to use huge pages (unless ``huge_pages`` is False) before it was
    first written, so that it is in huge pages from the start (registering it then has nothing to collapse; see
    ``transfer.huge_pages``). The memory is a private anonymous mapping of its own, from a huge-page boundary: the
    allocator may hand out heap memory this process wrote before, whose small pages no advice changes (seen after a
    long test run)."""
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    mapping = mmap.mmap(-1, nbytes + _HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps the mapping alive as long as any view of it
    offset = -raw.data_ptr() % _HUGE_PAGE_BYTES
    tensor = raw[offset : offset + nbytes].view(dtype).view(shape)
    if huge_pages:
        advise_huge_pages([(tensor.data_ptr(), tensor.data_ptr() + nbytes)])
    return tensor.zero_()
