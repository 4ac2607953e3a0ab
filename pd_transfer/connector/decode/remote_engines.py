"""The prefill engines a decode rank reads from: each connected once, then looked up per request.

Connecting to an engine (idempotent; one handshake per engine at a time, others are not held up): the
handshake (cached by the client), a compatibility check of every rank's layout, a transfer plan, each source
rank added as a NIXL peer with its remote and local descriptor lists prepared, and the connection warmed up
with a one-unit read into scratch memory, so the first request does not pay for connection setup. Plans that
fix layouts up also get descriptor lists into the staging area; caches packed by the engine read engines of
another block size through a packed staging area instead.

Transport (:mod:`.transport_choice`): where the prefill ranks read are on this host and offered their memory (GPU memory
our GPU can reach, shareable host memory, or other host memory to read in place), the engine is opened through
same-host IPC instead (:mod:`.ipc_reads`, :mod:`.cma_reads`; a GPU cache without a warm-up read), once; the connect
log line names the transport and why. NIXL still carries the notifications.
Descriptor lists name the memory they are in: a GPU's ("VRAM", with its device index) or the host's.

A failed connect removes the peers it added. ``forget`` drops an engine (it restarted or died), so the next
request handshakes afresh; its IPC handles, if any, are closed with it (once no copy holds them).

Restarts: a prefill restarted at the same address is a new *incarnation*: new NIXL agents (their names change
on every start) and maybe a new engine id. ``refresh`` handshakes afresh, bypassing the cache; if the engine
now published is another incarnation than the one connected, the old one's peers and descriptor lists are
dropped and the new one is connected in its place (counted in ``pd_transfer_peer_rehandshakes_total`` by
``reason``). The decode rank refreshes when a request names another engine id than the one connected, and when
a read fails because the peer disconnected. An engine dropped for a failure and connected again later counts
as ``reconnect``.

Invariants: at most one engine per address; an engine's peers are in the agent exactly while it is registered
here (or while it is being connected); a refresh that finds the same incarnation changes nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from pd_transfer.connector.cache import KVCache
from pd_transfer.handshake.client import HandshakeClient
from pd_transfer.handshake.errors import HandshakeError
from pd_transfer.handshake.host_identity import local_boot_id
from pd_transfer.handshake.messages import EngineMetadata, RankMetadata
from pd_transfer.metrics import TransferMetrics
from pd_transfer.same_host import MIN_DIRECT_ROW_BYTES, CmaEngine, IpcEngine, IpcUnavailable, gpu_reach, pid_namespace
from pd_transfer.spec import KVCacheLayout, KVRegion, TransportSetting, memory_of, planes_of
from pd_transfer.topology import PeerPlan, SourcePlan, check_compatible, expected_readers, plane_views
from pd_transfer.topology.mapping import TopologyError
from pd_transfer.topology.packed import PackedBlockFormat
from pd_transfer.topology.plan import DEFAULT_MIN_DIRECT_RUN_BYTES
from pd_transfer.transfer.agent import DescriptorList
from pd_transfer.transfer.agent_protocol import Agent

from .packed_staging import PackedStaging
from .staging import DEFAULT_STAGING_CHUNK_BYTES, StagingArea
from .transport_choice import TransportChoice, choose_transport

logger = logging.getLogger(__name__)

#: Whether a reader added to the decode rank reads an engine (its published metadata), asked once per engine at
#: connect, before the built-in choice; True: the engine's requests go to that reader.
Claim = Callable[[EngineMetadata], bool]


@dataclass
class SourceRank:
    """One prefill rank a plan reads from, with its descriptor lists prepared."""

    remote_rank: int
    peer: str  # its NIXL agent's name
    local: DescriptorList  # the plan's local grid: final places, or the packed staging cache
    remote: DescriptorList  # the plan's remote grid
    expected_readers: int  # decode ranks of our TP size that read from this rank
    staging: DescriptorList | None = None  # this source's units in every staging slot (plans that fix layouts up)


@dataclass
class RemoteEngine:
    """A connected prefill engine: what it published, the plan to read it by, and its source ranks (in the
    order of ``plan.sources``)."""

    engine: EngineMetadata
    host: str
    port: int
    plan: PeerPlan
    sources: list[SourceRank]
    staging: StagingArea | None = None  # the staging area the sources' ``staging`` lists point into
    packed: PackedStaging | None = None  # packed blocks of another block size: read whole, then regrouped
    ipc: IpcEngine | None = None  # its memory opened through same-host IPC (cuda_ipc, host_ipc)
    cma: CmaEngine | None = None  # its processes read in place (host_cma)
    #: What its requests go by, chosen once at connect: "nixl", same-host IPC ("cuda_ipc", "host_ipc",
    #: "host_cma"), or an added reader's name; the decode rank's reader of that name moves them.
    transport: str = "nixl"

    def close_same_host(self) -> None:
        """Close what a same-host transport opened (IPC handles, the processes' watches)."""
        for opened in (self.ipc, self.cma):
            if opened is not None:
                opened.close()


def incarnation(engine: EngineMetadata) -> tuple[str, tuple[str, ...]]:
    """What tells one start of an engine from another: its id and its ranks' NIXL agent names."""
    return engine.engine_id, tuple(rank.agent_name for rank in engine.ranks)


class RemoteEngines:
    """The engines one decode rank reads from, keyed by side channel ``(host, port)``; thread-safe.

    ``staging_bytes`` is the size of each slot group (the chunk a read lane reads and restages at a time) of the
    shared staging area (0: plans that fix layouts up do so in place). ``packed_formats(block_size)`` gives the
    packing of a (block, head) for a block size, for caches whose layout names a ``packing``; without it, such
    caches refuse engines of another block size.
    ``read_timeout_s`` bounds each warm-up read. ``on_connected(remote)`` is called for each engine once it is
    connected (before any request uses it). ``transport``: "auto" (same-host IPC where it can be used, else NIXL),
    "nixl", or "ipc" (an engine that cannot be opened through IPC is refused with ``IpcUnavailable``).
    """

    def __init__(
        self,
        agent: Agent,
        cache: KVCache,
        client: HandshakeClient,
        *,
        read_timeout_s: float,
        min_direct_run_bytes: int | None = None,
        staging_bytes: int = DEFAULT_STAGING_CHUNK_BYTES,
        packed_formats: Callable[[int], PackedBlockFormat] | None = None,
        packed_staging_bytes: int = 32 * 2**20,
        metrics: TransferMetrics | None = None,
        on_connected: Callable[[RemoteEngine], None] | None = None,
        transport: TransportSetting = "auto",
    ) -> None:
        self.agent = agent
        self.transport = transport
        #: Added readers' claims, by their transport's name, asked in order before the built-in choice.
        self.claims: dict[str, Claim] = {}
        self._on_connected = on_connected
        self.metrics = metrics if metrics is not None else TransferMetrics()
        self.cache = cache
        self.client = client
        self.read_timeout_s = read_timeout_s
        self.min_direct_run_bytes = (
            DEFAULT_MIN_DIRECT_RUN_BYTES if min_direct_run_bytes is None else min_direct_run_bytes
        )
        self.staging_bytes = staging_bytes
        self.packed_staging_bytes = packed_staging_bytes
        self._packed_formats = packed_formats
        self._remotes: dict[tuple[str, int], RemoteEngine] = {}
        self._lock = threading.Lock()  # guards _remotes and _engine_locks
        self._engine_locks: dict[tuple[str, int], threading.Lock] = {}
        self._staging_lock = threading.Lock()  # guards the staging areas
        self._staging: StagingArea | None = None
        self._packed_staging: dict[int, PackedStaging] = {}  # remote block size (tokens) -> its staging area
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
                remote = self._connect(host, port)
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
                    self.agent.name,
                    old.engine.engine_id,
                    host,
                    port,
                    engine.engine_id,
                    ", ".join(incarnation(engine)[1]),
                )
            else:
                reason = "reconnect"
            remote = self._connect(host, port, engine)
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
        if self._on_connected is not None:
            self._on_connected(remote)

    def _drop(self, key: tuple[str, int], remote: RemoteEngine) -> None:
        """Unregister ``remote`` (if still the engine at ``key``) after a failure or a restart and remove its peers;
        the cached handshake goes too, a remembered handshake failure stays."""
        with self._lock:
            if self._remotes.get(key) is remote:
                del self._remotes[key]
            self._dropped.add(key)
        self.client.forget(*key, failure=False)
        self._disconnect(remote)

    def _disconnect(self, remote: RemoteEngine) -> None:
        """Close ``remote``'s IPC handles and remove its peers."""
        remote.close_same_host()
        for source in remote.sources:
            self.agent.remove_peer(source.peer)

    def get(self, host: str, port: int) -> RemoteEngine | None:
        """The engine at ``host:port`` if connected, else None (never connects)."""
        with self._lock:
            return self._remotes.get((host, port))

    def forget(self, host: str, port: int) -> None:
        """Drop the engine at ``host:port``: its peers, descriptor lists and cached handshake."""
        with self._lock:
            remote = self._remotes.pop((host, port), None)
        self.client.forget(host, port)
        if remote is not None:
            self._disconnect(remote)

    def close(self) -> None:
        """Close every connected engine's IPC handles (its peers go with the agent)."""
        with self._lock:
            remotes = list(self._remotes.values())
        for remote in remotes:
            remote.close_same_host()

    def source_peers(self, host: str, port: int) -> list[str]:
        """NIXL agent names of the prefill ranks we read from at ``host:port`` ([] if not connected)."""
        remote = self.get(host, port)
        return [] if remote is None else [source.peer for source in remote.sources]

    def unread_peers(self, host: str, port: int) -> list[str]:
        """Decode rank 0 only: agent names of the prefill ranks at ``host:port`` that no decode rank of our TP
        size reads (their heads are read from another rank holding the same ones), added as peers on first
        use; [] on other ranks or when not connected."""
        remote = self.get(host, port)
        layout = self.cache.layout
        if remote is None or layout.tp_rank != 0:
            return []
        unread = [r for r in remote.engine.ranks if expected_readers(r.tp_rank, r.layout, layout.tp_size) == 0]
        return [self._peer_of(rank) for rank in unread]

    def _peer_of(self, rank: RankMetadata) -> str:
        """The NIXL agent name of ``rank``, added as a peer if it is not one yet."""
        return rank.agent_name if self.agent.has_peer(rank.agent_name) else self.agent.add_peer(rank.agent_metadata)

    # ------------------------------------------------------------------ connecting
    def _connect(self, host: str, port: int, engine: EngineMetadata | None = None) -> RemoteEngine:
        """Handshake (unless ``engine`` was just fetched), check, plan, add and warm up the engine at ``host:port``
        (not yet registered)."""
        started = time.perf_counter()
        if engine is None:
            engine = self.client.fetch(host, port)
        for rank in engine.ranks:
            check_compatible(self.cache.layout, rank.layout)
        packed = self._packed_staging_if_needed(engine)
        plan = self._plan(engine, packed)
        claimed = next((name for name, claims in self.claims.items() if claims(engine)), None)
        if claimed is None:
            choice, ipc, cma = self._open_ipc(engine, plan, packed is not None)
            transport: str = choice.transport
            why = choice.reason
        else:
            transport, why, ipc, cma = claimed, "claimed by the reader added for it", None, None
        same_host = ipc is not None or cma is not None
        try:
            sources = self._add_sources(engine, plan, via_ipc=same_host)
        except BaseException:
            for opened in (ipc, cma):
                if opened is not None:
                    opened.close()
            raise
        staging = self._staging if plan.postprocess is not None and not same_host else None
        logger.info(
            "decode %s: connected to engine %s at %s:%d (TP %d, %d source rank(s), postprocess: %s) in %.0f ms;"
            " transport %s (%s)",
            self.agent.name,
            engine.engine_id,
            host,
            port,
            engine.tp_size,
            len(sources),
            "packed regroup" if packed is not None else "yes" if plan.postprocess is not None else "no",
            (time.perf_counter() - started) * 1e3,
            transport,
            why,
        )
        return RemoteEngine(
            engine,
            host,
            port,
            plan,
            sources,
            staging=staging,
            packed=packed,
            ipc=ipc,
            cma=cma,
            transport=transport,
        )

    def _open_ipc(
        self, engine: EngineMetadata, plan: PeerPlan, packed: bool
    ) -> tuple[TransportChoice, IpcEngine | None, CmaEngine | None]:
        """The transport for ``engine`` and, for same-host IPC, its memory opened (or, read in place, its processes
        probed): (choice, the engine opened through IPC, the engine read in place), at most one of them. Raises
        ``IpcUnavailable`` when the setting is "ipc" and it cannot be used."""
        by_rank = {rank.tp_rank: rank for rank in engine.ranks}
        ranks = [by_rank[source.remote_rank] for source in plan.sources]
        place = self.cache.place
        choice = choose_transport(
            self.transport, place, ranks, local_boot_id(), packed=packed, reach=gpu_reach, pid_namespace=pid_namespace()
        )
        if choice.transport == "nixl":
            if self.transport == "ipc":
                raise IpcUnavailable(f"transport ipc: engine {engine.engine_id}: {choice.reason}")
            return choice, None, None
        try:
            if choice.transport == "host_cma":
                in_place = plan if plan.postprocess is None else self._plan(engine, None, MIN_DIRECT_ROW_BYTES)
                return choice, None, CmaEngine.open(engine, in_place)
            direct = plan if plan.postprocess is None else self._plan(engine, None, 0)  # rows of any size in place
            return choice, IpcEngine.open(choice.transport, engine, direct, self.cache.tensors, self.cache.place), None
        except IpcUnavailable as error:
            if self.transport == "ipc":
                raise IpcUnavailable(f"transport ipc: engine {engine.engine_id}: {error}") from None
            return TransportChoice("nixl", f"same-host IPC failed to open: {error}"), None, None

    def _packed_staging_if_needed(self, engine: EngineMetadata) -> PackedStaging | None:
        """A packed staging area when our blocks are packed and the engine's block size differs, else None."""
        local = self.cache.layout
        remote_block_size = engine.ranks[0].layout.block_size if engine.ranks else local.block_size
        if local.packing is None or remote_block_size == local.block_size:
            return None
        return self._packed_staging_for(remote_block_size)

    def _plan(
        self, engine: EngineMetadata, packed: PackedStaging | None, min_direct_run_bytes: int | None = None
    ) -> PeerPlan:
        """The plan from the engine's ranks into our cache, or into the packed staging cache; rows straight into
        place where they are at least ``min_direct_run_bytes`` long (default: the rank's setting)."""
        layout: KVCacheLayout = self.cache.layout if packed is None else packed.layout
        regions: list[KVRegion] = list(self.cache.regions if packed is None else packed.cache.regions)
        by_rank = {rank.tp_rank: rank for rank in engine.ranks}
        return PeerPlan.build(
            layout,
            regions,
            {r: by_rank[r].layout for r in by_rank},
            {r: list(by_rank[r].regions) for r in by_rank},
            min_direct_run_bytes=self.min_direct_run_bytes if min_direct_run_bytes is None else min_direct_run_bytes,
        )

    def _add_sources(self, engine: EngineMetadata, plan: PeerPlan, *, via_ipc: bool = False) -> list[SourceRank]:
        """Add each source rank as a peer, prepare its descriptor lists (in the memory each side's cache is in) and,
        unless the engine is copied through IPC (``via_ipc``), its staging lists, and warm it up (host caches read
        through IPC too: the read sets up the connection ``ReadDone`` goes over, so neither the first request nor a
        decode closing right after it waits for that); on failure, remove the peers added so far and re-raise."""
        by_rank = {rank.tp_rank: rank for rank in engine.ranks}
        sources: list[SourceRank] = []
        local = self.cache.place
        try:
            for source in plan.sources:
                rank = by_rank[source.remote_rank]
                peer = self.agent.add_peer(rank.agent_metadata)
                remote_list = self.agent.prepare_remote(peer, source.remote_grid, memory_of(list(rank.regions)))
                local_list = self.agent.prepare_local(source.local_grid, local)
                readers = expected_readers(source.remote_rank, rank.layout, self.cache.layout.tp_size)
                staging = self._prepare_staging(source) if plan.postprocess is not None and not via_ipc else None
                sources.append(SourceRank(source.remote_rank, peer, local_list, remote_list, readers, staging))
                if not via_ipc or local.is_host:  # a host cache read through IPC: it warms the notifications' way
                    self._warm_up(remote_list, source.unit_bytes)
        except Exception:
            for item in sources:
                self.agent.remove_peer(item.peer)
            raise
        return sources

    def _packed_staging_for(self, remote_block_size: int) -> PackedStaging:
        """The staging area for packed blocks of ``remote_block_size`` tokens (created on first use)."""
        local = self.cache.layout
        if self._packed_formats is None:
            raise TopologyError(
                f"blocks packed as {local.packing!r}: a prefill of {remote_block_size}-token blocks needs a regroup"
                f" that knows the packing, and this decode rank ({local.block_size}-token blocks) was given none"
            )
        with self._staging_lock:
            staging = self._packed_staging.get(remote_block_size)
            if staging is None:
                staging = self._packed_staging[remote_block_size] = PackedStaging(
                    self.agent,
                    self.cache,
                    self._packed_formats(remote_block_size),
                    self._packed_formats(local.block_size),
                    self.packed_staging_bytes,
                )
            return staging

    def _prepare_staging(self, source: SourcePlan) -> DescriptorList | None:
        """Descriptor rows of a source's units in every slot of the staging area (created on first use);
        None when ``staging_bytes`` is 0."""
        if self.staging_bytes <= 0:
            return None
        with self._staging_lock:
            if self._staging is None:
                plane_block_bytes = self.cache.regions[0].plane_block_len
                plane = plane_views(self.cache.tensors, self.cache.regions)[0]
                self._staging = StagingArea(
                    self.agent, plane_block_bytes, self.staging_bytes, plane.dtype, device=plane.device
                )
            staging = self._staging
        first_plane = planes_of(list(self.cache.regions))[0].base_address
        return self.agent.prepare_local(staging.source_rows(source, first_plane), staging.place)

    # ------------------------------------------------------------------ scratch reads
    def _warm_up(self, remote_list: DescriptorList, unit_bytes: int) -> None:
        """The first read to a peer pays for connection setup (25-36 ms): pay it now, into scratch memory."""
        for _ in self.scratch_reads(remote_list, unit_bytes, samples=1):
            pass

    def scratch_reads(self, remote_list: DescriptorList, unit_bytes: int, samples: int) -> Iterator[float]:
        """Read remote row 0 (``unit_bytes`` bytes) into a registered scratch buffer ``samples`` times; yields
        each read's post-to-done seconds. The cache is not touched."""
        scratch = torch.empty(unit_bytes, dtype=torch.uint8)
        registration = self.agent.register_spans([(scratch.data_ptr(), scratch.data_ptr() + unit_bytes)])
        try:
            local = self.agent.prepare_local(np.array([[scratch.data_ptr(), unit_bytes, 0]], dtype=np.uint64))
            try:
                zero = np.zeros(1, dtype=np.int32)
                for _ in range(samples):
                    yield self.agent.read(local, zero, remote_list, zero, timeout_s=self.read_timeout_s).seconds
            finally:
                local.release()
        finally:
            self.agent.deregister(registration)
