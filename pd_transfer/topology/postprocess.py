"""In-place kernels that turn staged local blocks into the local KV layout (vectorised torch).

A *staged* local plane block (``num_heads x block_size x head_size`` elements) holds, for each head source in
head order, a region of ``num_heads_j x block_size x head_size`` elements starting where head ``local_head_j``
would start in an HND block. The region holds ``block_size / piece`` pieces back to back; piece ``p`` holds
tokens ``[p * piece, (p + 1) * piece)`` of the source's heads in the *remote* layout's order: ``(heads, piece,
head_size)`` for HND or ``(piece, heads, head_size)`` for NHD. :func:`restage_blocks` rewrites such blocks
into ``(heads, tokens, head_size)`` (HND) or ``(tokens, heads, head_size)`` (NHD): a head-order permute
(HND <-> NHD), a block-size regrouping (``piece < block_size``), or both at once.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pd_transfer.spec import KVLayout

#: Default bytes of blocks restaged at a time on the CPU: large enough to amortise the per-call cost, small
#: enough for the scratch buffer to stay in cache between the gather and the permuted scatter (measured best
#: among 0.5-8 MiB on 512 MiB of bf16 blocks).
DEFAULT_CHUNK_BYTES = 1024 * 1024
#: The same on accelerators, where the cost is per kernel launch and caches are small anyway.
DEFAULT_DEVICE_CHUNK_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class StagedSource:
    """The part of a staged block filled from one head source: local heads ``[local_head, +num_heads)``."""

    local_head: int
    num_heads: int


@dataclass(frozen=True, slots=True)
class Restage:
    """Geometry of a staged local plane block and of the layout it must end in."""

    remote_layout: KVLayout  # order inside each staged piece
    local_layout: KVLayout  # order of the final block
    num_heads: int  # heads of the local block
    block_size: int  # tokens of the local block
    piece: int  # tokens of one staged piece; divides block_size
    head_size: int  # elements
    sources: tuple[StagedSource, ...]  # partition the local heads, in head order

    @property
    def block_elements(self) -> int:
        return self.num_heads * self.block_size * self.head_size

    @property
    def pieces(self) -> int:
        return self.block_size // self.piece


def _staged_view(region: torch.Tensor, spec: Restage, heads: int) -> torch.Tensor:
    """``region`` (c, heads * block_size * head_size) as (c, heads, pieces, piece, head_size), a view."""
    c, p, n, d = region.shape[0], spec.pieces, spec.piece, spec.head_size
    if spec.remote_layout == "HND":
        return region.view(c, p, heads, n, d).permute(0, 2, 1, 3, 4)
    return region.view(c, p, n, heads, d).permute(0, 3, 1, 2, 4)


def _final_view(blocks: torch.Tensor, spec: Restage) -> torch.Tensor:
    """``blocks`` (c, block_elements) as (c, heads, pieces, piece, head_size) in the local layout, a view."""
    c, h, p, n, d = blocks.shape[0], spec.num_heads, spec.pieces, spec.piece, spec.head_size
    if spec.local_layout == "HND":
        return blocks.view(c, h, p, n, d)
    return blocks.view(c, p, n, h, d).permute(0, 3, 1, 2, 4)


#: Word types the kernels move bytes as, widest first. torch has no 16-byte integer; complex128 copies are
#: plain 16-byte loads and stores (bit-exact, NaN payloads included) and halve the work of indexed copies.
_WORDS = (torch.complex128, torch.int64, torch.int32, torch.int16, torch.uint8)


def as_words(tensor: torch.Tensor, row_bytes: int) -> torch.Tensor:
    """``tensor`` (num_blocks, elements) reinterpreted, without a copy, as the widest words (16, 8, 4, 2 or 1
    bytes) that divide ``row_bytes`` (the bytes of one head vector), its strides and its address: the kernels
    only move bytes, and wide words make torch's indexed copies several times faster."""
    return as_same_words(row_bytes, tensor)[0]


def as_same_words(row_bytes: int, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """``tensors`` all reinterpreted as the same widest word type that fits each of them (see :func:`as_words`)."""
    for dtype in _WORDS:
        width = dtype.itemsize
        if row_bytes % width or any(tensor.data_ptr() % width for tensor in tensors):
            continue
        try:
            return [tensor.view(dtype) for tensor in tensors]
        except RuntimeError:
            continue
    raise ValueError(f"cannot reinterpret tensors of dtype {tensors[0].dtype} as bytes")


def restage_blocks(
    plane: torch.Tensor,
    block_ids: torch.Tensor,
    spec: Restage,
    chunk_bytes: int | None = None,
    *,
    host_kernel: bool = True,
) -> None:
    """Restage blocks ``block_ids`` (int64, distinct, on ``plane``'s device) of ``plane`` in place.

    ``plane`` is (num_blocks, block_elements) with contiguous rows (any row stride). Blocks are processed
    ``chunk_bytes`` at a time (default :data:`DEFAULT_CHUNK_BYTES` on the CPU, :data:`DEFAULT_DEVICE_CHUNK_BYTES`
    elsewhere; at least one block): gathered into a scratch buffer (one pass), then scattered back run by run
    (:func:`run_layout`; one pass), moving the bytes as wide words (:func:`as_words`). ``host_kernel=False``
    runs the accelerators' kernel on CPU tensors too (:class:`RunScatter`).
    """
    _check_plane(plane, spec)
    _check_devices(plane, block_ids=block_ids)
    total = block_ids.numel()
    if total == 0:
        return
    words = as_words(plane, spec.head_size * plane.element_size())
    spec = _rescaled(spec, words.shape[1])
    if chunk_bytes is None:
        chunk_bytes = DEFAULT_CHUNK_BYTES if plane.device.type == "cpu" else DEFAULT_DEVICE_CHUNK_BYTES
    block_bytes = spec.block_elements * words.element_size()
    per_chunk = max(1, min(total, chunk_bytes // max(block_bytes, 1)))
    staged = torch.empty((per_chunk, spec.block_elements), dtype=words.dtype, device=words.device)
    scatter = RunScatter([words], staged, spec, host_kernel=host_kernel)
    for start in range(0, total, per_chunk):
        ids = block_ids[start : start + per_chunk]
        torch.index_select(words, 0, ids, out=staged[: ids.numel()])
        scatter(0, ids)


def index_on(ids: np.ndarray, device: torch.device) -> torch.Tensor:
    """``ids`` as an int64 tensor on ``device``: on the CPU the array's own memory (no copy when it is int64
    already); on an accelerator one asynchronous copy from pinned host memory, queued on the current stream
    (kernels queued on other streams must wait for it). Move a request's ids once, then slice them."""
    host = torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64))
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def _check_plane(plane: torch.Tensor, spec: Restage) -> None:
    """Raise ``ValueError`` unless ``plane`` is (num_blocks, block_elements) with contiguous rows."""
    if plane.dim() != 2 or plane.shape[1] != spec.block_elements or (plane.stride(1) != 1 and plane.shape[1] > 1):
        raise ValueError(
            f"plane must be (num_blocks, {spec.block_elements}) with contiguous rows, got shape "
            f"{tuple(plane.shape)} strides {plane.stride()}"
        )


def _check_devices(plane: torch.Tensor, **others: torch.Tensor) -> None:
    """Raise ``ValueError`` unless every one of ``others`` lives on ``plane``'s device."""
    for name, tensor in others.items():
        if tensor.device != plane.device:
            raise ValueError(f"{name} is on {tensor.device}, the plane on {plane.device}: make it on the plane's")


def _scatter_permuted(final: torch.Tensor, ids: torch.Tensor, chunk: torch.Tensor, spec: Restage) -> None:
    """Write staged blocks ``chunk`` into blocks ``ids`` of ``final`` (:func:`_final_view`) through permuted views,
    element by element: the definition the run layout is derived from."""
    region_len = spec.block_size * spec.head_size
    for source in spec.sources:
        first = source.local_head * region_len
        region = chunk[:, first : first + source.num_heads * region_len]
        dest = final[:, source.local_head : source.local_head + source.num_heads]
        dest.index_copy_(0, ids, _staged_view(region, spec, source.num_heads))


@functools.lru_cache(maxsize=64)
def run_layout(spec: Restage, row_stride: int) -> tuple[int, np.ndarray]:
    """How a staged block maps onto its final block as runs: ``(run, rows)``, ``run`` being the longest number of
    elements such that every aligned run of a staged block lands, unbroken, on an aligned run of the final block,
    and dividing ``row_stride`` (elements from one block of the plane to the next); ``rows[i]`` (int64, one per
    run) is the run of the final block that staged run ``i`` lands on. A block 16 -> 64 regroup in HND moves runs
    of ``piece * head_size`` elements; a layout permute runs of one head vector."""
    elements = spec.block_elements
    staged = torch.arange(elements, dtype=torch.int64).view(1, elements)
    final = torch.empty((1, elements), dtype=torch.int64)
    _scatter_permuted(_final_view(final, spec), torch.zeros(1, dtype=torch.int64), staged, spec)
    landing = np.empty(elements, dtype=np.int64)
    landing[final.view(-1).numpy()] = np.arange(elements)  # where staged element e lands
    starts = np.flatnonzero(np.diff(landing) != 1) + 1  # staged elements that start a new unbroken run
    run = int(np.gcd.reduce(np.concatenate([starts, landing[starts], landing[:1], [elements, row_stride]])))
    return run, landing[::run] // run


class RunScatter:
    """Writes staged blocks of one staging buffer into blocks of fixed planes, run by run (:func:`run_layout`).

    ``planes``: each (num_blocks, block_elements) with contiguous rows (any row stride); ``staged``: (slots,
    block_elements), contiguous, of the planes' dtype and device. The word views, the run layout and (on an
    accelerator) its rows on the device are prepared once, so a scatter is an index computation and one indexed
    copy of whole runs. On the CPU (``host_kernel``) numpy copies each run with one memcpy, without the GIL from
    500 runs up (torch's indexed copies move one element at a time: 2-3 times the CPU on 4 KiB runs); elsewhere,
    or without ``host_kernel`` (so tests run the device path on CPU tensors), one ``index_put_``.
    """

    def __init__(
        self, planes: Sequence[torch.Tensor], staged: torch.Tensor, spec: Restage, *, host_kernel: bool = True
    ) -> None:
        if staged.dim() != 2 or staged.shape[1] != spec.block_elements or not staged.is_contiguous():
            raise ValueError(
                f"staged blocks must be contiguous (slots, {spec.block_elements}), got {tuple(staged.shape)}"
            )
        self.host = host_kernel and staged.device.type == "cpu"
        self._planes = [self._prepare(plane, staged, spec) for plane in planes]

    def _prepare(self, plane: torch.Tensor, staged: torch.Tensor, spec: Restage) -> _PlaneRuns:
        _check_plane(plane, spec)
        _check_devices(plane, staged=staged)
        if staged.dtype != plane.dtype:
            raise ValueError(f"staged blocks are {staged.dtype}, the plane {plane.dtype}")
        words, staged_words = as_same_words(spec.head_size * plane.element_size(), plane, staged)
        spec = _rescaled(spec, words.shape[1])
        elements = spec.block_elements
        row_stride = words.stride(0) if words.shape[0] > 1 else elements
        run, rows = run_layout(spec, row_stride)
        per_block, stride = elements // run, row_stride // run
        count = (words.shape[0] - 1) * stride + per_block if words.shape[0] else 0
        destination = words.as_strided((count, run), (run, 1), words.storage_offset())
        source = staged_words.reshape(-1, run)
        if self.host:
            run_type = np.dtype((np.void, run * words.element_size()))
            return _PlaneRuns(
                destination.numpy().view(run_type).reshape(-1),
                source.numpy().view(run_type).reshape(-1),
                rows,
                per_block,
                stride,
            )
        return _PlaneRuns(destination, source, torch.from_numpy(rows).to(plane.device), per_block, stride)

    def __call__(self, plane: int, block_ids: torch.Tensor, first_slot: int = 0) -> None:
        """Write staged slots ``first_slot`` on, one per block, into blocks ``block_ids`` (int64, distinct, on the
        planes' device) of plane ``plane``; on an accelerator the copy is queued on the current stream."""
        runs = self._planes[plane]
        first, end = first_slot * runs.per_block, (first_slot + block_ids.numel()) * runs.per_block
        if self.host:
            ids = block_ids.numpy()
            runs.destination[(ids[:, None] * runs.stride + runs.rows).reshape(-1)] = runs.source[first:end]
            return
        targets = (block_ids.unsqueeze(1) * runs.stride + runs.rows).reshape(-1)
        runs.destination.index_put_((targets,), runs.source[first:end])


@dataclass(frozen=True)
class _PlaneRuns:
    """One plane as runs (numpy arrays of void runs on the host path, (runs, run) tensors else), the staging
    buffer's runs, the run of a block each staged run lands on (``rows``), runs per block, and runs from one block
    of the plane to the next."""

    destination: Any
    source: Any
    rows: Any
    per_block: int
    stride: int


def scatter_staged(
    plane: torch.Tensor, block_ids: torch.Tensor, staged: torch.Tensor, spec: Restage, *, host_kernel: bool = True
) -> None:
    """Write staged blocks held outside the cache into blocks ``block_ids`` of ``plane``, in the local layout.

    ``staged`` is (len(block_ids), block_elements) of ``plane``'s dtype, each row a staged block as the reads
    left it; ``plane`` as for :func:`restage_blocks`. One pass: the staged rows are read (from cache, when the
    staging buffer is small) and written, run by run, to their final place (:func:`run_layout`); ``host_kernel``
    as for :func:`restage_blocks`.
    """
    _check_plane(plane, spec)
    if staged.shape != (block_ids.numel(), spec.block_elements) or staged.dtype != plane.dtype:
        raise ValueError(
            f"staged blocks must be ({block_ids.numel()}, {spec.block_elements}) of {plane.dtype}, got"
            f" {tuple(staged.shape)} of {staged.dtype}"
        )
    _check_devices(plane, block_ids=block_ids, staged=staged)
    if block_ids.numel() == 0:
        return
    RunScatter([plane], staged.contiguous(), spec, host_kernel=host_kernel)(0, block_ids)


def _rescaled(spec: Restage, words_per_block: int) -> Restage:
    """``spec`` with ``head_size`` counted in words of a reinterpreted plane of ``words_per_block`` columns."""
    if words_per_block == spec.block_elements:
        return spec
    head_size = words_per_block // (spec.num_heads * spec.block_size)
    return Restage(
        spec.remote_layout, spec.local_layout, spec.num_heads, spec.block_size, spec.piece, head_size, spec.sources
    )
