"""``kv_aware``: the backend whose engine holds the longest prefix of this prompt's KV blocks, by the engines' own KV
events (:mod:`pd_transfer.proxy.kv`).

The prompt's token ids (the client's, or the engines' ``/tokenize`` of its text: :mod:`pd_transfer.proxy.tokenize`)
are hashed as the engines hash their blocks, and each backend scored by the prefix it can reuse, each block credited
by the tier it is in (own cache 1.0, host 0.8, shared directory 0.6, local disk 0.3); the blocks of a request just
routed count as its backend's own until the events catch up. Out of balance (:class:`~.policy.Balance`), no match, or
a prompt without ids (tokenization off or failed, a batch): the least busy.
"""

from __future__ import annotations

from collections.abc import Sequence

from pd_transfer.proxy.kv.block_hash import BlockHasher
from pd_transfer.proxy.kv.index import KvIndex
from pd_transfer.proxy.routing.policy import Balance, Candidate, Choice, PolicyInputs, Rotation, least_busy
from pd_transfer.proxy.routing.request import RouteRequest


class KvAware(Rotation):
    def __init__(self, index: KvIndex, hasher: BlockHasher, balance: Balance | None = None) -> None:
        super().__init__()
        self.index = index
        self.hasher = hasher
        self.balance = balance or Balance()

    def choose(self, candidates: Sequence[Candidate], request: RouteRequest | None) -> Choice:
        rotated = self.turn(candidates)
        if request is None or request.token_ids() is None:
            return Choice(least_busy(rotated), "no_prompt")
        keys = request.block_keys(self.hasher)
        if self.balance.broken(rotated):
            choice = Choice(least_busy(rotated), "balance", {}, len(keys))
        else:
            matches = self.index.match(keys, [c.url for c in rotated])
            best = max(rotated, key=lambda c: (matches[c.url].score, -c.in_flight))
            match = matches[best.url]
            if match.score <= 0:
                choice = Choice(least_busy(rotated), "low_match", {}, len(keys))
            else:
                choice = Choice(best, "prefix", dict(match.by_tier), len(keys))
        self.index.routed(choice.backend.url, keys)
        return choice

    def forget(self, backend: Candidate) -> None:
        self.index.drop(backend.url)


def build(inputs: PolicyInputs) -> KvAware:
    assert inputs.index is not None and inputs.hasher is not None, "the registry gives kv_aware the KV index"
    return KvAware(inputs.index, inputs.hasher, inputs.balance)
