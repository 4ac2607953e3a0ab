"""What a routing policy is: the contract each policy module fulfils, the choice it returns, and what several policies
share (the rotation that breaks their ties, the balance guard of the prefix policies).

A policy module (``round_robin``, ``cache_aware``, ...) holds one class that implements :class:`Policy` and a
``build`` function making it from :class:`PolicyInputs`; :mod:`.registry` names it and says what it needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from pd_transfer.proxy.config import ProxyConfig
from pd_transfer.proxy.kv.block_hash import BlockHasher
from pd_transfer.proxy.kv.index import KvIndex
from pd_transfer.proxy.routing.prefix_tree import PrefixTree
from pd_transfer.proxy.routing.request import RouteRequest


class Candidate(Protocol):
    """What a policy sees of a backend (:class:`pd_transfer.proxy.routing.pool.Backend`)."""

    url: str
    in_flight: int


@dataclass
class Choice:
    """A policy's pick: the backend, why (``reason``: the ``reason`` label of ``pd_proxy_route_choices_total``) and,
    for the prefix policies, how many of the prompt's ``of`` blocks (chunks) matched, by tier."""

    backend: Any  # the chosen Candidate
    reason: str
    matched: dict[str, int] = field(default_factory=dict)
    of: int = 0


class Policy(Protocol):
    def choose(self, candidates: Sequence[Candidate], request: RouteRequest | None) -> Choice:
        """One of ``candidates`` (the pool's healthy backends, at least one) for ``request`` (None: there is no
        request to read, e.g. ``/v1/models``)."""
        ...

    def forget(self, backend: Candidate) -> None:
        """The backend restarted or left: what the policy remembers of it goes."""


@dataclass(frozen=True)
class Balance:
    """The load-balance guard of the prefix policies: out of balance when the busiest backend has more than ``abs``
    requests over the idlest AND more than ``rel`` times its count."""

    abs: int = 32
    rel: float = 1.5

    def __post_init__(self) -> None:
        if self.abs < 0 or self.rel < 1.0:
            raise ValueError(f"balance thresholds: abs >= 0 and rel >= 1, got {self.abs} and {self.rel}")

    def broken(self, candidates: Sequence[Candidate]) -> bool:
        loads = [c.in_flight for c in candidates]
        high, low = max(loads), min(loads)
        return high - low > self.abs and high > self.rel * low


@dataclass(frozen=True)
class PolicyInputs:
    """What a policy is built from: its pool's ``backends``, the proxy's ``config``, the ``balance`` guard, and what
    the registry says it needs (:class:`pd_transfer.proxy.routing.registry.Needs`), None otherwise: its pool's
    prefix ``tree``; the KV ``index`` the engines' events fill, and the ``hasher`` of their blocks."""

    backends: Sequence[Candidate]
    config: ProxyConfig
    balance: Balance
    tree: PrefixTree | None = None
    index: KvIndex | None = None
    hasher: BlockHasher | None = None


class Rotation:
    """A policy's turn among the candidates, which breaks its ties round robin; it remembers nothing of a backend."""

    def __init__(self) -> None:
        self._next = 0

    def turn(self, candidates: Sequence[Candidate]) -> list[Candidate]:
        """The candidates rotated by one more step each call."""
        start = self._next % len(candidates)
        self._next += 1
        return [*candidates[start:], *candidates[:start]]

    def forget(self, backend: Candidate) -> None:
        pass


def least_busy(candidates: Sequence[Candidate]) -> Candidate:
    """The candidate with the fewest requests in flight (the first of those tied)."""
    return min(candidates, key=_load)


def _load(backend: Candidate) -> int:
    return backend.in_flight
