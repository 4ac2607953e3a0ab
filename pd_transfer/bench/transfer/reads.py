"""``pd-transfer bench transfer``: our NIXL read path against a raw NIXL READ of the same descriptors and an
in-process copy of the same blocks, measured side by side in one run, plus idle CPU and one-block latency. (On one
host a decode would read the prefill's cache in place by default, ``host_cma``: ``bench topology`` measures that.)
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from functools import partial
from typing import TypeVar

import numpy as np
import torch

from pd_transfer.connector.cache import KVCache, zeroed_host_tensor
from pd_transfer.connector.decode.rank import DecodeRank
from pd_transfer.connector.options import DecodeOptions
from pd_transfer.settings import Settings, apply_process_defaults, environment
from pd_transfer.sim.peer import PrefillProcess, PrefillSpec
from pd_transfer.sim.shape import Shape
from pd_transfer.sim.verify import plane_tensors, received_correctly
from pd_transfer.transfer.agent import TransferAgent
from pd_transfer.transfer.huge_pages import HUGE_PAGE_BYTES, resident_huge_page_bytes, thp_mode

from .raw_nixl import RawNixlReader
from .unit_reads import one_unit_read_latencies

T = TypeVar("T")
_LEASE = "bench-lease"  # the request whose lease the prefill holds while reads are measured

QUICK_SHAPE = Shape(num_layers=4, request_tokens=1024, cache_blocks=128)


def copy_runs_gbps(source: KVCache, target: KVCache, source_ids: list[int], target_ids: list[int]) -> float:
    """In-process copy of the same blocks, the faster of per-run copies and per-plane gather/scatter."""
    sources, targets = plane_tensors(source), plane_tensors(target)
    src = np.asarray(source_ids)
    dst = np.asarray(target_ids)
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(src)]))
    runs = [(int(src[a]), int(dst[a]), int(b - a)) for a, b in zip(starts, ends, strict=True)]
    nbytes = sum(plane[0].numel() * plane.element_size() for plane in sources) * len(source_ids)

    started = time.perf_counter()
    for s_plane, t_plane in zip(sources, targets, strict=True):
        for s, t, n in runs:
            t_plane[t : t + n].copy_(s_plane[s : s + n])
    per_run = time.perf_counter() - started

    s_index, t_index = torch.from_numpy(src), torch.from_numpy(dst)
    started = time.perf_counter()
    for s_plane, t_plane in zip(sources, targets, strict=True):
        t_plane.index_copy_(0, t_index, s_plane.index_select(0, s_index))
    gather = time.perf_counter() - started
    return nbytes / min(per_run, gather) / 2**30


def host_copy_gbps(nbytes: int, repeats: int = 5, *, huge_pages: bool = False) -> float:
    """This host's in-process copy rate: ``nbytes`` contiguous, one thread, median of ``repeats`` (GiB/s); on
    memory in huge pages where the kernel gives them (``huge_pages``), else on the allocator's pages."""
    source, target = (
        zeroed_host_tensor((nbytes,), torch.uint8) if huge_pages else torch.zeros(nbytes, dtype=torch.uint8)
        for _ in range(2)
    )
    source.fill_(1)
    target.copy_(source)  # fault the pages in
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        target.copy_(source)
        seconds.append(time.perf_counter() - started)
    return nbytes / statistics.median(seconds) / 2**30


def _huge_fraction(cache: KVCache) -> float:
    """The share of ``cache``'s bytes in huge pages (its regions' whole span, from /proc/self/smaps)."""
    low = min(r.base_address for r in cache.regions)
    high = max(r.base_address + r.span_bytes for r in cache.regions)
    slack = HUGE_PAGE_BYTES  # the aligned run advised sits inside the tensor's own mapping
    return resident_huge_page_bytes([(low - slack, high + slack)]) / max(1, cache.nbytes)


def _with_cpu(prefill: PrefillProcess, cpu_samples: list[float], call: Callable[[], T]) -> T:
    """``call()``'s result; appends to ``cpu_samples`` the CPU seconds the prefill's process and this one (every
    thread, user and system) spent meanwhile."""
    before = prefill.cpu_seconds() + time.process_time()
    value = call()
    cpu_samples.append(prefill.cpu_seconds() + time.process_time() - before)
    return value


def _case(
    decode: DecodeRank,
    reading: DecodeRank | None,
    prefill: PrefillProcess,
    expected_prefill: list[KVCache],
    scratch: KVCache,
    remote_ids: list[int],
    local_ids: list[int],
    num_tokens: int,
    repeats: int,
    label: str,
) -> dict:
    host, port = prefill.host, prefill.port
    engine = decode.connect(host, port)
    plan = decode.remote_plan(host, port)
    (source,) = plan.sources
    local_rows, remote_rows = source.indices(remote_ids, local_ids, num_tokens)
    spans = [(r.base_address, r.base_address + r.span_bytes) for r in decode.cache.regions]
    raw = RawNixlReader(spans, engine.ranks[0].agent_metadata, source.local_grid, source.remote_grid)
    try:
        raw.read_seconds(local_rows, remote_rows)  # warm
        ours, ours_read, raws, writes, copies = [], [], [], [], []
        cpus: dict[str, list[float]] = {"ours": [], "ours_read": [], "raw_read": [], "raw_write": []}
        result = None
        for index in range(repeats):
            request_id = f"bench-{label}-{index}"
            prefill.request("hold", request_id, remote_ids)  # held, as a finished request is: it may be pushed
            pull = partial(decode.pull, request_id, host, port, remote_ids, local_ids, num_tokens)
            result = _with_cpu(prefill, cpus["ours"], pull)
            ours.append(result.seconds)
            if reading is not None:  # the same request read instead, beside it, by a decode that never asks to push
                prefill.request("hold", f"{request_id}-read", remote_ids)
                read = partial(reading.pull, f"{request_id}-read", host, port, remote_ids, local_ids, num_tokens)
                ours_read.append(_with_cpu(prefill, cpus["ours_read"], read).seconds)
            raws.append(_with_cpu(prefill, cpus["raw_read"], partial(raw.read_seconds, local_rows, remote_rows)))
            # the prefill's bytes, just read and verified, written back unchanged: the other direction's rate
            write = partial(raw.read_seconds, local_rows, remote_rows, operation="WRITE")
            writes.append(_with_cpu(prefill, cpus["raw_write"], write))
            copies.append(copy_runs_gbps(expected_prefill[0], scratch, remote_ids, local_ids))
    finally:
        raw.close()
    assert result is not None
    # what NIXL posts after merging rows adjacent on both sides
    l_addr = source.local_grid[local_rows, 0].astype(np.int64)
    r_addr = source.remote_grid[remote_rows, 0].astype(np.int64)
    unit = int(source.unit_bytes)
    merged = 1 + int(np.count_nonzero((np.diff(l_addr) != unit) | (np.diff(r_addr) != unit)))
    seconds = statistics.median(ours)
    raw_seconds = statistics.median(raws)
    gbps = result.bytes / seconds / 2**30
    raw_gbps = result.bytes / raw_seconds / 2**30
    memcpy_gbps = statistics.median(copies)
    gib = result.bytes / 2**30
    verified = received_correctly(decode.cache, local_ids, expected_prefill, remote_ids, num_tokens)
    return {
        "bytes": result.bytes,
        "rows": len(local_rows),
        "descriptors": merged,
        "seconds": round(seconds, 6),
        "gbps": round(gbps, 3),
        "raw_nixl_seconds": round(raw_seconds, 6),
        "raw_nixl_gbps": round(raw_gbps, 3),
        "raw_nixl_write_gbps": round(result.bytes / statistics.median(writes) / 2**30, 3),
        "memcpy_gbps": round(memcpy_gbps, 3),
        # both processes' CPU (all threads, user and system) per GiB moved: what each way costs the host
        "cpu_seconds_per_gib": round(statistics.median(cpus["ours"]) / gib, 4),
        "raw_nixl_cpu_seconds_per_gib": round(statistics.median(cpus["raw_read"]) / gib, 4),
        "raw_nixl_write_cpu_seconds_per_gib": round(statistics.median(cpus["raw_write"]) / gib, 4),
        "ratio_vs_raw_nixl": round(gbps / raw_gbps, 3),
        "ratio_vs_memcpy": round(gbps / memcpy_gbps, 3),
        "verified": bool(verified),
        "repeats": repeats,
        "pushed": bool(result.pushed_peers),  # the prefill wrote (push) instead of the decode reading
        **(_read_way(ours_read, cpus["ours_read"], result.bytes, raw_gbps) if ours_read else {}),
    }


def _read_way(seconds: list[float], cpus: list[float], num_bytes: int, raw_gbps: float) -> dict:
    """Where the prefill pushes: the same pulls read instead, beside them (``read_`` keys)."""
    gbps = num_bytes / statistics.median(seconds) / 2**30
    return {
        "read_seconds": round(statistics.median(seconds), 6),
        "read_gbps": round(gbps, 3),
        "read_cpu_seconds_per_gib": round(statistics.median(cpus) / (num_bytes / 2**30), 4),
        "read_ratio_vs_raw_nixl": round(gbps / raw_gbps, 3),
    }


def one_block_pulls(decode: DecodeRank, prefill: PrefillProcess, block_size: int, samples: int) -> list[float]:
    """Seconds of ``samples`` pulls of one held block each (the hold, a round trip to the prefill, not counted)."""
    seconds = []
    for index in range(samples):
        request_id = f"bench-one-block-{index}"
        prefill.request("hold", request_id, [index % 2])
        started = time.perf_counter()
        decode.pull(request_id, prefill.host, prefill.port, [index % 2], [index % 2], block_size)
        seconds.append(time.perf_counter() - started)
    return seconds


def request_ids(shape: Shape, seed: int) -> tuple[tuple[list[int], list[int]], tuple[list[int], list[int]]]:
    """The (remote, local) block ids of the contiguous request and of the scattered one (shuffled, distinct)."""
    rng = np.random.default_rng(seed)
    n = shape.request_blocks
    contiguous = (list(range(3, 3 + n)), list(range(5, 5 + n)))
    scattered = (
        sorted(rng.choice(shape.cache_blocks, n, replace=False).tolist(), key=lambda _: rng.random()),
        rng.choice(shape.cache_blocks, n, replace=False).tolist(),
    )
    return contiguous, scattered


def run(
    shape: Shape = Shape(),
    *,
    repeats: int = 5,
    idle_seconds: float = 5.0,
    seed: int = 7,
    read_lanes: int | None = None,
    prefill_options: dict[str, str] | None = None,
    busy_prefill: bool = False,
    settings: Settings,
) -> dict:
    """Run the whole benchmark; returns the JSON-ready result. ``read_lanes``: the decode's (default: its
    default); ``prefill_options``: more :class:`PrefillSpec` fields (``host``, ``netns``, ``ucx_net_devices``);
    ``busy_prefill``: the prefill process's engine loop holds the GIL (:class:`PrefillSpec`'s ``busy_engine``);
    ``settings``: the command's (both sides run with them), with the UCX variables in force now."""
    settings = apply_process_defaults(settings, net_devices="lo")
    torch.set_num_threads(1)
    layout = shape.layout_for()
    spec = PrefillSpec(
        engine_id="bench-prefill",
        layouts=[layout],
        num_blocks=shape.cache_blocks,
        seed=seed,
        settings=settings,
        busy_engine=busy_prefill,
        **(prefill_options or {}),  # type: ignore[arg-type]
    )
    contiguous, scattered = request_ids(shape, seed)
    with PrefillProcess(spec) as prefill:
        expected = spec.caches(huge_pages=settings.own_huge_pages)  # also the memcpy yardstick's source
        own_huge_pages = settings.own_huge_pages
        # our NIXL read path, against a raw NIXL READ (same-host reads in place: bench topology)
        options = DecodeOptions(read_lanes=read_lanes, settings=settings, transport="nixl")
        decode = DecodeRank(
            "bench-decode", KVCache.allocate(layout, shape.cache_blocks, huge_pages=own_huge_pages), options
        )
        scratch = KVCache.allocate(layout, shape.cache_blocks, huge_pages=own_huge_pages)
        reading: DecodeRank | None = None  # where the prefill pushes: a decode that reads, for the same requests
        try:
            decode.agent.lanes_ready.wait(30.0)  # made in the background; a server's first pulls may go without
            assert isinstance(decode.agent, TransferAgent)  # the default factory's; huge pages are a NIXL agent's
            decode.agent.huge_pages.wait(60.0)  # likewise: reads before it are correct, only slower
            started = time.perf_counter()
            decode.connect(prefill.host, prefill.port)
            connect_ms = (time.perf_counter() - started) * 1e3
            pushes = decode.push_ready(prefill.host, prefill.port, timeout_s=10.0)
            if pushes:
                reading = DecodeRank(
                    "bench-decode-read", KVCache.allocate(layout, shape.cache_blocks), replace(options, push="off")
                )
                reading.connect(prefill.host, prefill.port)
            lanes = decode.agent.lanes
            reported = {
                "transport": "nixl",
                "read_lanes": 1 + (len(lanes.lanes) if lanes is not None else 0),
                "split_min_bytes": lanes.split_min_bytes if lanes is not None else None,
                "ucx_env": {k: v for k, v in sorted(environment().items()) if k.startswith("UCX_")},
                "transparent_hugepages": thp_mode(),
                "huge_pages": settings.huge_pages,
                "busy_prefill_engine": busy_prefill,
                "decode_cache_huge_page_fraction": round(_huge_fraction(decode.cache), 3),
                "push": pushes,  # the decode asks the prefill to write (PD_TRANSFER_PUSH; auto: over TCP)
            }
            # as in a real request, the prefill holds a lease while the decode reads (it then polls fast)
            prefill.request("hold", _LEASE, [0])
            results = {
                "contiguous": _case(
                    decode, reading, prefill, expected, scratch, *contiguous, shape.request_tokens, repeats, "c"
                ),
                "scattered": _case(
                    decode, reading, prefill, expected, scratch, *scattered, shape.request_tokens, repeats, "s"
                ),
            }
            if reading is not None:
                reading.close()  # before the idle measurement
                reading = None
            released = prefill.wait_released(f"bench-s-{repeats - 1}", timeout_s=10.0)
            latencies = one_unit_read_latencies(decode, prefill.host, prefill.port, samples=300)
            pulls = one_block_pulls(decode, prefill, shape.block_size, samples=100)
            prefill.request("release", _LEASE)  # idle: nothing held
            # idle: both sides at once, the decode measured in this process
            prefill.send("idle_cpu", idle_seconds)
            cpu_start, wall_start = time.process_time(), time.perf_counter()
            time.sleep(idle_seconds)  # measuring idle: sleeping is the workload
            decode_idle = 100.0 * (time.process_time() - cpu_start) / (time.perf_counter() - wall_start)
            prefill_idle = float(prefill.receive(idle_seconds + 30)[1])
        finally:
            if reading is not None:
                reading.close()
            decode.close()
    one_block_bytes = layout.plane_block_bytes
    copies = {kind: host_copy_gbps(results["contiguous"]["bytes"], huge_pages=kind) for kind in (False, True)}
    return {
        "shape": asdict(shape),
        "host_copy_gbps": round(max(copies.values()), 3),
        "host_copy_gbps_4k_pages": round(copies[False], 3),
        "host_copy_gbps_huge_pages": round(copies[True], 3),
        "settings": reported,
        "request_bytes": results["contiguous"]["bytes"],
        "connect_ms": round(connect_ms, 1),
        **results,
        "prefill_saw_notification": released == [1],
        "idle_cpu_percent": round(max(prefill_idle, decode_idle), 3),
        "idle_cpu_percent_prefill": round(prefill_idle, 3),
        "idle_cpu_percent_decode": round(decode_idle, 3),
        "one_block_bytes": one_block_bytes,
        "one_block_p50_us": round(statistics.median(latencies) * 1e6, 1),
        "one_block_p99_us": round(float(np.percentile(latencies, 99)) * 1e6, 1),
        # a whole pull of one held block, as a request makes it (pushed where the prefill pushes)
        "one_block_pull_p50_us": round(statistics.median(pulls) * 1e6, 1),
        "one_block_pull_p99_us": round(float(np.percentile(pulls, 99)) * 1e6, 1),
    }
