"""The prefill engines a decode rank reads from: each connected once, then looked up per request.

Connecting to an engine (idempotent; one handshake per engine at a time, others are not held up): the handshake
(cached by the client), a compatibility check of every rank's layout, then the transports the rank prefers are asked
in order to open it (:meth:`~pd_transfer.connector.transports.seam.DecodeEnd.open`); the first that does gives the
engine its :class:`~pd_transfer.connector.transports.seam.Link` (NIXL: peers, descriptor lists, a warm-up read;
same-host IPC: the prefill's memory opened). The connect log line names the transport and why the ones before it
refused; where none opens it, ``NoTransport`` says why each refused.

A failed connect leaves nothing behind (a transport that fails while opening closes what it opened). ``forget``
drops an engine (it restarted or died), so the next request handshakes afresh; its link is closed with it.

Restarts: a prefill restarted at the same address is a new *incarnation*: new NIXL agents (their names change
on every start) and maybe a new engine id. ``refresh`` handshakes afresh, bypassing the cache; if the engine
now published is another incarnation than the one connected, the old one's link is closed and the new one is
connected in its place (counted in ``pd_transfer_peer_rehandshakes_total`` by ``reason``). The decode rank refreshes
when a request names another engine id than the one connected, and when a read fails because the peer disconnected.
An engine dropped for a failure and connected again later counts as ``reconnect``.

Invariants: at most one engine per address; an engine's link is open exactly while it is registered here (or while
it is being connected); a refresh that finds the same incarnation changes nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pd_transfer.connector.cache import KVCache
from pd_transfer.connector.transports.seam import DecodeEnd, Link, NoTransport, OfferedEngine, Refusal, Source
from pd_transfer.handshake.client import HandshakeClient
from pd_transfer.handshake.errors import HandshakeError
from pd_transfer.handshake.messages import EngineMetadata
from pd_transfer.metrics import TransferMetrics
from pd_transfer.topology import PeerPlan, check_compatible

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RemoteEngine:
    """A connected prefill engine: what it published, its side channel's address, and the link its transport opened
    (what its requests are read by)."""

    engine: EngineMetadata
    host: str
    port: int
    link: Link

    @property
    def transport(self) -> str:
        """The name of the transport that opened it (the pulls' ``transport`` label)."""
        return self.link.transport

    @property
    def plan(self) -> PeerPlan:
        """What its link reads."""
        return self.link.plan

    @property
    def sources(self) -> Sequence[Source]:
        """The prefill ranks its link reads."""
        return self.link.sources


def incarnation(engine: EngineMetadata) -> tuple[str, tuple[str, ...]]:
    """What tells one start of an engine from another: its id and its ranks' NIXL agent names."""
    return engine.engine_id, tuple(rank.agent_name for rank in engine.ranks)


class RemoteEngines:
    """The engines one decode rank (``name``: its agent's, for logs) reads from, keyed by side channel
    ``(host, port)``; thread-safe.

    ``ends``: the decode ends of the transports the rank prefers, by name, in order of preference.
    """

    def __init__(
        self,
        name: str,
        cache: KVCache,
        client: HandshakeClient,
        ends: Mapping[str, DecodeEnd],
        *,
        metrics: TransferMetrics | None = None,
    ) -> None:
        self.name = name
        self.cache = cache
        self.client = client
        self.ends = dict(ends)
        self.metrics = metrics if metrics is not None else TransferMetrics()
        self._remotes: dict[tuple[str, int], RemoteEngine] = {}
        self._lock = threading.Lock()  # guards _remotes and _engine_locks
        self._engine_locks: dict[tuple[str, int], threading.Lock] = {}
        self._dropped: set[tuple[str, int]] = set()  # addresses whose engine was dropped for a failure

    # ------------------------------------------------------------------ lookups
    def connect(self, host: str, port: int) -> RemoteEngine:
        """The engine at ``host:port``, handshaking and preparing it first if it is new. Raises what the
        handshake raises (``HandshakeError``), ``TopologyError`` for an incompatible engine, ``TransferError``."""
        key = (host, port)
        with self._lock:  # held briefly: a slow or dead engine must not stall the others
            remote = self._remotes.get(key)
            if remote is not None:
                return remote
            engine_lock = self._engine_locks.setdefault(key, threading.Lock())
        with engine_lock:  # one handshake per engine at a time
            with self._lock:
                remote = self._remotes.get(key)
            if remote is None:
                remote = self._open(host, port, self.client.fetch(host, port))
                self._register(key, remote, "reconnect")
            return remote

    def refresh(self, host: str, port: int, stale: RemoteEngine, *, dropping_on_failure: bool = False) -> RemoteEngine:
        """Handshake with ``host:port`` afresh (the cached handshake is bypassed) and return the engine connected
        there now: the same object when it is the incarnation already connected, else a newly connected one in
        its place (the old one's peers removed). ``stale`` is the engine the caller found wanting: if another
        one was connected there meanwhile (by a concurrent refresh), that one is returned without a handshake.
        Raises what :meth:`connect` raises; a failed handshake leaves the connected engine alone unless
        ``dropping_on_failure`` (its peer is known to be gone)."""
        key = (host, port)
        with self._lock:
            engine_lock = self._engine_locks.setdefault(key, threading.Lock())
        with engine_lock:
            with self._lock:
                old = self._remotes.get(key)
            if old is not None and old is not stale:
                return old
            try:
                engine = self.client.fetch(host, port, fresh=True)
            except HandshakeError:
                if dropping_on_failure and old is not None:
                    self._drop(key, old)
                raise
            if old is not None and incarnation(old.engine) == incarnation(engine):
                return old
            if old is not None:
                self._drop(key, old)
                reason = "engine_id" if old.engine.engine_id != engine.engine_id else "agents"
                logger.warning(
                    "decode %s: engine %s at %s:%d restarted (now engine %s, agents %s): handshaken afresh",
                    self.name,
                    old.engine.engine_id,
                    host,
                    port,
                    engine.engine_id,
                    ", ".join(incarnation(engine)[1]),
                )
            else:
                reason = "reconnect"
            remote = self._open(host, port, engine)
            self._register(key, remote, reason)
            return remote

    def _register(self, key: tuple[str, int], remote: RemoteEngine, reason: str) -> None:
        """Make ``remote`` the engine at ``key``; counted as a re-handshake (``reason``) after a restart or a drop."""
        with self._lock:
            self._remotes[key] = remote
            again = key in self._dropped
            self._dropped.discard(key)
        if again or reason != "reconnect":
            self.metrics.peer_rehandshakes.labels(reason).inc()

    def _drop(self, key: tuple[str, int], remote: RemoteEngine) -> None:
        """Unregister ``remote`` (if still the engine at ``key``) after a failure or a restart and close its link;
        the cached handshake goes too, a remembered handshake failure stays."""
        with self._lock:
            if self._remotes.get(key) is remote:
                del self._remotes[key]
            self._dropped.add(key)
        self.client.forget(*key, failure=False)
        remote.link.close()

    def evict(self, host: str, port: int, stale: RemoteEngine) -> bool:
        """Drop ``stale`` (its link closed, its cached handshake forgotten) if it is still the engine at
        ``host:port``; True if it was. The next :meth:`connect` there handshakes afresh (counted ``reconnect``).
        Another engine connected there meanwhile is left alone, and so is a remembered handshake failure."""
        key = (host, port)
        with self._lock:
            if self._remotes.get(key) is not stale:
                return False
            del self._remotes[key]
            self._dropped.add(key)
        self.client.forget(host, port, failure=False)
        stale.link.close()
        return True

    def get(self, host: str, port: int) -> RemoteEngine | None:
        """The engine at ``host:port`` if connected, else None (never connects)."""
        with self._lock:
            return self._remotes.get((host, port))

    def forget(self, host: str, port: int) -> None:
        """Drop the engine at ``host:port``: its link and cached handshake."""
        with self._lock:
            remote = self._remotes.pop((host, port), None)
        self.client.forget(host, port)
        if remote is not None:
            remote.link.close()

    def close(self) -> None:
        """Close every connected engine's link."""
        with self._lock:
            remotes = list(self._remotes.values())
            self._remotes.clear()
        for remote in remotes:
            remote.link.close()

    # ------------------------------------------------------------------ connecting
    def _open(self, host: str, port: int, engine: EngineMetadata) -> RemoteEngine:
        """Check ``engine`` (just fetched from ``host:port``) and open it with the first transport that does (not yet
        registered). ``NoTransport`` when none does, saying why each refused."""
        started = time.perf_counter()
        for rank in engine.ranks:
            check_compatible(self.cache.layout, rank.layout)
        offered = OfferedEngine(engine, host, port)
        refused: list[str] = []
        for name, end in self.ends.items():
            opened = end.open(offered)
            if isinstance(opened, Refusal):
                refused.append(f"{name}: {opened.reason}")
                continue
            logger.info(
                "decode %s: connected to engine %s at %s:%d (TP %d, %d source rank(s), postprocess: %s) in %.0f ms;"
                " transport %s%s",
                self.name,
                engine.engine_id,
                host,
                port,
                engine.tp_size,
                len(opened.sources),
                "yes" if opened.plan.postprocess is not None else "no",
                (time.perf_counter() - started) * 1e3,
                opened.transport,
                f" (not {'; '.join(refused)})" if refused else "",
            )
            return RemoteEngine(engine, host, port, opened)
        raise NoTransport(
            f"decode {self.name}: no transport of {', '.join(self.ends)} opens engine {engine.engine_id} at"
            f" {host}:{port}: {'; '.join(refused)}"
        )
