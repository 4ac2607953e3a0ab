"""``engine_spin_s``: shorten vLLM's busy-wait on its shared-memory queues in this process.

vLLM's engine core and workers wait for each other's messages in ``SpinCondition.wait``: for 1 s after a read
it calls ``os.sched_yield`` in a loop, releasing the GIL for the call and taking it straight back. CPython only
forces a GIL hand-over when a waiting thread saw no switch for 5 ms, and each of these re-takes counts as a
switch, so our threads in the same process (side-channel server, NIXL progress, loads, confirmations) get the
GIL only when they win a race against the spinning thread. An engine that steps while blocks are held or loads
are in flight re-arms the window every step. Measured on 2 cores with a TP 2 side: handshakes unanswered for
over 5 s and first reads stalled up to 30 s.

vLLM is imported only when :func:`limit_engine_spin` runs (in a process that loaded the connector).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

#: Milliseconds of one sleep-poll slice, after our spin limit and within vLLM's busy window
BUSY_POLL_MS = 1

#: ``SpinCondition.wait``'s signature: ``(condition, timeout_ms)``, ``None`` waits without a timeout
WaitFunction = Callable[[Any, int | None], None]


def limit_engine_spin(spin_s: float) -> None:
    """Make this process's vLLM shared-memory queue readers spin at most ``spin_s`` seconds after a read.

    Past ``spin_s`` and until vLLM's own window ends (1 s, kept per reader), the reader waits on its
    notification socket in slices of :data:`BUSY_POLL_MS` (no GIL, no CPU while it waits) and checks the queue
    between slices: it does not rely on the writer's notification there, which vLLM's publisher (send high-water
    mark 1) can drop under load (a reader relying on it would wait out vLLM's 5 s recheck interval).
    After the window the reader blocks as vLLM's does.

    Wraps ``SpinCondition.wait`` once per process; a later call changes the limit. The unwrapped method stays
    reachable as ``SpinCondition.wait._pd_transfer_original``. Without vLLM's ``SpinCondition`` it logs and
    does nothing.
    """
    try:
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    except ImportError:  # another vLLM layout: leave it alone
        logger.info("vLLM's SpinCondition not found; its readers' busy window is left as it is")
        return
    original = getattr(SpinCondition.wait, "_pd_transfer_original", None)
    if original is None:
        original = SpinCondition.wait
    SpinCondition.wait = _limited_wait(original, spin_s)  # type: ignore[method-assign,assignment]  # the patch itself


def _limited_wait(original: WaitFunction, spin_s: float) -> WaitFunction:
    """``original`` (vLLM's ``SpinCondition.wait``) with its busy window cut to ``spin_s`` seconds of spinning
    and the rest of the window polled in :data:`BUSY_POLL_MS` slices."""

    def wait(self: Any, timeout_ms: int | None = None) -> None:
        window = self.__dict__.get("_pd_transfer_window_s")
        if window is None:  # first wait of this reader: keep vLLM's window, spin only for our limit
            window = self._pd_transfer_window_s = getattr(self, "busy_loop_s", 0.0)
        self.busy_loop_s = min(window, spin_s)
        if time.monotonic() - getattr(self, "last_read", 0.0) < window:
            timeout_ms = BUSY_POLL_MS if timeout_ms is None else min(timeout_ms, BUSY_POLL_MS)
        original(self, timeout_ms)

    # marks the wrapper for later calls; the underscore keeps the name out of vLLM's own on its class
    wait._pd_transfer_original = original  # type: ignore[attr-defined]  # noqa: SLF001
    return wait
