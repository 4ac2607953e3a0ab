"""``by_length``: a toy policy: the prompt's length in token ids, modulo the healthy backends, picks one of them."""

from __future__ import annotations

from collections.abc import Sequence

from pd_transfer.proxy.routing.policy import Candidate, Choice, PolicyInputs, least_busy
from pd_transfer.proxy.routing.request import RouteRequest


class ByLength:
    def choose(self, candidates: Sequence[Candidate], request: RouteRequest | None) -> Choice:
        tokens = request.token_ids() if request is not None else None
        if tokens is None:  # no request to read, or its ids are not to be had (tokenization off or failed)
            return Choice(least_busy(candidates), "no_prompt")
        return Choice(candidates[len(tokens) % len(candidates)], "length")

    def forget(self, backend: Candidate) -> None:
        pass


def build(_inputs: PolicyInputs) -> ByLength:
    return ByLength()
