"""``pd-transfer bench topology``: heterogeneous transfers against the homogeneous transfer of the same
bytes, in one run. Prefill engines run in child processes; the decode ranks live in this process.

Cases on the default model shape (32 layers, K and V apart, 8 KV heads x 128, bf16, 4096 tokens):
``tp_2_to_1`` (prefill TP 2, each rank 4 heads -> decode TP 1) and ``block_16_to_64`` (prefill blocks
of 16 tokens -> decode blocks of 64, regrouped after receive), each against prefill TP 1 / block 16 ->
decode TP 1 / block 16 moving the same 512 MiB; measured once the decodes' read lanes are up and after one pull of
each case (a lane's first read of a peer sets up its connection). Beside the figures: the host's own copy rate
(512 MiB contiguous, one thread, on 4 KiB and on huge pages, after the pulls), the load average before and after,
the time it finished (UTC) and the settings (the decodes' transport setting, read lanes, staging chunk bytes, staged
jobs per lane); each case names the transport that moved it (``host_cma`` on one host by default: the prefills run
here and offer their caches to be read in place; ``--transport nixl`` measures NIXL's reads). With the caches
in host memory, ``cma_ceiling``: the same rows read by batched ``process_vm_readv`` on as many threads as the
decode had read lanes (:mod:`.cma_ceiling`, the machine's own ceiling for same-host reads), and each pull over it.

``--device cuda[:N]`` keeps both sides' caches on that device and adds ``gpu``: each case against the in-process
device copy of the same rows (:mod:`..device`); ``--device cpu`` does the same on CPU tensors.
"""

from __future__ import annotations

import datetime
import os
import statistics
from dataclasses import asdict, replace

import numpy as np
import torch

from pd_transfer.connector.cache import KVCache
from pd_transfer.connector.decode.rank import DecodeRank, PullStats
from pd_transfer.connector.options import DEFAULT_STAGED_JOBS_PER_LANE, DEFAULT_STAGING_CHUNK_BYTES, DecodeOptions
from pd_transfer.settings import Settings, apply_process_defaults
from pd_transfer.sim.peer import PrefillProcess, PrefillSpec
from pd_transfer.sim.shape import Shape
from pd_transfer.sim.verify import received_correctly

from ..device import parse_device, topology_section
from ..transfer.reads import QUICK_SHAPE, host_copy_gbps
from . import cma_ceiling

_LANES_READY_S = 30.0
#: Pulls of each case per run (interleaved; the figures are their medians). With 5, the ratios of five runs in a row
#: on 2 cores spread over 0.71-0.98; with 11, over 0.79-0.92 (2026-11-27).
REPEATS = 11


def _measure(
    decode: DecodeRank,
    prefill: PrefillProcess,
    remote_ids: list[int],
    local_ids: list[int],
    tokens: int,
    label: str,
    repeats: int,
) -> list[PullStats]:
    return [
        decode.pull(f"{label}-{index}", prefill.host, prefill.port, remote_ids, local_ids, tokens)
        for index in range(repeats)
    ]


def _summary(stats: list[PullStats], homogeneous: list[PullStats]) -> dict:
    """Medians over the repeats. The fix-up runs on a worker thread while later chunks are read:
    ``postprocess_ratio`` is what it adds to the pull (seconds after the last read / read seconds),
    ``postprocess_cpu_ratio`` its whole cost (its seconds, summed over the lanes that ran it / read seconds)."""
    seconds = statistics.median(s.seconds for s in stats)
    read_seconds = statistics.median(s.read_seconds for s in stats)
    post_seconds = statistics.median(s.postprocess_seconds for s in stats)
    exposed_seconds = statistics.median(s.postprocess_exposed_seconds for s in stats)
    homogeneous_seconds = statistics.median(s.seconds for s in homogeneous)
    gbps = stats[0].bytes / seconds / 2**30
    homogeneous_gbps = homogeneous[0].bytes / homogeneous_seconds / 2**30
    return {
        "transport": stats[0].transport,
        "bytes": stats[0].bytes,
        "descriptor_rows": stats[0].descriptors,
        "seconds": round(seconds, 6),
        "gbps": round(gbps, 3),
        "homogeneous_gbps": round(homogeneous_gbps, 3),
        "ratio_vs_homogeneous": round(gbps / homogeneous_gbps, 3),
        "read_seconds": round(read_seconds, 6),
        "postprocess_seconds": round(post_seconds, 6),
        "postprocess_exposed_seconds": round(exposed_seconds, 6),
        "postprocess_ratio": round(exposed_seconds / read_seconds, 3) if read_seconds > 0 else 0.0,
        "postprocess_cpu_ratio": round(post_seconds / read_seconds, 3) if read_seconds > 0 else 0.0,
    }


def _ceiling(
    result: dict, shape: Shape, ids: tuple[list[int], list[int], list[int]], threads: int, repeats: int, huge: bool
) -> dict:
    """:mod:`.cma_ceiling` for the same rows, on as many threads as the decode had read lanes, with each case's pull
    over it (``ours_vs_ceiling``)."""
    ceiling = cma_ceiling.measure(shape, ids, threads=threads, repeats=repeats, huge_pages=huge)
    for case in ("homogeneous", "tp_2_to_1", "block_16_to_64"):
        if case in ceiling:
            ceiling[case]["ours_vs_ceiling"] = round(result[case]["gbps"] / ceiling[case]["gbps"], 3)
    return ceiling


def run(
    *,
    quick: bool = False,
    repeats: int = REPEATS,
    seed: int = 11,
    device: str | None = None,
    transport: str = "auto",
    settings: Settings,
) -> dict:
    """Heterogeneous TP and block sizes against the homogeneous read, side by side. ``device``: where both sides'
    caches live, and the ``gpu`` section against its copy (None: the CPU, no section). ``transport``: the decodes'
    setting (each case reports what moved it). ``settings``: the command's (both sides run with them). Raises
    ``ValueError`` for a device that is not here."""
    target = parse_device(device) if device is not None else None
    on = str(target) if target is not None else "cpu"
    settings = apply_process_defaults(settings, net_devices="lo", vram=target is not None and target.type == "cuda")
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    shape: Shape = QUICK_SHAPE if quick else Shape()
    repeats = 3 if quick else repeats
    tokens = shape.request_tokens
    rng = np.random.default_rng(seed)
    small_blocks = shape.request_blocks
    big_block = 4 * shape.block_size
    big_cache_blocks = shape.cache_blocks // 4

    homogeneous_spec = PrefillSpec(
        "bench-tp1", [shape.layout_for()], shape.cache_blocks, seed=seed, device=on, settings=settings
    )
    tp2_spec = PrefillSpec(
        "bench-tp2",
        [shape.layout_for(tp_size=2, tp_rank=r) for r in range(2)],
        shape.cache_blocks,
        seed=seed + 1,
        device=on,
        settings=settings,
    )
    remote_ids = rng.choice(shape.cache_blocks, small_blocks, replace=False).tolist()
    local_ids = rng.choice(shape.cache_blocks, small_blocks, replace=False).tolist()
    big_local_ids = rng.choice(big_cache_blocks, -(-tokens // big_block), replace=False).tolist()

    with PrefillProcess(homogeneous_spec) as tp1, PrefillProcess(tp2_spec) as tp2:
        own = settings.own_huge_pages
        small_cache = KVCache.allocate(shape.layout_for(), shape.cache_blocks, device=on, huge_pages=own)
        big_cache = KVCache.allocate(
            shape.layout_for(block_size=big_block), big_cache_blocks, device=on, huge_pages=own
        )
        small = DecodeRank("bench-decode-b16", small_cache, DecodeOptions(settings=settings, transport=transport))
        big = DecodeRank("bench-decode-b64", big_cache, DecodeOptions(settings=settings, transport=transport))
        try:
            pairs = ((small, tp1, local_ids), (small, tp2, local_ids), (big, tp1, big_local_ids))
            for decode, prefill, _ in pairs:
                decode.connect(prefill.host, prefill.port)
            for decode in (small, big):  # lanes are made in the background: measure with them up
                decode.agent.lanes_ready.wait(_LANES_READY_S)
            for index, (decode, prefill, ids) in enumerate(pairs):  # each lane's first read of a peer connects
                _measure(decode, prefill, remote_ids, ids, tokens, f"warm-up-{index}", 1)
            tp1_caches, tp2_caches = homogeneous_spec.caches(huge_pages=own), tp2_spec.caches(huge_pages=own)
            homogeneous, tp_2_to_1, block_16_to_64 = [], [], []
            checks = {"homogeneous": True, "tp_2_to_1": True, "block_16_to_64": True}
            for index in range(repeats):  # interleaved, so drift on the machine hits every case alike
                homogeneous += _measure(small, tp1, remote_ids, local_ids, tokens, f"homog-{index}", 1)
                checks["homogeneous"] &= received_correctly(small.cache, local_ids, tp1_caches, remote_ids, tokens)
                tp_2_to_1 += _measure(small, tp2, remote_ids, local_ids, tokens, f"tp21-{index}", 1)
                checks["tp_2_to_1"] &= received_correctly(small.cache, local_ids, tp2_caches, remote_ids, tokens)
                block_16_to_64 += _measure(big, tp1, remote_ids, big_local_ids, tokens, f"b1664-{index}", 1)
                checks["block_16_to_64"] &= received_correctly(big.cache, big_local_ids, tp1_caches, remote_ids, tokens)
            read_lanes = small.agent.lane_count
        finally:
            small.close()
            big.close()
    copies = {kind: host_copy_gbps(homogeneous[0].bytes, huge_pages=kind) for kind in (False, True)}
    result = {
        "shape": asdict(replace(shape)),
        "host_copy_gbps": round(max(copies.values()), 3),
        "host_copy_gbps_4k_pages": round(copies[False], 3),
        "host_copy_gbps_huge_pages": round(copies[True], 3),
        "load_average": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],  # 1-minute, before and after
        "finished_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S"),
        "settings": {
            "transport": transport,
            "read_lanes": read_lanes,
            "staging_chunk_bytes": DEFAULT_STAGING_CHUNK_BYTES,
            "staged_jobs_per_lane": DEFAULT_STAGED_JOBS_PER_LANE,
        },
        "verified": all(checks.values()),
        "verified_cases": checks,
        "homogeneous": _summary(homogeneous, homogeneous),
        "tp_2_to_1": _summary(tp_2_to_1, homogeneous),
        "block_16_to_64": _summary(block_16_to_64, homogeneous),
    }
    if target is None or target.type == "cpu":
        result["cma_ceiling"] = _ceiling(
            result, shape, (remote_ids, local_ids, big_local_ids), read_lanes, repeats, own
        )
    if target is not None:
        cases = {"homogeneous": (tp1_caches, homogeneous), "tp_2_to_1": (tp2_caches, tp_2_to_1),
                 "block_16_to_64": (tp1_caches, block_16_to_64)}  # fmt: skip
        result["gpu"] = topology_section(
            target, {case: (caches, remote_ids, stats) for case, (caches, stats) in cases.items()}, repeats
        )
    return result
