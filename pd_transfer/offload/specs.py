"""What the scheduler side hands the worker side, and the events it reports.

A :class:`TierBlocks` names blocks in a tier (keys, and for the host pool the pool rows); a worker moves
their bytes to or from the engine blocks listed beside it in a :class:`TransferJob`. A
:class:`PageFormat` says how one rank's share of a block is laid out, so a tier can refuse bytes written
by another model, another rank or another layout.
"""

from __future__ import annotations

import hashlib
from typing import Literal

import msgspec

from pd_transfer.spec import ModelFingerprint

from .errors import OffloadInputError
from .keys import BlockKey

TierName = Literal["host", "disk"]
Direction = Literal["store", "load"]


class PageFormat(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One rank's bytes of one block: page ``i`` is ``page_bytes[i]`` bytes of the engine's cache tensor
    ``i`` (each tensor seen as ``(num_blocks, page_bytes[i])`` uint8). ``layout`` is free text naming
    anything else that changes the bytes (attention backend, packing); engines that differ in any field
    never read each other's blocks."""

    fingerprint: ModelFingerprint
    page_bytes: tuple[int, ...]
    block_size: int  # tokens per block
    tp_size: int = 1
    tp_rank: int = 0
    layout: str = ""

    def __post_init__(self) -> None:
        if not self.page_bytes or any(size <= 0 for size in self.page_bytes):
            raise OffloadInputError(f"page_bytes must be positive sizes, got {self.page_bytes[:8]}")
        if self.block_size <= 0 or not 0 <= self.tp_rank < self.tp_size:
            raise OffloadInputError("block_size must be positive and 0 <= tp_rank < tp_size")

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of this rank, all pages together."""
        return sum(self.page_bytes)

    @property
    def tag(self) -> bytes:
        """8 bytes naming this format (hash of its msgpack encoding)."""
        return hashlib.blake2b(msgspec.msgpack.encode(self), digest_size=8, person=b"pdt-page-format").digest()


class TierBlocks(msgspec.Struct, frozen=True):
    """Blocks in one tier: ``keys[i]`` lives in pool row ``rows[i]`` (host tier; empty for the disk tier).
    ``files[i]`` (disk tier, optional): the key naming the file that holds ``keys[i]``, from
    :func:`~.file_format.file_keys` over the prompt's whole chain of keys (the key of the last block of
    ``keys[i]``'s group, or ``keys[i]`` itself); empty: every block in its own file."""

    tier: TierName
    keys: tuple[BlockKey, ...]
    rows: tuple[int, ...] = ()
    files: tuple[BlockKey, ...] = ()


class TransferJob(msgspec.Struct, frozen=True):
    """Move ``tier_blocks.keys[i]`` to (``store``) or from (``load``) engine block ``block_ids[i]``."""

    job_id: int
    direction: Direction
    block_ids: tuple[int, ...]
    tier_blocks: TierBlocks


class TransferResult(msgspec.Struct, frozen=True):
    """A finished job. ``ok`` only if every block moved and, for loads, every block checked out; a failed
    load may have written some engine blocks, which must then be treated as garbage (recompute them)."""

    job_id: int
    direction: Direction
    ok: bool
    num_bytes: int  # bytes moved
    seconds: float  # wall time of the transfer in the worker
    failed_keys: tuple[BlockKey, ...] = ()
    error: str = ""


class BlocksStored(msgspec.Struct, frozen=True):
    """These blocks became loadable in ``tier``."""

    tier: TierName
    keys: tuple[BlockKey, ...]


class BlocksEvicted(msgspec.Struct, frozen=True):
    """These blocks left ``tier`` (evicted for room, failed to store, or found gone)."""

    tier: TierName
    keys: tuple[BlockKey, ...]


OffloadEvent = BlocksStored | BlocksEvicted
