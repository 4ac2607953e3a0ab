"""The host tier: a pool of block rows in (optionally named, shared) memory, outside the engine's cache.

The pool is ``num_rows`` rows of ``page_format.block_bytes`` bytes (a block's pages back to back, in
format order) plus a 32-byte header per row: the key stored there, the page format tag and a valid flag.
A store clears the flag, copies the pages, then writes key, tag and flag; a load copies only rows whose
header names the expected key and format, so a row given by mistake, a row another engine reused, or a
row caught mid-store is a miss, never wrong KV. The payload itself is not checksummed (it never leaves
memory; the copy is the whole cost of this tier).

Which rows hold what is the scheduler's :class:`~pd_transfer.offload.manager.OffloadManager`'s business.
A named pool (``HostPool.create(..., name=...)``) can be attached by other processes of the same host
(``HostPool.attach``): an engine's worker processes, or several engines that each manage their own row
range (``OffloadManager(first_row=...)``).

A GPU engine's blocks come and go through a :class:`~.device_copy.BlockCopier` (``store_device``,
``load_device``): its copies run on a stream of their own, and the pool is pinned (``create(..., pinned=True)``:
page-locked memory the device copies to and from asynchronously, private to the process) so that they do not
block. Headers are checked before a load is queued and written once a store's copies completed.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from multiprocessing import resource_tracker, shared_memory
from typing import TYPE_CHECKING

import numpy as np

from .errors import OffloadInputError
from .keys import KEY_BYTES, BlockKey, check_key
from .metrics import OffloadMetrics
from .specs import PageFormat, TierBlocks

if TYPE_CHECKING:
    import torch

    from .device_copy import BlockCopier

logger = logging.getLogger(__name__)

ROW_HEADER_BYTES = 32  # key (16), format tag (8), valid flag (1), zero (7)
_ALIGN = 4096
_VALID = 1


class HostPool:
    """``num_rows`` block rows in host memory; see the module docstring for the row header."""

    name = "host"

    def __init__(
        self,
        page_format: PageFormat,
        num_rows: int,
        memory: shared_memory.SharedMemory | torch.Tensor,
        *,
        owner: bool,
        metrics: OffloadMetrics | None = None,
    ) -> None:
        """Use :meth:`create` or :meth:`attach`. ``memory``: shared memory, or a pinned uint8 tensor (private)."""
        self.page_format = page_format
        self.num_rows = num_rows
        self._memory = memory
        self._owner = owner
        self._metrics = metrics
        self._tag = page_format.tag
        self._closed = False
        self._offsets = np.cumsum((0, *page_format.page_bytes))
        self._data_start = _round_up(num_rows * ROW_HEADER_BYTES)
        buffer = memory.buf if isinstance(memory, shared_memory.SharedMemory) else memory.numpy()
        assert buffer is not None
        self.headers = np.ndarray((num_rows, ROW_HEADER_BYTES), np.uint8, buffer, 0)
        self.rows = np.ndarray((num_rows, page_format.block_bytes), np.uint8, buffer, self._data_start)

    @staticmethod
    def bytes_needed(page_format: PageFormat, num_rows: int) -> int:
        """Bytes of memory a pool of ``num_rows`` rows takes (rows plus headers)."""
        return _round_up(num_rows * ROW_HEADER_BYTES) + num_rows * page_format.block_bytes

    @classmethod
    def create(
        cls,
        page_format: PageFormat,
        capacity_bytes: int,
        *,
        name: str | None = None,
        metrics: OffloadMetrics | None = None,
        pinned: bool = False,
    ) -> HostPool:
        """A new pool of ``capacity_bytes // block_bytes`` rows (zeroed, every row invalid). ``name``: the
        shared memory name others attach by (None: a generated one, see :attr:`shared_name`). ``pinned``:
        page-locked memory for a GPU engine's copies (needs CUDA; private to this process, so no ``name``)."""
        num_rows = int(capacity_bytes) // page_format.block_bytes
        if num_rows <= 0:
            raise OffloadInputError(f"{capacity_bytes} bytes hold no block of {page_format.block_bytes} bytes")
        size = cls.bytes_needed(page_format, num_rows)
        if pinned:
            if name is not None:
                raise OffloadInputError("a pinned host pool is private to its process: it has no name to attach by")
            return cls(page_format, num_rows, _pinned_zeros(size), owner=True, metrics=metrics)
        memory = shared_memory.SharedMemory(name=name, create=True, size=size)
        return cls(page_format, num_rows, memory, owner=True, metrics=metrics)

    @classmethod
    def attach(
        cls, name: str, page_format: PageFormat, num_rows: int, *, metrics: OffloadMetrics | None = None
    ) -> HostPool:
        """The pool another process created under ``name`` (same format and row count)."""
        try:
            memory = shared_memory.SharedMemory(name=name, create=False)
        except FileNotFoundError:
            raise OffloadInputError(f"no shared memory named {name[:64]!r}") from None
        # Python 3.11 tracks attached segments too and would unlink them when this process exits; the tracker knows
        # them by the private name (with its leading slash) and 3.11 has no public way to opt out (3.13's track=False)
        resource_tracker.unregister(memory._name, "shared_memory")  # type: ignore[attr-defined]  # noqa: SLF001
        if memory.size < cls.bytes_needed(page_format, num_rows):
            memory.close()
            raise OffloadInputError(f"shared memory {name[:64]!r} is smaller than {num_rows} rows of this format")
        return cls(page_format, num_rows, memory, owner=False, metrics=metrics)

    @property
    def shared_name(self) -> str:
        """The name other processes attach by; raises :class:`OffloadInputError` for a pinned (private) pool."""
        if not isinstance(self._memory, shared_memory.SharedMemory):
            raise OffloadInputError("a pinned host pool is private to its process: it has no name")
        return self._memory.name

    @property
    def pinned(self) -> bool:
        """Whether the pool is page-locked memory (device copies to and from it are asynchronous)."""
        return not isinstance(self._memory, shared_memory.SharedMemory)

    def row_tensor(self) -> torch.Tensor:
        """The rows as a ``(num_rows, block_bytes)`` uint8 CPU tensor sharing the pool's memory (pinned if the
        pool is)."""
        import torch

        if isinstance(self._memory, shared_memory.SharedMemory):
            return torch.from_numpy(self.rows)
        end = self._data_start + self.num_rows * self.page_format.block_bytes
        return self._memory[self._data_start : end].view(self.num_rows, self.page_format.block_bytes)

    @property
    def capacity_bytes(self) -> int:
        return self.num_rows * self.page_format.block_bytes

    # ------------------------------------------------------------------ batches (the worker's interface)
    def store_blocks(self, blocks: TierBlocks, block_ids: Sequence[int], caches: Sequence[np.ndarray]) -> int:
        """Copy engine block ``block_ids[i]`` into row ``blocks.rows[i]`` as ``blocks.keys[i]``; returns bytes."""
        rows = self._check(blocks, block_ids)
        self.headers[rows, 24] = 0
        runs = list(_runs(rows, block_ids))
        for index, cache in enumerate(caches):  # tensor by tensor: each source stays in the caches longer
            start, end = self._offsets[index], self._offsets[index + 1]
            for row, block, count in runs:
                np.copyto(self.rows[row : row + count, start:end], cache[block : block + count])
        return self._stored(rows, blocks.keys)

    def load_blocks(
        self, blocks: TierBlocks, block_ids: Sequence[int], caches: Sequence[np.ndarray]
    ) -> tuple[int, list[BlockKey]]:
        """Copy row ``blocks.rows[i]`` into engine block ``block_ids[i]`` where the row holds ``blocks.keys[i]``;
        returns (bytes loaded, keys whose row held something else)."""
        good_rows, good_blocks, missed = self._loadable(blocks, block_ids)
        runs = list(_runs(good_rows, good_blocks))
        for index, cache in enumerate(caches):
            start, end = self._offsets[index], self._offsets[index + 1]
            for row, block, count in runs:
                np.copyto(cache[block : block + count], self.rows[row : row + count, start:end])
        return len(good_rows) * self.page_format.block_bytes, missed

    def store_device(
        self, blocks: TierBlocks, block_ids: Sequence[int], copier: BlockCopier, after: torch.cuda.Event | None
    ) -> int:
        """:meth:`store_blocks` from a device cache: ``copier`` copies the blocks after ``after`` (an event on the
        engine's stream), the headers are written once its copies completed (their event). Returns bytes."""
        rows = self._check(blocks, block_ids)
        self.headers[rows, 24] = 0
        done = copier.to_host(block_ids, rows, self.row_tensor(), after)
        if done is not None:
            done.synchronize()
        return self._stored(rows, blocks.keys)

    def load_device(
        self, blocks: TierBlocks, block_ids: Sequence[int], copier: BlockCopier, after: torch.cuda.Event | None
    ) -> tuple[int, list[BlockKey]]:
        """:meth:`load_blocks` into a device cache: the rows that hold their keys are copied by ``copier`` after
        ``after``; returns once the blocks hold them (their event completed)."""
        good_rows, good_blocks, missed = self._loadable(blocks, block_ids)
        done = copier.from_host(good_rows, good_blocks, self.row_tensor(), after)
        if done is not None:
            done.synchronize()
        return len(good_rows) * self.page_format.block_bytes, missed

    def close(self) -> None:
        """Unmap the pool (and remove its name if this process created it); idempotent. Views taken from it
        must be gone."""
        if self._closed:
            return
        self._closed = True
        del self.headers, self.rows
        if not isinstance(self._memory, shared_memory.SharedMemory):
            return  # pinned: freed with the last view of the tensor
        try:
            self._memory.close()
        except BufferError:
            logger.warning("host pool %s: views still exported; left mapped until exit", self._memory.name)
        if self._owner:
            self._memory.unlink()

    # ------------------------------------------------------------------ internals
    def _stored(self, rows: list[int], keys: Sequence[BlockKey]) -> int:
        """Write the headers of rows whose bytes were copied in (key, format tag, then the valid flag); bytes."""
        for row, key in zip(rows, keys, strict=True):
            self.headers[row, :KEY_BYTES] = np.frombuffer(key, np.uint8)
            self.headers[row, KEY_BYTES:24] = np.frombuffer(self._tag, np.uint8)
        self.headers[rows, 24] = _VALID
        return len(rows) * self.page_format.block_bytes

    def _loadable(self, blocks: TierBlocks, block_ids: Sequence[int]) -> tuple[list[int], list[int], list[BlockKey]]:
        """(rows holding their key, their engine blocks, the keys of the other rows: misses, counted and logged)."""
        rows = self._check(blocks, block_ids)
        good = [i for i, (row, key) in enumerate(zip(rows, blocks.keys, strict=True)) if self._holds(row, key)]
        good_set = set(good)
        missed = [blocks.keys[i] for i in range(len(rows)) if i not in good_set]
        if missed:
            logger.warning(
                "host tier: %d of %d rows did not hold their block; treated as misses", len(missed), len(rows)
            )
            if self._metrics is not None:
                self._metrics.rejected_blocks.labels(self.name, "foreign").inc(len(missed))
        return [rows[i] for i in good], [int(block_ids[i]) for i in good], missed

    def _holds(self, row: int, key: BlockKey) -> bool:
        header = self.headers[row]
        return bool(
            header[24] == _VALID and header[:KEY_BYTES].tobytes() == key and header[KEY_BYTES:24].tobytes() == self._tag
        )

    def _check(self, blocks: TierBlocks, block_ids: Sequence[int]) -> list[int]:
        rows = [int(row) for row in blocks.rows]
        for key in blocks.keys:
            check_key(key)
        if not len(rows) == len(blocks.keys) == len(block_ids):
            raise OffloadInputError("host tier: rows, keys and engine blocks differ in number")
        if rows and not (0 <= min(rows) and max(rows) < self.num_rows):
            raise OffloadInputError(f"host tier: a row is outside 0..{self.num_rows - 1}")
        return rows


def _pinned_zeros(size: int) -> torch.Tensor:
    """``size`` zeroed bytes of page-locked host memory; :class:`OffloadInputError` where CUDA cannot pin."""
    import torch

    try:
        return torch.zeros(size, dtype=torch.uint8, pin_memory=True)
    except RuntimeError as error:
        raise OffloadInputError(f"cannot pin {size} bytes of host memory for the pool: {error}") from None


def _runs(first: Sequence[int], second: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """``(first start, second start, length)`` of the runs where both sequences count up by one together."""
    start = 0
    for i in range(1, len(first) + 1):
        if i == len(first) or first[i] != first[i - 1] + 1 or second[i] != second[i - 1] + 1:
            yield int(first[start]), int(second[start]), i - start
            start = i


def _round_up(size: int) -> int:
    return -(-size // _ALIGN) * _ALIGN
