"""vLLM's GPU cache layouts on CUDA tensors: described as on the CPU (the same regions, at device addresses), read
back through the description element for element as a CPU twin is, and plans between such caches (TP 1 <-> 2, block
16 <-> 64, HND <-> NHD, K and V apart <-> together, MLA) carried out with copies on the device and checked through
each side's own description. tests/unit/test_vllm_gpu_layouts.py checks the same on CPU tensors."""

from __future__ import annotations

import pytest
import torch
from vllm_gpu_caches import PAIRS, TOKENS, check_pair, geometry, layer_caches

from pd_transfer.integrations.vllm_cache_layouts import describe_cache_layout
from pd_transfer.sim.peer import fill_pattern
from pd_transfer.sim.verify import logical

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: torch sees no GPU here"),
]

FORMATS = [  # (format, order, vLLM layout, MLA)
    ("paged", "NHD", "LB", False),
    ("paged", "HND", "LB", False),
    ("paged", "NHD", "BL", False),
    ("paged", "NHD", "LB", True),
    ("flash-attn", "NHD", "LB", False),
    ("flash-attn", "HND", "LB", False),
    ("flashinfer", "NHD", "LB", False),
    ("flashinfer", "HND", "LB", False),
    ("mla-latent", "NHD", "LB", True),
]


@pytest.mark.parametrize(("fmt", "order", "vllm_layout", "mla"), FORMATS)
def test_cuda_tensors_are_described_as_their_cpu_twins(fmt: str, order: str, vllm_layout: str, mla: bool) -> None:
    g = geometry(mla=mla)
    twins = {}
    for device in ("cpu", "cuda"):
        tensors = layer_caches(fmt, order, 12, g, torch.bfloat16, vllm_layout, device)
        twins[device] = describe_cache_layout(tensors, g, cache_format=fmt)  # type: ignore[arg-type]
    (cpu_layout, cpu), (cuda_layout, cuda) = twins["cpu"], twins["cuda"]
    assert cuda_layout == cpu_layout and cuda_layout.layout == order
    assert all(t.is_cuda for t in cuda.tensors)
    assert [r.base_address for r in cuda.regions] == [t.data_ptr() for t in cuda.tensors]
    for a, b in zip(cpu.regions, cuda.regions, strict=True):
        assert (a.layer, a.kinds, a.num_blocks, a.block_len, a.block_stride) == (
            b.layer, b.kinds, b.num_blocks, b.block_len, b.block_stride
        )  # fmt: skip
    fill_pattern(cpu, seed=3)
    for source, target in zip(cpu.tensors, cuda.tensors, strict=True):
        target.copy_(source)  # element for element, whatever either side's strides
    ids = [7, 2, 9, 0, 11, 4, 5, 1, 3, 10]
    tokens = min(TOKENS, len(ids) * g.block_size)
    assert torch.equal(logical(cuda, ids, tokens).cpu(), logical(cpu, ids, tokens))


@pytest.mark.parametrize("pair", list(PAIRS))
def test_plans_between_cuda_caches_move_the_right_bytes(pair: str) -> None:
    check_pair(pair, torch.bfloat16, "cuda", reads="device")
