"""``round_robin``: the next healthy backend in turn."""

from __future__ import annotations

from collections.abc import Sequence

from pd_transfer.proxy.routing.policy import Candidate, Choice, PolicyInputs, Rotation
from pd_transfer.proxy.routing.request import RouteRequest


class RoundRobin(Rotation):
    def choose(self, candidates: Sequence[Candidate], request: RouteRequest | None) -> Choice:
        return Choice(self.turn(candidates)[0], "rotation")


def build(_inputs: PolicyInputs) -> RoundRobin:
    return RoundRobin()
