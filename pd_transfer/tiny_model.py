"""A tiny, seeded Llama checkpoint that vLLM can serve, made locally (no model hub).

``build_tiny_model(directory)`` writes a Hugging Face style model folder:

- ``config.json``: ``LlamaForCausalLM``, hidden 256, intermediate 512, 4 layers, 4 attention heads,
  2 KV heads, head_dim 64, vocab 2048, 2048 positions, untied embeddings;
- ``tokenizer.json``: a byte-level BPE (vocab 2048, specials ``<s>``, ``</s>``, ``<pad>``) trained with
  the ``tokenizers`` library on synthetic English-like text generated here from a fixed word list,
  plus ``tokenizer_config.json`` (``PreTrainedTokenizerFast``, a small chat template),
  ``special_tokens_map.json`` and ``generation_config.json``;
- ``model.safetensors``: weights drawn from ``N(0, 0.02)`` with a generator seeded by ``seed``
  (RMSNorm weights are ones), saved with the ``safetensors`` package under the names Hugging Face's
  Llama uses.

The same ``seed`` and ``dtype`` give the same bytes in every file. The tokenizer does not depend on
``seed``, so checkpoints of different seeds share one tokenizer. A finished folder carries
``pd_transfer_tiny_model.json`` (what it was built with and each file's SHA-256); building again
into it is a no-op unless ``overwrite`` is set. This module imports neither vLLM nor transformers.

Command line: ``python -m pd_transfer.tiny_model DIR [--seed N] [--dtype float32] [--overwrite]``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: `make-model` needs the vllm extra's tokenizers
    import torch
    from tokenizers import Tokenizer

__all__ = ["DTYPES", "MODEL_CONFIG", "build_tiny_model", "main", "synthetic_corpus"]

MARKER = "pd_transfer_tiny_model.json"
FORMAT_VERSION = 1

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
SPECIAL_TOKENS = (BOS, EOS, PAD)  # ids 0, 1, 2: the BPE trainer adds special tokens first
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2

VOCAB_SIZE = 2048
HIDDEN = 256
INTERMEDIATE = 512
LAYERS = 4
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 64
MAX_POSITIONS = 2048
INIT_STD = 0.02

DTYPES = ("float32", "bfloat16", "float16")

MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": HIDDEN,
    "intermediate_size": INTERMEDIATE,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "head_dim": HEAD_DIM,
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": MAX_POSITIONS,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "mlp_bias": False,
    "pretraining_tp": 1,
    "initializer_range": INIT_STD,
    "tie_word_embeddings": False,
    "use_cache": True,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "pad_token_id": PAD_ID,
}

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)

# Model files, in the order they are written; the marker comes last.
FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "model.safetensors",
)

# ---------------------------------------------------------------------------------------------
# Synthetic text for the tokenizer
# ---------------------------------------------------------------------------------------------

_NAMES = (
    "Alice Bob Carol David Emma Frank Grace Henry Irene Jack Karen Leo Maria Nora Oscar Paul "
    "Quinn Rosa Sam Tara Uma Victor Wendy Xavier Yara Zoe"
).split()
_DETERMINERS = "the a this that every some one another my your our their his her".split()
_ADJECTIVES = (
    "small large old new quiet loud bright dark warm cold quick slow happy sad green red blue "
    "yellow white black heavy light early late strong gentle busy empty full simple careful "
    "curious ancient modern narrow wide deep shallow clever brave calm noisy tiny huge rare common"
).split()
_NOUNS = (
    "cat dog bird house tree river mountain city village road car train boat book letter song "
    "garden window door table chair kitchen market school teacher student doctor farmer child "
    "friend family morning evening night day week year winter summer spring autumn storm rain "
    "snow sun moon star sky field forest island bridge tower castle machine computer server "
    "message story question answer idea plan problem game picture lamp cup bottle bread apple "
    "orange coffee tea water fire stone paper pencil clock street station library museum office"
).split()
_VERBS = (
    "saw found built opened closed carried painted watched followed remembered visited cleaned "
    "fixed moved lifted pushed pulled wrote read heard liked loved helped called answered asked "
    "crossed reached left kept gave took made started finished counted shared bought sold "
    "borrowed returned chose planted measured described explained"
).split()
_INTRANSITIVE = (
    "slept arrived waited laughed smiled walked ran jumped sang danced worked rested stayed "
    "listened travelled wondered returned disappeared shone fell rose"
).split()
_ADVERBS = (
    "quickly slowly quietly happily carefully suddenly finally often rarely always never soon "
    "again together alone early late gently loudly calmly eagerly"
).split()
_PREPOSITIONS = "in on under near behind beside across through over into from with without after before".split()
_CONJUNCTIONS = ("and", "but", "so", "because", "while", "although", "when", "until")
_QUESTION_WORDS = ("Why", "Where", "When", "How")
_TOPICS = (
    "weather history music science cooking travel gardening numbers colors animals "
    "languages planets rivers computers trains"
).split()


_ONSETS = "b bl br c ch cl cr d dr f fl fr g gl gr h j k l m n p pl pr qu r s sh sk sl sn st str t th tr v w z".split()
_VOWELS = "a e i o u ai ea ee oa oo ou ie".split()
_CODAS = ["", "", "n", "r", "l", "s", "t", "m", "nd", "st", "rk", "ng", "ck", "sh", "th", "mp", "lt"]


def _pseudo_words(count: int, seed: int) -> list[str]:
    """Made-up, pronounceable words (a long tail of rarer 'words' so BPE can fill a 2048 vocabulary)."""
    rng = random.Random(seed)
    words: list[str] = []
    seen: set[str] = set()
    while len(words) < count:
        word = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(rng.randint(1, 3)))
        if word not in seen:
            seen.add(word)
            words.append(word)
    return words


_PSEUDO_NOUNS = _pseudo_words(1500, seed=7)
_PSEUDO_NAMES = [w.capitalize() for w in _pseudo_words(400, seed=11)]


def _skewed(rng: random.Random, words: Sequence[str]) -> str:
    """A word with a Zipf-like bias towards the front of the list."""
    return words[int(len(words) * rng.random() ** 2.5)]


def _noun_phrase(rng: random.Random) -> str:
    if rng.random() < 0.2:
        return rng.choice(_NAMES) if rng.random() < 0.6 else _skewed(rng, _PSEUDO_NAMES)
    words = [rng.choice(_DETERMINERS)]
    if rng.random() < 0.6:
        words.append(rng.choice(_ADJECTIVES))
    noun = rng.choice(_NOUNS) if rng.random() < 0.7 else _skewed(rng, _PSEUDO_NOUNS)
    if words[0] in ("some", "their", "our") and rng.random() < 0.5:
        noun += "s"
    words.append(noun)
    return " ".join(words)


def _clause(rng: random.Random) -> str:
    subject = _noun_phrase(rng)
    if rng.random() < 0.65:
        parts = [subject, rng.choice(_VERBS), _noun_phrase(rng)]
    else:
        parts = [subject, rng.choice(_INTRANSITIVE)]
    if rng.random() < 0.4:
        parts += [rng.choice(_PREPOSITIONS), _noun_phrase(rng)]
    if rng.random() < 0.3:
        parts.append(rng.choice(_ADVERBS))
    return " ".join(parts)


def _capitalize(text: str) -> str:
    return text[:1].upper() + text[1:]


def _sentence(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.55:
        return _capitalize(_clause(rng)) + "."
    if kind < 0.75:
        return _capitalize(_clause(rng)) + ", " + rng.choice(_CONJUNCTIONS) + " " + _clause(rng) + "."
    if kind < 0.85:
        return f"{rng.choice(_QUESTION_WORDS)} was {_noun_phrase(rng)} so {rng.choice(_ADJECTIVES)}?"
    if kind < 0.93:
        count = rng.randint(2, 2026)
        return f"{_capitalize(_noun_phrase(rng))} counted {count} {rng.choice(_NOUNS)}s on day {rng.randint(1, 31)}."
    return f'"{_capitalize(_clause(rng))}!" said {rng.choice(_NAMES)}.'


def _dialogue(rng: random.Random) -> str:
    topic = rng.choice(_TOPICS)
    lines = [
        f"user: Tell me something about {topic}.",
        "assistant: " + " ".join(_sentence(rng) for _ in range(rng.randint(1, 3))),
    ]
    if rng.random() < 0.5:
        lines.append("user: " + _sentence(rng))
        lines.append("assistant: " + _sentence(rng))
    return "\n".join(lines)


def synthetic_corpus(approx_bytes: int = 400_000, *, corpus_seed: int = 1234) -> list[str]:
    """Deterministic English-like paragraphs (and a few chat transcripts) totalling about ``approx_bytes``."""
    rng = random.Random(corpus_seed)
    paragraphs: list[str] = []
    total = 0
    while total < approx_bytes:
        if rng.random() < 0.15:
            text = _dialogue(rng)
        else:
            text = " ".join(_sentence(rng) for _ in range(rng.randint(2, 6)))
        paragraphs.append(text)
        total += len(text) + 1
    return paragraphs


# ---------------------------------------------------------------------------------------------
# Writers
# ---------------------------------------------------------------------------------------------


def json_bytes(obj: object) -> bytes:
    """``obj`` as a model folder's JSON files are written: indented, keys sorted, a final newline."""
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()


def _train_tokenizer() -> Tokenizer:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(synthetic_corpus(), trainer=trainer)
    ids = [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS]
    if ids != [BOS_ID, EOS_ID, PAD_ID]:
        raise RuntimeError(f"unexpected special token ids {ids}")
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"trained a vocabulary of {tokenizer.get_vocab_size()} tokens, not {VOCAB_SIZE}")
    # Like Llama: a BOS in front of every encoded text (callers pass add_special_tokens=False to skip it).
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS} $A", pair=f"{BOS} $A {BOS}:1 $B:1", special_tokens=[(BOS, BOS_ID)]
            ),
        ]
    )
    return tokenizer


def tokenizer_files() -> dict[str, bytes]:
    """The tiny model's tokenizer files: file name -> contents (the tokenizer is trained on each call)."""
    tokenizer = _train_tokenizer()
    special = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    added = {
        str(i): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, token in enumerate(SPECIAL_TOKENS)
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "unk_token": None,
        "added_tokens_decoder": added,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITIONS,
        "padding_side": "left",
    }
    return {
        "tokenizer.json": (tokenizer.to_str(pretty=True) + "\n").encode(),
        "tokenizer_config.json": json_bytes(tokenizer_config),
        "special_tokens_map.json": json_bytes(special),
    }


def _weights(seed: int, dtype: str) -> dict[str, torch.Tensor]:
    import torch

    generator = torch.Generator(device="cpu").manual_seed(seed)
    target = getattr(torch, dtype)

    def normal(*shape: int) -> torch.Tensor:
        # Drawn in float32 so every dtype comes from the same numbers.
        return torch.empty(shape, dtype=torch.float32).normal_(0.0, INIT_STD, generator=generator).to(target)

    def ones(*shape: int) -> torch.Tensor:
        return torch.ones(shape, dtype=target)

    q_out, kv_out = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    tensors = {"model.embed_tokens.weight": normal(VOCAB_SIZE, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        tensors[p + "self_attn.q_proj.weight"] = normal(q_out, HIDDEN)
        tensors[p + "self_attn.k_proj.weight"] = normal(kv_out, HIDDEN)
        tensors[p + "self_attn.v_proj.weight"] = normal(kv_out, HIDDEN)
        tensors[p + "self_attn.o_proj.weight"] = normal(HIDDEN, q_out)
        tensors[p + "mlp.gate_proj.weight"] = normal(INTERMEDIATE, HIDDEN)
        tensors[p + "mlp.up_proj.weight"] = normal(INTERMEDIATE, HIDDEN)
        tensors[p + "mlp.down_proj.weight"] = normal(HIDDEN, INTERMEDIATE)
        tensors[p + "input_layernorm.weight"] = ones(HIDDEN)
        tensors[p + "post_attention_layernorm.weight"] = ones(HIDDEN)
    tensors["model.norm.weight"] = ones(HIDDEN)
    tensors["lm_head.weight"] = normal(VOCAB_SIZE, HIDDEN)
    return tensors


def _safetensors_bytes(seed: int, dtype: str) -> bytes:
    from safetensors.torch import save

    return save(_weights(seed, dtype), metadata={"format": "pt"})


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file beside it: a reader sees the old file or the whole new
    one (mode 0644)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600 files; a model folder is meant to be readable
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _read_marker(directory: Path) -> dict | None:
    try:
        marker = json.loads((directory / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def _is_complete(directory: Path, marker: dict) -> bool:
    files = marker.get("files")
    if not isinstance(files, dict) or set(files) != set(FILES):
        return False
    for name, digest in files.items():
        path = directory / name
        if not path.is_file() or _sha256(path) != digest:
            return False
    return True


def build_tiny_model(directory: Path, *, seed: int = 0, dtype: str = "float32", overwrite: bool = False) -> Path:
    """Write the tiny Llama checkpoint into ``directory`` (created if needed) and return its path.

    A folder already built with the same ``seed`` and ``dtype`` whose files are intact is left as it
    is. One built with other parameters raises ``FileExistsError`` unless ``overwrite`` is set; an
    unfinished one (no marker, or a file missing or changed) is rebuilt.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, not {dtype!r}")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, not {seed!r}")
    directory = Path(directory).expanduser().resolve()
    if directory.exists() and not directory.is_dir():
        raise NotADirectoryError(f"{directory} exists and is not a directory")
    wanted = {"format_version": FORMAT_VERSION, "seed": seed, "dtype": dtype}

    marker = _read_marker(directory)
    if marker is not None and not overwrite:
        built_with = {k: marker.get(k) for k in wanted}
        if built_with != wanted:
            if _is_complete(directory, marker):
                raise FileExistsError(
                    f"{directory} holds a tiny model built with {built_with}, not {wanted}; pass overwrite=True"
                )
        elif _is_complete(directory, marker):
            return directory

    directory.mkdir(parents=True, exist_ok=True)
    (directory / MARKER).unlink(missing_ok=True)
    contents: dict[str, bytes] = {
        "config.json": json_bytes({**MODEL_CONFIG, "torch_dtype": dtype}),
        "generation_config.json": json_bytes({"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}),
        **tokenizer_files(),
        "model.safetensors": _safetensors_bytes(seed, dtype),
    }
    digests = {}
    for name in FILES:
        write_atomic(directory / name, contents[name])
        digests[name] = hashlib.sha256(contents[name]).hexdigest()
    write_atomic(directory / MARKER, json_bytes({**wanted, "files": digests}))
    return directory


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``pd-transfer make-model`` (for wiring into another parser)."""
    parser.add_argument("directory", type=Path, metavar="DIR", help="folder to write the model into")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights (default 0)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="weight dtype (default float32)")
    parser.add_argument("--overwrite", action="store_true", help="rebuild even if DIR already holds the model")


def run(args: argparse.Namespace) -> int:
    """Build the model described by parsed ``args``; print its folder. Returns an exit code."""
    try:
        path = build_tiny_model(args.directory, seed=args.seed, dtype=args.dtype, overwrite=args.overwrite)
    except (ValueError, OSError) as exc:
        print(f"make-model: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pd-transfer make-model",
        description="Write a tiny seeded Llama checkpoint (config, BPE tokenizer, safetensors) that vLLM can serve.",
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
