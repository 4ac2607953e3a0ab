"""How a pool picks among its healthy backends: the routing policies, and session affinity in front of any of them.

* ``round_robin``; ``least_outstanding`` (fewest requests this proxy has in flight there, ties round robin);
  ``power_of_two`` (two backends at random, the less busy of them).
* ``cache_aware``: a bounded prefix tree (:mod:`.prefix_tree`) of the prompts sent to each backend. When the pool is
  out of balance (the busiest backend has more than ``balance_abs`` requests over the idlest and more than
  ``balance_rel`` times its count) the idlest gets the request; else the backend whose sent prefixes match the
  longest part of the prompt, if that part is over ``cache_threshold`` of it; else the backend holding the least
  of the tree (where a new prefix costs least). The prompt is then recorded as sent there.
* ``kv_aware``: the engines' own KV events (:mod:`.kv_events`, :mod:`.kv_index`): the prompt's token ids are hashed
  as the engines hash their blocks, and each backend scored by the prefix it can reuse, each block credited by the
  tier it is in (own cache 1.0, host 0.8, shared directory 0.6, local disk 0.3); the blocks of a request just
  routed count as its backend's own until the events catch up. A text or chat prompt is hashed by
  the ids the engines' ``/tokenize`` gave (:mod:`.tokenize`). Same balance guard; no match, or a prompt without ids
  (tokenization off or failed, a batch), goes to the least busy.
* session affinity (any policy): a request naming a session (the ``X-Session-Id`` header, else the body's ``user``)
  goes where that session's last request went while that backend is healthy and the session was used within
  ``ttl_s``; at most ``max_sessions`` are remembered (the least recently used forgotten first).

Each choice is a :class:`Choice`: the backend, why (``reason``) and, for the prefix policies, how many blocks (or
chunks) matched by tier, which the proxy logs at DEBUG and counts in its metrics.
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import xxhash

from pd_transfer.proxy import flow
from pd_transfer.proxy.block_hash import BlockHasher
from pd_transfer.proxy.kv_index import KvIndex
from pd_transfer.proxy.prefix_tree import PrefixTree, text_chunks, token_chunks

POLICIES = ("round_robin", "least_outstanding", "power_of_two", "cache_aware", "kv_aware")
#: Why a backend was chosen (the ``reason`` label of ``pd_proxy_route_choices_total``).
REASONS = (
    "rotation",
    "least_busy",
    "two_choices",
    "balance",
    "prefix",
    "low_match",
    "no_prompt",
    "session",
    "local_prefill",  # a decode prefills the request itself (.local_prefill)
)
SESSION_HEADER = "X-Session-Id"
#: The longest prompt (tokens) kv_aware hashes: 64k tokens, beyond which a longer shared prefix changes no choice.
MAX_HASHED_TOKENS = 65536


class Candidate(Protocol):
    """What a policy sees of a backend (:class:`pd_transfer.proxy.routing.Backend`)."""

    url: str
    in_flight: int


@dataclass
class Choice:
    backend: Any  # the chosen Candidate
    reason: str
    matched: dict[str, int] = field(default_factory=dict)  # prefix blocks (chunks for cache_aware) by tier
    of: int = 0  # the prompt's blocks (chunks)


class RouteRequest:
    """What routing reads of a client request; derived values computed once, on first use, for both pools."""

    def __init__(self, endpoint: str, body: dict[str, Any], session_header: str | None = None) -> None:
        self.endpoint = endpoint
        self.body = body
        self._session_header = session_header
        self._chunks: list[int] | None = None
        self._tokens: list[int] | bool | None = False  # False: not looked at yet
        self._tokenized: list[int] | None = None  # the engines' ids of a text or chat prompt (.tokenize)
        self._keys: tuple[BlockHasher, list[int]] | None = None  # the block keys of token_ids(), and by whom

    def session(self) -> int | None:
        """The session's key (a 64-bit hash: the proxy keeps no client string), or None when the request names none."""
        name = self._session_header
        if not name:
            user = self.body.get("user")
            name = user if isinstance(user, str) else None
        if not name:
            return None
        return xxhash.xxh3_64_intdigest(name.encode("utf-8", "surrogatepass"))

    def token_ids(self) -> list[int] | None:
        """The prompt's token ids: the client's (a completions prompt of ids, or one list of them), else the ones the
        engines gave for its text (:meth:`set_token_ids`), else None."""
        sent = self.sent_ids()
        return sent if sent is not None else self._tokenized

    def set_token_ids(self, tokens: list[int]) -> None:
        """The engines' token ids of a text or chat prompt (:mod:`pd_transfer.proxy.tokenize`)."""
        self._tokenized = tokens[:MAX_HASHED_TOKENS]
        self._keys = None

    def block_keys(self, hasher: BlockHasher) -> list[int]:
        """The keys of the full blocks of :meth:`token_ids` (none without ids), hashed by ``hasher`` once per request
        (both pools and the local prefill read them)."""
        cached = self._keys
        if cached is not None and cached[0] is hasher:
            return cached[1]
        tokens = self.token_ids()
        keys = hasher.keys(tokens) if tokens is not None else []
        self._keys = (hasher, keys)
        return keys

    def sent_ids(self) -> list[int] | None:
        """The token ids the client sent, or None when it sent text or chat messages."""
        if self._tokens is False:
            self._tokens = None
            if self.endpoint == flow.COMPLETIONS:
                prompt = self.body.get("prompt")
                if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
                    prompt = prompt[0]
                if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
                    self._tokens = prompt[:MAX_HASHED_TOKENS]
        return self._tokens if isinstance(self._tokens, list) else None

    def chunks(self) -> list[int]:
        """The prompt's chained chunk names for the prefix tree (text, or token ids when the client sent ids; never
        the engines' ids, so that a failed tokenization does not change a prompt's names)."""
        if self._chunks is None:
            tokens = self.sent_ids()
            if tokens is not None:
                self._chunks = token_chunks(tokens)
            else:
                self._chunks = text_chunks(prompt_text(self.endpoint, self.body))
        return self._chunks


def prompt_text(endpoint: str, body: dict[str, Any]) -> str:
    """The text a request's prefix is read from: the prompt, or the chat messages' roles and text in order."""
    if endpoint == flow.COMPLETIONS:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            return prompt[0]
        return ""
    parts: list[str] = []
    for message in body.get("messages") or ():
        if not isinstance(message, dict):
            continue
        parts.append(f"<{message.get('role')}>")
        content = message.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts.extend(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return "\n".join(parts)


class Policy(Protocol):
    name: str

    def choose(self, candidates: Sequence[Candidate], request: RouteRequest | None) -> Choice: ...

    def forget(self, backend: Candidate) -> None:
        """The backend restarted or left: what the policy remembers of it goes."""


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def turn(self, candidates: Sequence[Candidate]) -> list[Candidate]:
        """The candidates rotated by one more step each call (ties among them go round robin)."""
        start = self._next % len(candidates)
        self._next += 1
        return [*candidates[start:], *candidates[:start]]

    def choose(self, candidates: Sequence[Candidate], request: RouteRequest | None) -> Choice:
        return Choice(self.turn(candidates)[0], "rotation")

    def forget(self, backend: Candidate) -> None:
        pass


class LeastOutstanding(RoundRobin):
    name = "least_outstanding"

    def choose(self, candidates: Sequence[Candidate], request: RouteRequest | None) -> Choice:
        return Choice(min(self.turn(candidates), key=_load), "least_busy")


class PowerOfTwo(RoundRobin):
    name = "power_of_two"

    def __init__(self, rng: random.Random | None = None) -> None:
        super().__init__()
        self._rng = rng or random.Random()

    def choose(self, candidates: Sequence[Candidate], request: RouteRequest | None) -> Choice:
        if len(candidates) == 1:
            return Choice(candidates[0], "two_choices")
        first, second = self._rng.sample(range(len(candidates)), 2)
        a, b = candidates[first], candidates[second]
        return Choice(b if b.in_flight < a.in_flight else a, "two_choices")


def _load(backend: Candidate) -> int:
    return backend.in_flight


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


class CacheAware(RoundRobin):
    name = "cache_aware"

    def __init__(
        self,
        backends: Sequence[Candidate],
        max_entries: int = 1 << 20,
        threshold: float = 0.5,
        balance: Balance | None = None,
    ) -> None:
        super().__init__()
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"the cache threshold must be within [0, 1], got {threshold}")
        self.tree = PrefixTree(max_entries)
        self.threshold = threshold
        self.balance = balance or Balance()
        self._slots = {id(b): i for i, b in enumerate(backends)}

    def choose(self, candidates: Sequence[Candidate], request: RouteRequest | None) -> Choice:
        rotated = self.turn(candidates)
        if request is None:
            return Choice(min(rotated, key=_load), "no_prompt")
        names = request.chunks()
        slots = [self._slots[id(c)] for c in rotated]
        if self.balance.broken(rotated):
            chosen, reason, matched = min(rotated, key=_load), "balance", 0
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


class KvAware(RoundRobin):
    name = "kv_aware"

    def __init__(self, index: KvIndex, hasher: BlockHasher, balance: Balance | None = None) -> None:
        super().__init__()
        self.index = index
        self.hasher = hasher
        self.balance = balance or Balance()

    def choose(self, candidates: Sequence[Candidate], request: RouteRequest | None) -> Choice:
        rotated = self.turn(candidates)
        if request is None or request.token_ids() is None:
            return Choice(min(rotated, key=_load), "no_prompt")
        keys = request.block_keys(self.hasher)
        if self.balance.broken(rotated):
            choice = Choice(min(rotated, key=_load), "balance", {}, len(keys))
        else:
            matches = self.index.match(keys, [c.url for c in rotated])
            best = max(rotated, key=lambda c: (matches[c.url].score, -c.in_flight))
            match = matches[best.url]
            if match.score <= 0:
                choice = Choice(min(rotated, key=_load), "low_match", {}, len(keys))
            else:
                choice = Choice(best, "prefix", dict(match.by_tier), len(keys))
        self.index.routed(choice.backend.url, keys)
        return choice

    def forget(self, backend: Candidate) -> None:
        self.index.drop(backend.url)


class Affinity:
    """Session affinity in front of a policy: ``ttl_s`` idle seconds a session is kept, ``max_sessions`` at most."""

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
