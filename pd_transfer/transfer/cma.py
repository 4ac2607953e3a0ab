"""Reading another process's memory on this host with Linux's ``process_vm_readv`` (cross-memory attach), many rows
a call: the same-host read path for host caches (:mod:`pd_transfer.connector.transports.ipc.cma_reads`) and the
bench's ceiling.

A call takes up to :data:`MAX_IOV` entries on each side, and the kernel fills the local entries in order from the
remote ones taken together: a remote row may land as several local pieces (a block-size regroup done by the copy
itself), and rows adjacent on one side are one entry there. UCX's CMA transport, which NIXL reads with on one host,
makes one call per row. The kernel checks the reader may read the process (same user, and ptrace access: Yama's
``ptrace_scope``, a container's seccomp profile); the bytes move in the reader's thread, the owner does nothing.

Errors: a process that is gone raises :class:`~.errors.PeerDisconnected`; anything else (memory not mapped there,
not permitted, a short read) :class:`CmaError` (a :class:`~.errors.TransferError`) naming the errno, the pid and the
bytes.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import itertools
import os
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import numpy as np

from .errors import PeerDisconnected, TransferError, TransferTimeout

#: The most iovec entries ``process_vm_readv`` takes on each side (Linux's ``UIO_MAXIOV``).
MAX_IOV = 1024
#: ``struct iovec``: a base address and a length, both 64-bit here.
IOVEC = np.dtype([("base", np.uint64), ("length", np.uint64)])
#: Bytes one call moves at most (when both sides allow more), so that a request spreads over the threads.
CALL_BYTES = 8 << 20


@dataclass(frozen=True)
class CmaCall:
    """One ``process_vm_readv``: ``remote`` entries of process ``pid`` into ``local`` ones (:data:`IOVEC` arrays of
    at most :data:`MAX_IOV` each), ``nbytes`` in all."""

    pid: int
    local: np.ndarray
    remote: np.ndarray
    nbytes: int


def plan_calls(
    pid: int, local: np.ndarray, remote: np.ndarray, row_bytes: int, *, call_bytes: int = CALL_BYTES
) -> list[CmaCall]:
    """The calls that read row ``i`` of process ``pid`` (``row_bytes`` at ``remote[i]``) into ``local[i]`` for every
    ``i`` (address arrays of equal length): rows cut into calls of at most :data:`MAX_IOV` rows and ``call_bytes``
    (at least one row), rows adjacent on a side within a call merged into one entry there."""
    count = len(local)
    if len(remote) != count:
        raise ValueError(f"{count} local rows but {len(remote)} remote ones")
    if row_bytes <= 0:
        raise ValueError(f"rows must have a positive length, got {row_bytes}")
    if not count:
        return []
    local = np.asarray(local, dtype=np.uint64)
    remote = np.asarray(remote, dtype=np.uint64)
    local_breaks, remote_breaks = _breaks(local, row_bytes), _breaks(remote, row_bytes)
    firsts = np.arange(0, count, max(1, min(MAX_IOV, call_bytes // row_bytes)), dtype=np.int64)
    local_breaks[firsts] = remote_breaks[firsts] = True  # a call's first row starts an entry on both sides
    local_entries, local_at = _entries(local, local_breaks, firsts, row_bytes)
    remote_entries, remote_at = _entries(remote, remote_breaks, firsts, row_bytes)
    ends = [*firsts[1:].tolist(), count]
    return [
        CmaCall(
            pid,
            local_entries[local_at[index] : local_at[index + 1]],
            remote_entries[remote_at[index] : remote_at[index + 1]],
            (end - first) * row_bytes,
        )
        for index, (first, end) in enumerate(zip(firsts.tolist(), ends, strict=True))
    ]


def entries_of(addresses: np.ndarray, lengths: np.ndarray | int) -> np.ndarray:
    """An :data:`IOVEC` array of rows at ``addresses`` of ``lengths`` bytes (one length for all, or one each)."""
    entries = np.empty(len(addresses), dtype=IOVEC)
    entries["base"] = addresses
    entries["length"] = lengths
    return entries


def merged_rows(addresses: np.ndarray, row_bytes: int) -> np.ndarray:
    """The rows of ``row_bytes`` at ``addresses`` as :data:`IOVEC` entries in the same order, rows right after each
    other merged into one entry."""
    addresses = np.asarray(addresses, dtype=np.uint64)
    if not len(addresses):
        return np.empty(0, dtype=IOVEC)
    entries, _ = _entries(addresses, _breaks(addresses, row_bytes), np.zeros(1, dtype=np.int64), row_bytes)
    return entries


def _breaks(addresses: np.ndarray, row_bytes: int) -> np.ndarray:
    """Whether each row starts a new run (is not right after the row before it)."""
    breaks = np.ones(len(addresses), dtype=bool)
    breaks[1:] = addresses[1:] != addresses[:-1] + np.uint64(row_bytes)
    return breaks


def _entries(
    addresses: np.ndarray, breaks: np.ndarray, firsts: np.ndarray, row_bytes: int
) -> tuple[np.ndarray, list[int]]:
    """(the iovec entries of every run, in order; where each call's entries start, and a last bound)."""
    if breaks.all():  # no run of two rows: an entry per row
        return entries_of(addresses, row_bytes), [*firsts.tolist(), len(addresses)]
    starts = np.flatnonzero(breaks)
    entries = np.empty(len(starts), dtype=IOVEC)
    entries["base"] = addresses[starts]
    entries["length"] = np.diff(starts, append=len(addresses)).astype(np.uint64) * np.uint64(row_bytes)
    at = np.searchsorted(starts, firsts).tolist()
    return entries, [*at, len(starts)]


def unavailable() -> str:
    """ "" where this process can call ``process_vm_readv``, else why not."""
    try:
        _readv()
    except TransferError as error:
        return str(error)
    return ""


@functools.cache
def _readv() -> Callable[..., int]:
    """libc's ``process_vm_readv`` (ctypes releases the GIL around the call)."""
    if not sys.platform.startswith("linux"):
        raise TransferError(f"process_vm_readv is Linux's; this is {sys.platform}")
    try:
        function = ctypes.CDLL(None, use_errno=True).process_vm_readv
    except (OSError, AttributeError) as error:
        raise TransferError(f"this C library has no process_vm_readv: {error}") from None
    function.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    function.restype = ctypes.c_ssize_t
    return function


class CmaError(TransferError):
    """A ``process_vm_readv`` that failed; ``errno`` says how (0: it read fewer bytes than asked)."""

    def __init__(self, message: str, errno: int) -> None:
        super().__init__(message)
        self.errno = errno


def run_call(call: CmaCall) -> None:
    """Make ``call``; raises as the module says when it did not read every byte."""
    got = _readv()(call.pid, call.local.ctypes.data, len(call.local), call.remote.ctypes.data, len(call.remote), 0)
    if got == call.nbytes:
        return
    code = ctypes.get_errno() if got < 0 else 0
    if code == errno.ESRCH:
        raise PeerDisconnected(f"process {call.pid} is gone (process_vm_readv: {os.strerror(code)})")
    why = os.strerror(code) if code else f"a short read, {got} of {call.nbytes} bytes"
    raise CmaError(f"process_vm_readv of process {call.pid}, {call.nbytes} bytes: {why}", code)


def read_bytes(pid: int, address: int, nbytes: int) -> bytes:
    """``nbytes`` at ``address`` in process ``pid``; raises as :func:`run_call`."""
    buffer = ctypes.create_string_buffer(nbytes)
    local = np.array([(ctypes.addressof(buffer), nbytes)], dtype=IOVEC)
    remote = np.array([(address, nbytes)], dtype=IOVEC)
    run_call(CmaCall(pid, local, remote, nbytes))
    return buffer.raw


class CmaPool:
    """Runs calls on ``threads`` threads of its own, the calls cut into ``threads`` consecutive runs (neighbouring
    calls read neighbouring memory). ``close`` stops the threads."""

    def __init__(self, threads: int, name: str = "pd-transfer-cma") -> None:
        if threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        self.threads = threads
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name)

    def run(self, calls: Sequence[CmaCall], timeout_s: float) -> None:
        """Make every call; raises the first call's error (as :func:`run_call`), or ``TransferTimeout`` when they
        did not all finish within ``timeout_s`` (the calls left are then skipped)."""
        if not calls:
            return
        if len(calls) == 1 or self.threads == 1:
            _run_all(calls, None)
            return
        bounds = np.linspace(0, len(calls), min(self.threads, len(calls)) + 1).astype(int)
        stop: list[bool] = []  # set once a run failed or the wait ran out: the other runs stop between calls
        futures = [self._pool.submit(_run_all, calls[a:b], stop) for a, b in itertools.pairwise(bounds)]
        deadline = time.monotonic() + timeout_s
        try:
            for future in futures:
                future.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            stop.append(True)
            raise TransferTimeout(
                f"{len(calls)} process_vm_readv calls did not finish within {timeout_s:g} s"
            ) from None
        except BaseException:
            stop.append(True)
            for future in futures:  # the memory they write into stays in use until every run is out
                future.exception()
            raise

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self) -> CmaPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _run_all(calls: Sequence[CmaCall], stop: list[bool] | None) -> None:
    for call in calls:
        if stop:
            return
        run_call(call)
