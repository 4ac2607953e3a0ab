"""What a rank's paged KV cache looks like: shared by the handshake (on the wire) and the planner.

Vocabulary used throughout pd-transfer:

* A **region** is one registered tensor whose leading dimension is the block index: block ``i`` starts
  at ``base_address + i * block_stride`` and is ``block_len`` bytes long.
* A region holds one or more **planes**: the K part, the V part, both (K then V inside each block), or
  the MLA latent. A plane's block is ``block_len / len(kinds)`` bytes at offset
  ``kind_index * plane_block_len`` inside the region's block.
* Inside a plane block the elements are ``(heads, tokens, head_size)`` for layout ``HND`` or
  ``(tokens, heads, head_size)`` for ``NHD``; ``heads`` is this rank's share of the KV heads.
* A region's **memory** is ``"host"`` (CPU memory) or ``"cuda"`` (the memory of GPU ``device_index``, numbered as
  the owning process sees its devices). All regions of one rank's cache share one memory (:func:`memory_of`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal

import msgspec

if TYPE_CHECKING:
    import torch

#: Longest text a peer may send in a name field (bytes of UTF-8 are at most 4x this); enforced when decoding.
MAX_NAME_CHARS = 4096
#: Longest rendering of a peer's value in an error message or a log line.
MAX_ECHO_CHARS = 80

Name = Annotated[str, msgspec.Meta(max_length=MAX_NAME_CHARS)]
ShortName = Annotated[str, msgspec.Meta(max_length=64)]
Count = Annotated[int, msgspec.Meta(ge=0, le=1 << 40)]
Address = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]  # user-space addresses fit in 63 bits

KVLayout = Literal["HND", "NHD"]
PlaneKind = Literal["k", "v", "latent"]
MemoryKind = Literal["host", "cuda"]
DeviceIndex = Annotated[int, msgspec.Meta(ge=0, le=1023)]

#: Bytes per element of the dtypes a KV cache may use.
DTYPE_SIZES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint8": 1,
    "int8": 1,
}


class ModelFingerprint(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The facts two engines must agree on to share KV, whatever their parallelism or block size."""

    model: Name
    dtype: ShortName
    num_layers: Count
    total_num_kv_heads: Count
    head_size: Count
    use_mla: bool = False

    def differences(self, other: ModelFingerprint) -> list[str]:
        """Human-readable ``field: ours != theirs`` for every field that differs."""
        out = []
        for field in self.__struct_fields__:
            mine, theirs = getattr(self, field), getattr(other, field)
            if mine != theirs:
                out.append(f"{field}: {clipped(mine)} != {clipped(theirs)}")
        return out


def clipped(value: object, limit: int = MAX_ECHO_CHARS) -> str:
    """``repr(value)`` cut to ``limit`` characters, saying how long it was: for echoing a peer's value safely."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} chars)"


class KVCacheLayout(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How one TP rank holds the model's KV cache."""

    fingerprint: ModelFingerprint
    tp_size: Count
    tp_rank: Count
    block_size: Count  # tokens per block
    layout: KVLayout = "HND"
    #: Set when the elements inside each (block, head) follow an engine's own packing rather than ``layout``
    #: (e.g. ``"vllm-cpu-attn:vec"``): such blocks are copied whole between equal block sizes, and regrouped
    #: element by element (:mod:`pd_transfer.topology.packed`) when block sizes differ. Both sides must name the
    #: same packing.
    packing: ShortName | None = None

    @property
    def element_size(self) -> int:
        """Bytes per element."""
        try:
            return DTYPE_SIZES[self.fingerprint.dtype]
        except KeyError:
            raise ValueError(f"unsupported KV dtype {self.fingerprint.dtype!r}") from None

    @property
    def num_local_heads(self) -> int:
        """KV heads held by this rank (1 for MLA; replicated heads when tp_size > total heads)."""
        if self.fingerprint.use_mla:
            return 1
        return max(1, self.fingerprint.total_num_kv_heads // self.tp_size)

    @property
    def first_global_head(self) -> int:
        """Global index of this rank's first KV head (0 for MLA)."""
        heads = self.fingerprint.total_num_kv_heads
        if self.fingerprint.use_mla:
            return 0
        if self.tp_size <= heads:
            return self.tp_rank * (heads // self.tp_size)
        return self.tp_rank // (self.tp_size // heads)

    @property
    def plane_block_elements(self) -> int:
        """Elements in one block of one plane: heads * tokens * head_size."""
        return self.num_local_heads * self.block_size * self.fingerprint.head_size

    @property
    def plane_block_bytes(self) -> int:
        return self.plane_block_elements * self.element_size


class KVRegion(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One registered block-indexed tensor of a rank's cache (addresses in the owner's process)."""

    layer: Count
    kinds: Annotated[tuple[PlaneKind, ...], msgspec.Meta(max_length=3)]  # ("k",), ("v",), ("k", "v"), ("latent",)
    base_address: Address  # bytes
    num_blocks: Count
    block_len: Count  # bytes of one block, all kinds together
    block_stride: Count  # bytes between the starts of consecutive blocks
    memory: MemoryKind = "host"  # where the bytes are: host memory, or the GPU ``device_index``
    device_index: DeviceIndex = 0  # the GPU, as the owner's process numbers them (0 for host memory)

    @property
    def place(self) -> MemoryPlace:
        """Where this region's bytes are."""
        return MemoryPlace(self.memory, self.device_index)

    @property
    def plane_block_len(self) -> int:
        return self.block_len // len(self.kinds)

    @property
    def span_bytes(self) -> int:
        """Bytes from the first block's start to the last block's end."""
        if self.num_blocks == 0:
            return 0
        return (self.num_blocks - 1) * self.block_stride + self.block_len


class MemoryPlace(msgspec.Struct, frozen=True):
    """Where a cache's bytes are: host memory (``device_index`` 0), or GPU ``device_index`` of the owning process."""

    memory: MemoryKind = "host"
    device_index: int = 0

    @property
    def is_host(self) -> bool:
        return self.memory == "host"

    def __str__(self) -> str:
        return "host" if self.memory == "host" else f"cuda:{self.device_index}"


HOST = MemoryPlace()


def memory_of(regions: list[KVRegion]) -> MemoryPlace:
    """The one memory every region is in (host for no regions); ``ValueError`` naming two regions that differ."""
    if not regions:
        return HOST
    first = regions[0].place
    for region in regions[1:]:
        if region.place != first:
            raise ValueError(
                f"a cache's regions must share one memory: layer {regions[0].layer} is in {first},"
                f" layer {region.layer} in {region.place}"
            )
    return first


def place_of_tensor(tensor: torch.Tensor) -> MemoryPlace:
    """The memory ``tensor`` is in; ``ValueError`` for devices other than the CPU and CUDA GPUs."""
    device = tensor.device
    if device.type == "cpu":
        return HOST
    if device.type == "cuda":
        return MemoryPlace("cuda", 0 if device.index is None else device.index)
    raise ValueError(f"KV caches live in host or CUDA memory, not on {device}")


class Plane(msgspec.Struct, frozen=True):
    """One (layer, kind) of a cache, as an address pattern: block ``i`` of the plane starts at
    ``base_address + i * block_stride`` and is ``block_len`` bytes."""

    layer: int
    kind: PlaneKind
    base_address: int
    num_blocks: int
    block_len: int
    block_stride: int


def planes_of(regions: list[KVRegion]) -> list[Plane]:
    """The planes of a cache, ordered by (layer, kind) so both sides of a transfer list them alike."""
    planes = [
        Plane(
            layer=region.layer,
            kind=kind,
            base_address=region.base_address + index * region.plane_block_len,
            num_blocks=region.num_blocks,
            block_len=region.plane_block_len,
            block_stride=region.block_stride,
        )
        for region in regions
        for index, kind in enumerate(region.kinds)
    ]
    order = {"k": 0, "v": 1, "latent": 2}
    planes.sort(key=lambda plane: (plane.layer, order[plane.kind]))
    return planes


def region_from_tensor(tensor: torch.Tensor, layer: int, kinds: tuple[PlaneKind, ...]) -> KVRegion:
    """Describe a tensor whose dim 0 is the block index and whose blocks are each contiguous, in host or CUDA memory
    (its memory and device are the tensor's)."""
    if tensor.dim() < 2:
        raise ValueError(f"a KV region needs a block dimension and block contents, got shape {tuple(tensor.shape)}")
    block = tensor[0]
    if not block.is_contiguous():
        raise ValueError(f"layer {layer} {kinds}: each block must be contiguous in memory (strides {tensor.stride()})")
    element_size = tensor.element_size()
    place = place_of_tensor(tensor)
    return KVRegion(
        layer=layer,
        kinds=kinds,
        base_address=tensor.data_ptr(),
        num_blocks=tensor.shape[0],
        block_len=block.numel() * element_size,
        block_stride=tensor.stride(0) * element_size,
        memory=place.memory,
        device_index=place.device_index,
    )
