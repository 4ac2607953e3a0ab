"""Driving NIXL progress without a busy core.

NIXL's own progress thread spins at 100% of a core per agent even when idle. We turn it off and poll
instead: fast (``active_interval_s``) while the owner expects traffic (``set_expecting``: a prefill rank
holds blocks that decode ranks will read, which tcp-emulated reads need the target to progress) and for
a while after anything happened, then backing off geometrically to ``idle_interval_s``. A poll costs
about 1 us in NIXL plus the thread wake-up, so idle polling every 20 ms stays far below 1% of a core.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from pd_transfer.affinity import unpin_current_thread

logger = logging.getLogger(__name__)


class AdaptivePoller:
    """Calls ``poll()`` on a daemon thread; ``poll`` returns True when it found work.

    ``wake()`` asks for fast polling now (a read or handshake is about to start).
    """

    def __init__(
        self,
        name: str,
        poll: Callable[[], bool],
        *,
        active_interval_s: float = 0.0002,
        idle_interval_s: float = 0.02,
        active_window_s: float = 0.05,
    ) -> None:
        self._poll = poll
        self._active_interval_s = active_interval_s
        self._idle_interval_s = idle_interval_s
        self._active_window_s = active_window_s
        self._stop = threading.Event()
        self._wakeup = threading.Event()
        self._last_activity = time.monotonic()
        self._expecting = False
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

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        self._wakeup.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        unpin_current_thread()  # not starved by an engine pinned to this process's core
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
            if self._expecting or now - self._last_activity < self._active_window_s:
                interval = self._active_interval_s
            else:
                interval = min(self._idle_interval_s, max(interval * 2, self._active_interval_s))
            if self._wakeup.wait(interval):
                self._wakeup.clear()
