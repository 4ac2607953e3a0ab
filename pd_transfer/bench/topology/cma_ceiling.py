"""The machine's own ceiling for ``bench topology``'s same-host reads: ``process_vm_readv`` with many rows per call,
on as many threads as the decode has read lanes, from child processes holding the prefill's rows.

UCX's CMA transport, which NIXL reads with on one host, makes one ``process_vm_readv`` per row. The kernel takes up
to :data:`MAX_IOV` entries a call on each side, and a call may scatter one remote row into several local pieces.
This measures the bench's three cases read that way, the same rows of the same request: the homogeneous read (whole
rows into whole rows), TP 2 -> 1 (half rows from two processes into the halves of whole rows) and block 16 -> 64
(whole remote rows scattered a piece per KV head into blocks four times as long: the regroup done by the kernel's
copy, with no staging and no restage). It uses neither NIXL, UCX nor pd-transfer's read path: a yardstick beside
the pulls, not a transport.

A child (:class:`~pd_transfer.sim.child.ChildProcess`) allocates a zeroed host tensor (huge pages where asked,
:func:`~pd_transfer.connector.cache.zeroed_host_tensor`), writes into every 8-byte word its own byte offset plus a
marker, answers with its address and holds the memory until it is told to stop. Each case is verified once, by the
first and the last word of every piece it wrote, against the offsets it read.
"""

from __future__ import annotations

import multiprocessing.connection
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from pd_transfer.connector.cache import zeroed_host_tensor
from pd_transfer.sim.child import ChildProcess, commands
from pd_transfer.sim.shape import Shape
from pd_transfer.transfer.cma import MAX_IOV, CmaCall, CmaPool, plan_calls
from pd_transfer.transfer.errors import TransferError

_CHILD_READY_S = 60.0
_READ_S = 120.0  # one case's reads (a 512 MiB request takes well under a second)
_FILL_WORDS = 1 << 23  # words written per step when a child fills its memory (64 MiB)


@dataclass(frozen=True)
class SourceRead:
    """What one call sequence reads from one process (``pid``): ``remote`` row addresses of ``row_bytes`` each, in
    order, written to ``local`` piece addresses of ``piece_bytes`` each (``row_bytes // piece_bytes`` per row, in
    the order the row's bytes come)."""

    pid: int
    remote: np.ndarray  # uint64
    row_bytes: int
    local: np.ndarray  # uint64
    piece_bytes: int

    @property
    def pieces_per_row(self) -> int:
        return self.row_bytes // self.piece_bytes

    def calls(self) -> list[CmaCall]:
        """The calls: as many pieces as a call takes (:data:`MAX_IOV`), a remote row's pieces one entry there."""
        per_row, piece = self.pieces_per_row, self.piece_bytes
        remote = (self.remote[:, None] + np.arange(per_row, dtype=np.uint64)[None, :] * np.uint64(piece)).reshape(-1)
        return plan_calls(self.pid, self.local, remote, piece, call_bytes=MAX_IOV * piece)


class Reader:
    """Runs :class:`SourceRead` sequences on ``threads`` threads (:class:`~pd_transfer.transfer.cma.CmaPool`)."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._pool = CmaPool(threads, name="pd-transfer-cma-ceiling")

    def close(self) -> None:
        self._pool.close()

    def seconds(self, reads: Sequence[SourceRead]) -> float:
        """Wall seconds to run every call of ``reads``; ``TransferError`` when one failed (naming errno), past two
        minutes ``TransferTimeout``."""
        calls = [call for read in reads for call in read.calls()]
        started = time.perf_counter()
        self._pool.run(calls, _READ_S)
        return time.perf_counter() - started


@dataclass(frozen=True)
class HeldMemory:
    """A child's memory: where it lies in the child (``pid``, ``address``) and the ``marker`` its words carry."""

    pid: int
    address: int
    marker: int


@contextmanager
def held_memory(nbytes: int, marker: int, *, huge_pages: bool) -> Iterator[HeldMemory]:
    """A child holding ``nbytes`` filled as the module says, for the duration of the block (its start and stop
    bounded as :class:`~pd_transfer.sim.child.ChildProcess` bounds them)."""
    payload = f"{nbytes} {marker} {int(huge_pages)}".encode()
    with ChildProcess(_hold, payload, what="memory-holding child", ready_timeout_s=_CHILD_READY_S) as child:
        yield HeldMemory(child.pid, int(child.ready), marker)


def _hold(conn: multiprocessing.connection.Connection, payload: bytes) -> None:
    """The child's side: allocate, fill, send the address, hold until told to stop."""
    nbytes, marker, huge_pages = (int(field) for field in payload.split())
    memory = zeroed_host_tensor((nbytes,), torch.uint8, bool(huge_pages))
    words = memory.numpy().view(np.uint64)
    for first in range(0, len(words), _FILL_WORDS):
        end = min(len(words), first + _FILL_WORDS)
        words[first:end] = np.arange(first, end, dtype=np.uint64) * np.uint64(8) + np.uint64(marker)
    conn.send(words.ctypes.data)
    for _ in commands(conn):
        pass


@dataclass(frozen=True)
class Geometry:
    """``bench topology``'s rows: ``planes`` (layers x K and V) of ``cache_blocks`` blocks on each side, a block of a
    plane ``row_bytes`` (every head, HND), ``heads`` pieces of it per block."""

    planes: int
    cache_blocks: int
    row_bytes: int
    heads: int

    @classmethod
    def of(cls, shape: Shape) -> Geometry:
        """``ValueError`` for a layout other than HND (heads outermost in a block: a TP rank's heads, and a head's
        tokens, are runs of it)."""
        if shape.layout != "HND":
            raise ValueError(f"the ceiling reads HND blocks (a head's tokens in one run), not {shape.layout}")
        element = torch.empty(0, dtype=getattr(torch, shape.dtype)).element_size()
        row = shape.num_kv_heads * shape.block_size * shape.head_size * element
        return cls(2 * shape.num_layers, shape.cache_blocks, row, shape.num_kv_heads)

    @property
    def nbytes(self) -> int:
        """One side's cache (the decode's, with either block size; the prefill's at TP 1)."""
        return self.planes * self.cache_blocks * self.row_bytes

    def slots(self, block_ids: Sequence[int] | np.ndarray, blocks_per_plane: int) -> np.ndarray:
        """Plane-major (plane, block) slot numbers of ``block_ids`` in every plane: ``plane * blocks_per_plane +
        block``."""
        ids = np.asarray(block_ids, dtype=np.uint64)
        planes = np.arange(self.planes, dtype=np.uint64)[:, None]
        return (planes * np.uint64(blocks_per_plane) + ids[None, :]).reshape(-1)


def cases(
    geometry: Geometry,
    sources: tuple[HeldMemory, HeldMemory],
    local_base: int,
    ids: tuple[Sequence[int], Sequence[int], Sequence[int]],
) -> dict[str, list[SourceRead]]:
    """The three cases' reads: ``sources`` (the TP 1 prefill, also TP 2's rank 0; TP 2's rank 1), into the memory at
    ``local_base``; ``ids``: (remote block ids, local ids at block 16, local ids at block 64) as the pulls use them."""
    remote_ids, local_ids, big_ids = ids
    row, half, cb = geometry.row_bytes, geometry.row_bytes // 2, geometry.cache_blocks
    remote_slots = geometry.slots(remote_ids, cb)
    local_rows = np.uint64(local_base) + geometry.slots(local_ids, cb) * np.uint64(row)
    first = sources[0]
    homogeneous = SourceRead(first.pid, np.uint64(first.address) + remote_slots * np.uint64(row), row, local_rows, row)
    tp_2_to_1 = [
        SourceRead(
            rank.pid,
            np.uint64(rank.address) + remote_slots * np.uint64(half),
            half,
            local_rows + np.uint64(r * half),
            half,
        )
        for r, rank in enumerate(sources)
    ]
    piece = row // geometry.heads
    blocks = np.arange(len(remote_ids))
    big_of = np.asarray(big_ids, dtype=np.uint64)[blocks // 4]
    big_rows = np.uint64(local_base) + geometry.slots(big_of, cb // 4) * np.uint64(4 * row)
    in_block = np.tile((blocks % 4).astype(np.uint64) * np.uint64(piece), geometry.planes)
    heads = np.arange(geometry.heads, dtype=np.uint64) * np.uint64(4 * piece)
    pieces = ((big_rows + in_block)[:, None] + heads[None, :]).reshape(-1)
    block_16_to_64 = SourceRead(first.pid, homogeneous.remote, row, pieces, piece)
    return {"homogeneous": [homogeneous], "tp_2_to_1": tp_2_to_1, "block_16_to_64": [block_16_to_64]}


def verified(reads: Sequence[SourceRead], sources: Sequence[HeldMemory], local: np.ndarray, local_base: int) -> bool:
    """Whether the first and last word of every piece ``reads`` wrote into ``local`` (uint64 words from
    ``local_base``) hold the offsets, and the marker, of the bytes they were read from."""
    marker_of = {held.pid: (held.address, held.marker) for held in sources}
    for read in reads:
        address, marker = marker_of[read.pid]
        per_row, piece = read.pieces_per_row, read.piece_bytes
        offsets = np.repeat(read.remote - np.uint64(address), per_row) + np.tile(
            np.arange(per_row, dtype=np.uint64) * np.uint64(piece), len(read.remote)
        )
        words = (read.local - np.uint64(local_base)) // np.uint64(8)
        last = np.uint64(piece // 8 - 1)
        if not np.array_equal(local[words], offsets + np.uint64(marker)):
            return False
        if not np.array_equal(local[words + last], offsets + np.uint64(piece - 8) + np.uint64(marker)):
            return False
    return True


def measure(
    shape: Shape,
    ids: tuple[Sequence[int], Sequence[int], Sequence[int]],
    *,
    threads: int,
    repeats: int = 5,
    huge_pages: bool = True,
) -> dict:
    """Each case's GiB/s (median of ``repeats``, cases interleaved) and its ratio to the homogeneous read, read on
    ``threads`` threads; ``ids`` as for :func:`cases`. ``{"unavailable": why}`` where the host cannot read that
    way."""
    geometry = Geometry.of(shape)
    try:
        with ExitStack() as stack:
            reader = Reader(threads)
            stack.callback(reader.close)
            sources = (
                stack.enter_context(held_memory(geometry.nbytes, 1 << 48, huge_pages=huge_pages)),
                stack.enter_context(held_memory(geometry.nbytes // 2, 2 << 48, huge_pages=huge_pages)),
            )
            local = zeroed_host_tensor((geometry.nbytes,), torch.uint8, huge_pages).numpy().view(np.uint64)
            local_base = local.ctypes.data
            reads = cases(geometry, sources, local_base, ids)
            checks: dict[str, bool] = {}
            seconds: dict[str, list[float]] = {case: [] for case in reads}
            for case, case_reads in reads.items():  # faults the pages in, then checks what landed
                local.fill(0)
                reader.seconds(case_reads)
                checks[case] = verified(case_reads, sources, local, local_base)
            for _ in range(repeats):
                for case, case_reads in reads.items():
                    seconds[case].append(reader.seconds(case_reads))
    except TransferError as error:  # not Linux, not permitted
        return {"unavailable": str(error)}
    nbytes = len(ids[0]) * geometry.planes * geometry.row_bytes
    gbps = {case: nbytes / statistics.median(values) / 2**30 for case, values in seconds.items()}
    return {
        "method": f"process_vm_readv, up to {MAX_IOV} rows a call, {threads} threads, no NIXL",
        "threads": threads,
        "huge_pages": huge_pages,
        "bytes": nbytes,
        "verified": all(checks.values()),
        "verified_cases": checks,
        **{
            case: {"gbps": round(rate, 3), "ratio_vs_homogeneous": round(rate / gbps["homogeneous"], 3)}
            for case, rate in gbps.items()
        },
    }
