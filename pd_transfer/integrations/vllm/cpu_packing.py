"""How vLLM's CPU attention backend packs K and V inside a block, measured with vLLM's own kernel.

Each (block, head) of a ``CPU_ATTN`` layer holds a K half then a V half of ``block_size * head_size`` elements
each, in an order that depends on the attention ISA and the dtype (float32 ``vec``: K dim-major, V
token-major; bfloat16 ``amx``: tiled). Nothing here hard-codes those orders: :func:`measure_packing` runs
``cpu_attn_reshape_and_cache`` on numbered vectors and reads back where each element went.

vLLM is imported only inside the functions that need it (a worker process, when registering or measuring).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

from pd_transfer.spec import KVCacheLayout
from pd_transfer.topology.packed import PackedBlockFormat

logger = logging.getLogger(__name__)

#: Prefix of :attr:`KVCacheLayout.packing` for vLLM's CPU cache; the attention ISA follows it
PACKING_PREFIX = "vllm-cpu-attn:"

#: Digits of the numbers written into probe vectors: exact in every float type the CPU cache uses
_PROBE_BASE = 64


def attention_isa(dtype: torch.dtype, block_size: int, head_size: int, cache_dtype: str | None) -> str:
    """The CPU attention backend's ISA for this cache (``"vec"``, ``"amx"``, ...), which fixes the packing of
    K and V inside a block and so whether blocks are portable byte for byte; ``"unknown"`` (with a warning)
    when vLLM's private helper cannot be called."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        return str(_get_attn_isa(dtype, block_size, head_size, cache_dtype))
    except Exception as error:  # private helper: keep working if it moves, but say so
        logger.warning("could not determine the CPU attention ISA (%s); fingerprint says 'unknown'", error)
        return "unknown"


def measure_packing(isa: str, dtype: torch.dtype, block_size: int, head_size: int) -> PackedBlockFormat:
    """Where vLLM's CPU attention kernel of ``isa`` puts each K and V element of a (block, head) of
    ``block_size`` tokens of ``head_size`` ``dtype`` elements.

    Numbered vectors go through ``cpu_attn_reshape_and_cache`` into a one-block, one-head cache (a digit in
    base 64 per pass, so the numbers stay exact in bfloat16), and their positions are read back. The result's
    K and V offsets are ``[block_size, head_size]`` int64 element offsets into the (block, head) chunk of
    ``2 * block_size * head_size`` elements. Raises ``RuntimeError`` if the kernel leaves elements unwritten.
    """
    key = _measure_half(0, isa, dtype, block_size, head_size)
    value = _measure_half(1, isa, dtype, block_size, head_size)
    return PackedBlockFormat(block_size, head_size, key, value)


def _measure_half(half: int, isa: str, dtype: torch.dtype, block_size: int, head_size: int) -> torch.Tensor:
    """``[block_size, head_size]`` int64: the chunk offset of each (token, dim) element of the K (``half``
    0) or V (1) half."""
    elements = block_size * head_size
    number_at = torch.zeros(elements, dtype=torch.int64)  # the number found at each offset of the half
    for digit in range(_passes(elements)):
        number_at += _written_digits(half, digit, isa, dtype, block_size, head_size) * _PROBE_BASE**digit
    position = torch.empty(elements, dtype=torch.int64)
    position[number_at] = torch.arange(elements) + half * elements
    return position.view(block_size, head_size)


def _passes(elements: int) -> int:
    """Base-:data:`_PROBE_BASE` digits needed to number ``elements`` elements (at least one)."""
    passes = 1
    while _PROBE_BASE**passes < elements:
        passes += 1
    return passes


def _written_digits(
    half: int, digit: int, isa: str, dtype: torch.dtype, block_size: int, head_size: int
) -> torch.Tensor:
    """One probe pass: digit ``digit`` of each element's number written through the kernel into the K
    (``half`` 0) or V (1) half of a fresh one-block cache; returns the half as ``[block_size * head_size]``
    int64, in memory order."""
    from vllm import _custom_ops as ops

    elements = block_size * head_size
    numbers = ((torch.arange(elements) // _PROBE_BASE**digit) % _PROBE_BASE).to(dtype)
    probe = numbers.view(block_size, 1, head_size)
    zero = torch.zeros_like(probe)
    cache = torch.full((1, 1, 2 * block_size, head_size), -1, dtype=dtype)
    key_cache, value_cache = cache.chunk(2, dim=2)
    key, value = (probe, zero) if half == 0 else (zero, probe)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, torch.arange(block_size), isa)
    written = cache.view(-1)[half * elements : (half + 1) * elements].to(torch.int64)
    if bool((written < 0).any()):
        raise RuntimeError(f"the {isa} kernel left parts of a {block_size}-token block unwritten")
    return written


def packed_format_source(
    layout: KVCacheLayout, dtype: torch.dtype, cache_dtype: str | None
) -> Callable[[int], PackedBlockFormat] | None:
    """The packing of any block size for a cache described by ``layout`` (packing ``vllm-cpu-attn:<isa>``,
    head size ``2 * head_size``) holding ``dtype``: measured once per block size, then cached. ``None`` for
    quantised caches (``cache_dtype`` other than ``None``/``"auto"``): those move between equal block sizes only.
    """
    if cache_dtype not in (None, "auto"):
        return None
    isa = (layout.packing or "").removeprefix(PACKING_PREFIX)
    head_size = layout.fingerprint.head_size // 2

    @functools.cache
    def packed_format(block_size: int) -> PackedBlockFormat:
        return measure_packing(isa, dtype, block_size, head_size)

    return packed_format
