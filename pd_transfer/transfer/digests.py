"""Digests of KV rows where they sit in memory, what a prefill and a decode compute over the same moved bytes to check
them end to end (issue 42): XXH3-64 (seed 0) of the bytes of a run of :data:`~pd_transfer.transfer.cma.IOVEC` rows
taken in order as one stream, as the offload tier's block checksum is (:mod:`pd_transfer.offload.checksum`: any change
of the bytes, moved, zeroed, stale or swapped ranges, changes it with probability ``1 - 2**-64``; about 9-10 GB/s a
core on these hosts, the speed of reading the bytes).

Which of a request's groups of rows (a stream's layers), or rows (a read's units), a decode checks: ``verify`` is
``all`` (every one), ``sample`` (an eighth of them, :data:`SAMPLE_EVERY`: the first eighth for one request, the next
for the next, and so on, so that over ``SAMPLE_EVERY`` requests every position is checked; adjacent ones, which lie
in long runs of memory, cheap to hash; at least one a request) or ``off``.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
from typing import Literal, get_args

import numpy as np
import xxhash

#: What a decode checks of what it received (see the module's docstring).
Verify = Literal["all", "sample", "off"]
VERIFY_MODES: tuple[Verify, ...] = get_args(Verify)
#: ``sample`` checks one group in this many.
SAMPLE_EVERY = 8
#: Requests checked so far in this process: where ``sample`` looks turns with it (:func:`next_turn`).
_TURNS = itertools.count()


def next_turn() -> int:
    """The next request's turn for :func:`sampled` (thread-safe: ``itertools.count`` under the GIL)."""
    return next(_TURNS)


def rows_digest(rows: np.ndarray) -> int:
    """XXH3-64 of the bytes of ``rows`` (:data:`~pd_transfer.transfer.cma.IOVEC` entries of this process's memory,
    each readable), in order, as one stream: an integer in ``[0, 2**64)``. The bytes are read where they are (no
    copy); the caller keeps them from changing meanwhile if it wants the digest of one moment."""
    digest = xxhash.xxh3_64()
    for base, length in zip(rows["base"].tolist(), rows["length"].tolist(), strict=True):
        if length:
            digest.update(_bytes_at(length).from_address(base))
    return int(digest.intdigest())


def span_digest(address: int, length: int) -> int:
    """:func:`rows_digest` of the one row of ``length`` bytes at ``address`` (one call, no row array: for many short
    spans, a held request's blocks)."""
    return int(xxhash.xxh3_64_intdigest(_bytes_at(length).from_address(address))) if length else _EMPTY


_EMPTY = int(xxhash.xxh3_64_intdigest(b""))


@functools.lru_cache(maxsize=256)
def _bytes_at(length: int) -> type[ctypes.Array[ctypes.c_char]]:
    """The ctypes type of ``length`` bytes (made once a length: making one costs more than hashing a short row)."""
    return ctypes.c_char * length


def sampled(verify: str, count: int, turn: int, every: int = SAMPLE_EVERY) -> slice | None:
    """Which of ``count`` groups (or rows) a request checks under ``verify``, as a slice of them (None: none);
    ``turn``: the request's number among those checked (any integer that grows by one a request); ``every``:
    ``sample`` checks one ``every``-th of them. ``ValueError`` for a mode that is none."""
    if verify not in VERIFY_MODES:
        raise ValueError(f"verify: {verify[:40]!r} is none of {', '.join(VERIFY_MODES)}")
    if verify == "off" or count == 0:
        return None
    if verify == "all":
        return slice(0, count)
    every = min(every, count)
    share = turn % every
    return slice(count * share // every, count * (share + 1) // every)  # adjacent ones: few, long runs to hash


def groups_to_verify(verify: str, groups: int, turn: int) -> list[int]:
    """The indices of the groups (of ``groups``) a request checks under ``verify`` (:func:`sampled`)."""
    chosen = sampled(verify, groups, turn)
    return [] if chosen is None else list(range(groups)[chosen])
