"""Pulls of packed caches (each (block, head) packed as an engine packs it, as vLLM's CPU caches are) across
block sizes, both ways and with different TP sizes: a prefill process, real NIXL and ZMQ, the bytes checked
token by token through each side's packing (not through the plan)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest
import torch

from pd_transfer.connector.cache import KVCache
from pd_transfer.connector.decode.rank import DecodeRank
from pd_transfer.connector.options import DecodeOptions
from pd_transfer.settings import DEFAULTS
from pd_transfer.sim.peer import PrefillProcess, PrefillSpec
from pd_transfer.spec import KVCacheLayout, ModelFingerprint
from pd_transfer.topology import TopologyError
from pd_transfer.topology.packed import PackedBlockFormat

os.environ.setdefault("UCX_NET_DEVICES", "lo")

HEAD = 16  # elements of one K (or V) vector
HEADS = 2
LAYERS = 2
PACKING = "test:key-transposed"
FINGERPRINT = ModelFingerprint(
    model="tiny", dtype="float32", num_layers=LAYERS, total_num_kv_heads=HEADS, head_size=2 * HEAD
)


def layout(block_size: int, tp_size: int = 1, tp_rank: int = 0, packing: str | None = PACKING) -> KVCacheLayout:
    return KVCacheLayout(FINGERPRINT, tp_size, tp_rank, block_size, "HND", packing=packing)


def key_transposed(block_size: int) -> PackedBlockFormat:
    return PackedBlockFormat.key_transposed(block_size, HEAD)


def tokens_of(cache: KVCache, block_ids: list[int], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the blocks' tokens in order, as (heads, tokens, HEAD) of int32 words."""
    fmt = key_transposed(cache.layout.block_size)
    chunks = cache.tensors[layer].view(torch.int32)[block_ids].reshape(len(block_ids), -1, fmt.chunk_elements)
    heads = chunks.shape[1]

    def take(table: torch.Tensor) -> torch.Tensor:
        picked = chunks[:, :, table.reshape(-1)].view(len(block_ids), heads, fmt.block_size, HEAD)
        return picked.permute(1, 0, 2, 3).reshape(heads, -1, HEAD)

    return take(fmt.key_offsets), take(fmt.value_offsets)


@pytest.fixture
def decode_for() -> Iterator:
    made: list[DecodeRank] = []

    def make(
        local: KVCacheLayout,
        num_blocks: int,
        packed_formats: Callable[[int], PackedBlockFormat] | None = None,
        packed_staging_bytes: int = 32 * 2**20,
    ) -> DecodeRank:
        options = DecodeOptions(settings=DEFAULTS, packed_staging_bytes=packed_staging_bytes)
        rank = DecodeRank("decode", KVCache.allocate(local, num_blocks), options, packed_formats=packed_formats)
        made.append(rank)
        return rank

    yield make
    for rank in made:
        rank.close()


@pytest.mark.parametrize(
    ("prefill_block", "prefill_tp", "decode_block", "num_tokens"),
    [(32, 1, 128, 300), (128, 1, 32, 300), (32, 2, 128, 385), (64, 1, 32, 64), (32, 1, 128, 5)],
)
def test_packed_pull_across_block_sizes(
    decode_for, prefill_block: int, prefill_tp: int, decode_block: int, num_tokens: int
) -> None:
    spec = PrefillSpec(
        engine_id="prefill",
        layouts=[layout(prefill_block, prefill_tp, rank) for rank in range(prefill_tp)],
        num_blocks=24,
    )
    expected = spec.caches()
    remote_ids = list(range(23, 23 - -(-num_tokens // prefill_block), -1))  # scattered, descending
    local_count = -(-num_tokens // decode_block)
    local_ids = [3 * i + 1 for i in range(local_count)]
    with PrefillProcess(spec) as prefill:
        decode = decode_for(layout(decode_block), 40, packed_formats=key_transposed, packed_staging_bytes=64 * 1024)
        before = decode.cache.tensors[0].clone()
        stats = decode.pull("req-packed", prefill.host, prefill.port, remote_ids, local_ids, num_tokens)
        assert prefill.wait_released("req-packed", timeout_s=10.0) == [1] * prefill_tp
    assert decode.remote_plan(prefill.host, prefill.port).postprocess is None  # whole chunks, regrouped after
    assert stats.bytes == prefill_tp * LAYERS * len(remote_ids) * (HEADS // prefill_tp) * 2 * prefill_block * HEAD * 4
    for layer in range(LAYERS):
        want_k = torch.cat([tokens_of(c, remote_ids, layer)[0] for c in expected])  # heads of rank 0, then 1
        want_v = torch.cat([tokens_of(c, remote_ids, layer)[1] for c in expected])
        got_k, got_v = tokens_of(decode.cache, local_ids, layer)
        assert torch.equal(got_k[:, :num_tokens], want_k[:, :num_tokens]), f"layer {layer}: K differs"
        assert torch.equal(got_v[:, :num_tokens], want_v[:, :num_tokens]), f"layer {layer}: V differs"
    untouched = [b for b in range(40) if b not in local_ids]
    assert torch.equal(decode.cache.tensors[0][untouched], before[untouched])


def test_packed_pull_without_formats_is_refused_clearly(decode_for) -> None:
    spec = PrefillSpec(engine_id="prefill", layouts=[layout(32)], num_blocks=8)
    with PrefillProcess(spec) as prefill:
        decode = decode_for(layout(128), 4)
        with pytest.raises(TopologyError, match="needs a regroup that knows the packing"):
            decode.pull("req", prefill.host, prefill.port, [0, 1, 2, 3], [0], 128)


def test_packings_must_match(decode_for) -> None:
    spec = PrefillSpec(engine_id="prefill", layouts=[layout(32, packing="other")], num_blocks=8)
    with PrefillProcess(spec) as prefill:
        decode = decode_for(layout(32), 4, packed_formats=key_transposed)
        with pytest.raises(TopologyError, match="block packing differs"):
            decode.pull("req", prefill.host, prefill.port, [0], [0], 32)


def test_bad_block_ids_are_refused_before_reading(decode_for) -> None:
    spec = PrefillSpec(engine_id="prefill", layouts=[layout(32)], num_blocks=8)
    with PrefillProcess(spec) as prefill:
        decode = decode_for(layout(128), 4, packed_formats=key_transposed)
        with pytest.raises(ValueError, match="remote_block_ids: block id 99 is out of range"):
            decode.pull("req", prefill.host, prefill.port, [0, 1, 2, 99], [0], 128)
        with pytest.raises(ValueError, match=r"local_block_ids: .* need 1 block ids, got 2"):
            decode.pull("req", prefill.host, prefill.port, [0, 1, 2, 3], [0, 1], 128)
