"""The disk tier's two file formats and how a block finds the file that holds it.

A **block file** (``<key hex>.kvblock``) holds one block; a **group file** (``<key hex>.g<N>.kvgroup``) holds
``N`` consecutive blocks of one prompt, the blocks ``g*N .. g*N + N - 1`` of its chain of block keys, and is
named by the key of its *last* block. That key chains every key before it, so the name commits to the whole
group's content: two prompts share a group file exactly when they share the group's last block's whole
prefix. A lookup that knows a prompt's chain of keys computes each block's file with :func:`file_keys`;
``N`` in the name keeps tiers configured with different group sizes from reading each other's groups.

Block file (version 2, little-endian): see :mod:`.files` and docs/offload.md.

Group file (version 1, little-endian)::

    offset       bytes   field
    0            8       magic b"PDKVGRP1"
    8            2       format version (1)
    10           2       zero
    12           4       blocks in the file (N)
    16           16      file key (the key of the group's last block)
    32           8       page format tag
    40           8       payload bytes of one block
    48           4       header bytes (64 + 24 N, rounded up to a multiple of 64)
    52           4       CRC-32 of bytes 0..51 and of the entries
    56           8       zero
    64           24 N    entries: block key (16), payload checksum (8), one per block in order
    header bytes ...     payload: block 0's pages in format order, then block 1's, ...

Each block keeps its own payload checksum, so a load checks exactly the blocks it reads.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from typing import Literal

from .errors import OffloadInputError
from .keys import BlockKey

ReadOutcome = Literal["ok", "missing", "truncated", "corrupt", "foreign"]

MAGIC = b"PDKVBLK1"
VERSION = 2  # 1: the payload checksum was row and column sums (checksum.py)
HEADER_BYTES = 64
_HEADER = struct.Struct("<8sHHI16s8sQQ")  # up to the header CRC

GROUP_MAGIC = b"PDKVGRP1"
GROUP_VERSION = 1
_GROUP_FIXED = struct.Struct("<8sHHI16s8sQI")  # up to the CRC
_ENTRY = struct.Struct("<16sQ")
MAX_GROUP_BLOCKS = 256


def encode_header(key: BlockKey, tag: bytes, payload_bytes: int, checksum: int) -> bytes:
    """The 64-byte header of a block file."""
    fields = _HEADER.pack(MAGIC, VERSION, HEADER_BYTES, 0, key, tag, payload_bytes, checksum)
    return (fields + struct.pack("<I", zlib.crc32(fields))).ljust(HEADER_BYTES, b"\0")


def check_header(header: bytes, key: BlockKey, tag: bytes, payload_bytes: int) -> tuple[ReadOutcome, int]:
    """``("ok", payload checksum)`` if ``header`` is a valid header of ``key`` in format ``tag``, else the reason."""
    if len(header) < HEADER_BYTES:
        return "truncated", 0
    fields = header[: _HEADER.size]
    if header[:8] != MAGIC or struct.unpack_from("<I", header, _HEADER.size)[0] != zlib.crc32(fields):
        return "corrupt", 0
    _magic, version, header_bytes, _flags, file_key, file_tag, file_payload, checksum = _HEADER.unpack(fields)
    if version != VERSION or header_bytes != HEADER_BYTES or file_tag != tag or file_payload != payload_bytes:
        return "foreign", 0
    if file_key != key:
        return "foreign", 0
    return "ok", checksum


def group_header_bytes(blocks: int) -> int:
    """Bytes of a group file's header for ``blocks`` blocks (a multiple of 64)."""
    return -(-(64 + _ENTRY.size * blocks) // 64) * 64


def encode_group_header(
    file_key: BlockKey, tag: bytes, payload_bytes: int, entries: Sequence[tuple[BlockKey, int]]
) -> bytes:
    """The header of a group file of ``entries`` (block key, payload checksum), named by ``file_key``."""
    size = group_header_bytes(len(entries))
    fixed = _GROUP_FIXED.pack(GROUP_MAGIC, GROUP_VERSION, 0, len(entries), file_key, tag, payload_bytes, size)
    body = b"".join(_ENTRY.pack(key, checksum) for key, checksum in entries)
    crc = zlib.crc32(body, zlib.crc32(fixed))
    return (fixed + struct.pack("<I", crc)).ljust(64, b"\0") + body.ljust(size - 64, b"\0")


def check_group_header(
    header: bytes, file_key: BlockKey, tag: bytes, payload_bytes: int, blocks: int
) -> tuple[ReadOutcome, dict[BlockKey, tuple[int, int]]]:
    """``("ok", {block key: (slot, payload checksum)})`` if ``header`` (at least :func:`group_header_bytes`
    bytes of the file) is a valid header of the ``blocks``-block group ``file_key`` in format ``tag``; else
    the reason and an empty map."""
    size = group_header_bytes(blocks)
    if len(header) < size:
        return "truncated", {}
    fixed = header[: _GROUP_FIXED.size]
    body = header[64 : 64 + _ENTRY.size * blocks]
    stored_crc = struct.unpack_from("<I", header, _GROUP_FIXED.size)[0]
    if header[:8] != GROUP_MAGIC or stored_crc != zlib.crc32(body, zlib.crc32(fixed)):
        return "corrupt", {}
    _magic, version, _zero, count, key, file_tag, file_payload, header_bytes = _GROUP_FIXED.unpack(fixed)
    if (version, count, header_bytes, file_tag, file_payload) != (GROUP_VERSION, blocks, size, tag, payload_bytes):
        return "foreign", {}
    entries = [_ENTRY.unpack_from(body, i * _ENTRY.size) for i in range(blocks)]
    if key != file_key or entries[-1][0] != file_key:
        return "foreign", {}
    return "ok", {entry_key: (slot, checksum) for slot, (entry_key, checksum) in enumerate(entries)}


def check_group_blocks(group_blocks: int) -> int:
    """``group_blocks`` if it is a valid group size (1: every block in its own file), else OffloadInputError."""
    if isinstance(group_blocks, bool) or not isinstance(group_blocks, int) or not 1 <= group_blocks <= MAX_GROUP_BLOCKS:
        raise OffloadInputError(f"group_blocks must be an integer in 1..{MAX_GROUP_BLOCKS}, got {group_blocks!r}")
    return group_blocks


def file_keys(chain: Sequence[BlockKey], group_blocks: int) -> tuple[BlockKey, ...]:
    """For a prompt's chain of block keys (``chain[i]``: block ``i`` of the prompt, from its first block), the
    key naming the file that holds each block: the key of the last block of its group of ``group_blocks``
    (groups aligned to block 0) when the whole group is in ``chain``, else its own key (a tail stays in block
    files). With ``group_blocks`` 1, ``chain`` itself."""
    check_group_blocks(group_blocks)
    whole = len(chain) - len(chain) % group_blocks
    return tuple(
        chain[(i // group_blocks + 1) * group_blocks - 1] if i < whole else chain[i] for i in range(len(chain))
    )
