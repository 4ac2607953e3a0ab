"""What a prefill rank's held requests' KV was when they were held: a digest of each of their blocks in each plane,
so that a read checks the bytes it sends against the forward that wrote them, not only against the wire.

A digest of rows (:mod:`pd_transfer.transfer.digests`) computed when they are sent (tcp) or once a decode read them
(read checks, :mod:`pd_transfer.connector.prefill.read_checks`) and compared where they landed catches what the wire
or the decode's side changed. Bytes changed in the prefill's cache after its forward and before the read (a stray
write, a fault; issue 42 asks for it) would be sent, read and digested as they are now. So the prefill rank (a host
cache's) observes its :class:`~pd_transfer.connector.streams.StreamBoard` with one of these: each request is digested
here when it is held (every block of it in every plane, on the thread that holds it: about 10 GB/s a core, a CPU
forward's KV in far less than the forward took), and the digest of a read's or a stream's checked rows is followed by
a re-digest of the blocks holding those rows (:meth:`HeldDigests.changed`): a block that changed since its hold fails
the read as a digest mismatch would, naming the block.

Host caches only. Memory: one digest per block and plane of each held request. Thread-safe.
"""

from __future__ import annotations

import threading

import numpy as np

from pd_transfer.connector.cache import KVCache
from pd_transfer.spec import planes_of
from pd_transfer.transfer.digests import span_digest


class HeldDigests:
    """The digest of each (plane, block) of the held requests of ``cache`` as their hold found it (a
    :class:`~pd_transfer.connector.streams.HoldObserver`)."""

    def __init__(self, cache: KVCache) -> None:
        self._planes = planes_of(list(cache.regions))
        self._bases = np.array([plane.base_address for plane in self._planes], dtype=np.int64)
        self._strides = np.array([plane.block_stride for plane in self._planes], dtype=np.int64)
        self._lens = np.array([plane.block_len for plane in self._planes], dtype=np.int64)
        self._counts = np.array([plane.num_blocks for plane in self._planes], dtype=np.int64)
        self._lock = threading.Lock()
        self._digests: dict[tuple[int, int], tuple[str, int]] = {}  # (plane, block) -> (request, digest at its hold)
        self._keys: dict[str, list[tuple[int, int]]] = {}  # request -> its keys

    def held(self, request_id: str, block_ids: tuple[int, ...]) -> None:
        """``request_id`` is held in ``block_ids``: digest every block of it in every plane, now."""
        keys = [(plane, block) for plane in range(len(self._planes)) for block in block_ids]
        digests = {key: (request_id, self._digest(*key)) for key in keys}
        with self._lock:
            self._forget(request_id)
            self._digests.update(digests)
            self._keys[request_id] = keys

    def ended(self, request_id: str) -> None:
        """``request_id``'s blocks are the engine's again: its digests are dropped."""
        with self._lock:
            self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        for key in self._keys.pop(request_id, ()):
            if self._digests.get(key, ("",))[0] == request_id:
                del self._digests[key]

    @property
    def blocks(self) -> int:
        """How many (plane, block) digests are kept."""
        with self._lock:
            return len(self._digests)

    def changed(self, rows: np.ndarray) -> str:
        """Why ``rows`` (IOVEC entries in the cache) must not be sent as their hold left them: the first block holding
        some of them, of a held request, whose bytes differ from its digest at the hold (a block of no held request is
        not checked); "" when none does."""
        for plane, block in self._covering(rows):
            with self._lock:
                held = self._digests.get((plane, block))
            if held is None:
                continue
            request_id, digest = held
            if self._digest(plane, block) != digest:
                where = self._planes[plane]
                return (
                    f"block {block} of layer {where.layer} ({where.kind}) changed in the prefill's cache after request"
                    f" {request_id[:80]} was held"
                )
        return ""

    def _covering(self, rows: np.ndarray) -> list[tuple[int, int]]:
        """The (plane, block) pairs holding some byte of ``rows``, in order (a plane's block: ``block_len`` bytes every
        ``block_stride``; planes may interleave, K and V in each block). One pass over rows x planes in numpy."""
        bases, strides, lens, counts = self._bases, self._strides, self._lens, self._counts
        starts = rows["base"].astype(np.int64)[:, None]
        lasts = starts + rows["length"].astype(np.int64)[:, None] - 1
        first = np.maximum(-((bases + lens - 1 - starts) // strides), 0)  # the first block ending at or after start
        final = np.minimum((lasts - bases) // strides, counts - 1)  # the last block beginning at or before last
        hit_rows, hit_planes = np.nonzero(first <= final)  # in row order, then plane order
        firsts, finals = first[hit_rows, hit_planes], final[hit_rows, hit_planes]
        keys: dict[tuple[int, int], None] = {}
        if np.array_equal(firsts, finals):  # each row inside one block of each plane it touches (a plan's units)
            keys.update(dict.fromkeys(zip(hit_planes.tolist(), firsts.tolist(), strict=True)))
            return list(keys)
        for plane, low, high in zip(hit_planes.tolist(), firsts.tolist(), finals.tolist(), strict=True):
            for block in range(low, high + 1):
                keys[(plane, block)] = None
        return list(keys)

    def _digest(self, plane: int, block: int) -> int:
        where = self._planes[plane]
        return span_digest(where.base_address + block * where.block_stride, where.block_len)
