"""Backends, their health and the pools routing among them (a pool's policy: :mod:`.registry`). Runs on the proxy's
event loop; no locks needed."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

from pd_transfer.proxy.routing.affinity import Affinity, choose
from pd_transfer.proxy.routing.policy import Choice, Policy
from pd_transfer.proxy.routing.request import RouteRequest

log = logging.getLogger(__name__)

#: A draining vLLM server's 503 carries this header (``pd_transfer.integrations.vllm.drain.DRAINING_HEADER``): the
#: request never reached its engine, so it may go to another backend; the server takes no more.
DRAINING_HEADER = "X-PD-Draining"
DRAINING = "draining"  # the reason a draining backend is out


def is_draining(status: int, headers: Mapping[str, str]) -> bool:
    """Whether an answer (``status``, ``headers``: case-insensitive, as aiohttp gives them) says its server is
    draining: a 503 with ``DRAINING_HEADER``. (A 503 without it, e.g. vLLM's full queue, is not a drain.)"""
    return status == 503 and headers.get(DRAINING_HEADER) == "1"


def health_reason(status: int, headers: Mapping[str, str]) -> str:
    """Why a backend whose ``GET /health`` answered ``status`` is out: ``DRAINING``, or the status."""
    return DRAINING if is_draining(status, headers) else f"GET /health answered {status}"


@dataclass(eq=False)
class Backend:
    url: str
    role: str  # "prefill" or "decode"
    healthy: bool = True
    in_flight: int = 0
    reason: str = ""  # why it is out, while it is
    changed_at: float = field(default_factory=time.monotonic)
    served: int = 0

    def state(self) -> dict[str, object]:
        out: dict[str, object] = {"url": self.url, "healthy": self.healthy, "in_flight": self.in_flight}
        if not self.healthy:
            out["reason"] = self.reason
        return out


class Pool:
    """The backends of one role and the policy picking among the healthy ones.

    ``policy``: the policy's name (:mod:`.registry`), ``router`` the policy built for these ``backends``.
    ``affinity``: session affinity in front of it. ``on_change(backend)`` is told of every change of a backend's
    health, ``on_choice(role, choice)`` of every choice (the proxy's log line and metrics)."""

    def __init__(
        self,
        role: str,
        backends: list[Backend],
        policy: str,
        router: Policy,
        *,
        affinity: Affinity | None = None,
        on_change: Callable[[Backend], None] | None = None,
        on_choice: Callable[[str, Choice], None] | None = None,
    ) -> None:
        if not backends:
            raise ValueError(f"at least one {role} backend is needed")
        self.role = role
        self.policy = policy
        self.backends = backends
        self.router = router
        self.affinity = affinity
        self._on_change = on_change
        self._on_choice = on_choice

    def healthy(self) -> list[Backend]:
        return [b for b in self.backends if b.healthy]

    def pick(
        self, exclude: Collection[Backend] = (), request: RouteRequest | None = None, prefer: Backend | None = None
    ) -> Backend | None:
        """The backend the policy picks for ``request`` (None: no request to read, e.g. ``/v1/models``) among the
        healthy ones not excluded; None if there is none. ``prefer``: a backend chosen before (and reported,
        :meth:`report`), taken while it is healthy and not excluded."""
        if prefer is not None and prefer.healthy and all(prefer is not b for b in exclude):
            return prefer
        if exclude:
            excluded = set(map(id, exclude))
            candidates = [b for b in self.backends if b.healthy and id(b) not in excluded]
        else:
            candidates = [b for b in self.backends if b.healthy]
        if not candidates:
            return None
        choice = choose(self.router, self.affinity, candidates, request)
        self.report(choice)
        backend: Backend = choice.backend
        return backend

    def report(self, choice: Choice) -> None:
        """Tell ``on_choice`` of a choice among this pool's backends (made by :meth:`pick`, or before it)."""
        if self._on_choice is not None:
            self._on_choice(self.role, choice)

    def note_answer(self, backend: Backend, status: int, headers: Mapping[str, str]) -> bool:
        """Look at a backend's answer to a request: one saying it drains (:func:`is_draining`) takes it out until a
        health check passes (after its restart). True for such an answer: the request never reached the engine."""
        if not is_draining(status, headers):
            return False
        self.set_health(backend, False, DRAINING)
        return True

    def set_health(self, backend: Backend, healthy: bool, reason: str = "") -> None:
        if backend.healthy == healthy:
            if not healthy:
                backend.reason = reason
            return
        backend.healthy = healthy
        backend.reason = "" if healthy else reason
        backend.changed_at = time.monotonic()
        if healthy:
            log.info("%s backend %s is back", self.role, backend.url)
        else:
            log.warning("%s backend %s taken out: %s", self.role, backend.url, reason)
            # what it held is gone when it comes back (a drain or a crash ends in a restart)
            self.router.forget(backend)
            if self.affinity is not None:
                self.affinity.forget(backend)
        if self._on_change is not None:
            self._on_change(backend)


class StateSignal:
    """Wakes waiters on every backend state change (tests and tools wait on it instead of sleeping)."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def fire(self, _backend: Backend | None = None) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait_until(self, predicate: Callable[[], bool], timeout_s: float) -> None:
        """Returns once ``predicate()`` holds; raises TimeoutError after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not predicate():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("backend state did not reach the expected condition in time")
            event = self._event
            try:
                await asyncio.wait_for(event.wait(), remaining)
            except TimeoutError:
                if not predicate():
                    raise
