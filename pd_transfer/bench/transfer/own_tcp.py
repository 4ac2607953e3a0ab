"""The ``tcp`` transport in ``pd-transfer bench transfer --tcp``: the same contiguous and scattered requests as the
NIXL pulls, pulled by a decode rank whose engine is opened with ``transport="tcp"`` from a prefill process offering it
(its own connections: rows sent with ``sendmsg`` out of the prefill's cache, received with ``recvmsg`` into place), each
pull verified, with both processes' CPU per GiB and one-block pulls. :mod:`.tcp` sets the ratios against the TCP
stream measured in the same run. The scattered request also by decodes that check what they read against the
prefill's digests otherwise than the default (``verify``: ``off``, ``all``; issue 42), each ratio against ``off``."""

from __future__ import annotations

import statistics
import time
from functools import partial

import numpy as np
import torch

from pd_transfer.connector.cache import KVCache
from pd_transfer.connector.decode.rank import DecodeRank
from pd_transfer.connector.options import DecodeOptions
from pd_transfer.settings import Settings, apply_process_defaults
from pd_transfer.sim.peer import PrefillProcess, PrefillSpec
from pd_transfer.sim.shape import Shape
from pd_transfer.sim.verify import received_correctly
from pd_transfer.transfer.digests import VERIFY_MODES, Verify

from .reads import _with_cpu, one_block_pulls, request_ids


def run(
    shape: Shape,
    *,
    repeats: int = 5,
    seed: int = 7,
    prefill_options: dict[str, str] | None = None,
    settings: Settings,
) -> dict:
    """Pulls of the benchmark's two requests by the ``tcp`` transport, ``repeats`` each (the median's GiB/s, both
    processes' CPU seconds per GiB, whether every pull's bytes were right), and one-block pull latencies.
    ``prefill_options``: more :class:`PrefillSpec` fields (``host``, ``netns``, ``ucx_net_devices``)."""
    settings = apply_process_defaults(settings, net_devices="lo")
    torch.set_num_threads(1)
    layout = shape.layout_for()
    spec = PrefillSpec(
        engine_id="bench-prefill-tcp",
        layouts=[layout],
        num_blocks=shape.cache_blocks,
        seed=seed,
        settings=settings,
        transport="tcp",
        **(prefill_options or {}),  # type: ignore[arg-type]
    )
    contiguous, scattered = request_ids(shape, seed)
    with PrefillProcess(spec) as prefill:
        expected = spec.caches(huge_pages=settings.own_huge_pages)
        options = DecodeOptions(settings=settings, transport="tcp")
        cache = KVCache.allocate(layout, shape.cache_blocks, huge_pages=settings.own_huge_pages)
        decode = DecodeRank("bench-decode-tcp", cache, options)
        try:
            decode.connect(prefill.host, prefill.port)
            cases = {
                name: pulled_case(decode, prefill, expected, *ids, shape.request_tokens, repeats, name[0])
                for name, ids in (("contiguous", contiguous), ("scattered", scattered))
            }
            pulls = one_block_pulls(decode, prefill, shape.block_size, samples=100)
        finally:
            decode.close()
        by_verify = {options.verify: cases["scattered"]}
        for verify in VERIFY_MODES:
            if verify not in by_verify:  # one decode at a time: one more cache at a time
                by_verify[verify] = _verify_case(prefill, expected, shape, settings, verify, scattered, repeats)
    off = by_verify["off"]["seconds"]
    return {
        **cases,
        "scattered_by_verify": {
            verify: {**case, "cost_vs_off": round(case["seconds"] / off, 3)} for verify, case in by_verify.items()
        },
        "one_block_pull_p50_us": round(statistics.median(pulls) * 1e6, 1),
        "one_block_pull_p99_us": round(float(np.percentile(pulls, 99)) * 1e6, 1),
    }


def _verify_case(
    prefill: PrefillProcess,
    expected: list[KVCache],
    shape: Shape,
    settings: Settings,
    verify: Verify,
    ids: tuple[list[int], list[int]],
    repeats: int,
) -> dict:
    """The request ``ids`` pulled by a decode of its own whose ``verify`` is ``verify``."""
    layout = shape.layout_for()
    cache = KVCache.allocate(layout, shape.cache_blocks, huge_pages=settings.own_huge_pages)
    options = DecodeOptions(settings=settings, transport="tcp", verify=verify)
    decode = DecodeRank(f"bench-decode-tcp-{verify}", cache, options)
    try:
        decode.connect(prefill.host, prefill.port)
        return pulled_case(decode, prefill, expected, *ids, shape.request_tokens, repeats, f"v{verify}")
    finally:
        decode.close()


def pulled_case(
    decode: DecodeRank,
    prefill: PrefillProcess,
    expected: list[KVCache],
    remote_ids: list[int],
    local_ids: list[int],
    num_tokens: int,
    repeats: int,
    label: str,
    transport: str = "tcp",
) -> dict:
    """``repeats`` pulls of a request held in ``remote_ids`` into ``local_ids`` by ``decode`` (opened by ``transport``),
    each verified: the median's seconds and GiB/s, the prefill's CPU seconds per GiB."""
    seconds: list[float] = []
    cpus: list[float] = []
    verified = True
    moved = 0
    for index in range(repeats):
        request_id = f"bench-{transport}-{label}-{index}"
        prefill.request("hold", request_id, remote_ids)
        for tensor in decode.cache.tensors:  # each pull verified on what it wrote itself
            tensor.zero_()
        pull = partial(decode.pull, request_id, prefill.host, prefill.port, remote_ids, local_ids, num_tokens)
        started = time.perf_counter()
        stats = _with_cpu(prefill, cpus, pull)
        seconds.append(time.perf_counter() - started)
        assert stats.transport == transport, stats.transport
        moved = stats.bytes
        verified = verified and received_correctly(decode.cache, local_ids, expected, remote_ids, num_tokens)
    median = statistics.median(seconds)
    return {
        "bytes": moved,
        "seconds": round(median, 6),
        "gbps": round(moved / median / 2**30, 3),
        "cpu_seconds_per_gib": round(statistics.median(cpus) / (moved / 2**30), 4),
        "verified": bool(verified),
        "repeats": repeats,
    }
