"""What ``pd-transfer bench offload --end-to-end`` sizes from the model, and how its results are saved per model.

A model's KV bytes per token (K and V, every layer, every KV head, float32 as the bench serves it) decide how
much a prefix hit has to move: 4 KiB per token for the tiny test model, about 45 KiB for SmolLM2-135M, 256 KiB for
the Llama-3-8B KV geometry (``pd-transfer make-model --kv-8b``). The byte budgets of the tiers and of vLLM's own
cache follow from it (never below the constants the tiny model's runs used, so those stay comparable); the
number of vLLM cache blocks and the context length do not depend on the model, only on the prompt.

Results are kept per model in ``end_to_end_by_model`` (model folder name -> that model's run), and
``end_to_end`` holds the saved run whose model has the most KV bytes per token: the run where loading matters
most, the one the goal is judged on first.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["Sizing", "kv_bytes_per_token", "save_result", "sizing_for"]

BLOCK = 128  # tokens per vLLM block
CACHE_BLOCKS = 18  # vLLM's own cache (one block is vLLM's null block): room for MAX_MODEL_LEN
MAX_MODEL_LEN = 2048
PREFIX = 1500
TAIL = 24
MAX_TOKENS = 8
HELD_PROMPTS = 3  # prompts' full blocks the host tier (and vLLM's CPU offload) hold: a round needs one
DIR_PROMPTS = 4  # prompts' full blocks the directory tier holds
MIB = 2**20
HOST_FLOOR_BYTES = 64 * MIB  # the tiny model's runs used these constants
DIR_FLOOR_BYTES = 256 * MIB
CACHE_FLOOR_BYTES = 64 * MIB
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
BY_MODEL_KEY = "end_to_end_by_model"
HEADLINE_KEY = "end_to_end"


@dataclass(frozen=True)
class Sizing:
    """Byte budgets of one model's run. ``block_bytes``: one vLLM block (``BLOCK`` tokens, all layers);
    ``prefix_blocks``: full blocks of a prompt (what a hit loads); the rest are what each setup is given."""

    kv_bytes_per_token: int
    block_bytes: int
    prefix_blocks: int
    host_bytes: int
    dir_bytes: int
    vllm_cpu_bytes: int
    kv_cache_bytes: int
    cache_blocks: int = CACHE_BLOCKS
    max_model_len: int = MAX_MODEL_LEN

    @property
    def prefix_bytes(self) -> int:
        """Bytes a hit on the prefix's full blocks moves into vLLM's cache."""
        return self.prefix_blocks * self.block_bytes

    def as_json(self) -> dict[str, int]:
        return asdict(self) | {"prefix_bytes": self.prefix_bytes}


def kv_bytes_per_token(config: dict[str, Any], dtype: str = "float32") -> int:
    """KV bytes of one token: ``2 * layers * kv_heads * head_dim * dtype size`` from a Hugging Face
    ``config.json`` (``head_dim`` defaults to ``hidden_size / num_attention_heads``, ``num_key_value_heads`` to
    ``num_attention_heads``). Raises ``ValueError`` when a field is missing or not a positive integer."""
    try:
        heads = int(config["num_attention_heads"])
        layers = int(config["num_hidden_layers"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as error:
        raise ValueError(f"config.json lacks a usable attention geometry ({type(error).__name__}: {error})") from None
    if min(layers, kv_heads, head_dim) <= 0:
        raise ValueError("config.json: layers, KV heads and head_dim must be positive")
    return 2 * layers * kv_heads * head_dim * DTYPE_BYTES[dtype]


def sizing_for(model_dir: str | Path, dtype: str = "float32") -> Sizing:
    """The run's budgets for the model in ``model_dir`` (its ``config.json``). Raises ``ValueError`` when the
    config is unreadable or the model's context is shorter than ``MAX_MODEL_LEN``."""
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"cannot read the model's config.json: {type(error).__name__}") from None
    if not isinstance(config, dict):
        raise ValueError("the model's config.json is not an object")
    positions = config.get("max_position_embeddings")
    if isinstance(positions, int) and positions < MAX_MODEL_LEN:
        raise ValueError(f"the model's context ({positions} tokens) is shorter than the bench's {MAX_MODEL_LEN}")
    per_token = kv_bytes_per_token(config, dtype)
    block_bytes = BLOCK * per_token
    prompt_blocks = (PREFIX + TAIL) // BLOCK
    return Sizing(
        kv_bytes_per_token=per_token,
        block_bytes=block_bytes,
        prefix_blocks=prompt_blocks,
        host_bytes=max(HOST_FLOOR_BYTES, HELD_PROMPTS * prompt_blocks * block_bytes),
        dir_bytes=max(DIR_FLOOR_BYTES, DIR_PROMPTS * prompt_blocks * block_bytes),
        vllm_cpu_bytes=max(HOST_FLOOR_BYTES, HELD_PROMPTS * prompt_blocks * block_bytes),
        kv_cache_bytes=max(CACHE_FLOOR_BYTES, _round_up(CACHE_BLOCKS * block_bytes, MIB)),
    )


def save_result(path: Path, result: dict[str, Any]) -> None:
    """Merge ``result`` into ``path``: under ``end_to_end_by_model[result["model"]]``, and ``end_to_end`` becomes
    the saved run with the most KV bytes per token (the rest of the file kept)."""
    whole: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    by_model = whole.get(BY_MODEL_KEY)
    if not isinstance(by_model, dict):
        by_model = {}
    by_model[str(result.get("model"))] = result
    whole[BY_MODEL_KEY] = by_model
    whole[HEADLINE_KEY] = max(by_model.values(), key=lambda run: int(run.get("kv_bytes_per_token") or 0))
    whole.pop("end_to_end_note", None)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(whole, indent=4) + "\n")


def _round_up(size: int, unit: int) -> int:
    return -(-size // unit) * unit
