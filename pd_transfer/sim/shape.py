"""A stand-in model's KV cache geometry and one request's length: what the demo and the transfer benchmarks move."""

from __future__ import annotations

from dataclasses import dataclass

from pd_transfer.spec import KVCacheLayout, ModelFingerprint


@dataclass(frozen=True)
class Shape:
    """A model's cache and one request, as the demo and the benchmarks move them."""

    num_layers: int = 32
    num_kv_heads: int = 8
    head_size: int = 128
    dtype: str = "bfloat16"
    block_size: int = 16
    request_tokens: int = 4096
    cache_blocks: int = 512  # per side; the request uses request_tokens / block_size of them
    layout: str = "HND"

    @property
    def request_blocks(self) -> int:
        return -(-self.request_tokens // self.block_size)

    def fingerprint(self) -> ModelFingerprint:
        return ModelFingerprint(
            model="bench-llama",
            dtype=self.dtype,
            num_layers=self.num_layers,
            total_num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
        )

    def layout_for(self, tp_size: int = 1, tp_rank: int = 0, block_size: int | None = None) -> KVCacheLayout:
        return KVCacheLayout(
            fingerprint=self.fingerprint(),
            tp_size=tp_size,
            tp_rank=tp_rank,
            block_size=block_size or self.block_size,
            layout=self.layout,  # type: ignore[arg-type]
        )
