"""Whether a file's pages are in the kernel's page cache, and dropping them from it (Linux; no privilege needed).

* :func:`resident_fraction`: the share of a file's pages the page cache holds. Linux 6.5+ answers with one
  ``cachestat`` call, which walks the cache's folios (about 10 ns a page here); older kernels with ``mincore`` on
  a read-only mapping of the file that is never read (so asking faults nothing in; about 0.2 us a page), which
  the kernel answers for a file's pages only to a process that owns the file or may write it (else it reports no
  page resident, so a caller acting on "resident" errs towards "not resident"). Both through ``ctypes``: the
  standard library has neither.
* :func:`drop_from_cache`: write a file's dirty pages back (``fdatasync``) and ask the kernel to evict its clean
  pages (``posix_fadvise(POSIX_FADV_DONTNEED)``), so the next read comes from the storage. The kernel keeps pages
  some process has mapped or locked, and a filesystem in memory (tmpfs) keeps them all: check with
  :func:`resident_fraction`.

Where the platform lacks the calls these answer None or do nothing; they never raise for that.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
from functools import cache

import numpy as np

#: how the benchmarks make files cold (recorded with their results)
DROP_METHOD = "fdatasync, then posix_fadvise(POSIX_FADV_DONTNEED), per file; checked with resident_fraction"

_CACHESTAT = 451  # the syscall's number on every architecture (Linux 6.5+)
_MAP_FAILED = ctypes.c_void_p(-1).value


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_uint64)
        for name in ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")
    ]


class LibraryCalls:
    """The C library's calls, typed; ``cachestat`` False once the kernel said it has none (set it False to ask
    with ``mincore`` only)."""

    def __init__(self, libc: ctypes.CDLL) -> None:
        self.libc = libc
        self.cachestat = True
        libc.syscall.restype = ctypes.c_long
        libc.mmap.restype = ctypes.c_void_p
        integer = ctypes.c_int
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, integer, integer, integer, ctypes.c_int64]
        libc.munmap.restype = ctypes.c_int
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.restype = ctypes.c_int
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


@cache
def library_calls() -> LibraryCalls | None:
    """The process's one :class:`LibraryCalls`, or None where the C library or its ``mincore`` is missing."""
    try:
        return LibraryCalls(ctypes.CDLL(None, use_errno=True))
    except (OSError, AttributeError):  # no C library to load, or one without mincore
        return None


def resident_fraction(path: str | os.PathLike[str]) -> float | None:
    """The fraction (0..1) of ``path``'s pages in the page cache; 1.0 for an empty file. None when it cannot be
    told: no such file, or neither ``cachestat`` nor ``mincore`` here."""
    calls = library_calls()
    if calls is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 1.0
        pages = -(-size // mmap.PAGESIZE)
        cached = _cachestat(calls, fd) if calls.cachestat else None
        if cached is None:
            cached = _mincore(calls, fd, size)
        return None if cached is None else min(cached, pages) / pages
    finally:
        os.close(fd)


def _cachestat(calls: LibraryCalls, fd: int) -> int | None:
    """Pages of the whole file (``len`` 0) in the page cache, or None (no such syscall: remembered)."""
    stat = _Stat()
    if calls.libc.syscall(_CACHESTAT, fd, ctypes.byref(_Range(0, 0)), ctypes.byref(stat), 0) == 0:
        return int(stat.nr_cache)
    if ctypes.get_errno() in (errno.ENOSYS, errno.EPERM):  # an older kernel, or a seccomp filter refusing it
        calls.cachestat = False
    return None


def _mincore(calls: LibraryCalls, fd: int, size: int) -> int | None:
    """Pages of the file's ``size`` bytes the page cache holds, by ``mincore`` on a mapping never read."""
    address = calls.libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if address is None or address == _MAP_FAILED:
        return None
    try:
        vector = np.zeros(-(-size // mmap.PAGESIZE), np.uint8)
        if calls.libc.mincore(address, size, vector.ctypes.data) != 0:
            return None
        return int(np.count_nonzero(vector & 1))
    finally:
        calls.libc.munmap(address, size)


def drop_from_cache(path: str | os.PathLike[str]) -> None:
    """Write ``path``'s dirty pages back, then ask the kernel to evict its pages from the page cache. Raises
    :class:`OSError` if the file cannot be opened; does nothing more where ``posix_fadvise`` is missing."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
