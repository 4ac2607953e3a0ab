"""Driving NIXL progress without a busy core.

NIXL's progress thread, as NIXL's Python wrapper starts it, spins at 100% of a core per agent even when idle. Two
ways replace it:

- An agent that serves reads (a prefill rank's) runs NIXL's progress thread with a wait of its own
  (``PD_TRANSFER_NATIVE_PROGRESS_MS``, :func:`pd_transfer.transfer.native.make_nixl_agent`): the thread sleeps in
  ``poll()`` on UCX's event descriptor and wakes when a request or data arrives. Over TCP the target's progress
  is what sends the bytes of a read (UCX emulates the READ with active messages, ``rma_am``), and this thread does
  it in native code, without Python's GIL and without waiting for a poll: a one-block read over TCP took 52-90 us
  at p50 with it, 256-312 us with the poller below, and 5.2 ms with a busy engine in the prefill's process
  (``pd-transfer bench transfer --only-tcp [--busy-prefill]``; docs/benchmarks.md).
- Every agent also has :class:`AdaptivePoller`, which takes notifications (and, without the native thread,
  progresses the agent): fast (``active_interval_s``) while the owner expects traffic (``set_expecting``: a
  prefill rank holds blocks that decode ranks will read) and for a while after anything happened, then backing
  off geometrically to ``idle_interval_s``. A poll costs about 1 us in NIXL plus the thread wake-up, so idle
  polling every 20 ms stays far below 1% of a core.

While the owner expects reads, a poll that found work (a notification, or a poll longer than
``PD_TRANSFER_BUSY_POLL_US``) is followed by the next one at once: without the native thread, that keeps the
socket of a read over TCP fed, and the poller returns to waiting as soon as a poll finds nothing. Idle, a slow poll
is more likely a preempted thread than data: it does not count (counting it kept idle CPU at 5-9 % under load).

A read that stopped spinning checks its state every ``PD_TRANSFER_READ_WAIT_US`` (default 50). Over TCP each check
also receives what arrived, and a one-block read takes a few hundred microseconds: at 500 us a one-block read's p50
was 745-757 us, at 50 us 326 us (one round, load 18-22). A CMA read is done inside the post, so it never waits there.
The owner (:class:`~.agent.TransferAgent`) takes these values from its ``Settings``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from pd_transfer.affinity import CpuSet, unpin_current_thread

logger = logging.getLogger(__name__)


class AdaptivePoller:
    """Calls ``poll()`` on a daemon thread; ``poll`` returns True when it found work (then, while expecting, it
    is called again at once).

    ``wake()`` asks for fast polling now (a read or handshake is about to start). The thread runs on
    ``thread_cpus`` (None: the creator's).
    """

    def __init__(
        self,
        name: str,
        poll: Callable[[], bool],
        *,
        active_interval_s: float = 0.0002,
        idle_interval_s: float = 0.02,
        active_window_s: float = 0.05,
        thread_cpus: CpuSet = None,
    ) -> None:
        self._poll = poll
        self._thread_cpus = thread_cpus
        self._active_interval_s = active_interval_s
        self._idle_interval_s = idle_interval_s
        self._active_window_s = active_window_s
        self._stop = threading.Event()
        self._wakeup = threading.Event()
        self._last_activity = time.monotonic()
        self._expecting = False
        self._fast_holders = 0  # callers inside fast(): each expects traffic until it leaves
        self._holders_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"pd-transfer-poll-{name}", daemon=True)
        self.polls = 0

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        self._last_activity = time.monotonic()
        self._wakeup.set()

    def set_expecting(self, expecting: bool) -> None:
        """Poll fast for as long as ``expecting`` is True."""
        self._expecting = expecting
        if expecting:
            self.wake()

    @contextmanager
    def fast(self) -> Iterator[None]:
        """Expect traffic for the duration of the block (counted: concurrent callers do not undo each other's)."""
        with self._holders_lock:
            self._fast_holders += 1
        self.wake()
        try:
            yield
        finally:
            with self._holders_lock:
                self._fast_holders -= 1

    @property
    def expecting(self) -> bool:
        """Whether the owner expects traffic (``set_expecting``, or a caller inside ``fast``)."""
        return self._expecting or self._fast_holders > 0

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        self._wakeup.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        unpin_current_thread(self._thread_cpus)  # not starved by an engine pinned to this process's core
        interval = self._idle_interval_s
        while not self._stop.is_set():
            try:
                found = self._poll()
            except Exception:  # a failing poll must not kill progress for the whole agent
                logger.exception("progress poll failed")
                found = False
            self.polls += 1
            now = time.monotonic()
            if found:
                self._last_activity = now
            if found and self.expecting:  # reads in flight: poll again now (the loop still ends on stop)
                interval = self._active_interval_s
                continue
            if self.expecting or now - self._last_activity < self._active_window_s:
                interval = self._active_interval_s
            else:
                interval = min(self._idle_interval_s, max(interval * 2, self._active_interval_s))
            if self._wakeup.wait(interval):
                self._wakeup.clear()
