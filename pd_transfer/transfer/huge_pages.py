"""Memory in transparent huge pages, so that same-host reads copy at the memory's speed.

On one host UCX reads with CMA (``process_vm_readv``): the kernel pins the source pages as it copies and walks
the destination's. On 4 KiB pages that walk costs a large share of the read (measured here, 512 MiB with two
read lanes: 0.5-0.73 of an in-process copy on 4 KiB pages, 0.88-0.99 on 2 MiB pages). So caches pd-transfer
allocates itself are advised ``MADV_HUGEPAGE`` before their first write (they start in huge pages), and, where asked,
memory an engine allocated is advised when it is registered and its present pages are gathered into huge pages
with ``MADV_COLLAPSE`` (Linux 6.1+; about 2.5 s per GiB already written, on a background thread). Both are advice:
the content never changes, a failure leaves the memory as it was, and only whole 2 MiB-aligned runs inside a span
can change.

``PD_TRANSFER_HUGE_PAGES`` (``Settings.huge_pages``; whoever allocates or registers decides from it, these functions
always advise): ``own`` (default) advises only pd-transfer's own allocations; ``all`` also engine memory at
registration; ``0`` nothing. Engine memory is not advised by default: with vLLM's 2 GiB CPU caches
advised and collapsed, 1 GiB pulls took 0.57-1.33 s where they took 0.30-0.44 s without (one run of three requests
each, cause not found), while pd-transfer's own caches read at 0.88-0.99 of a copy with it and 0.49-0.62 without.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 * 2**20  # the PMD size with 4 KiB base pages (x86-64, arm64)
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25
_COLLAPSE_PIECE = 32 * 2**20
_COLLAPSE_ERRORS = {
    errno.EINVAL: "MADV_COLLAPSE: EINVAL (memory not written yet: it faults in huge; or a kernel before 6.1)",
    errno.EAGAIN: "MADV_COLLAPSE: EAGAIN (pages busy or pinned)",
    errno.ENOMEM: "MADV_COLLAPSE: ENOMEM (no free huge pages)",
}

Span = tuple[int, int]  # (start, end) byte addresses in this process


@dataclass(frozen=True)
class Collapse:
    """What collapsing some spans did: ``eligible_bytes`` (2 MiB-aligned runs inside them), ``collapsed_bytes``
    (of those, in huge pages afterwards), ``seconds`` spent, and why not all of it (``reason``, "" if all)."""

    eligible_bytes: int
    collapsed_bytes: int
    seconds: float
    reason: str = ""


def thp_mode() -> str:
    """The kernel's transparent huge page mode (the bracketed word of ``/sys/kernel/mm/transparent_hugepage/
    enabled``: "always", "madvise" or "never"), or "unknown" where it cannot be read."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "unknown"
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else "unknown"


@cache
def _madvise() -> Callable[[int, int, int], int] | None:
    try:
        function = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    function.restype = ctypes.c_int
    return function


def aligned_runs(spans: Sequence[Span]) -> list[Span]:
    """The 2 MiB-aligned (start, end) run inside each span; spans that hold no whole aligned 2 MiB give none."""
    runs = []
    for start, end in spans:
        first = -(-start // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
        last = end // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
        if last > first:
            runs.append((first, last))
    return runs


def advise_huge_pages(spans: Sequence[Span]) -> int:
    """Advise ``MADV_HUGEPAGE`` on the aligned runs of ``spans`` (microseconds; pages faulted from now on come as
    huge pages where the kernel has them). Returns the bytes advised; never raises (a refusal is logged)."""
    madvise = _madvise()
    if madvise is None:
        return 0
    advised = 0
    for start, end in aligned_runs(spans):
        if madvise(start, end - start, _MADV_HUGEPAGE) == 0:
            advised += end - start
        else:
            logger.info("MADV_HUGEPAGE refused: %s", errno.errorcode.get(ctypes.get_errno(), "?"))
    return advised


def collapse_huge_pages(spans: Sequence[Span]) -> Collapse:
    """Gather the present pages of the aligned runs of ``spans`` into huge pages (``MADV_COLLAPSE``, 32 MiB at a
    time, pieces refused with EAGAIN tried once more at the end; slow on memory written with 4 KiB pages, instant
    where it is in huge pages already). ``collapsed_bytes`` is what ``/proc/self/smaps`` shows afterwards. Never
    raises: a kernel without it (EINVAL), no free huge pages (ENOMEM) or pages pinned at the moment (EAGAIN) leave
    that memory as it was, named in ``reason``."""
    started = time.perf_counter()
    runs = aligned_runs(spans)
    eligible = sum(end - start for start, end in runs)
    madvise = _madvise()
    if madvise is None or not runs:
        why = "no madvise" if madvise is None else "no aligned 2 MiB run"
        return Collapse(eligible, 0, time.perf_counter() - started, why)
    pieces = [(at, min(at + _COLLAPSE_PIECE, end)) for start, end in runs for at in range(start, end, _COLLAPSE_PIECE)]
    reasons: set[str] = set()
    for attempt in range(2):
        refused = []
        for start, end in pieces:
            if madvise(start, end - start, _MADV_COLLAPSE) != 0:
                code = ctypes.get_errno()
                if attempt or code != errno.EAGAIN:
                    reasons.add(_COLLAPSE_ERRORS.get(code, f"MADV_COLLAPSE: {errno.errorcode.get(code, '?')}"))
                if code != errno.EAGAIN:
                    continue
                refused.append((start, end))
        pieces = refused
    collapsed = min(eligible, resident_huge_page_bytes(runs))
    return Collapse(eligible, collapsed, time.perf_counter() - started, "; ".join(sorted(reasons)))


def resident_huge_page_bytes(spans: Sequence[Span]) -> int:
    """Bytes of this process's anonymous huge pages in mappings that lie inside ``spans`` (from
    ``/proc/self/smaps``; 0 where it cannot be read). Advising a run splits it into a mapping of its own, so after
    :func:`advise_huge_pages` this counts the runs' huge pages."""
    try:
        text = Path("/proc/self/smaps").read_text(encoding="ascii", errors="replace")
    except OSError:
        return 0
    total, inside = 0, False
    for line in text.splitlines():
        head = line.split(" ", 1)[0]
        if "-" in head and ":" not in head:
            low, _, high = head.partition("-")
            start, end = int(low, 16), int(high, 16)
            inside = any(a <= start and end <= b for a, b in spans)
        elif inside and line.startswith("AnonHugePages:"):
            total += int(line.split()[1]) * 1024
    return total


class HugePageCollapser:
    """Advises memory as it is registered and collapses it on background threads (one per registration, at the
    lowest CPU priority), so that registering stays fast. ``results`` holds each finished collapse."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.results: list[Collapse] = []
        self._threads: list[threading.Thread] = []

    def submit(self, spans: Sequence[Span]) -> None:
        """Advise ``spans`` now (microseconds) and collapse their present pages in the background."""
        spans = list(spans)
        if not aligned_runs(spans) or not advise_huge_pages(spans):
            return
        thread = threading.Thread(target=self._collapse, args=(spans,), name=f"{self.owner}-huge-pages", daemon=True)
        self._threads.append(thread)
        thread.start()

    def wait(self, timeout_s: float) -> bool:
        """Wait (at most ``timeout_s`` in all) until every collapse submitted so far ended; whether they all did.
        Reads never need this: before a collapse ends they are correct, only slower."""
        deadline = time.monotonic() + timeout_s
        for thread in list(self._threads):
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(thread.is_alive() for thread in self._threads)

    def _collapse(self, spans: list[Span]) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # this thread only (Linux)
        except OSError:
            pass
        result = collapse_huge_pages(spans)
        self.results.append(result)
        logger.info(
            "%s: %.0f of %.0f MiB of registered memory in huge pages after %.2f s%s",
            self.owner,
            result.collapsed_bytes / 2**20,
            result.eligible_bytes / 2**20,
            result.seconds,
            f" ({result.reason})" if result.reason else "",
        )
