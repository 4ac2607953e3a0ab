"""Reads in place with ``process_vm_readv`` (pd_transfer.transfer.cma): rows cut into calls within the kernel's
limits, rows adjacent on a side merged, a remote row scattered into local pieces; run for real against this
process's own memory, and the errors it raises."""

from __future__ import annotations

import os
import sys
import threading

import numpy as np
import pytest

from pd_transfer.transfer import cma
from pd_transfer.transfer.errors import TransferError, TransferTimeout

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process_vm_readv is Linux's")

ROW = 4096


def addresses(buffer: np.ndarray, rows: np.ndarray, row_bytes: int = ROW) -> np.ndarray:
    return np.uint64(buffer.ctypes.data) + rows.astype(np.uint64) * np.uint64(row_bytes)


def expanded(entries: np.ndarray, row_bytes: int) -> list[int]:
    """Every row's address an iovec array covers, in order."""
    return [int(base) + offset for base, length in entries.tolist() for offset in range(0, int(length), row_bytes)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_calls_stay_within_the_kernels_limits_and_cover_every_row_in_order(seed: int) -> None:
    rng = np.random.default_rng(seed)
    count = 5000
    local = np.sort(rng.choice(20000, count, replace=False)).astype(np.uint64) * np.uint64(ROW)  # runs here and there
    remote = np.arange(count, dtype=np.uint64) * np.uint64(ROW) + np.uint64(1 << 30)  # one long run
    calls = cma.plan_calls(7, local, remote, ROW, call_bytes=3 << 20)
    assert all(call.pid == 7 for call in calls)
    assert all(len(call.local) <= cma.MAX_IOV and len(call.remote) <= cma.MAX_IOV for call in calls)
    assert all(call.nbytes <= 3 << 20 for call in calls)
    assert all(int(call.local["length"].sum()) == int(call.remote["length"].sum()) == call.nbytes for call in calls)
    assert [a for call in calls for a in expanded(call.local, ROW)] == local.tolist()
    assert [a for call in calls for a in expanded(call.remote, ROW)] == remote.tolist()
    assert all(len(call.remote) == 1 for call in calls)  # adjacent remote rows are one entry


def test_scattered_rows_are_cut_at_the_entry_limit() -> None:
    count = 3 * cma.MAX_IOV + 5
    local = np.arange(count, dtype=np.uint64) * np.uint64(2 * ROW)  # never adjacent: an entry per row
    remote = np.arange(count, dtype=np.uint64) * np.uint64(ROW)
    calls = cma.plan_calls(1, local, remote, ROW, call_bytes=1 << 40)
    assert [len(call.local) for call in calls] == [cma.MAX_IOV] * 3 + [5]
    assert [len(call.remote) for call in calls] == [1] * 4


def test_bad_rows_are_refused() -> None:
    with pytest.raises(ValueError, match="3 local rows but 2 remote"):
        cma.plan_calls(1, np.zeros(3, np.uint64), np.zeros(2, np.uint64), ROW)
    with pytest.raises(ValueError, match="positive length"):
        cma.plan_calls(1, np.zeros(1, np.uint64), np.zeros(1, np.uint64), 0)
    assert cma.plan_calls(1, np.zeros(0, np.uint64), np.zeros(0, np.uint64), ROW) == []


def test_a_remote_row_lands_as_pieces_and_rows_land_where_asked() -> None:
    """A block-size regroup as the reads in place do it: each 4-piece remote row scattered a piece per head."""
    heads, piece = 4, 1024
    source = np.arange(64 * heads * piece // 8, dtype=np.uint64).view(np.uint8)  # 64 rows of 4 KiB
    target = np.zeros_like(source)
    rows = np.random.default_rng(3).permutation(64)[:40]
    slots = np.arange(40)
    remote = np.repeat(addresses(source, rows), heads) + np.tile(np.arange(heads, dtype=np.uint64) * piece, 40)
    local = (
        np.uint64(target.ctypes.data)
        + np.repeat((slots // 4).astype(np.uint64) * np.uint64(4 * ROW) + (slots % 4).astype(np.uint64) * piece, heads)
        + np.tile(np.arange(heads, dtype=np.uint64) * np.uint64(4 * piece), 40)
    )
    calls = cma.plan_calls(os.getpid(), local, remote, piece, call_bytes=16 * piece)
    with cma.CmaPool(2) as pool:
        pool.run(calls, timeout_s=10)
    for slot, row in zip(slots.tolist(), rows.tolist(), strict=True):
        for head in range(heads):
            at = (slot // 4) * 4 * ROW + head * 4 * piece + (slot % 4) * piece
            assert np.array_equal(target[at : at + piece], source[row * ROW + head * piece :][:piece])


def test_memory_not_mapped_there_is_a_transfer_error_and_the_pool_stays_usable() -> None:
    target = np.zeros(ROW, dtype=np.uint8)
    bad = cma.plan_calls(os.getpid(), addresses(target, np.zeros(1)), np.array([4096], np.uint64), ROW)
    with cma.CmaPool(2) as pool:
        with pytest.raises(TransferError, match=f"process {os.getpid()}, 4096 bytes: Bad address"):
            pool.run(bad * 3, timeout_s=10)
        source = np.full(ROW, 7, dtype=np.uint8)
        pool.run(cma.plan_calls(os.getpid(), addresses(target, np.zeros(1)), addresses(source, np.zeros(1)), ROW), 10)
    assert int(target.sum()) == 7 * ROW


def test_read_bytes_reads_this_processs_memory() -> None:
    data = np.frombuffer(os.urandom(16), dtype=np.uint8).copy()
    assert cma.read_bytes(os.getpid(), data.ctypes.data, 16) == data.tobytes()
    assert cma.unavailable() == ""


def test_calls_that_outlast_their_bound_raise_a_timeout_and_the_pool_stays_usable() -> None:
    source = np.ones(64 << 20, dtype=np.uint8)
    target = np.zeros_like(source)
    rows = np.arange(len(source) // ROW)
    calls = cma.plan_calls(os.getpid(), addresses(target, rows), addresses(source, rows), ROW)
    with cma.CmaPool(2) as pool:
        busy = threading.Event()
        # both threads held, so the calls cannot even start before their bound (no race with the machine's speed)
        held = [pool._pool.submit(busy.wait, 60) for _ in range(2)]  # noqa: SLF001
        try:
            with pytest.raises(TransferTimeout, match=f"{len(calls)} process_vm_readv calls did not finish within 0 s"):
                pool.run(calls, timeout_s=0)
        finally:
            busy.set()
        assert all(future.result(timeout=60) for future in held)
        pool.run(calls, timeout_s=60)
    assert bool((target == 1).all())
