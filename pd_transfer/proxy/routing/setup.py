"""The proxy's routing, built from its config: each role's pool and policy (:mod:`.registry`), session affinity, and
what the policies need: the KV index, the block hasher and one event subscriber per engine that publishes
(:mod:`pd_transfer.proxy.kv.events`) when a policy reads the engines' KV events, a prefix tree per pool whose policy
keeps one; the local prefill (:mod:`.local_prefill`) when asked for.

Settings that cannot work are refused here, when the proxy starts, with what to change: a policy name or need the
registry refuses (:func:`.registry.problems`), a hash configuration no engine can have
(:class:`~pd_transfer.proxy.kv.block_hash.HashConfigError`), a source naming no backend of the proxy.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import zmq.asyncio
from prometheus_client import Counter

from pd_transfer.proxy.config import ProxyConfig
from pd_transfer.proxy.kv.block_hash import BlockHasher
from pd_transfer.proxy.kv.events import FAULTS, EventSource, EventStream, EventSubscriber
from pd_transfer.proxy.kv.index import Credits, KvIndex
from pd_transfer.proxy.metrics import ProxyMetrics
from pd_transfer.proxy.routing.affinity import Affinity
from pd_transfer.proxy.routing.local_prefill import LocalPrefill
from pd_transfer.proxy.routing.policy import Balance, Choice, PolicyInputs
from pd_transfer.proxy.routing.pool import Backend, Pool
from pd_transfer.proxy.routing.prefix_tree import PrefixTree
from pd_transfer.proxy.routing.registry import POLICIES, ROLES, problems

log = logging.getLogger(__name__)


class Routing:
    """The pools of both roles (:meth:`pool`), their policies' shared state, and the event subscribers
    (:meth:`start`, :meth:`close`). ``metrics``: where choices, KV event faults and the index's size are counted."""

    def __init__(self, config: ProxyConfig, metrics: ProxyMetrics) -> None:
        self.config = config
        self.metrics = metrics
        if config.max_local_prefill_tokens < 0:
            raise ValueError(f"--max-local-prefill must be >= 0 tokens (0: off), got {config.max_local_prefill_tokens}")
        if config.local_prefill_max_busy < 0:
            raise ValueError(
                f"--local-prefill-max-busy must be >= 0 requests (0: off), got {config.local_prefill_max_busy}"
            )
        policies = {role: config.policy_of(role) for role in ROLES}
        local_prefill = config.max_local_prefill_tokens > 0
        found = problems(policies, local_prefill=local_prefill, event_sources=bool(config.kv_event_sources))
        if found:
            raise ValueError(found[0])
        if config.tokenize_timeout_s <= 0:
            raise ValueError(f"--tokenize-timeout must be positive, got {config.tokenize_timeout_s}")
        self.needs = {role: POLICIES[policy].needs for role, policy in policies.items()}
        self.balance = Balance(config.balance_abs_threshold, config.balance_rel_threshold)
        self.sources = [EventSource.parse(text) for text in config.kv_event_sources]
        known = {url.rstrip("/") for url in [*config.prefill, *config.decode]}
        for source in self.sources:
            if source.backend not in known:
                raise ValueError(
                    f"--kv-event-source names {source.backend[:120]}, which is no prefill or decode backend"
                )
        self.index: KvIndex | None = None
        self.hasher: BlockHasher | None = None
        if any(needs.events for needs in self.needs.values()):
            self.hasher = BlockHasher(config.kv_hash_algo, config.kv_hash_seed, config.kv_block_size)
            self.index = KvIndex(
                config.kv_max_blocks,
                Credits(config.kv_penalty_host, config.kv_penalty_shared, config.kv_penalty_disk),
                shared_disk=config.kv_shared_directory,
                routed_ttl_s=config.kv_routed_ttl_s,
            )
            metrics.kv_index_entries.set_function(self.index.__len__)
        self.local_prefill: LocalPrefill | None = None
        if local_prefill and self.index is not None and self.hasher is not None:
            followed = {source.backend for source in self.sources}
            self.local_prefill = LocalPrefill(
                self.index, self.hasher, config.max_local_prefill_tokens, followed, config.local_prefill_max_busy
            )
        #: The roles whose requests need the prompt's token ids (a text or chat prompt is tokenized for them).
        needing_ids = frozenset(role for role, needs in self.needs.items() if needs.token_ids)
        self.tokenize_roles = needing_ids if config.tokenize else frozenset()
        self.streams: list[EventStream] = []
        #: Each (role, backend, reason) series of ``route_choices``, looked up once (the request path only counts).
        self._choice_counts: dict[tuple[str, str, str], Counter] = {}
        self._subscribers: list[EventSubscriber] = []
        self._context: zmq.asyncio.Context | None = None

    def pool(self, role: str, urls: list[str], on_change: Callable[[Backend], None] | None) -> Pool:
        """The pool of ``role`` over ``urls``, its policy built by the registry with what it needs."""
        config = self.config
        backends = [Backend(url.rstrip("/"), role) for url in urls]
        policy = config.policy_of(role)
        needs = self.needs[role]
        inputs = PolicyInputs(
            backends,
            config,
            self.balance,
            tree=PrefixTree(config.max_tree_size) if needs.tree else None,
            index=self.index if needs.events else None,
            hasher=self.hasher if needs.events else None,
        )
        affinity = Affinity(config.session_ttl_s, config.max_sessions) if config.session_ttl_s > 0 else None
        return Pool(
            role,
            backends,
            policy,
            POLICIES[policy].build(inputs),
            affinity=affinity,
            on_change=on_change,
            on_choice=self._chosen,
        )

    def _chosen(self, role: str, choice: Choice) -> None:
        metrics = self.metrics
        key = (role, choice.backend.url, choice.reason)
        counter = self._choice_counts.get(key)
        if counter is None:
            counter = self._choice_counts[key] = metrics.route_choices.labels(*key)
        counter.inc()
        if choice.of:
            metrics.route_prompt_blocks.labels(role).inc(choice.of)
            for tier, count in choice.matched.items():
                metrics.route_matched.labels(role, tier).inc(count)
        if log.isEnabledFor(logging.DEBUG):
            matched = " ".join(f"{tier}={n}" for tier, n in sorted(choice.matched.items())) or "none"
            log.debug(
                "%s -> %s (%s; matched %s of %d blocks)", role, choice.backend.url, choice.reason, matched, choice.of
            )

    async def start(self) -> None:
        """One subscriber per event source (when a policy reads the engines' KV events)."""
        if self.index is None or self.hasher is None:
            return
        self._context = zmq.asyncio.Context()
        for source in self.sources:
            stream = EventStream(source.backend, self.index, self.hasher, on_fault=self._fault_counter(source.backend))
            self.metrics.kv_batches.labels(source.backend).set_function(_batches_of(stream))
            subscriber = EventSubscriber(source, stream, self._context, silence_s=self.config.kv_silence_s)
            subscriber.start()
            self.streams.append(stream)
            self._subscribers.append(subscriber)

    def _fault_counter(self, backend: str) -> Callable[[str], None]:
        faults = self.metrics.kv_faults
        for kind in FAULTS:  # every series at zero from the start
            faults.labels(backend, kind)

        def count(kind: str) -> None:
            faults.labels(backend, kind).inc()

        return count

    async def close(self) -> None:
        for subscriber in self._subscribers:
            await subscriber.close()
        self._subscribers.clear()
        if self._context is not None:
            self._context.term()
            self._context = None


def _batches_of(stream: EventStream) -> Callable[[], float]:
    return lambda: stream.stats.batches
