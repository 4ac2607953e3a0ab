"""PackedRegroup against an element-by-element expectation, for several packings and block sizes."""

from __future__ import annotations

import math

import pytest
import torch

from pd_transfer.topology.packed import PackedBlockFormat, PackedRegroup

HEAD = 8  # elements of one K (or V) vector


def amx_bf16(block_size: int, head_size: int) -> PackedBlockFormat:
    """vLLM CPU's bfloat16 AMX packing (measured with its reshape_and_cache kernel, see docs/)."""
    t = torch.arange(block_size)[:, None]
    d = torch.arange(head_size)[None, :]
    key = (t // 16) * 16 * head_size + (d // 2) * 32 + (t % 16) * 2 + d % 2
    value = block_size * head_size + (d // 16) * block_size * 16 + (t // 2) * 32 + (d % 16) * 2 + t % 2
    return PackedBlockFormat(block_size, head_size, key, value)


def shuffled(block_size: int, head_size: int, seed: int) -> PackedBlockFormat:
    """Any packing at all: a random permutation of the chunk."""
    order = torch.randperm(2 * block_size * head_size, generator=torch.Generator().manual_seed(seed))
    return PackedBlockFormat(
        block_size, head_size, order[: block_size * head_size].view(block_size, head_size),
        order[block_size * head_size :].view(block_size, head_size),
    )  # fmt: skip


FORMATS = {
    "token_major": PackedBlockFormat.token_major,
    "key_transposed": PackedBlockFormat.key_transposed,
    "shuffled": lambda b, h: shuffled(b, h, seed=b),
}


def logical(chunks: torch.Tensor, fmt: PackedBlockFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks, heads, chunk) -> K, V as (heads, blocks * block_size, head_size), token order."""
    blocks, heads = chunks.shape[:2]
    key = chunks[:, :, fmt.key_offsets.reshape(-1)].view(blocks, heads, fmt.block_size, fmt.head_size)
    value = chunks[:, :, fmt.value_offsets.reshape(-1)].view(blocks, heads, fmt.block_size, fmt.head_size)
    return (
        key.permute(1, 0, 2, 3).reshape(heads, -1, fmt.head_size),
        value.permute(1, 0, 2, 3).reshape(heads, -1, fmt.head_size),
    )


@pytest.mark.parametrize("packing", sorted(FORMATS))
@pytest.mark.parametrize(("remote_block", "local_block"), [(32, 128), (128, 32), (64, 64), (16, 48), (48, 16)])
@pytest.mark.parametrize("num_tokens", [1, 31, 128, 200, 385])
def test_regroup_matches_token_by_token(packing: str, remote_block: int, local_block: int, num_tokens: int) -> None:
    make = FORMATS[packing]
    remote_fmt, local_fmt = make(remote_block, HEAD), make(local_block, HEAD)
    regroup = PackedRegroup(remote_fmt, local_fmt)
    heads = 3
    groups = regroup.groups(num_tokens)
    remote_count = -(-num_tokens // remote_block)
    staged = torch.randn(groups * regroup.remote_blocks_per_group + 2, heads, remote_fmt.chunk_elements)
    local = torch.full((40, heads, local_fmt.chunk_elements), float("nan"))
    untouched = local.clone()
    local_count = -(-num_tokens // local_block)
    ids = torch.randperm(40, generator=torch.Generator().manual_seed(num_tokens))[:local_count]

    regroup.apply(staged, local, ids, num_tokens)

    want_k, want_v = logical(staged[:remote_count], remote_fmt)
    got_k, got_v = logical(local[ids], local_fmt)
    assert torch.equal(got_k[:, :num_tokens], want_k[:, :num_tokens])
    assert torch.equal(got_v[:, :num_tokens], want_v[:, :num_tokens])
    others = torch.ones(40, dtype=torch.bool)
    others[ids] = False
    assert torch.equal(local[others].isnan(), untouched[others].isnan()), "blocks outside the request were written"


def test_bits_move_unchanged() -> None:
    """NaN payloads and negative zeros survive: the regroup moves bits, not float values."""
    fmt_remote, fmt_local = amx_bf16(32, 32), amx_bf16(64, 32)
    regroup = PackedRegroup(fmt_remote, fmt_local)
    raw = torch.randint(-(2**15), 2**15, (2, 1, fmt_remote.chunk_elements), dtype=torch.int16)
    staged = raw.view(torch.bfloat16)
    local = torch.zeros((1, 1, fmt_local.chunk_elements), dtype=torch.bfloat16)
    regroup.apply(staged, local, torch.tensor([0]), 64)
    want_k, want_v = logical(raw, fmt_remote)
    got_k, got_v = logical(local.view(torch.int16), fmt_local)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


def test_group_geometry() -> None:
    regroup = PackedRegroup(PackedBlockFormat.key_transposed(48, HEAD), PackedBlockFormat.key_transposed(32, HEAD))
    assert regroup.group_tokens == math.lcm(48, 32) == 96
    assert (regroup.remote_blocks_per_group, regroup.local_blocks_per_group) == (2, 3)
    assert regroup.groups(97) == 2


def test_bad_inputs_are_named() -> None:
    with pytest.raises(ValueError, match="exactly once"):
        PackedBlockFormat(2, 2, torch.zeros(2, 2, dtype=torch.int64), torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="head sizes differ"):
        PackedRegroup(PackedBlockFormat.token_major(4, 2), PackedBlockFormat.token_major(4, 4))
    regroup = PackedRegroup(PackedBlockFormat.token_major(4, 2), PackedBlockFormat.token_major(8, 2))
    with pytest.raises(ValueError, match="need 2 local blocks"):
        regroup.apply(torch.zeros(4, 1, 16), torch.zeros(4, 1, 32), torch.tensor([0]), 12)
