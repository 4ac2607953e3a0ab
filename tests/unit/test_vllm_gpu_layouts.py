"""vLLM's GPU cache layouts described without vLLM or a GPU: CPU tensors shaped (and strided) as the GPU backends hand
them over (tests/support/vllm_gpu_caches.py), described by ``integrations/vllm_cache_layouts.py``; the regions checked
field by field, the errors checked by their messages, and plans between such caches (TP 1 <-> 2, block 16 <-> 64, HND
<-> NHD, K and V apart <-> together, MLA) carried out byte for byte with ``memmove`` over the planner's descriptor grids
(and once with the tensor copies tests/gpu uses on CUDA), then checked through each side's own description
(``pd_transfer.sim.verify``, which does not use the plan)."""

from __future__ import annotations

import pytest
import torch
from vllm_gpu_caches import HEAD_SIZE, HEADS, LAYERS, PAIRS, check_pair, geometry, layer_caches

from pd_transfer.integrations.vllm_cache_layouts import (
    AmbiguousCacheShape,
    block_rows,
    describe_cache_layout,
    infer_format,
    order_of_vllm_layout,
)
from pd_transfer.spec import KVRegion
from pd_transfer.topology import TopologyError, check_compatible


class TestRegions:
    def test_flash_attn_is_two_regions_a_layer_k_then_v(self) -> None:
        caches = layer_caches("flash-attn", "NHD", 10, geometry())
        layout, cache = describe_cache_layout(caches, geometry(), cache_format="flash-attn")
        block = 16 * HEADS * HEAD_SIZE * 4
        assert layout.layout == "NHD" and layout.packing is None and layout.fingerprint.head_size == HEAD_SIZE
        assert layout.fingerprint.num_layers == LAYERS
        base = caches["model.layers.0.self_attn.attn"].data_ptr()
        assert cache.regions[:2] == [
            KVRegion(layer=0, kinds=("k",), base_address=base, num_blocks=10, block_len=block, block_stride=block),
            KVRegion(layer=0, kinds=("v",), base_address=base + 10 * block, num_blocks=10, block_len=block,
                     block_stride=block),
        ]  # fmt: skip
        assert [(r.layer, r.kinds) for r in cache.regions] == [(0, ("k",)), (0, ("v",)), (1, ("k",)), (1, ("v",))]
        assert tuple(cache.tensors[0].shape) == (10, 16, HEADS, HEAD_SIZE)

    def test_flashinfer_is_one_region_a_layer_k_and_v_inside_each_block(self) -> None:
        layout, cache = describe_cache_layout(layer_caches("flashinfer", "NHD", 10, geometry()), geometry())
        block = 2 * 16 * HEADS * HEAD_SIZE * 4
        assert layout.layout == "NHD"
        assert [(r.kinds, r.block_len, r.block_stride) for r in cache.regions] == [(("k", "v"), block, block)] * 2

    def test_mla_latent_is_one_latent_region_a_layer(self) -> None:
        g = geometry(mla=True)
        layout, cache = describe_cache_layout(layer_caches("mla-latent", "NHD", 10, g), g)
        assert layout.fingerprint.use_mla and layout.fingerprint.head_size == 24 and layout.num_local_heads == 1
        assert [(r.kinds, r.block_len) for r in cache.regions] == [(("latent",), 16 * 24 * 4)] * 2

    @pytest.mark.parametrize("order", ["NHD", "HND"])
    def test_paged_view_moves_k_and_v_of_a_token_head_as_one(self, order: str) -> None:
        caches = layer_caches("paged", order, 10, geometry())
        layout, cache = describe_cache_layout(caches, geometry(), cache_format="paged", order=order)  # type: ignore[arg-type]
        assert layout.layout == order and layout.fingerprint.head_size == 2 * HEAD_SIZE
        assert [r.kinds for r in cache.regions] == [("k",)] * LAYERS
        heads_then_tokens = (HEADS, 16) if order == "HND" else (16, HEADS)
        assert tuple(cache.tensors[0].shape) == (10, *heads_then_tokens, 2 * HEAD_SIZE)

    def test_paged_layers_interleaved_in_a_block_widen_the_block_stride(self) -> None:
        caches = layer_caches("paged", "NHD", 10, geometry(), vllm_layout="BL")
        _, cache = describe_cache_layout(caches, geometry(), cache_format="paged", order=order_of_vllm_layout("BLNHC"))
        block = 16 * HEADS * 2 * HEAD_SIZE * 4
        assert [(r.block_len, r.block_stride) for r in cache.regions] == [(block, LAYERS * block)] * LAYERS
        assert cache.regions[1].base_address - cache.regions[0].base_address == block

    def test_paged_mla_is_a_latent_plane(self) -> None:
        g = geometry(mla=True)
        layout, cache = describe_cache_layout(layer_caches("paged", "NHD", 10, g), g, cache_format="paged")
        assert layout.fingerprint.head_size == 24 and [r.kinds for r in cache.regions] == [("latent",)] * LAYERS

    def test_vllm_layout_names(self) -> None:
        names = {"LBNHC": "NHD", "LBHNC": "HND", "BLNHC": "NHD", "BLHNC": "HND", "NHD": "NHD", "HND": "HND"}
        assert {name: order_of_vllm_layout(name) for name in names} == names
        assert order_of_vllm_layout(None) is None
        with pytest.raises(ValueError, match="unknown KV cache layout name"):
            order_of_vllm_layout("LBC")

    def test_block_rows_are_the_blocks_bytes_in_memory_order(self) -> None:
        caches = layer_caches("paged", "NHD", 6, geometry(), vllm_layout="BL")
        tensor = caches["model.layers.1.self_attn.attn"]
        tensor.copy_(torch.arange(tensor.numel(), dtype=torch.float32).view_as(tensor))
        rows = block_rows(tensor)
        assert rows.shape == (6, 16 * HEADS * 2 * HEAD_SIZE * 4) and rows.data_ptr() == tensor.data_ptr()
        assert torch.equal(rows[3], tensor[3].permute(1, 0, 2).contiguous().view(torch.uint8).flatten())


class TestFormatChoice:
    @pytest.mark.parametrize("fmt", ["paged", "flash-attn", "flashinfer"])
    def test_each_attention_shape_names_its_format(self, fmt: str) -> None:
        tensor = next(iter(layer_caches(fmt, "NHD", 10, geometry()).values()))
        assert infer_format(tuple(tensor.shape), geometry()) == fmt

    def test_mla_shapes(self) -> None:
        g = geometry(mla=True)
        assert infer_format((10, 16, 24), g) == "mla-latent" and infer_format((10, 1, 16, 24), g) == "paged"

    def test_two_blocks_of_flash_attn_or_flashinfer_are_ambiguous_unless_named(self) -> None:
        caches = layer_caches("flash-attn", "NHD", 2, geometry())
        with pytest.raises(AmbiguousCacheShape, match=r"could be any of \['flash-attn', 'flashinfer'\]"):
            describe_cache_layout(caches, geometry())
        _, cache = describe_cache_layout(caches, geometry(), cache_format="flash-attn")
        assert len(cache.regions) == 2 * LAYERS

    def test_a_shape_of_no_format_names_the_expected_ones(self) -> None:
        with pytest.raises(ValueError, match=r"expected paged \[num_blocks, heads, block_size, 2\*head_size"):
            infer_format((10, 16, 3, HEAD_SIZE), geometry())


class TestRefusals:
    def test_heads_of_another_tp_size(self) -> None:
        caches = layer_caches("paged", "NHD", 10, geometry(tp=2))
        with pytest.raises(ValueError, match=r"not paged .* with block_size 16, 4 head\(s\) and 16 elements"):
            describe_cache_layout(caches, geometry(tp=1), cache_format="paged")

    def test_another_block_size(self) -> None:
        with pytest.raises(ValueError, match="unexpected KV cache tensor"):
            describe_cache_layout(layer_caches("flash-attn", "NHD", 10, geometry(block=32)), geometry(block=16))

    def test_heads_between_layers_of_a_block(self) -> None:
        caches = layer_caches("paged", "HND", 10, geometry(), vllm_layout="BH")
        with pytest.raises(ValueError, match="a block is not contiguous in memory"):
            describe_cache_layout(caches, geometry(), cache_format="paged")

    def test_order_the_strides_contradict(self) -> None:
        caches = layer_caches("paged", "HND", 10, geometry())
        with pytest.raises(ValueError, match=r"the engine says its KV cache is NHD, but .* strides make it HND"):
            describe_cache_layout(caches, geometry(), cache_format="paged", order="NHD")

    def test_layers_that_differ(self) -> None:
        caches = layer_caches("paged", "NHD", 10, geometry())
        name = "model.layers.0.self_attn.attn"
        caches[name] = layer_caches("paged", "HND", 10, geometry())[name]
        with pytest.raises(ValueError, match=r"is not in .* memory order"):
            describe_cache_layout(caches, geometry(), cache_format="paged")
        caches[name] = torch.zeros(11, HEADS, 16, 2 * HEAD_SIZE)
        with pytest.raises(ValueError, match="differs from"):
            describe_cache_layout(caches, geometry(), cache_format="paged")

    def test_a_dtype_we_do_not_move_and_no_tensors(self) -> None:
        with pytest.raises(ValueError, match="int32 is not one pd-transfer moves"):
            describe_cache_layout(layer_caches("paged", "NHD", 4, geometry(), dtype=torch.int32), geometry())
        with pytest.raises(ValueError, match="no KV cache tensors"):
            describe_cache_layout({}, geometry())

    def test_paged_and_flash_attn_engines_do_not_pair(self) -> None:
        paged, _ = describe_cache_layout(layer_caches("paged", "NHD", 4, geometry()), geometry())
        split, _ = describe_cache_layout(layer_caches("flash-attn", "NHD", 4, geometry()), geometry())
        with pytest.raises(TopologyError, match="head_size differs"):
            check_compatible(paged, split)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("pair", list(PAIRS))
def test_plans_between_gpu_layouts_move_the_right_bytes(pair: str, dtype: torch.dtype) -> None:
    check_pair(pair, dtype, "cpu", reads="memmove")


@pytest.mark.parametrize("pair", ["paged_hnd_to_nhd", "flash_attn_hnd_tp2_block64_to_flashinfer_16"])
def test_the_device_copies_of_the_gpu_test_carry_out_a_plan_as_memmove_does(pair: str) -> None:
    check_pair(pair, torch.bfloat16, "cpu", reads="device")
