"""vLLM's GPU KV cache tensors described as pd-transfer regions, without importing vLLM (so CPU tensors of the same
shapes test it in CI, and :mod:`.vllm.gpu_cache` only reads vLLM's config around it).

Formats (per layer, as vLLM hands them to ``register_kv_caches``; ``B`` blocks, ``N`` tokens a block, ``H`` this
rank's KV heads, ``D`` the head size):

* ``"paged"``: vLLM 0.31 and 0.32, every attention backend (FlashAttention, FlashInfer, Triton, MLA): one logical
  ``[B, H, N, C]`` view whose memory order is the engine's ``KVCacheLayout`` (``LBNHC``: NHD, ``LBHNC``: HND; the
  ``BL..`` layouts interleave the layers inside a block, which only widens the block stride). ``C`` is K then V of
  one (token, head), ``2 * D`` elements, for attention (described as one plane, kind ``"k"``, of head size ``2 * D``:
  K and V of a (token, head) move as one, and head slicing, block regrouping and HND <-> NHD stay right); for MLA,
  ``H`` is 1 and ``C`` the latent (kind ``"latent"``).
* ``"flash-attn"``: ``(2, B, N, H, D)``, K and V first (older vLLM): two regions a layer, kinds ``("k",)`` and
  ``("v",)``.
* ``"flashinfer"``: ``(B, 2, N, H, D)``: one region a layer, kinds ``("k", "v")``.
* ``"mla-latent"``: ``(B, N, kv_lora_rank + rope_dim)``: kind ``("latent",)``.

NHD or HND is read from the strides (a tensor may be a permuted view, as vLLM allocates HND caches); a size-1 head
or token axis makes the two the same bytes, described as NHD. A block must be contiguous once its axes are put in
memory order (``BHLNC`` is refused). The region tensors of the resulting :class:`KVCache` are views of the
engine's memory in memory order: ``(B, N, H, D)`` / ``(B, H, N, D)``, ``(B, 2, ...)`` for ``"flashinfer"``,
``(B, N, 1, latent)`` for ``"mla-latent"``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from pd_transfer.connector.cache import KVCache
from pd_transfer.spec import DTYPE_SIZES, KVCacheLayout, KVLayout, ModelFingerprint, PlaneKind

CacheFormat = Literal["paged", "flash-attn", "flashinfer", "mla-latent"]

#: each format's logical axes: ``kv`` K/V, ``B`` block, ``N`` token, ``H`` head, ``D`` content
_AXES: dict[CacheFormat, str] = {"paged": "BHND", "flash-attn": "kBNHD", "flashinfer": "BkNHD", "mla-latent": "BND"}
_SHAPES: dict[CacheFormat, str] = {
    "paged": "[num_blocks, heads, block_size, 2*head_size or latent]",
    "flash-attn": "(2, num_blocks, block_size, heads, head_size)",
    "flashinfer": "(num_blocks, 2, block_size, heads, head_size)",
    "mla-latent": "(num_blocks, block_size, latent)",
}


class AmbiguousCacheShape(ValueError):
    """A cache tensor's shape fits more than one format: name the format explicitly."""


@dataclass(frozen=True)
class CacheGeometry:
    """What the model and the engine say one TP rank's cache holds. ``head_size``: elements of one head's K (= V);
    for MLA the latent, ``kv_lora_rank + rope_dim``."""

    model: str
    total_num_kv_heads: int
    head_size: int
    use_mla: bool
    block_size: int  # tokens a block
    tp_size: int = 1
    tp_rank: int = 0

    @property
    def local_heads(self) -> int:
        """KV heads one rank holds (1 for MLA; replicated heads when TP exceeds them)."""
        return 1 if self.use_mla else max(1, self.total_num_kv_heads // self.tp_size)

    def formats(self) -> tuple[CacheFormat, ...]:
        """The formats a cache of this model can have."""
        return ("paged", "mla-latent") if self.use_mla else ("paged", "flash-attn", "flashinfer")

    def expected_sizes(self, cache_format: CacheFormat) -> dict[str, int]:
        """The size of each axis of ``cache_format`` but the block count."""
        content = self.head_size if self.use_mla or cache_format != "paged" else 2 * self.head_size
        return {"k": 2, "N": self.block_size, "H": self.local_heads, "D": content}


def describe_cache_layout(
    kv_caches: Mapping[str, torch.Tensor],
    geometry: CacheGeometry,
    *,
    cache_format: CacheFormat | None = None,
    order: KVLayout | None = None,
) -> tuple[KVCacheLayout, KVCache]:
    """The layout and cache of one TP rank's ``kv_caches`` (layer name -> tensor, any device), regions ordered by
    layer index (:func:`layer_indices`).

    ``cache_format``: the tensors' format (None: inferred from the first tensor's shape, see :func:`infer_format`).
    ``order``: NHD or HND as the engine states it (None: read from the strides; given, it must agree with them).
    Raises ``ValueError`` (:class:`AmbiguousCacheShape` where several formats fit) for no tensors, a shape that is
    not the format's for this geometry, tensors that differ from the first in shape, dtype, device or memory order,
    a dtype pd-transfer does not move, or blocks that are not contiguous in memory.
    """
    if not kv_caches:
        raise ValueError("no KV cache tensors to register")
    names = list(kv_caches)
    first = kv_caches[names[0]]
    fmt = cache_format if cache_format is not None else infer_format(tuple(first.shape), geometry)
    _check_shape(names[0], first, fmt, geometry)
    found = _memory_order(first, fmt)
    if order is not None and found is not None and order != found:
        raise ValueError(f"the engine says its KV cache is {order}, but layer {names[0]}'s strides make it {found}")
    layout = _layout(geometry, fmt, first.dtype, len(names), order or found or "NHD")
    tensors: list[torch.Tensor] = []
    kinds: list[tuple[str, ...]] = []
    layers: list[int] = []
    for layer, name in sorted(zip(layer_indices(names), names, strict=True)):
        tensor = kv_caches[name]
        if tensor.shape != first.shape or tensor.dtype != first.dtype or tensor.device != first.device:
            raise ValueError(
                f"KV cache of layer {name} differs from {names[0]}: {tuple(tensor.shape)} {tensor.dtype} on"
                f" {tensor.device}, not {tuple(first.shape)} {first.dtype} on {first.device}"
            )
        if _memory_order(tensor, fmt) not in (found, None):
            raise ValueError(f"KV cache of layer {name} is not in {names[0]}'s memory order ({found})")
        for view, kind in _region_views(tensor, fmt, layout.layout, geometry.use_mla):
            _check_block_contiguous(name, fmt, view)
            tensors.append(view)
            kinds.append(kind)
            layers.append(layer)
    return layout, KVCache.from_tensors(layout, tensors, kinds, layers)


def infer_format(shape: tuple[int, ...], geometry: CacheGeometry) -> CacheFormat:
    """The one format of :attr:`CacheGeometry.formats` whose shape ``shape`` has (any block count). Raises
    :class:`AmbiguousCacheShape` when several fit (a ``(2, 2, ...)`` tensor of FlashAttention or FlashInfer),
    ``ValueError`` naming the expected shapes when none does."""
    fits = [fmt for fmt in geometry.formats() if _shape_fits(shape, fmt, geometry)]
    if len(fits) == 1:
        return fits[0]
    if fits:
        raise AmbiguousCacheShape(f"a KV cache tensor of shape {shape} could be any of {fits}: name its format")
    expected = "; ".join(f"{fmt} {_SHAPES[fmt]}" for fmt in geometry.formats())
    raise ValueError(
        f"unexpected KV cache tensor {shape} for block_size {geometry.block_size}, {geometry.local_heads} KV"
        f" head(s) of {geometry.head_size} a rank{' (MLA)' if geometry.use_mla else ''}: expected {expected}"
    )


def block_rows(tensor: torch.Tensor) -> torch.Tensor:
    """A ``(num_blocks, block_bytes)`` uint8 view of a tensor whose dim 0 is the block index, its other axes put
    in memory order (vLLM's ``paged`` layer views, whatever the ``KVCacheLayout``); rows may be further apart
    than their length. Raises ``ValueError`` when a block is not contiguous in memory."""
    inner = sorted(range(1, tensor.dim()), key=lambda axis: -int(tensor.stride()[axis]))
    if tensor.dim() < 2 or not tensor.permute(0, *inner)[0].is_contiguous():
        raise ValueError(f"a block of a {tuple(tensor.shape)} tensor of strides {tensor.stride()} is not contiguous")
    size = tensor.element_size()
    rows = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    shape, strides = (tensor.shape[0], tensor[0].numel() * size), (tensor.stride(0) * size, 1)
    return rows.set_(tensor.untyped_storage(), tensor.storage_offset() * size, shape, strides)


def layer_indices(names: Sequence[str]) -> list[int]:
    """The layer index of each name (the first ``.<number>.`` in it: ``model.layers.3.self_attn.attn`` -> 3), or
    ``0..len(names)-1`` if the names do not give distinct indices."""
    layers = [_layer_index(name, index) for index, name in enumerate(names)]
    return layers if len(set(layers)) == len(layers) else list(range(len(names)))


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def order_of_vllm_layout(name: str | None) -> KVLayout | None:
    """NHD or HND from the name of vLLM's ``KVCacheLayout`` (``LBNHC`` -> NHD, ``LBHNC`` -> HND), or from its legacy
    names ``NHD`` / ``HND``; None when not given."""
    if not name:
        return None
    letters = name.upper()
    if letters in ("NHD", "HND"):
        return letters  # type: ignore[return-value]
    if "N" not in letters or "H" not in letters:
        raise ValueError(f"unknown KV cache layout name {name[:16]!r}")
    return "NHD" if letters.index("N") < letters.index("H") else "HND"


# ---------------------------------------------------------------------------------------------- internals
def _layer_index(name: str, fallback: int) -> int:
    numbers = re.findall(r"\.(\d+)\.", f".{name}.")
    return int(numbers[0]) if numbers else fallback


def _shape_fits(shape: tuple[int, ...], fmt: CacheFormat, geometry: CacheGeometry) -> bool:
    axes = _AXES[fmt]
    sizes = geometry.expected_sizes(fmt)
    if len(shape) != len(axes):
        return False
    return all(axis == "B" or size == sizes[axis] for axis, size in zip(axes, shape, strict=True))


def _check_shape(name: str, tensor: torch.Tensor, fmt: CacheFormat, geometry: CacheGeometry) -> None:
    if fmt not in geometry.formats():
        raise ValueError(f"format {fmt!r} does not hold a{' MLA' if geometry.use_mla else 'n attention'} cache")
    if not _shape_fits(tuple(tensor.shape), fmt, geometry):
        sizes = geometry.expected_sizes(fmt)
        raise ValueError(
            f"KV cache of layer {name} is {tuple(tensor.shape)}, not {fmt} {_SHAPES[fmt]} with block_size"
            f" {sizes['N']}, {sizes['H']} head(s) and {sizes['D']} elements a head"
        )


def _memory_order(tensor: torch.Tensor, fmt: CacheFormat) -> KVLayout | None:
    """NHD or HND by the strides of the token and head axes; None when one of them has size 1 (the same bytes)."""
    axes = _AXES[fmt]
    if "H" not in axes:
        return None
    tokens, heads = axes.index("N"), axes.index("H")
    if tensor.shape[tokens] == 1 or tensor.shape[heads] == 1:
        return None
    return "HND" if tensor.stride(heads) > tensor.stride(tokens) else "NHD"


def _layout(
    geometry: CacheGeometry, fmt: CacheFormat, dtype: torch.dtype, num_layers: int, order: KVLayout
) -> KVCacheLayout:
    name = dtype_name(dtype)
    if name not in DTYPE_SIZES:
        raise ValueError(f"KV cache dtype {name} is not one pd-transfer moves ({', '.join(DTYPE_SIZES)})")
    fingerprint = ModelFingerprint(
        model=geometry.model,
        dtype=name,
        num_layers=num_layers,
        total_num_kv_heads=1 if geometry.use_mla else geometry.total_num_kv_heads,
        head_size=geometry.expected_sizes(fmt)["D"],  # paged attention: K and V of a (token, head) as one
        use_mla=geometry.use_mla,
    )
    return KVCacheLayout(fingerprint, geometry.tp_size, geometry.tp_rank, geometry.block_size, order)


def _region_views(
    tensor: torch.Tensor, fmt: CacheFormat, order: KVLayout, use_mla: bool
) -> list[tuple[torch.Tensor, tuple[PlaneKind, ...]]]:
    """The layer's region tensors in memory order, with their kinds."""
    hnd = order == "HND"
    if fmt == "paged":
        view = tensor if hnd else tensor.permute(0, 2, 1, 3)
        return [(view, ("latent",) if use_mla else ("k",))]
    if fmt == "flash-attn":
        key, value = (tensor[index].permute(0, 2, 1, 3) if hnd else tensor[index] for index in range(2))
        return [(key, ("k",)), (value, ("v",))]
    if fmt == "flashinfer":
        return [(tensor.permute(0, 1, 3, 2, 4) if hnd else tensor, ("k", "v"))]
    return [(tensor.unsqueeze(2), ("latent",))]


def _check_block_contiguous(name: str, fmt: CacheFormat, view: torch.Tensor) -> None:
    if not view[0].is_contiguous():
        raise ValueError(
            f"KV cache of layer {name} ({fmt}, strides {view.stride()} in memory order): a block is not contiguous"
            " in memory (a layout that puts heads or layers between a block's tokens is not supported)"
        )
