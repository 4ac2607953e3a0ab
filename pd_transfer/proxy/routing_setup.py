"""The proxy's routing, built from its config: each role's pool and policy, session affinity, and for ``kv_aware``
the KV index, the block hasher and one event subscriber per engine that publishes (:mod:`.kv_events`).

Settings that cannot work are refused here, when the proxy starts, with what to change: an unknown policy, a
hash configuration no engine can have (:class:`~pd_transfer.proxy.block_hash.HashConfigError`), ``kv_aware``
without event sources, a source naming no backend of the proxy.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import zmq.asyncio
from prometheus_client import Counter

from pd_transfer.proxy.block_hash import BlockHasher
from pd_transfer.proxy.config import ProxyConfig
from pd_transfer.proxy.kv_events import FAULTS, EventSource, EventStream, EventSubscriber
from pd_transfer.proxy.kv_index import Credits, KvIndex
from pd_transfer.proxy.local_prefill import LocalPrefill
from pd_transfer.proxy.metrics import ProxyMetrics
from pd_transfer.proxy.policies import POLICIES, Affinity, Balance, CacheAware, Choice, KvAware, Policy
from pd_transfer.proxy.routing import Backend, Pool

log = logging.getLogger(__name__)


class Routing:
    def __init__(self, config: ProxyConfig, metrics: ProxyMetrics) -> None:
        self.config = config
        self.metrics = metrics
        roles = ("prefill", "decode")
        for role in roles:
            if config.policy_of(role) not in POLICIES:
                raise ValueError(
                    f"unknown {role} routing policy {config.policy_of(role)[:40]!r}; one of {', '.join(POLICIES)}"
                )
        self.balance = Balance(config.balance_abs_threshold, config.balance_rel_threshold)
        self.sources = [EventSource.parse(text) for text in config.kv_event_sources]
        self.index: KvIndex | None = None
        self.hasher: BlockHasher | None = None
        if any(config.policy_of(role) == "kv_aware" for role in roles):
            if not self.sources:
                raise ValueError(
                    "the kv_aware policy needs the engines' KV events: --kv-event-source URL=tcp://HOST:PORT"
                    "[,tcp://HOST:REPLAY_PORT] per engine (vLLM's --kv-events-config endpoint and replay_endpoint)"
                )
            self.hasher = BlockHasher(config.kv_hash_algo, config.kv_hash_seed, config.kv_block_size)
            self.index = KvIndex(
                config.kv_max_blocks,
                Credits(config.kv_penalty_host, config.kv_penalty_shared, config.kv_penalty_disk),
                shared_disk=config.kv_shared_directory,
                routed_ttl_s=config.kv_routed_ttl_s,
            )
            metrics.kv_index_entries.set_function(self.index.__len__)
        known = {url.rstrip("/") for url in [*config.prefill, *config.decode]}
        for source in self.sources:
            if source.backend not in known:
                raise ValueError(
                    f"--kv-event-source names {source.backend[:120]}, which is no prefill or decode backend"
                )
        self.local_prefill = self._local_prefill()
        if config.tokenize_timeout_s <= 0:
            raise ValueError(f"--tokenize-timeout must be positive, got {config.tokenize_timeout_s}")
        #: The roles whose requests need the engines' token ids of a text or chat prompt (kv_aware pools).
        kv_roles = frozenset(role for role in roles if config.policy_of(role) == "kv_aware")
        self.tokenize_roles = kv_roles if config.tokenize else frozenset()
        self.streams: list[EventStream] = []
        #: Each (role, backend, reason) series of ``route_choices``, looked up once (the request path only counts).
        self._choice_counts: dict[tuple[str, str, str], Counter] = {}
        self._subscribers: list[EventSubscriber] = []
        self._context: zmq.asyncio.Context | None = None

    def _local_prefill(self) -> LocalPrefill | None:
        """Conditional disaggregation, when asked for (``max_local_prefill_tokens``); it reads what the decodes hold
        from their KV events, so it needs the decode pool kv_aware."""
        bound = self.config.max_local_prefill_tokens
        if bound < 0:
            raise ValueError(f"--max-local-prefill must be >= 0 tokens (0: off), got {bound}")
        if not bound:
            return None
        if self.config.policy_of("decode") != "kv_aware" or self.index is None or self.hasher is None:
            raise ValueError(
                "--max-local-prefill needs the decode policy kv_aware (--decode-policy kv_aware and the decodes'"
                " --kv-event-source): what a decode holds is read from its KV events"
            )
        return LocalPrefill(self.index, self.hasher, bound, {source.backend for source in self.sources})

    def pool(self, role: str, urls: list[str], on_change: Callable[[Backend], None] | None) -> Pool:
        config = self.config
        policy = config.policy_of(role)
        affinity = Affinity(config.session_ttl_s, config.max_sessions) if config.session_ttl_s > 0 else None
        return Pool(
            role, urls, policy, on_change, build=self._builder(policy), affinity=affinity, on_choice=self._chosen
        )

    def _builder(self, policy: str) -> Callable[[list[Backend]], Policy] | None:
        config = self.config
        if policy == "cache_aware":
            return lambda backends: CacheAware(backends, config.max_tree_size, config.cache_threshold, self.balance)
        if policy == "kv_aware":
            index, hasher = self.index, self.hasher
            assert index is not None and hasher is not None
            return lambda _backends: KvAware(index, hasher, self.balance)
        return None

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
        """One subscriber per event source (kv_aware only)."""
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
