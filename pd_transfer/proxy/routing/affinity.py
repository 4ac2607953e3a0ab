"""Session affinity in front of any policy: a request naming a session (the session header, else the body's ``user``)
goes where that session's last request went while that backend is healthy and the session was used within
``ttl_s``; at most ``max_sessions`` are remembered (the least recently used forgotten first)."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from pd_transfer.proxy.routing.policy import Candidate, Choice, Policy
from pd_transfer.proxy.routing.request import RouteRequest


class Affinity:
    """The sessions of one pool: ``ttl_s`` idle seconds a session is kept, ``max_sessions`` at most; ``clock`` in
    seconds."""

    def __init__(self, ttl_s: float, max_sessions: int = 100_000, clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_s <= 0 or max_sessions < 1:
            raise ValueError(f"session affinity needs ttl_s > 0 and max_sessions >= 1, got {ttl_s} and {max_sessions}")
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self._clock = clock
        self._sessions: OrderedDict[int, tuple[str, float]] = OrderedDict()  # key -> (backend url, last used)

    def __len__(self) -> int:
        return len(self._sessions)

    def lookup(self, key: int, candidates: Sequence[Candidate]) -> Candidate | None:
        self._expire()
        entry = self._sessions.get(key)
        if entry is None:
            return None
        return next((c for c in candidates if c.url == entry[0]), None)

    def remember(self, key: int, backend: Candidate) -> None:
        sessions = self._sessions
        sessions[key] = (backend.url, self._clock())
        sessions.move_to_end(key)
        while len(sessions) > self.max_sessions:
            sessions.popitem(last=False)

    def forget(self, backend: Candidate) -> None:
        for key in [k for k, (url, _) in self._sessions.items() if url == backend.url]:
            del self._sessions[key]

    def _expire(self) -> None:
        sessions = self._sessions
        horizon = self._clock() - self.ttl_s
        while sessions:
            key, (_, used) = next(iter(sessions.items()))
            if used >= horizon:
                return
            del sessions[key]


def choose(
    policy: Policy, affinity: Affinity | None, candidates: Sequence[Candidate], request: RouteRequest | None
) -> Choice:
    """The policy's choice, unless the request's session still has a healthy backend it sticks to."""
    key = request.session() if affinity is not None and request is not None else None
    if affinity is not None and key is not None:
        sticky = affinity.lookup(key, candidates)
        if sticky is not None:
            affinity.remember(key, sticky)
            return Choice(sticky, "session")
    choice = policy.choose(candidates, request)
    if affinity is not None and key is not None:
        affinity.remember(key, choice.backend)
    return choice
