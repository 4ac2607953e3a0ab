"""vLLM's prefix-cache block hashes, computed the way the engine computes them, without importing vLLM.

vLLM (0.31-0.32, ``vllm/v1/core/kv_cache_utils.py``) names a full block of ``block_size`` tokens by
``hash_fn((parent, tuple(tokens), extra_keys))``: ``parent`` is the previous block's hash, or for the first block
``NONE_HASH = hash_fn(seed)``; ``extra_keys`` is None for plain text prompts (no LoRA, multimodal input or cache
salt). ``hash_fn`` is the engine's ``--prefix-caching-hash-algo``:

* ``sha256`` (vLLM's default): SHA-256 of the pickle (highest protocol) of the object;
* ``sha256_cbor``: SHA-256 of its canonical CBOR;
* ``xxhash`` / ``xxhash_cbor``: XXH3-128 of the same encodings.

The seed is the engine's ``PYTHONHASHSEED`` when set; otherwise ``"vllm-none-hash"`` for the SHA-256 algorithms and a
random per-process value for the xxhash ones, which no other process can reproduce: :class:`BlockHasher` refuses
those without an explicit seed.

The events name a block by these bytes, or by their last 8 bytes as an unsigned integer
(``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``); :func:`block_key` maps both forms to one integer key (the last 60 bits:
a Python int of two 30-bit digits, the smallest form a dict key of that width takes), so the index is the same
whichever form an engine sends. A collision of two keys costs a routing choice, never correctness.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import xxhash

ALGORITHMS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
#: The seed vLLM derives NONE_HASH from when PYTHONHASHSEED is unset and the algorithm is SHA-256.
DEFAULT_SEED = "vllm-none-hash"
KEY_BITS = 60
_KEY_MASK = (1 << KEY_BITS) - 1


class HashConfigError(ValueError):
    """The proxy cannot compute the engines' block hashes with what it was told (algorithm, seed, block size)."""


def block_key(block_hash: bytes | int) -> int:
    """The index's key of an engine's block hash (bytes, or the int form of its last 8 bytes)."""
    if isinstance(block_hash, int):
        return block_hash & _KEY_MASK
    return int.from_bytes(block_hash[-8:], "big") & _KEY_MASK


def _cbor_head(major: int, value: int) -> bytes:
    """A canonical CBOR item head (RFC 8949 section 4.2: the shortest argument form)."""
    if value < 24:
        return bytes([major << 5 | value])
    for extra, width in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if value < 1 << (8 * width):
            return bytes([major << 5 | extra]) + value.to_bytes(width, "big")
    raise HashConfigError(f"an integer of {value.bit_length()} bits has no CBOR encoding here")


def _cbor(value: Any) -> bytes:
    """Canonical CBOR of what block hashing feeds it: bytes, str, non-negative ints, None, tuples of those."""
    if value is None:
        return b"\xf6"
    if isinstance(value, bool):
        return b"\xf5" if value else b"\xf4"
    if isinstance(value, int):
        return _cbor_head(0, value) if value >= 0 else _cbor_head(1, -1 - value)
    if isinstance(value, bytes):
        return _cbor_head(2, len(value)) + value
    if isinstance(value, str):
        raw = value.encode()
        return _cbor_head(3, len(raw)) + raw
    if isinstance(value, tuple | list):
        return _cbor_head(4, len(value)) + b"".join(_cbor(v) for v in value)
    raise HashConfigError(f"cannot CBOR-encode a {type(value).__name__} for block hashing")


def _pickled(value: Any) -> bytes:
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def _xxh3_128(data: bytes) -> bytes:
    return xxhash.xxh3_128_digest(data)


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


_FUNCTIONS: dict[str, tuple[Callable[[Any], bytes], Callable[[bytes], bytes]]] = {
    "sha256": (_pickled, _sha256),
    "sha256_cbor": (_cbor, _sha256),
    "xxhash": (_pickled, _xxh3_128),
    "xxhash_cbor": (_cbor, _xxh3_128),
}


class BlockHasher:
    """The engines' block hashes of a token sequence: ``algorithm`` (one of :data:`ALGORITHMS`), ``seed`` (the
    engines' ``PYTHONHASHSEED``; None: vLLM's default, refused for xxhash whose default is random per process) and
    ``block_size`` (tokens per block, the engines' ``--block-size``)."""

    def __init__(self, algorithm: str = "sha256", seed: str | None = None, block_size: int = 16) -> None:
        if algorithm not in _FUNCTIONS:
            raise HashConfigError(
                f"unknown prefix-caching hash algorithm {algorithm[:40]!r}; one of {', '.join(ALGORITHMS)}"
            )
        if seed is None and algorithm.startswith("xxhash"):
            raise HashConfigError(
                f"with --prefix-caching-hash-algo {algorithm} and no PYTHONHASHSEED each vLLM engine seeds its block"
                " hashes randomly, so no router can compute them: set PYTHONHASHSEED to the same value on the"
                " engines and give it to the proxy (--kv-hash-seed), or use sha256"
            )
        if block_size < 1:
            raise HashConfigError(f"the block size must be positive, got {block_size}")
        self.algorithm = algorithm
        self.seed = DEFAULT_SEED if seed is None else seed
        self.block_size = block_size
        encode, digest = _FUNCTIONS[algorithm]
        self._hash: Callable[[Any], bytes] = lambda value: digest(encode(value))
        self.none_hash = self._hash(self.seed)

    def block_hash(self, parent: bytes | None, tokens: Sequence[int], extra_keys: Any = None) -> bytes:
        """One block's hash, as vLLM's ``hash_block_tokens`` computes it."""
        return self._hash((parent or self.none_hash, tuple(tokens), extra_keys))

    def hashes(self, token_ids: Sequence[int], max_blocks: int | None = None) -> list[bytes]:
        """The hashes of the full blocks of ``token_ids`` (a partial last block has none), at most ``max_blocks``."""
        size = self.block_size
        count = len(token_ids) // size
        if max_blocks is not None:
            count = min(count, max_blocks)
        out: list[bytes] = []
        parent: bytes | None = None
        for i in range(count):
            parent = self.block_hash(parent, token_ids[i * size : (i + 1) * size])
            out.append(parent)
        return out

    def keys(self, token_ids: Sequence[int], max_blocks: int | None = None) -> list[int]:
        """The index keys (:func:`block_key`) of the full blocks of ``token_ids``."""
        return [block_key(h) for h in self.hashes(token_ids, max_blocks)]

    def mismatch(
        self, block_hashes: Sequence[bytes | int], parent: bytes | int | None, token_ids: Sequence[int], block_size: int
    ) -> str | None:
        """Why an engine's ``BlockStored`` (without extra keys) cannot come from this hasher, or None when it can
        or cannot be checked (an int parent hash: its full bytes are unknown). Checks the first block only."""
        if block_size != self.block_size:
            return (
                f"the engine's blocks hold {block_size} tokens, the proxy was told {self.block_size} (--kv-block-size)"
            )
        if not block_hashes or len(token_ids) < block_size or isinstance(parent, int):
            return None
        expected = self.block_hash(parent, token_ids[:block_size])
        if block_key(block_hashes[0]) != block_key(expected):
            return (
                f"the engine's block hashes are not {self.algorithm} with the seed the proxy was given: set"
                " --kv-hash-algo to the engines' --prefix-caching-hash-algo and --kv-hash-seed to their"
                " PYTHONHASHSEED (unset: vLLM's default)"
            )
        return None
