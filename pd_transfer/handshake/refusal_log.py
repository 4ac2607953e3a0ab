"""How many lines a side channel logs about frames it refused: at most ``lines`` every ``window_s`` seconds, then a
count of those it left out (issue 42, item 4).

Every refused or malformed frame used to be a line of its own: a real vLLM prefill's log grew by about 2 MB every
10,000 hostile frames (measured against a real prefill: its memory stayed flat, the log did not), so a trickle of junk
grew a long-lived prefill's log, and whatever keeps it (a container's log driver, a journal, a pipe read into memory),
without bound, and cost a write each. A budget bounds it: a flood leaves ``lines`` lines a window and one summary,
while the counters (``pd_transfer_side_channel_rejected_total{reason}``) still count every frame.

Thread-safe (one lock); ``clock``: monotonic seconds.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

#: Lines about refused frames logged at most, each window.
LINES_PER_WINDOW = 20
#: The window (s).
WINDOW_S = 60.0


class RefusalLog:
    """Logs to ``logger`` at most ``lines`` lines every ``window_s`` seconds (see the module's docstring); the first
    line after a window in which some were left out says how many, naming ``what()`` (what the lines are about, as
    it is named then)."""

    def __init__(
        self,
        logger: logging.Logger,
        what: Callable[[], str],
        *,
        lines: int = LINES_PER_WINDOW,
        window_s: float = WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if lines < 1 or not window_s > 0:
            raise ValueError(f"a budget of {lines} lines every {window_s} s")
        self._logger, self._what = logger, what
        self._lines, self._window_s, self._clock = lines, window_s, clock
        self._lock = threading.Lock()
        self._window_began = clock()
        self._logged = 0
        self.left_out = 0  # lines left out in the current window
        self.left_out_total = 0  # lines left out since the start

    def log(self, level: int, message: str, *args: object) -> bool:
        """Log ``message % args`` at ``level`` if the window has room (after the count of lines the last window left
        out, if any); returns whether it was logged."""
        with self._lock:
            now = self._clock()
            if now - self._window_began >= self._window_s:
                if self.left_out:
                    self._logger.warning(
                        "%s: %d more not logged in the last %.0f s",
                        self._what(),
                        self.left_out,
                        now - self._window_began,
                    )
                self._window_began, self._logged, self.left_out = now, 0, 0
            if self._logged >= self._lines:
                self.left_out += 1
                self.left_out_total += 1
                return False
            self._logged += 1
        self._logger.log(level, message, *args)
        return True
