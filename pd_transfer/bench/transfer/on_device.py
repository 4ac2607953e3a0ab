"""``pd-transfer bench transfer --device cuda[:N]``: one node, both caches on one device, a prefill in its own process.

Side by side in one run, for a contiguous and a scattered request: our pull (same-host IPC: CUDA IPC on a GPU; where
it cannot be used, what the decode chose instead, named in ``transport``), raw NIXL READs of the same descriptors (the
memory registered as VRAM), the in-process device copy of the same rows (the faster of the copies our path makes and
per-plane gather/scatter, on local memory), the gather limit (the same rows gathered by one ``index_select`` over one
flat view: what one kernel does, :func:`~..device.gather_limit`), and a raw IPC copy of as many bytes out of the
prefill's opened memory;
then one-block latency (a one-row copy, waited for) and a whole pull of one held block. The device's name and its
in-process copy rate are recorded beside them. ``--device cpu`` runs the same on host memory (the prefill's cache in
shareable memory, copied through the host IPC path), cheaply enough for CI. The result goes under ``gpu``.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable
from functools import partial

import numpy as np
import torch

from pd_transfer.connector.cache import KVCache
from pd_transfer.connector.decode.rank import DecodeRank
from pd_transfer.connector.decode.remote_engines import RemoteEngine
from pd_transfer.connector.options import DecodeOptions
from pd_transfer.connector.transports.ipc.transport import SameHostLink
from pd_transfer.rows import move_rows
from pd_transfer.same_host.ipc_engine import IpcEngine, IpcSource, storages
from pd_transfer.settings import Settings, apply_process_defaults
from pd_transfer.sim.peer import PrefillProcess, PrefillSpec
from pd_transfer.sim.shape import Shape
from pd_transfer.sim.verify import plane_tensors, received_correctly
from pd_transfer.topology import PeerPlan, SourcePlan

from ..device import gather_limit
from .raw_nixl import RawNixlReader
from .reads import one_block_pulls, request_ids
from .unit_reads import one_unit_read_latencies

_LEASE = "bench-device-lease"
_RAW_NIXL_REPEATS = 2  # VRAM over NIXL crawls where UCX emulates the read (0.5 GB/s measured): two reads suffice


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "host"


def _synchronized(device: torch.device, call: Callable[[], object]) -> float:
    """Seconds ``call()`` takes, the device's queued work included."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    call()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def device_copy_seconds(
    source: KVCache, target: KVCache, remote_ids: list[int], local_ids: list[int], tokens: int
) -> float:
    """The in-process copy of the same rows on the caches' device: the fastest of the copies our path makes
    (:func:`~pd_transfer.rows.move_rows` by torch, planned from ``source`` in this process), a
    gather/scatter per plane of the same blocks, and a copy per plane and run of consecutive blocks."""
    device = target.tensors[0].device
    plan = PeerPlan.build(target.layout, list(target.regions), {0: source.layout}, {0: list(source.regions)})
    (rows_plan,) = plan.sources
    local_rows, remote_rows = rows_plan.indices(remote_ids, local_ids, tokens)
    mine = storages(source.tensors)
    copier = IpcSource.open(mine, [s.data_ptr() for s in mine], rows_plan, storages(target.tensors))
    copies = copier.copies(local_rows, remote_rows)
    ours = _synchronized(device, lambda: move_rows(copies, lambda v: torch.from_numpy(v).to(device), one_kernel=False))
    source_ids = torch.tensor(remote_ids, device=device)
    target_ids = torch.tensor(local_ids, device=device)
    pairs = list(zip(plane_tensors(source), plane_tensors(target), strict=True))

    src, dst = np.asarray(remote_ids), np.asarray(local_ids)
    breaks = [0, *(np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1).tolist(), len(src)]
    runs = [(int(src[a]), int(dst[a]), b - a) for a, b in itertools.pairwise(breaks)]

    def per_plane() -> None:
        for s_plane, t_plane in pairs:
            t_plane.index_copy_(0, target_ids, s_plane.index_select(0, source_ids))

    def per_run() -> None:
        for s_plane, t_plane in pairs:
            for first, into, count in runs:
                t_plane[into : into + count].copy_(s_plane[first : first + count])

    return min(ours, _synchronized(device, per_plane), _synchronized(device, per_run))


def _case(
    decode: DecodeRank,
    prefill: PrefillProcess,
    expected: KVCache,
    scratch: KVCache,
    ids: tuple[list[int], list[int]],
    num_tokens: int,
    repeats: int,
    label: str,
) -> dict:
    host, port = prefill.host, prefill.port
    remote = decode.remotes.connect(host, port)
    (plan,) = remote.plan.sources
    remote_ids, local_ids = ids
    local_rows, remote_rows = plan.indices(remote_ids, local_ids, num_tokens)
    device = decode.cache.tensors[0].device
    ours, copies, raw_ipc = [], [], []
    result = None
    for index in range(repeats):
        request_id = f"bench-device-{label}-{index}"
        prefill.request("hold", request_id, remote_ids)
        result = decode.pull(request_id, host, port, remote_ids, local_ids, num_tokens)
        ours.append(result.seconds)
        copies.append(device_copy_seconds(expected, scratch, remote_ids, local_ids, num_tokens))
        opened = remote.link.opened if isinstance(remote.link, SameHostLink) else None
        if isinstance(opened, IpcEngine):
            raw_ipc.append(_raw_ipc_copy_seconds(opened.sources[0], storages(scratch.tensors)[0], result.bytes, device))
    assert result is not None
    verified = received_correctly(decode.cache, local_ids, [expected], remote_ids, num_tokens)
    raw_nixl = _raw_nixl_seconds(decode, remote, plan, local_rows, remote_rows)
    gib = result.bytes / 2**30
    gbps = gib / statistics.median(ours)
    copy_gbps = gib / statistics.median(copies)
    limit = gather_limit(device, plane_tensors(expected), remote_ids, repeats)
    measured = {
        "bytes": result.bytes,
        "rows": len(local_rows),
        "transport": result.transport,
        "seconds": round(statistics.median(ours), 6),
        "gbps": round(gbps, 3),
        "device_copy_gbps": round(copy_gbps, 3),
        "ratio_vs_device_copy": round(gbps / copy_gbps, 3),
        **limit,
        "ratio_vs_gather_limit": round(gbps / limit["gather_limit_gbps"], 3),
        "raw_nixl_gbps": round(gib / raw_nixl, 3),
        "ratio_vs_raw_nixl": round(gbps / (gib / raw_nixl), 3),
        "verified": bool(verified),
        "repeats": repeats,
    }
    if raw_ipc:
        raw_gbps = gib / statistics.median(raw_ipc)
        measured.update(raw_ipc_gbps=round(raw_gbps, 3), ratio_vs_raw_ipc=round(gbps / raw_gbps, 3))
    return measured


def _raw_ipc_copy_seconds(source: IpcSource, target: torch.Tensor, nbytes: int, device: torch.device) -> float:
    """One plain copy of ``nbytes`` out of the prefill's first opened segment (as many as it has): no plan, no rows."""
    segment = source.remote_segments[0].view(-1).view(torch.uint8)
    count = min(nbytes, segment.numel(), target.numel())
    return _synchronized(device, lambda: target[:count].copy_(segment[:count])) * nbytes / count


def _raw_nixl_seconds(
    decode: DecodeRank, remote: RemoteEngine, plan: SourcePlan, local: np.ndarray, theirs: np.ndarray
) -> float:
    """The median post-to-done seconds of raw NIXL READs of the same descriptors (a bare agent of its own)."""
    spans = [(r.base_address, r.base_address + r.span_bytes) for r in decode.cache.regions]
    rank = remote.engine.ranks[0]
    raw = RawNixlReader(
        spans,
        rank.agent_metadata,
        plan.local_grid,
        plan.remote_grid,
        local=decode.cache.place,
        remote=rank.regions[0].place,
    )
    try:
        raw.read_seconds(local[:1], theirs[:1])  # connection set-up
        return statistics.median(raw.read_seconds(local, theirs) for _ in range(_RAW_NIXL_REPEATS))
    finally:
        raw.close()


def _copy_rate_gbps(device: torch.device, nbytes: int, repeats: int = 5) -> float:
    """The device's in-process copy rate: ``nbytes`` contiguous, median of ``repeats`` (GiB/s)."""
    source = torch.ones(nbytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    seconds = [_synchronized(device, partial(target.copy_, source)) for _ in range(repeats)]
    return nbytes / statistics.median(seconds) / 2**30


def run(shape: Shape, device: str, *, repeats: int = 5, seed: int = 7, settings: Settings) -> dict:
    """The whole benchmark on ``device`` ("cuda", "cuda:N" or "cpu"); returns the JSON-ready ``gpu`` section.
    ``settings``: the command's (both sides run with them)."""
    where = torch.device(device)
    settings = apply_process_defaults(settings, net_devices="lo", vram=where.type == "cuda")
    if where.type == "cuda":
        where = torch.device("cuda", torch.cuda.current_device() if where.index is None else where.index)
        torch.cuda.set_device(where)
    layout = shape.layout_for()
    spec = PrefillSpec(
        engine_id="bench-device-prefill",
        layouts=[layout],
        num_blocks=shape.cache_blocks,
        seed=seed,
        device=str(where),
        shareable=where.type == "cpu",
        settings=settings,
    )
    contiguous, scattered = request_ids(shape, seed)
    with PrefillProcess(spec) as prefill:
        (expected,) = spec.caches(huge_pages=settings.own_huge_pages)
        cache = KVCache.allocate(layout, shape.cache_blocks, device=where)
        decode = DecodeRank("bench-device-decode", cache, DecodeOptions(read_lanes=1, settings=settings))
        scratch = KVCache.allocate(layout, shape.cache_blocks, device=where)
        try:
            started = time.perf_counter()
            remote = decode.remotes.connect(prefill.host, prefill.port)
            connect_ms = (time.perf_counter() - started) * 1e3
            prefill.request("hold", _LEASE, [0])
            cases = {
                name: _case(decode, prefill, expected, scratch, ids, shape.request_tokens, repeats, name[0])
                for name, ids in (("contiguous", contiguous), ("scattered", scattered))
            }
            latencies = one_unit_read_latencies(decode, prefill.host, prefill.port, samples=300)
            pulls = one_block_pulls(decode, prefill, shape.block_size, samples=100)
            prefill.request("release", _LEASE)
        finally:
            decode.close()
    return {
        "device": str(where),
        "device_name": device_name(where),
        "device_copy_gbps": round(_copy_rate_gbps(where, cases["contiguous"]["bytes"]), 3),
        "transport": remote.transport,
        "connect_ms": round(connect_ms, 1),
        "request_bytes": cases["contiguous"]["bytes"],
        **cases,
        "one_block_bytes": layout.plane_block_bytes,
        "one_block_p50_us": round(statistics.median(latencies) * 1e6, 1),
        "one_block_p99_us": round(float(np.percentile(latencies, 99)) * 1e6, 1),
        "one_block_pull_p50_us": round(statistics.median(pulls) * 1e6, 1),
        "one_block_pull_p99_us": round(float(np.percentile(pulls, 99)) * 1e6, 1),
    }


def summary_lines(section: dict) -> list[str]:
    """The text form of :func:`run`'s result."""
    lines = [
        f"{section['device']} ({section['device_name']}, copy {section['device_copy_gbps']} GiB/s): request"
        f" {section['request_bytes'] / 2**20:.0f} MiB, transport {section['transport']},"
        f" connect {section['connect_ms']} ms"
    ]
    for case in ("contiguous", "scattered"):
        r = section[case]
        raw_ipc = f"  raw IPC {r['raw_ipc_gbps']:8.2f}" if "raw_ipc_gbps" in r else ""
        lines.append(
            f"  {case:10s} {r['gbps']:8.2f} GiB/s  gather limit {r['gather_limit_gbps']:8.2f}"
            f"  device copy {r['device_copy_gbps']:8.2f}{raw_ipc}  raw NIXL {r['raw_nixl_gbps']:7.2f}"
            f"  ratio vs gather limit {r['ratio_vs_gather_limit']:.3f}  verified {r['verified']}"
        )
    lines.append(
        f"  one block p50 {section['one_block_p50_us']} us (copy), {section['one_block_pull_p50_us']} us (pull)"
    )
    return lines
