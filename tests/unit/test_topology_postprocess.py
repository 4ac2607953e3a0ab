"""restage_blocks and scatter_staged against an element-by-element reference, on every dtype width, stride and
chunking, with the host's kernel and with the accelerators' kernel run on CPU tensors."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pd_transfer.topology import Restage, StagedSource, restage_blocks
from pd_transfer.topology.postprocess import as_words, index_on, run_layout, scatter_staged


def reference(staged_block: torch.Tensor, spec: Restage) -> torch.Tensor:
    """The final block written one (head, token) vector at a time from the staged block's definition."""
    h, n, d, piece = spec.num_heads, spec.block_size, spec.head_size, spec.piece
    out = torch.empty(h * n * d, dtype=staged_block.dtype)
    for source in spec.sources:
        region = source.local_head * n * d
        for p in range(n // piece):
            for i in range(source.num_heads):
                for s in range(piece):
                    if spec.remote_layout == "HND":
                        at = region + ((p * source.num_heads + i) * piece + s) * d
                    else:
                        at = region + ((p * piece + s) * source.num_heads + i) * d
                    head, token = source.local_head + i, p * piece + s
                    final = (head * n + token) * d if spec.local_layout == "HND" else (token * h + head) * d
                    out[final : final + d] = staged_block[at : at + d]
    return out


def split_heads(draw: st.DrawFn, heads: int) -> tuple[StagedSource, ...]:
    cuts = sorted(draw(st.sets(st.integers(1, heads - 1), max_size=3))) if heads > 1 else []
    bounds = [0, *cuts, heads]
    return tuple(StagedSource(a, b - a) for a, b in itertools.pairwise(bounds))


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.float8_e4m3fn, torch.int64]


@st.composite
def cases(draw: st.DrawFn):
    heads = draw(st.sampled_from([1, 2, 3, 4, 8]))
    block = draw(st.sampled_from([1, 2, 4, 8, 16]))
    piece = draw(st.sampled_from([p for p in (1, 2, 4, 8, 16) if block % p == 0]))
    spec = Restage(
        remote_layout=draw(st.sampled_from(["HND", "NHD"])),
        local_layout=draw(st.sampled_from(["HND", "NHD"])),
        num_heads=heads,
        block_size=block,
        piece=piece,
        head_size=draw(st.sampled_from([1, 3, 4, 8])),
        sources=split_heads(draw, heads),
    )
    dtype = draw(st.sampled_from(DTYPES))
    num_blocks = draw(st.integers(1, 12))
    ids = draw(st.lists(st.integers(0, num_blocks - 1), unique=True, max_size=num_blocks))
    pad = draw(st.sampled_from([0, 1, 5]))
    chunk = draw(st.sampled_from([1, 200, 1 << 20]))
    return spec, dtype, num_blocks, ids, pad, chunk


@pytest.mark.parametrize("host_kernel", [True, False], ids=["host-kernel", "device-kernel-on-cpu"])
@settings(max_examples=200, deadline=None)
@given(cases())
def test_matches_reference(host_kernel: bool, case) -> None:
    spec, dtype, num_blocks, ids, pad, chunk = case
    elements = spec.block_elements
    width = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (num_blocks, (elements + pad) * width), dtype=torch.uint8)
    raw.view(-1)[: raw.numel() // 8 * 8].view(torch.int64)[::5] = 0x7FF0000000000001  # signalling NaN doubles
    backing = raw.view(dtype)  # random bit patterns: NaNs of every width must survive bit for bit
    plane = backing[:, :elements]
    before = backing.clone()
    restage_blocks(plane, torch.tensor(ids, dtype=torch.int64), spec, chunk, host_kernel=host_kernel)
    as_bytes = backing.view(torch.uint8)
    old_bytes = before.view(torch.uint8)
    for block in range(num_blocks):
        if block in ids:
            want = reference(before[block, :elements], spec)
            assert torch.equal(backing[block, :elements].view(torch.uint8), want.view(torch.uint8)), block
            assert torch.equal(as_bytes[block, elements * width :], old_bytes[block, elements * width :])
        else:
            assert torch.equal(as_bytes[block], old_bytes[block])


def test_uses_wide_words() -> None:
    plane = torch.zeros(4, 2 * 16 * 128, dtype=torch.bfloat16)
    assert as_words(plane, 128 * 2).dtype == torch.complex128
    assert as_words(plane[:, 4:], 128 * 2).dtype == torch.int64  # start 8-byte aligned only
    assert as_words(plane[:, 1:], 128 * 2).dtype == torch.int16  # misaligned start
    assert as_words(torch.zeros(4, 12, dtype=torch.float32), 12).dtype == torch.int32
    assert as_words(torch.zeros(4, 8, dtype=torch.float32), 8).dtype == torch.int64


def test_refuses_wrong_shape() -> None:
    spec = Restage("HND", "NHD", 2, 4, 4, 8, (StagedSource(0, 2),))
    with pytest.raises(ValueError, match="plane must be"):
        restage_blocks(torch.zeros(3, 63), torch.tensor([0]), spec)


@pytest.mark.parametrize("host_kernel", [True, False], ids=["host-kernel", "device-kernel-on-cpu"])
@settings(max_examples=60, deadline=None)
@given(cases())
def test_scatter_staged_matches_reference(host_kernel: bool, case) -> None:
    spec, dtype, num_blocks, ids, pad, _ = case
    elements = spec.block_elements
    width = torch.empty((), dtype=dtype).element_size()
    backing = torch.randint(0, 256, (num_blocks, (elements + pad) * width), dtype=torch.uint8).view(dtype)
    before = backing.clone()
    staged = torch.randint(0, 256, (len(ids), elements * width), dtype=torch.uint8).view(dtype)
    scatter_staged(backing[:, :elements], torch.tensor(ids, dtype=torch.int64), staged, spec, host_kernel=host_kernel)
    for block in range(num_blocks):
        got = backing[block].view(torch.uint8)
        if block in ids:
            want = reference(staged[ids.index(block)], spec)
            assert torch.equal(got[: elements * width], want.view(torch.uint8))
            assert torch.equal(got[elements * width :], before[block].view(torch.uint8)[elements * width :])
        else:
            assert torch.equal(got, before[block].view(torch.uint8))


def test_scatter_staged_refuses_wrong_rows() -> None:
    spec = Restage("HND", "NHD", 2, 4, 4, 8, (StagedSource(0, 2),))
    with pytest.raises(ValueError, match="staged blocks must be"):
        scatter_staged(torch.zeros(3, 64), torch.tensor([0, 1]), torch.zeros(1, 64), spec)


def test_run_layout_of_a_block_regroup_moves_whole_head_pieces() -> None:
    """HND block 16 -> 64: each staged piece of one head (16 tokens x head_size) lands unbroken."""
    spec = Restage("HND", "HND", 8, 64, 16, 128, (StagedSource(0, 8),))
    run, rows = run_layout(spec, spec.block_elements)
    assert run == 16 * 128
    # staged runs are (piece, head); final ones (head, piece)
    assert rows.tolist() == [head * 4 + piece for piece in range(4) for head in range(8)]
    assert run_layout(spec, spec.block_elements + 128)[0] == 128  # a row stride the runs must divide


def test_tensors_on_another_device_are_refused_naming_both() -> None:
    spec = Restage("HND", "NHD", 2, 4, 4, 8, (StagedSource(0, 2),))
    plane = torch.zeros(3, 64)
    with pytest.raises(ValueError, match="block_ids is on meta, the plane on cpu"):
        restage_blocks(plane, torch.zeros(1, dtype=torch.int64, device="meta"), spec)
    with pytest.raises(ValueError, match="staged is on meta"):
        scatter_staged(plane, torch.tensor([0]), torch.zeros(1, 64, device="meta"), spec)


def test_index_on_the_cpu_shares_the_arrays_memory() -> None:
    ids = np.array([4, 1, 7], dtype=np.int64)
    tensor = index_on(ids, torch.device("cpu"))
    assert tensor.dtype == torch.int64 and tensor.tolist() == [4, 1, 7]
    assert tensor.data_ptr() == ids.ctypes.data
    assert index_on(np.array([2, 3], dtype=np.int32), torch.device("cpu")).dtype == torch.int64
