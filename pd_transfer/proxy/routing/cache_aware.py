"""``cache_aware``: the backend that was sent the longest prefix of this prompt, by a bounded prefix tree of the
prompts this proxy routed (:mod:`.prefix_tree`), not by what the engines report.

When the pool is out of balance (:class:`~.policy.Balance`) the idlest backend gets the request; else the backend
whose sent prefixes match the longest part of the prompt, if that part is over ``threshold`` of it; else the backend
holding the least of the tree (where a new prefix costs least). The prompt is then recorded as sent there. A
prompt's chunks are named from its text, or from the token ids the client sent (:meth:`RouteRequest.chunks`).
"""

from __future__ import annotations

from collections.abc import Sequence

from pd_transfer.proxy.routing.policy import Balance, Candidate, Choice, PolicyInputs, Rotation, least_busy
from pd_transfer.proxy.routing.prefix_tree import PrefixTree
from pd_transfer.proxy.routing.request import RouteRequest


class CacheAware(Rotation):
    """Over ``backends`` (each a slot of ``tree``): ``threshold`` in [0, 1], the share of a prompt's chunks that must
    match to follow the match."""

    def __init__(
        self,
        backends: Sequence[Candidate],
        tree: PrefixTree,
        threshold: float = 0.5,
        balance: Balance | None = None,
    ) -> None:
        super().__init__()
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"the cache threshold must be within [0, 1], got {threshold}")
        self.tree = tree
        self.threshold = threshold
        self.balance = balance or Balance()
        self._slots = {id(b): i for i, b in enumerate(backends)}

    def choose(self, candidates: Sequence[Candidate], request: RouteRequest | None) -> Choice:
        rotated = self.turn(candidates)
        if request is None:
            return Choice(least_busy(rotated), "no_prompt")
        names = request.chunks()
        slots = [self._slots[id(c)] for c in rotated]
        if self.balance.broken(rotated):
            chosen, reason, matched = least_busy(rotated), "balance", 0
        else:
            matches = self.tree.match(names, slots)
            best = max(rotated, key=lambda c: (matches[self._slots[id(c)]], -c.in_flight))
            matched = matches[self._slots[id(best)]]
            if names and matched / len(names) > self.threshold:
                chosen, reason = best, "prefix"
            else:
                chosen = min(rotated, key=lambda c: (self.tree.held(self._slots[id(c)]), c.in_flight))
                reason, matched = "low_match", matches[self._slots[id(chosen)]]
        if names:
            self.tree.insert(names, self._slots[id(chosen)])
        return Choice(chosen, reason, {"routed": matched}, len(names))

    def forget(self, backend: Candidate) -> None:
        slot = self._slots.get(id(backend))
        if slot is not None:
            self.tree.remove_worker(slot)


def build(inputs: PolicyInputs) -> CacheAware:
    assert inputs.tree is not None, "the registry gives cache_aware a tree"
    return CacheAware(inputs.backends, inputs.tree, inputs.config.cache_threshold, inputs.balance)
