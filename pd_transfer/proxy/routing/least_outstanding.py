"""``least_outstanding``: the healthy backend with the fewest requests this proxy has in flight there (ties in turn)."""

from __future__ import annotations

from collections.abc import Sequence

from pd_transfer.proxy.routing.policy import Candidate, Choice, PolicyInputs, Rotation, least_busy
from pd_transfer.proxy.routing.request import RouteRequest


class LeastOutstanding(Rotation):
    def choose(self, candidates: Sequence[Candidate], request: RouteRequest | None) -> Choice:
        return Choice(least_busy(self.turn(candidates)), "least_busy")


def build(_inputs: PolicyInputs) -> LeastOutstanding:
    return LeastOutstanding()
