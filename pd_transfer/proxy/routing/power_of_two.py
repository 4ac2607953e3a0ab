"""``power_of_two``: two healthy backends drawn at random, the less busy of them."""

from __future__ import annotations

import random
from collections.abc import Sequence

from pd_transfer.proxy.routing.policy import Candidate, Choice, PolicyInputs
from pd_transfer.proxy.routing.request import RouteRequest


class PowerOfTwo:
    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(self, candidates: Sequence[Candidate], request: RouteRequest | None) -> Choice:
        if len(candidates) == 1:
            return Choice(candidates[0], "two_choices")
        first, second = self._rng.sample(range(len(candidates)), 2)
        a, b = candidates[first], candidates[second]
        return Choice(b if b.in_flight < a.in_flight else a, "two_choices")

    def forget(self, backend: Candidate) -> None:
        pass


def build(_inputs: PolicyInputs) -> PowerOfTwo:
    return PowerOfTwo()
