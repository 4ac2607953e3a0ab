"""Test helpers: staged reads (connector/transports/nixl/staged_reads.py) of encoded caches with reads done by
``memmove`` over the descriptor rows, on the CPU or with the planes and the staging area on another device, and the
fix-up kernels' specs and random blocks; reads checked against the live registered memory, and a timing stress for
the GPU path.

Used by tests/unit/test_staged_reads.py and tests/unit/test_device_kernels.py (CPU) and their CUDA twins in
tests/gpu/test_gpu_staged_reads.py. Caches are ``topology_sim``'s, so every received element is checked against
what the prefill held, and every byte outside the request against its sentinel.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
from topology_sim import LOCAL_SENTINEL, REMOTE_SENTINEL, RankCache, build_cache, fill_request

from pd_transfer.connector.transports.nixl.sources import SourceRank
from pd_transfer.connector.transports.nixl.staged_reads import LaneTotals, StagedChunks, StagedLaneWork
from pd_transfer.connector.transports.nixl.staging import StagingArea
from pd_transfer.spec import HOST, KVCacheLayout, MemoryPlace, ModelFingerprint, planes_of
from pd_transfer.topology import PeerPlan, Restage, StagedSource
from pd_transfer.transfer.agent import DescriptorList, ReadStats
from pd_transfer.transfer.lanes import LaneRead

MODEL = ModelFingerprint(model="staged-llama", dtype="float32", num_layers=2, total_num_kv_heads=4, head_size=8)

#: Fix-up specs of the kernels' tests: a regroup, a TP 2 -> 1 permute, and both with a layout change.
SPECS = {
    "block_16_to_64": Restage("HND", "HND", 8, 64, 16, 128, (StagedSource(0, 8),)),
    "tp_2_to_1_nhd_to_hnd": Restage("NHD", "HND", 4, 16, 16, 64, (StagedSource(0, 2), StagedSource(2, 2))),
    "block_8_to_32_hnd_to_nhd": Restage("HND", "NHD", 2, 32, 8, 32, (StagedSource(0, 2),)),
}


@dataclass(frozen=True)
class Case:
    """A staged pull's two sides: the prefill's TP, block size and layout, the decode's (TP 1) block and layout."""

    remote_tp: int
    remote_block: int
    remote_layout: str
    local_block: int
    local_layout: str


CASES = {
    "block_16_to_64": Case(1, 16, "HND", 64, "HND"),
    "tp_2_to_1_nhd_to_hnd": Case(2, 16, "NHD", 16, "HND"),
    "tp_2_to_1_block_8_to_32": Case(2, 8, "HND", 32, "NHD"),
}


class Registrations:
    """What a staging area needs of an agent here: registering is nothing without NIXL but the memory's place,
    recorded in :attr:`places`."""

    def __init__(self) -> None:
        self.places: list[MemoryPlace] = []

    def register_spans(self, spans: list[tuple[int, int]], *, place: MemoryPlace = HOST) -> None:
        assert spans and all(end > start for start, end in spans)
        self.places.append(place)

    def release_dlist(self, dlist: DescriptorList) -> None:
        dlist.released = True


class UnregisteredMemory(AssertionError):
    """A read named bytes outside every live registered region: memory deregistered, or freed under its rows."""


class LiveMemory:
    """The host memory reads may touch here: each span registered with the tensor that owns it, dropped when it is
    deregistered or when that tensor is freed (a ``weakref.finalize``; a view keeps its base, hence the span, alive).

    The staged read's descriptor rows are raw addresses: a cache only its rows named is freed under them, and a
    read would copy freed bytes (glibc's chunk headers, or ``MALLOC_PERTURB_``'s fill) without a word. Readers here
    call :meth:`check` first, so such a read fails naming the rows. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: dict[int, tuple[int, int]] = {}  # registration -> (start, end) byte addresses
        self._next = 0
        # Registrations to drop, applied under the lock by the next register or check. A tensor's finalizer only
        # appends here (atomic): it may run inside the garbage collector on a thread that holds the lock already
        # (any allocation can collect), where taking the lock again would deadlock.
        self._dropped: list[int] = []

    def register(self, owner: torch.Tensor) -> int:
        """Register the bytes of ``owner`` (host memory, contiguous) while it lives; returns the registration."""
        assert owner.device.type == "cpu" and owner.is_contiguous()
        start = owner.data_ptr()
        with self._lock:
            self._apply_drops()
            self._next += 1
            key = self._next
            self._spans[key] = (start, start + owner.numel() * owner.element_size())
        weakref.finalize(owner, self.deregister, key)
        return key

    def deregister(self, key: int) -> None:
        """Drop registration ``key`` (idempotent): from the next :meth:`check` on, its bytes are not live."""
        self._dropped.append(key)

    def _apply_drops(self) -> None:
        """With the lock held: forget what was deregistered."""
        while self._dropped:
            self._spans.pop(self._dropped.pop(), None)

    def check(self, rows: np.ndarray, what: str) -> None:
        """Raise :class:`UnregisteredMemory` unless every descriptor row (address, length, device) of ``rows`` lies
        whole inside one live registration; ``what`` names the rows in the message."""
        with self._lock:
            self._apply_drops()
            spans = sorted(self._spans.values())
        addresses, ends = rows[:, 0].astype(np.uint64), rows[:, 0].astype(np.uint64) + rows[:, 1].astype(np.uint64)
        starts = np.array([a for a, _ in spans], dtype=np.uint64)
        stops = np.array([b for _, b in spans], dtype=np.uint64)
        index = np.searchsorted(starts, addresses, side="right").astype(np.int64) - 1
        inside = (index >= 0) & (ends <= stops[np.maximum(index, 0)]) if spans else np.zeros(len(rows), dtype=bool)
        if not inside.all():
            bad = np.flatnonzero(~inside)
            first = rows[bad[0]]
            raise UnregisteredMemory(
                f"{len(bad)} of {len(rows)} {what} rows lie outside every live registered region (first at "
                f"{int(first[0]):#x}, {int(first[1])} bytes): their memory was deregistered or freed; whatever handed "
                "out these addresses must own the tensors behind them for as long as they are read"
            )


#: The host memory of every pull here: prefill caches, decode caches and CPU staging areas (see :class:`LiveMemory`).
HOST_MEMORY = LiveMemory()


#: The environment variable that moves the timing stress's seeds (scripts/test-gpu sets the repetition's number).
STRESS_SEED_VARIABLE = "PD_TRANSFER_STRESS_SEED"


def stress_seed(offset: int) -> int:
    """A timing stress seed: ``offset`` plus 1000 times ``$PD_TRANSFER_STRESS_SEED`` (0 when unset), so each
    repetition of a stress test draws other timings."""
    return int(os.environ.get(STRESS_SEED_VARIABLE, "0")) * 1000 + offset


class TimingStress:
    """Perturbs the timing of the staged read's GPU path, drawn from ``seed``, to surface missing orderings.

    On an accelerator: a GPU sleep of 0 to ``max_cycles`` clock cycles (``torch.cuda._sleep``; 2M cycles is about
    1 ms) queued on the stream that moves a request's block ids before they move (the lanes' fix-ups must wait for
    them: ``StagedChunks.ready``); each read made on a stream of the reader's own, after a sleep, and waited for on
    the host, as a NIXL READ lands its bytes outside any lane's stream; and a sleep on the lane's stream after each
    read, so that its fix-up runs late and the next read into a group must wait for it (``SlotFences``). On every
    device: the lanes start in a random order (:meth:`lane_order`). On the CPU the sleeps are skipped (a lane's
    fix-up runs on its thread before it reads again: nothing is queued to perturb) and :attr:`sleeps` stays 0.
    Thread-safe."""

    def __init__(self, seed: int, *, max_cycles: int = 2_000_000) -> None:
        assert max_cycles > 0
        self.seed = seed
        self.max_cycles = max_cycles
        self.sleeps = 0  # GPU sleeps queued so far
        self.orders: list[list[int]] = []  # each lane order handed out, in turn
        self._rng = np.random.default_rng(seed)
        self._lock = threading.Lock()

    def lane_order(self, lanes: int) -> list[int]:
        """The lanes ``0 .. lanes - 1`` in a random order: the order they are started in."""
        with self._lock:
            order = self._rng.permutation(lanes).tolist()
            self.orders.append(order)
        return order

    def sleep(self, device: torch.device) -> None:
        """Queue a random GPU sleep (a quarter of them none) on the current stream of ``device``; nothing on the
        CPU."""
        if device.type != "cuda":
            return
        with self._lock:
            cycles = int(self._rng.integers(0, self.max_cycles)) if self._rng.random() >= 0.25 else 0
            self.sleeps += 1
        if cycles:
            torch.cuda._sleep(cycles)  # noqa: SLF001 - torch's only in-stream GPU delay (a spin of that many clocks)

    def stressed(self, read: LaneRead, device: torch.device) -> LaneRead:
        """``read`` made as described above on ``device`` (on the CPU: ``read`` itself)."""
        if device.type != "cuda":
            return read

        def run(
            local: DescriptorList,
            local_rows: np.ndarray,
            remote: DescriptorList,
            remote_rows: np.ndarray,
            timeout_s: float,
        ) -> ReadStats:
            reader = torch.cuda.Stream(device)  # not ordered with the lane's stream: only the host orders them
            with torch.cuda.stream(reader):
                self.sleep(device)
                stats = read(local, local_rows, remote, remote_rows, timeout_s)
            reader.synchronize()  # the read returns once its bytes landed, as a NIXL READ does
            self.sleep(device)  # on the lane's stream: the fix-up of these bytes starts late
            return stats

        return run


def random_blocks(count: int, spec: Restage, seed: int) -> torch.Tensor:
    """``count`` blocks of ``spec``'s elements (int16), drawn from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**15), 2**15, (count, spec.block_elements), dtype=torch.int16, generator=generator)


def memmove_read(
    local: DescriptorList, local_rows: np.ndarray, remote: DescriptorList, remote_rows: np.ndarray, timeout_s: float
) -> ReadStats:
    """A READ as NIXL makes it on one host: each remote row's bytes into the local row of the same index. Both sides'
    rows must lie in :data:`HOST_MEMORY` (else :class:`UnregisteredMemory`, before a byte is copied)."""
    assert timeout_s > 0 and len(local_rows) == len(remote_rows)
    HOST_MEMORY.check(remote.rows[remote_rows], "remote")
    HOST_MEMORY.check(local.rows[local_rows], "local")
    for mine, theirs in zip(local_rows.tolist(), remote_rows.tolist(), strict=True):
        length = int(local.rows[mine, 1])
        assert length == int(remote.rows[theirs, 1])
        ctypes.memmove(int(local.rows[mine, 0]), int(remote.rows[theirs, 0]), length)
    return ReadStats(
        bytes=int(local.row_lengths[local_rows].sum()), descriptors=len(local_rows), post_seconds=0.0, seconds=0.0
    )


@dataclass
class Pull:
    """One request, planned and staged: what a lane needs, and the caches to check (``local`` on the host; with
    another ``device``, the planes the lanes write are copies there: :meth:`received` brings them back).

    A pull owns every buffer whose addresses its descriptor lists name: ``remotes`` (the prefill caches the lanes
    read), ``local`` and ``planes`` (what they write) and the staging area in ``work``. Keep the pull for as long
    as its lanes run: its rows are raw addresses, and a cache only its rows named would be freed under them."""

    remotes: dict[int, RankCache]  # the prefill caches, by rank: the memory every remote row points into
    local: RankCache
    local_ids: list[int]
    tokens: int
    chunks: StagedChunks
    work: StagedLaneWork
    planes: list[torch.Tensor]  # what the lanes write: ``local``'s planes, or their copies on another device

    def received(self) -> None:
        """Copy the planes the lanes wrote back into ``local`` (nothing to do on the CPU)."""
        for mine, written in zip(self.local.planes(), self.planes, strict=True):
            if written.data_ptr() != mine.data_ptr():
                mine.copy_(written.cpu())


def staged_pull(
    case: Case,
    group_blocks: int,
    tokens: int = 150,
    seed: int = 5,
    device: str = "cpu",
    stress: TimingStress | None = None,
) -> Pull:
    """The request of ``tokens`` tokens, its slot groups ``group_blocks`` plane blocks each, read into planes on
    ``device``; with ``stress``, its block ids move to the device after a random sleep on the current stream."""
    rng = np.random.default_rng(seed)
    remote_blocks, local_blocks = 24, 12
    remote_ids = rng.permutation(remote_blocks)[: -(-tokens // case.remote_block)].tolist()
    local_ids = rng.permutation(local_blocks)[: -(-tokens // case.local_block)].tolist()
    remotes: dict[int, RankCache] = {}
    for rank in range(case.remote_tp):
        layout = KVCacheLayout(MODEL, case.remote_tp, rank, case.remote_block, case.remote_layout)  # type: ignore[arg-type]
        remotes[rank] = build_cache(layout, remote_blocks, False, 0, REMOTE_SENTINEL[4])
        fill_request(remotes[rank], remote_ids, tokens)
    layout = KVCacheLayout(MODEL, 1, 0, case.local_block, case.local_layout)  # type: ignore[arg-type]
    local = build_cache(layout, local_blocks, False, 0, LOCAL_SENTINEL[4])
    for cache in [*remotes.values(), local]:
        for buffer in cache.buffers:
            HOST_MEMORY.register(buffer)
    plan = PeerPlan.build(
        layout,
        local.regions,
        {r: c.layout for r, c in remotes.items()},
        {r: c.regions for r, c in remotes.items()},
        strategy="staged",
    )
    assert plan.postprocess is not None and len(plan.sources) == case.remote_tp
    planes = [plane if device == "cpu" else plane.to(device) for plane in local.planes()]
    block_bytes = local.regions[0].plane_block_len
    staging = StagingArea(
        Registrations(),  # type: ignore[arg-type]
        block_bytes,
        group_blocks * block_bytes,
        planes[0].dtype,
        device=device,
    )
    if device == "cpu":
        HOST_MEMORY.register(staging.blocks)
    first_plane = planes_of(local.regions)[0].base_address
    owner = Registrations()
    sources = [
        SourceRank(
            remote_rank=source.remote_rank,
            peer=f"prefill-{source.remote_rank}",
            expected_readers=1,
            courier=owner,  # type: ignore[arg-type]
            local=DescriptorList(owner, None, "", source.local_grid),
            remote=DescriptorList(owner, None, f"prefill-{source.remote_rank}", source.remote_grid),
            staging=DescriptorList(owner, None, "", staging.source_rows(source, first_plane)),
        )
        for source in plan.sources
    ]
    rows = [source.indices(remote_ids, local_ids, tokens) for source in plan.sources]
    if stress is not None:
        stress.sleep(staging.device)
    chunks = StagedChunks.plan(plan, rows, staging.slots, local_blocks, staging.fences)
    deadline = time.perf_counter() + 60
    work = StagedLaneWork(chunks, sources, staging, staging.scatter_for(plan.postprocess.restage, planes), deadline)
    return Pull(remotes, local, local_ids, tokens, chunks, work, planes)


def run_lanes(
    work: StagedLaneWork, lanes: int, read: LaneRead = memmove_read, stress: TimingStress | None = None
) -> list[LaneTotals]:
    """Every lane on a thread of its own, as the read lanes run them, started in lane order (with ``stress``: in
    its random order, reading through :meth:`TimingStress.stressed`); each lane's totals, by lane, or the first
    failure raised. Each lane is given 60 s."""
    order = list(range(lanes)) if stress is None else stress.lane_order(lanes)
    if stress is not None:
        read = stress.stressed(read, work.staging.device)
    with ThreadPoolExecutor(max_workers=lanes) as pool:
        futures = {lane: pool.submit(work.run, lane, read) for lane in order}
        return [futures[lane].result(timeout=60) for lane in range(lanes)]
