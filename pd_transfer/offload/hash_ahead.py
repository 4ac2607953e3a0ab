"""The payload checksums of a disk store job's files, computed on a helper thread while the job writes them.

The disk tier writes each file's payload first and its header, which holds the payload checksums, last
(:mod:`.files`). With ``ahead``, the store hands a file to one helper thread right before it writes the file's
payload in one ``os.writev``; the helper hashes it while the kernel copies it (``xxhash`` and ``os.writev``
both release the GIL), and the store takes the checksums right before writing the header. So on two cores the
checksum leaves the write's critical path (measured: docs/offload.md, "Benchmark"). One file at a time, not the
whole job queued at once: a helper that runs while the store's thread is back in Python makes that thread wait
for the GIL (CPython hands it over only after its 5 ms switch interval when the holder keeps taking it back, as
a hash of 64 KiB pages one call each does); hashing a file takes less time than writing it, so the helper is idle
again when the write returns. A file the helper has not started by then is hashed by the store itself (the
helper falls behind when the other CPUs are busy): a store never waits for a helper that gets no CPU. Without
``ahead`` (one CPU, or a job too small to gain) the store hashes each block on its own thread right before
writing it, while the bytes are in the CPU's caches.

The helper is one thread per process (:mod:`.helpers`), started on first use and blocked on its queue while idle
(it never spins); a forked child starts its own. Contract: the pages stay unchanged until the context exits; on exit
every file not started is cancelled and a running one is waited for, so nothing reads them after the store
returns (the engine may then reuse its blocks).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from types import TracebackType

import numpy as np

from .checksum import payload_checksum
from .helpers import helper, helper_useful

__all__ = ["MIN_AHEAD_BYTES", "WAIT_SECONDS", "ChecksumsAhead", "file_checksums", "helper_useful"]

#: a job of fewer payload bytes hashes on the caller's thread (a hand-off costs tens of microseconds)
MIN_AHEAD_BYTES = 1 << 20
#: seconds a store waits for one file's checksums (CPU work only: reached only if the process is starved)
WAIT_SECONDS = 300.0

Pages = Sequence[np.ndarray]


def _pool() -> ThreadPoolExecutor:
    """The process's checksum helper thread, started on first use."""
    return helper("checksum")


def file_checksums(blocks: Sequence[Pages]) -> list[int]:
    """The :func:`~.checksum.payload_checksum` of each block (its pages in format order), in order."""
    return [payload_checksum(pages) for pages in blocks]


class ChecksumsAhead:
    """The checksums of ``files`` (each a list of blocks, each block's pages), for one store job. ``ahead``: the
    helper thread hashes a file while the store writes it (:meth:`start`, then the write, then :meth:`result`);
    else :meth:`result` computes them on the caller's thread."""

    def __init__(self, files: Sequence[Sequence[Pages]], *, ahead: bool) -> None:
        self._files = files
        self._ahead = ahead
        self._futures: dict[int, Future[list[int]]] = {}

    @property
    def ahead(self) -> bool:
        """Whether the helper thread computes the checksums."""
        return self._ahead

    def __enter__(self) -> ChecksumsAhead:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.settle()

    def start(self, index: int) -> bool:
        """With ``ahead``, hand file ``index`` to the helper thread (call right before writing its payload in one
        ``os.writev``: the helper takes the GIL while the write has released it) and return True; else False."""
        if self._ahead:
            self._futures[index] = _pool().submit(file_checksums, self._files[index])
        return self._ahead

    def result(self, index: int) -> list[int]:
        """File ``index``'s checksums, one per block in order: the helper's (waits at most ``WAIT_SECONDS``, then
        :class:`TimeoutError`); computed here without ``ahead``, without :meth:`start`, or when the helper has not
        started the file yet (then it never will: a store never waits for a helper that gets no CPU)."""
        future = self._futures.get(index)
        if future is None or future.cancel():
            return file_checksums(self._files[index])
        return future.result(timeout=WAIT_SECONDS)

    def settle(self) -> None:
        """Cancel the files not started; wait for a running one. Afterwards no helper task reads the pages."""
        for future in self._futures.values():
            future.cancel()
        wait(self._futures.values(), timeout=WAIT_SECONDS)

    @property
    def pending(self) -> int:
        """Helper tasks of this job not finished (0 after :meth:`settle`)."""
        return sum(not future.done() for future in self._futures.values())
