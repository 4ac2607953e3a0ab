"""A prefill engine's drain, whatever engine runs it: from its start new work is refused with a clear reason, and the
engine stops once every lease it holds for decode readers has ended.

:class:`Drain` is the switch and the reason. Whoever takes requests in (an HTTP server, an engine's admission) asks
:meth:`Drain.refuse_new` before taking one: while draining it raises :class:`Draining`, whose message says so, and
which an HTTP layer answers with 503 and the header ``X-PD-Draining: 1`` (so that our proxy sends the request to
another server and routes nothing more to this one). :meth:`.scheduler.SchedulerSide.drain` adds the rest: it waits
until every request held for decode readers has ended (read by each reader, released, expired or aborted: what the
workers report as ``finished_sending``), bounded by the lease, and then stops the side channel. Requests admitted
before the drain began are held and read as usual: they are what the drain waits for.

On vLLM the switch is ``DrainMiddleware``'s (:mod:`pd_transfer.integrations.vllm.drain`, in the API server process),
and the wait is vLLM's own ``--shutdown-timeout``: its engine keeps stepping while our connector holds blocks, which
it counts as unfinished requests until the same ``finished_sending``.

:meth:`Drain.start` may be called from a signal handler: it takes no lock (one assignment).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)


class Draining(RuntimeError):
    """New work refused: the engine drains (shuts down). The message names the engine, why and since when."""


@dataclass(frozen=True)
class DrainOutcome:
    """How a drain ended: requests held for decode readers when it began, those still held when it stopped waiting
    (0: every lease ended), and its seconds."""

    held_at_start: int
    left: int
    seconds: float

    @property
    def complete(self) -> bool:
        """Every lease held when the drain began has ended."""
        return self.left == 0


class Drain:
    """Whether an engine (``name``, for the messages) drains, why and since when (``clock`` seconds). Starts once."""

    def __init__(self, name: str, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self._clock = clock
        self._started: tuple[float, str] | None = None  # (since, reason): one assignment, atomic

    @property
    def draining(self) -> bool:
        return self._started is not None

    @property
    def since(self) -> float | None:
        """When the drain began (``clock`` seconds), or None."""
        started = self._started
        return None if started is None else started[0]

    def start(self, reason: str) -> bool:
        """Enter the drain (``reason``: what started it, e.g. "received SIGTERM"); False if it had started already."""
        if self._started is not None:
            return False
        self._started = (self._clock(), reason)
        logger.warning("%s drains (%s): new requests are refused, held KV stays readable", self.name, reason)
        return True

    def refusal(self) -> str | None:
        """Why new work is refused now (a sentence for an error body), or None while not draining."""
        started = self._started
        if started is None:
            return None
        since, reason = started
        return (
            f"{self.name} is draining ({reason}, {self._clock() - since:.1f} s ago): it takes no new request;"
            " send it elsewhere"
        )

    def refuse_new(self) -> None:
        """Raise :class:`Draining` while draining (call before taking a request in)."""
        refusal = self.refusal()
        if refusal is not None:
            raise Draining(refusal)
