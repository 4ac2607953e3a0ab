"""A disk load job's files read by two threads at once: the caller's and the process's ``read`` helper thread.

Why: read one after another from storage, a job's files loaded at 0.75 of a plain sequential read of the same
bytes, each block's checksum and each file's first readahead window waiting on the one thread; two threads each
taking the next file keep two files' reads in flight and hash in parallel, and reached 0.96 (docs/offload.md,
"Benchmark"). From the page cache both ways are bound by the copy.

How: the job's blocks are grouped by the file that holds them (every block of a file read by one thread, in job
order, so the file's readahead stays sequential and its state in the reader is touched by one thread only); the
caller and the helper each take the next group from one queue until it is empty. A helper busy elsewhere or
starved of CPU so leaves every group to the caller: a load never waits for a helper that has not started. Before
returning, the caller withdraws the helper's task if it has not started, else waits for it; a read that raises
stops both threads after their current group and is raised: nothing writes the engine's blocks after the job's
result.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Hashable, Sequence

from .helpers import helper

#: seconds a load waits for the helper's last group (reached only if the process is starved)
WAIT_SECONDS = 300.0


def by_file(files: Sequence[Hashable]) -> list[list[int]]:
    """The indices of ``files`` grouped by equal value, groups in order of first appearance, indices ascending."""
    groups: dict[Hashable, list[int]] = {}
    for index, file in enumerate(files):
        groups.setdefault(file, []).append(index)
    return list(groups.values())


def read_groups(groups: Sequence[Sequence[int]], read: Callable[[int], bool], *, two: bool) -> set[int]:
    """Call ``read(index)`` for every index of ``groups``, a group's indices in order on one thread; ``two``: the
    caller and the ``read`` helper thread take groups from one queue (one thread when there is one group). Returns
    the indices whose ``read`` returned False. ``read`` must be safe to call from two threads for indices of
    different groups."""
    pending: queue.SimpleQueue[Sequence[int]] = queue.SimpleQueue()
    for group in groups:
        pending.put(group)
    missed: set[int] = set()
    failed = threading.Event()  # either thread's read raised: both stop after their group

    def drain() -> None:
        while not failed.is_set():
            try:
                group = pending.get_nowait()
            except queue.Empty:
                return
            try:
                missed.update(index for index in group if not read(index))
            except BaseException:
                failed.set()
                raise

    helping = helper("read").submit(drain) if two and len(groups) > 1 else None
    try:
        drain()
    finally:
        if helping is not None and not helping.cancel():
            helping.result(timeout=WAIT_SECONDS)
    return missed
