"""Digests of KV rows where they sit in memory, what a prefill and a decode compute over the same moved bytes to check
them end to end (issue 42): XXH3-64 (seed 0) of the bytes of a run of :data:`~pd_transfer.transfer.cma.IOVEC` rows
taken in order as one stream, as the offload tier's block checksum is (:mod:`pd_transfer.offload.checksum`: any change
of the bytes, moved, zeroed, stale or swapped ranges, changes it with probability ``1 - 2**-64``; about 9-10 GB/s a
core on these hosts, the speed of reading the bytes).

Which of a request's groups of rows a decode checks: ``verify`` is ``all`` (every group), ``sample`` (one group in
:data:`SAMPLE_EVERY`, at an offset that turns with each request, so that over ``SAMPLE_EVERY`` requests every group
position is checked; at least one group a request) or ``off``.
"""

from __future__ import annotations

import ctypes
from typing import Literal, get_args

import numpy as np
import xxhash

#: What a decode checks of what it received (see the module's docstring).
Verify = Literal["all", "sample", "off"]
VERIFY_MODES: tuple[Verify, ...] = get_args(Verify)
#: ``sample`` checks one group in this many.
SAMPLE_EVERY = 8


def rows_digest(rows: np.ndarray) -> int:
    """XXH3-64 of the bytes of ``rows`` (:data:`~pd_transfer.transfer.cma.IOVEC` entries of this process's memory,
    each readable), in order, as one stream: an integer in ``[0, 2**64)``. The bytes are read where they are (no
    copy); the caller keeps them from changing meanwhile if it wants the digest of one moment."""
    digest = xxhash.xxh3_64()
    for base, length in zip(rows["base"].tolist(), rows["length"].tolist(), strict=True):
        if length:
            digest.update((ctypes.c_char * length).from_address(base))
    return int(digest.intdigest())


def groups_to_verify(verify: str, groups: int, turn: int) -> list[int]:
    """The indices of the groups (of ``groups``) a request checks under ``verify``; ``turn``: the request's number
    among those checked (any integer that grows by one a request). ``ValueError`` for a mode that is none."""
    if verify not in VERIFY_MODES:
        raise ValueError(f"verify: {verify[:40]!r} is none of {', '.join(VERIFY_MODES)}")
    if verify == "all":
        return list(range(groups))
    if verify == "off" or groups == 0:
        return []
    every = min(SAMPLE_EVERY, groups)
    return list(range(turn % every, groups, every))
