"""The routing policies by name: the one table of what builds each policy and what it needs of the proxy.

A policy is one module of this package (a class implementing :class:`~.policy.Policy` and a ``build`` function) and
one line of :data:`POLICIES`. What it needs (:class:`Needs`) is all the proxy and ``pd-transfer up`` learn of it:
the proxy tokenizes text prompts for a pool whose policy needs token ids, subscribes to the engines' KV events for
one that needs them (and ``up`` turns them on in those engines), and keeps a prefix tree for one that needs a tree.
Names and needs are checked here alone (:func:`problems`), by the proxy when it starts and by ``up`` before it
starts anything. This module imports no HTTP stack and no ZMQ (an import-linter contract): ``up`` reads it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from pd_transfer.proxy.routing import cache_aware, kv_aware, least_outstanding, power_of_two, round_robin
from pd_transfer.proxy.routing.policy import Policy, PolicyInputs

ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class Needs:
    """What a policy reads besides its pool's backends and the proxy's settings."""

    token_ids: bool = False  # the prompt's token ids: a text or chat prompt is tokenized by the engines' /tokenize
    events: bool = False  # the engines' KV events, in the KV index (--kv-event-source; up turns them on)
    tree: bool = False  # a prefix tree of the prompts its pool routed (--max-tree-size nodes)


@dataclass(frozen=True)
class Registered:
    """One policy: ``build`` makes it for a pool, from inputs that hold what ``needs`` asks for."""

    build: Callable[[PolicyInputs], Policy]
    needs: Needs = Needs()


POLICIES: dict[str, Registered] = {
    "round_robin": Registered(round_robin.build),
    "least_outstanding": Registered(least_outstanding.build),
    "power_of_two": Registered(power_of_two.build),
    "cache_aware": Registered(cache_aware.build, Needs(tree=True)),
    "kv_aware": Registered(kv_aware.build, Needs(token_ids=True, events=True)),
}


def names() -> tuple[str, ...]:
    """The registered policies' names, in the table's order (the flags' choices)."""
    return tuple(POLICIES)


def needs_of(policy: str) -> Needs:
    """What the policy named ``policy`` needs; ``ValueError`` naming the known ones for an unknown name."""
    registered = POLICIES.get(policy)
    if registered is None:
        raise ValueError(f"unknown routing policy {policy[:40]!r}; one of {', '.join(POLICIES)}")
    return registered.needs


def problems(policies: Mapping[str, str], *, local_prefill: bool, event_sources: bool = True) -> list[str]:
    """What is wrong with routing ``policies`` (role -> policy name, for ``prefill`` and ``decode``), one message
    each (empty: fine). ``local_prefill``: conditional disaggregation is asked for (``--max-local-prefill``);
    ``event_sources``: the engines' KV event endpoints are given (``up`` wires them itself)."""
    found = []
    for role in ROLES:
        if policies[role] not in POLICIES:
            found.append(f"unknown {role} routing policy {policies[role][:40]!r}; one of {', '.join(POLICIES)}")
    if found:
        return found
    if not event_sources and any(POLICIES[policies[role]].needs.events for role in ROLES):
        found.append(
            "a policy reading the engines' KV events (kv_aware) needs them: --kv-event-source URL=tcp://HOST:PORT"
            "[,tcp://HOST:REPLAY_PORT] per engine (vLLM's --kv-events-config endpoint and replay_endpoint)"
        )
    if local_prefill and not POLICIES[policies["decode"]].needs.events:
        found.append(
            "--max-local-prefill needs a decode policy that reads the engines' KV events (--decode-policy kv_aware):"
            " what a decode holds is read from its KV events"
        )
    return found
