"""The payload checksum of a block file: row and column sums of its pages, hashed.

A page whose size is a multiple of 4096 bytes is read as a matrix of little-endian uint64 words, 512 to a
row (one row per 4 KiB). With all sums wrapping (mod 2**64), the checksum hashes (8-byte BLAKE2b, read as a
little-endian integer) the 512 column sums of the block, page ``p``'s weighted by the odd number ``2p + 1``,
then every row sum of every page in order, then the CRC-32 of each page of any other size.

What it catches: a change of up to three bits anywhere, any change confined to one row or one column,
zero-filled or stale 4 KiB ranges, pages moved or swapped, random garbage (all but about 2**-64 of it).
What it misses: changes that cancel in every row sum and every weighted column sum at once (at least four
words at the corners of a rectangle, with opposite differences), a pattern storage faults do not make; the
directory is trusted storage, like the engines' own memory. Why not one CRC-32 of the payload: zlib's ran
at 1.2-3.8 GB/s here, slower than reading the file from the page cache, and halved the disk tier's
throughput; the sums are numpy reductions, and only 1/256 of the bytes (the sums) are hashed.
"""

from __future__ import annotations

import hashlib
import sys
import zlib
from collections.abc import Sequence

import numpy as np

_ROW_WORDS = 512
_ROW_BYTES = _ROW_WORDS * 8


def payload_checksum(pages: Sequence[np.ndarray]) -> int:
    """The checksum of the pages (contiguous 1-D uint8 arrays), in order: an integer in ``[0, 2**64)``."""
    columns = np.zeros(_ROW_WORDS, np.uint64)
    rows: list[bytes] = []
    others: list[bytes] = []
    for index, page in enumerate(pages):
        if page.nbytes % _ROW_BYTES:
            others.append(zlib.crc32(page.data).to_bytes(4, "little"))
            continue
        words = page.view(np.uint64).reshape(-1, _ROW_WORDS)
        if sys.byteorder != "little":
            words = words.byteswap()
        columns += np.add.reduce(words, axis=0) * np.uint64(2 * index + 1)
        rows.append(np.add.reduce(words, axis=1).tobytes())
    digest = hashlib.blake2b(columns.tobytes(), digest_size=8, person=b"pdt-kvblock")
    for part in (*rows, *others):
        digest.update(part)
    return int.from_bytes(digest.digest(), "little")
