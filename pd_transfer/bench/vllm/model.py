"""A seeded Llama with Llama-3-8B's KV geometry and tiny everywhere else, for ``pd-transfer bench vllm --scale``.

``build_kv8b_model(directory)`` writes a Hugging Face model folder that CPU vLLM serves: 32 layers, 8 KV heads of
head size 128 (Llama-3-8B's KV cache: ``2 * 32 * 8 * 128`` values per token, 256 KiB per token in float32, 1 GiB
for 4,096 tokens), but 8 attention heads (no grouping, so attention costs a quarter of the 8B model's), hidden
size 256, intermediate size 512, the tiny model's 2,048-token vocabulary and tokenizer, 8,192 positions. Weights
are drawn from ``N(0, 0.02)`` with a generator seeded by ``seed`` (norms are ones), saved as safetensors in
``dtype`` (float32 by default: vLLM's CPU backend serves it everywhere; bfloat16 halves the KV bytes and needs a
CPU with bf16 support to be fast). About 180 MB in float32.

A folder whose marker (``pd_transfer_kv8b_model.json``, written last) records the same seed and dtype is left as
it is. This module imports neither vLLM nor transformers (torch, safetensors and tokenizers, which vLLM brings).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from pd_transfer import tiny_model

if TYPE_CHECKING:
    import torch

__all__ = ["KV8B_CONFIG", "KV8B_MODEL_DIR", "build_kv8b_model", "kv_bytes_per_token", "run"]

#: Where ``pd-transfer make-model --kv-8b`` puts the model by default, relative to the working directory.
KV8B_MODEL_DIR = Path(".models/llama8b-kv-f32")
MARKER = "pd_transfer_kv8b_model.json"
LAYERS, HEADS, KV_HEADS, HEAD_DIM = 32, 8, 8, 128
HIDDEN, INTERMEDIATE, MAX_POSITIONS = 256, 512, 8192
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

KV8B_CONFIG = {
    **tiny_model.MODEL_CONFIG,
    "hidden_size": HIDDEN,
    "intermediate_size": INTERMEDIATE,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "head_dim": HEAD_DIM,
    "max_position_embeddings": MAX_POSITIONS,
}


def kv_bytes_per_token(dtype: str = "float32") -> int:
    """KV bytes one token takes in the model's cache: K and V, every layer, every KV head (``2 * 32 * 8 * 128``
    values) times the dtype's size."""
    return 2 * LAYERS * KV_HEADS * HEAD_DIM * DTYPE_BYTES[dtype]


def _weights(seed: int, dtype: str) -> dict[str, torch.Tensor]:
    import torch

    generator = torch.Generator(device="cpu").manual_seed(seed)
    target = getattr(torch, dtype)

    def normal(*shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.float32).normal_(0.0, tiny_model.INIT_STD, generator=generator).to(target)

    q_out, kv_out = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    vocab = int(KV8B_CONFIG["vocab_size"])  # type: ignore[call-overload]
    tensors = {"model.embed_tokens.weight": normal(vocab, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        for name, shape in (
            ("self_attn.q_proj", (q_out, HIDDEN)),
            ("self_attn.k_proj", (kv_out, HIDDEN)),
            ("self_attn.v_proj", (kv_out, HIDDEN)),
            ("self_attn.o_proj", (HIDDEN, q_out)),
            ("mlp.gate_proj", (INTERMEDIATE, HIDDEN)),
            ("mlp.up_proj", (INTERMEDIATE, HIDDEN)),
            ("mlp.down_proj", (HIDDEN, INTERMEDIATE)),
        ):
            tensors[p + name + ".weight"] = normal(*shape)
        tensors[p + "input_layernorm.weight"] = torch.ones(HIDDEN, dtype=target)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(HIDDEN, dtype=target)
    tensors["model.norm.weight"] = torch.ones(HIDDEN, dtype=target)
    tensors["lm_head.weight"] = normal(vocab, HIDDEN)
    return tensors


def _built_with(directory: Path) -> dict[str, object] | None:
    try:
        marker = json.loads((directory / MARKER).read_text())
    except (OSError, ValueError):
        return None
    files = marker.get("files") if isinstance(marker, dict) else None
    if not isinstance(files, dict) or not all((directory / name).is_file() for name in files):
        return None
    return {k: marker.get(k) for k in ("seed", "dtype")}


def build_kv8b_model(directory: Path, *, seed: int = 0, dtype: str = "float32", overwrite: bool = False) -> Path:
    """Write the model into ``directory`` (created if needed); its resolved path. A folder built with the same
    ``seed`` and ``dtype`` is left as it is; one built with others raises ``FileExistsError`` unless
    ``overwrite``. Raises ``ValueError`` on an unknown dtype or a negative seed."""
    if dtype not in DTYPE_BYTES or seed < 0:
        raise ValueError(f"dtype must be one of {tuple(DTYPE_BYTES)} and seed non-negative, not {dtype!r}, {seed}")
    directory = Path(directory).expanduser().resolve()
    wanted: dict[str, object] = {"seed": seed, "dtype": dtype}
    found = _built_with(directory)
    if found == wanted and not overwrite:
        return directory
    if found is not None and not overwrite:
        raise FileExistsError(f"{directory.name} holds a model built with {found}, not {wanted}; pass --overwrite")
    from safetensors.torch import save

    directory.mkdir(parents=True, exist_ok=True)
    (directory / MARKER).unlink(missing_ok=True)
    contents = {
        "config.json": tiny_model.json_bytes({**KV8B_CONFIG, "torch_dtype": dtype}),
        "generation_config.json": tiny_model.json_bytes(
            {"bos_token_id": tiny_model.BOS_ID, "eos_token_id": tiny_model.EOS_ID, "pad_token_id": tiny_model.PAD_ID}
        ),
        **tiny_model.tokenizer_files(),
        "model.safetensors": save(_weights(seed, dtype), metadata={"format": "pt"}),
    }
    for name, data in contents.items():
        tiny_model.write_atomic(directory / name, data)
    digests = {name: hashlib.sha256(data).hexdigest() for name, data in contents.items()}
    marker = {**wanted, "kv_bytes_per_token": kv_bytes_per_token(dtype), "files": digests}
    tiny_model.write_atomic(directory / MARKER, tiny_model.json_bytes(marker))
    return directory


def run(args: argparse.Namespace) -> int:
    """``pd-transfer make-model --kv-8b DIR``: build the model; print its folder. Returns an exit code."""
    try:
        path = build_kv8b_model(args.directory, seed=args.seed, dtype=args.dtype, overwrite=args.overwrite)
    except (ValueError, OSError) as error:
        print(f"make-model: {error}", file=sys.stderr)
        return 2
    print(path)
    return 0
