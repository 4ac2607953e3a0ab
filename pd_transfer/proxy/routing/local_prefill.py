"""Conditional disaggregation: a request whose prompt a decode already holds, but for a few tokens, is prefilled by
that decode itself; no prefill hop, no KV transfer.

A decode holds the prompts it decoded (the KV it pulled, and the tokens it generated after them) until its cache
evicts them: the next turn of a chat, or another user of a system prompt it decoded, finds most of its prompt there.
Sending such a request through a prefill costs an HTTP hop, a prefill step and a pull for the few tokens the decode
lacks; computing those tokens on the decode costs one step of its own. ``max_tokens`` bounds what a decode computes
that way (its other requests wait for that step); a prompt with more uncached tokens goes through P/D as before. When
the index follows the prefills' events too, a decode takes the request only if it holds
at least as many of its blocks as the best prefill: a local prefill never computes more than the prefill hop would
(a decode whose cache evicted part of a system prompt the prefill still holds leaves it to the prefill).

A local prefill also weighs load (issue 41 item 6; NVIDIA Dynamo's disaggregation router makes the same call): its
step delays every request the decode is generating, so with ``max_busy`` set, a decode with ``max_busy`` or more
requests in flight leaves the request to the prefill hop when a prefill has fewer than ``max_busy`` in flight (a short
queue); when every prefill is as busy, the decode still takes it.

What a decode holds comes from its KV events (the KV index, :mod:`pd_transfer.proxy.kv.index`): the blocks it
reported stored in any tier it reaches, and the blocks of requests just routed to it. The uncached part is counted
in tokens: the prompt's length less the held prefix's blocks times the block size.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from pd_transfer.proxy.kv.block_hash import BlockHasher
from pd_transfer.proxy.kv.index import KvIndex
from pd_transfer.proxy.routing.policy import Candidate, Choice
from pd_transfer.proxy.routing.request import MAX_HASHED_TOKENS, RouteRequest

#: The route choice's reason (``pd_proxy_route_choices_total{role="decode"}``) of a request prefilled on its decode.
LOCAL_PREFILL = "local_prefill"


class LocalPrefill:
    """Picks the decode that prefills a request itself, when one holds all but at most ``max_tokens`` of its prompt
    (``max_tokens`` >= 1). ``index`` and ``hasher``: the decode pool's ``kv_aware`` ones; ``followed``: the backends
    whose events the index reads (a prefill among them is weighed against the decodes); ``max_busy``: requests in
    flight from which a decode leaves the request to a prefill with fewer (0: load is not weighed)."""

    def __init__(
        self,
        index: KvIndex,
        hasher: BlockHasher,
        max_tokens: int,
        followed: Collection[str] = frozenset(),
        max_busy: int = 0,
    ) -> None:
        if max_tokens < 1:
            raise ValueError(f"the local prefill bound must be at least 1 token, got {max_tokens}")
        if max_busy < 0:
            raise ValueError(f"the local prefill's busy bound must be >= 0 requests (0: off), got {max_busy}")
        self.index = index
        self.hasher = hasher
        self.max_tokens = max_tokens
        self.followed = frozenset(followed)
        self.max_busy = max_busy

    def decode_for(
        self, candidates: Sequence[Candidate], request: RouteRequest, prefills: Sequence[Candidate] = ()
    ) -> Choice | None:
        """The decode among ``candidates`` (healthy ones) that holds the longest prefix of the request's prompt, if
        that leaves at most ``max_tokens`` tokens to compute (ties: the least busy), no prefill of ``prefills``
        (the healthy ones) whose events the index follows holds more of it, and it is not too busy (``max_busy``)
        while a prefill is not; None otherwise, and for a prompt whose token ids are unknown or longer than the proxy
        hashes. The chosen decode is credited with the prompt's blocks (:meth:`KvIndex.routed`): it will hold them."""
        tokens = request.token_ids()
        if not candidates or tokens is None or len(tokens) >= MAX_HASHED_TOKENS:
            return None
        keys = request.block_keys(self.hasher)
        rivals = [p.url for p in prefills if p.url in self.followed]
        matches = self.index.match(keys, [*[c.url for c in candidates], *rivals])
        best = max(candidates, key=lambda c: (matches[c.url].blocks, -c.in_flight))
        held = matches[best.url]
        if len(tokens) - held.blocks * self.hasher.block_size > self.max_tokens:
            return None
        if any(matches[url].blocks > held.blocks for url in rivals) or self._too_busy(best, prefills):
            return None
        self.index.routed(best.url, keys)
        return Choice(best, LOCAL_PREFILL, dict(held.by_tier), len(keys))

    def _too_busy(self, decode: Candidate, prefills: Sequence[Candidate]) -> bool:
        """Whether ``decode`` has ``max_busy`` requests in flight or more while a prefill has fewer."""
        if not self.max_busy or decode.in_flight < self.max_busy:
            return False
        return any(prefill.in_flight < self.max_busy for prefill in prefills)
