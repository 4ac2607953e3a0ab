"""What read checks cost (issue 42), ``pd-transfer bench transfer --verify-cost``: the benchmark's scattered request
pulled in place on one host, by ``process_vm_readv`` (``host_cma``) and by NIXL reads (``nixl``, push off), by a decode
of each ``verify`` mode (``off``, ``sample``, ``all``; each with a cache of its own), from one prefill process; each
pull verified, the median's time against ``off``'s by the same transport. Beside them: this host's copy rate (the
ratios depend on it: hashing runs at about a core's copy speed) and what the prefill's digests at the hold take for
the request (on the prefill's step, not in the pull: :class:`~pd_transfer.connector.held_digests.HeldDigests`).

The ``tcp`` transport's own digests: ``--tcp`` (:mod:`.own_tcp`, ``scattered_by_verify``)."""

from __future__ import annotations

import statistics
import time

import torch

from pd_transfer.connector.cache import KVCache
from pd_transfer.connector.decode.rank import DecodeRank
from pd_transfer.connector.held_digests import HeldDigests
from pd_transfer.connector.options import DecodeOptions
from pd_transfer.settings import Settings, apply_process_defaults
from pd_transfer.sim.peer import PrefillProcess, PrefillSpec
from pd_transfer.sim.shape import Shape
from pd_transfer.transfer.digests import VERIFY_MODES

from .own_tcp import pulled_case
from .reads import host_copy_gbps, request_ids

TRANSPORTS = ("host_cma", "nixl")


def run(shape: Shape, *, repeats: int = 5, seed: int = 7, settings: Settings) -> dict:
    """The section: ``{transport: {verify: case}}`` (each case as :func:`.own_tcp.pulled_case` gives it, with
    ``cost_vs_off``), ``copy_gbps``, ``hold_digest_seconds``."""
    settings = apply_process_defaults(settings, net_devices="lo")
    torch.set_num_threads(1)
    layout = shape.layout_for()
    spec = PrefillSpec(
        engine_id="bench-prefill-verify", layouts=[layout], num_blocks=shape.cache_blocks, seed=seed, settings=settings
    )
    _, (remote_ids, local_ids) = request_ids(shape, seed)
    result: dict = {}
    with PrefillProcess(spec) as prefill:
        expected = spec.caches(huge_pages=settings.own_huge_pages)
        for transport in TRANSPORTS:
            by_verify = {}
            for verify in VERIFY_MODES:
                cache = KVCache.allocate(layout, shape.cache_blocks, huge_pages=settings.own_huge_pages)
                options = DecodeOptions(settings=settings, transport=transport, verify=verify, push="off")
                decode = DecodeRank(f"bench-decode-{transport}-{verify}", cache, options)
                try:
                    decode.connect(prefill.host, prefill.port)
                    by_verify[verify] = pulled_case(
                        decode, prefill, expected, remote_ids, local_ids, shape.request_tokens, repeats, verify,
                        transport,
                    )  # fmt: skip
                finally:
                    decode.close()
            off = by_verify["off"]["seconds"]
            result[transport] = {
                verify: {**case, "cost_vs_off": round(case["seconds"] / off, 3)} for verify, case in by_verify.items()
            }
        request_bytes = result[TRANSPORTS[0]]["off"]["bytes"]
    result["copy_gbps"] = round(host_copy_gbps(request_bytes, huge_pages=settings.own_huge_pages), 3)
    result["hold_digest_seconds"] = round(_hold_digest_seconds(expected[0], remote_ids, repeats), 6)
    return result


def _hold_digest_seconds(cache: KVCache, block_ids: list[int], repeats: int) -> float:
    """The median time the prefill's digests at the hold take for a request in ``block_ids`` of ``cache``."""
    held = HeldDigests(cache)
    seconds = []
    for index in range(repeats):
        started = time.perf_counter()
        held.held(f"bench-{index}", tuple(block_ids))
        seconds.append(time.perf_counter() - started)
        held.ended(f"bench-{index}")
    return statistics.median(seconds)


def summary_lines(section: dict) -> list[str]:
    """The text form of :func:`run`'s section."""
    lines = [
        f"verify cost: host copy {section['copy_gbps']} GiB/s; the prefill's digests at the hold"
        f" {section['hold_digest_seconds'] * 1e3:.1f} ms a request"
    ]
    for transport in TRANSPORTS:
        cases = section[transport]
        lines.append(
            f"  {transport:9s} "
            + "  ".join(
                f"{verify} {case['gbps']:.2f} GiB/s ({case['cost_vs_off']} x off's time, verified {case['verified']})"
                for verify, case in cases.items()
            )
        )
    return lines
