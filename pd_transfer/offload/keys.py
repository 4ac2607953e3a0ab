"""Block keys: one 16-byte name per full block of a token sequence, chained so a key names a whole prefix.

``key[i] = blake2b(domain | fingerprint_digest | key[i-1] | tokens of block i as int64 little-endian)``
with ``key[-1]`` the empty string. Two consequences:

* a key equals another only for the same model (the fingerprint digest is inside every hash), the same
  tokens in this block *and* every block before it: a shared prefix hits across requests, processes and
  machines; a different model, or the same tokens after a different prefix, never does;
* only full blocks have keys (a partial block's KV changes as tokens arrive).

The fingerprint is the model-level :class:`~pd_transfer.spec.ModelFingerprint`; how one rank lays out its
share of a block (TP rank, page sizes) is a :class:`~pd_transfer.offload.specs.PageFormat`, checked by the
tiers, not part of the key, so every rank of an engine stores and loads under the same keys.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgspec
import numpy as np

from pd_transfer.spec import ModelFingerprint

from .errors import OffloadInputError

#: Bytes of a block key.
KEY_BYTES = 16
_DOMAIN = b"pd-transfer/offload/block-key/v1"

BlockKey = bytes


def fingerprint_digest(fingerprint: ModelFingerprint) -> bytes:
    """16 bytes naming the model: the hash of the fingerprint's canonical msgpack encoding."""
    encoded = msgspec.msgpack.encode(fingerprint)
    return hashlib.blake2b(encoded, digest_size=KEY_BYTES, person=b"pdt-fingerprint").digest()


def chain_block_keys(
    fingerprint: ModelFingerprint,
    token_ids: Sequence[int],
    block_size: int,
    *,
    parent: BlockKey | None = None,
) -> list[BlockKey]:
    """Keys of the full blocks of ``token_ids`` (``len(token_ids) // block_size`` keys).

    ``parent`` is the key of the block just before ``token_ids[0]`` when continuing a chain (None: the
    tokens start the sequence). Raises :class:`OffloadInputError` for a non-positive block size, a parent
    of the wrong length, or a token id outside ``[0, 2**63)``.
    """
    if block_size <= 0:
        raise OffloadInputError(f"block_size must be positive, got {block_size}")
    if parent is not None and len(parent) != KEY_BYTES:
        raise OffloadInputError(f"a parent key is {KEY_BYTES} bytes, got {len(parent)}")
    full = len(token_ids) // block_size * block_size
    try:
        tokens = np.asarray(token_ids[:full], dtype=np.int64) if full else np.zeros(0, dtype=np.int64)
    except (OverflowError, TypeError, ValueError):
        raise OffloadInputError("token ids must be integers in [0, 2**63)") from None
    if tokens.ndim != 1 or (full and int(tokens.min()) < 0):
        raise OffloadInputError("token ids must be integers in [0, 2**63)")
    model = fingerprint_digest(fingerprint)
    previous = parent or b""
    keys: list[BlockKey] = []
    for start in range(0, full, block_size):
        digest = hashlib.blake2b(digest_size=KEY_BYTES)
        digest.update(_DOMAIN)
        digest.update(model)
        digest.update(len(previous).to_bytes(1, "little") + previous)
        digest.update(tokens[start : start + block_size].astype("<i8").tobytes())
        previous = digest.digest()
        keys.append(previous)
    return keys


def check_key(key: object) -> BlockKey:
    """``key`` as a block key, or :class:`OffloadInputError` if it is not ``KEY_BYTES`` bytes."""
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        length = len(key) if isinstance(key, bytes) else type(key).__name__
        raise OffloadInputError(f"a block key is {KEY_BYTES} bytes, got {length}")
    return key


def short(key: BlockKey) -> str:
    """The first 12 hex digits of a key, for logs."""
    return key[:6].hex()
