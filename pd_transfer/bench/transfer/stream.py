"""``pd-transfer bench stream``: a request's KV streamed layer by layer while the prefill computes it, against the
sequential path (compute, then the whole transfer), side by side in one run, over the ``tcp`` transport.

A prefill process (:class:`~pd_transfer.sim.peer.PrefillProcess`, the real rank and transport) stands in for an
engine computing a request: each of its layers takes ``compute_us_per_token`` x tokens / layers (slept: the cache
already holds the KV pattern every pull is checked against), is then marked written, and the request is held at the
end. This process's decode rank either waits for the hold and then pulls (``sequential``), or asks first and receives
each layer as it is written (``streamed``, :meth:`~pd_transfer.connector.decode.rank.DecodeRank.pull_streamed`).
Each round's time runs from sending the prefill its request to the decode holding every byte (verified), the two
modes alternated. Across a veth into a network namespace where one can be made (two hosts on one wire), shaped to
``--wire-gbit`` if given; else on loopback.

Streamed requests are checked against the prefill's digests as a decode of each ``--verify`` mode checks them (issue
42: ``off``, ``sample``, the default, and ``all``; one decode rank a mode, its own cache), each mode a streamed round
of its own beside the sequential one: what the checks cost is read off side by side.

Reported per prompt length: the prefill's compute, the sequential transfer alone and its ratio to the compute (where
the run sits), the sequential p50, each verify mode's streamed p50 and its ratio to the sequential one (the default
mode's as ``streamed_p50_s``), each mode's against ``off`` (``verify_cost``), and the streamed tail: from the
prefill's last layer to the decode holding the request, against one layer's transfer (the sequential transfer /
layers) + 50 ms. Seconds throughout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from dataclasses import asdict, replace
from typing import Any

import torch

from pd_transfer.connector.cache import KVCache
from pd_transfer.connector.decode.rank import DecodeRank
from pd_transfer.connector.options import DecodeOptions
from pd_transfer.connector.transports.requests import PullStats
from pd_transfer.settings import Settings, apply_process_defaults, process_environment, read_settings
from pd_transfer.sim.peer import PrefillProcess, PrefillSpec
from pd_transfer.sim.shape import Shape
from pd_transfer.sim.verify import received_correctly
from pd_transfer.transfer.digests import VERIFY_MODES, Verify

from .netns import Veth, add_wire_argument, veth_or_reason

PROMPTS = (512, 2048, 4096)
#: The verify mode whose streamed figures are the run's headline (the decode's default).
DEFAULT_VERIFY: Verify = DecodeOptions.verify
#: A tail within one layer's transfer and this much (s) meets the issue's bound.
TAIL_ALLOWANCE_S = 0.050
_TIMEOUT_S = 300.0


def run(
    prompts: tuple[int, ...],
    *,
    rounds: int,
    compute_us_per_token: float,
    netns: bool,
    wire_gbit: float | None,
    settings: Settings,
    verify: tuple[Verify, ...] = VERIFY_MODES,
) -> dict[str, Any]:
    """The benchmark (see the module's docstring); the veth's reason where it could not be built."""
    shape = replace(Shape(), request_tokens=max(prompts), cache_blocks=-(-max(prompts) // Shape().block_size) + 2)
    result: dict[str, Any] = {
        "shape": asdict(shape),
        "compute_us_per_token": compute_us_per_token,
        "rounds": rounds,
        "verify": list(verify),
    }
    if not netns:
        result["path"] = "loopback"
        result["prompts"] = _prompts(shape, prompts, rounds, compute_us_per_token, None, settings, verify)
        return result
    with veth_or_reason(wire_gbit) as net:
        if isinstance(net, str):
            return {**result, "skipped": net}
        result["path"], result["wire_gbit"] = "veth", wire_gbit
        with process_environment({"UCX_NET_DEVICES": net.outer}):
            result["prompts"] = _prompts(shape, prompts, rounds, compute_us_per_token, net, settings, verify)
    return result


def _prompts(
    shape: Shape,
    prompts: tuple[int, ...],
    rounds: int,
    compute_us: float,
    net: Veth | None,
    settings: Settings,
    verify: tuple[Verify, ...],
) -> list[dict[str, Any]]:
    settings = apply_process_defaults(settings, net_devices="lo")
    torch.set_num_threads(1)
    layout = shape.layout_for()
    where = {"host": net.inner_address, "netns": net.ns, "ucx_net_devices": net.inner} if net else {}
    spec = PrefillSpec(
        engine_id="bench-stream-prefill",
        layouts=[layout],
        num_blocks=shape.cache_blocks,
        seed=3,
        settings=settings,
        transport="tcp",
        **where,  # type: ignore[arg-type]
    )
    with PrefillProcess(spec) as prefill:
        expected = spec.caches()
        decodes: dict[Verify, DecodeRank] = {}
        try:
            for mode in verify:
                cache = KVCache.allocate(layout, shape.cache_blocks)
                options = DecodeOptions(settings=settings, transport="tcp", verify=mode)
                decodes[mode] = DecodeRank(f"bench-stream-decode-{mode}", cache, options)
                decodes[mode].connect(prefill.host, prefill.port)
            return [
                _prompt(decodes, prefill, expected, shape, tokens, rounds, compute_us * tokens / shape.num_layers / 1e6)
                for tokens in prompts
            ]
        finally:
            for decode in decodes.values():
                decode.close()


def _prompt(
    decodes: dict[Verify, DecodeRank],
    prefill: PrefillProcess,
    expected: list[KVCache],
    shape: Shape,
    tokens: int,
    rounds: int,
    layer_s: float,
) -> dict[str, Any]:
    blocks = -(-tokens // shape.block_size)
    remote_ids = list(range(blocks))
    local_ids = list(range(2, 2 + blocks))[::-1]  # another order: rows land scattered
    sequential: list[dict[str, float]] = []
    streamed: dict[Verify, list[dict[str, float]]] = {mode: [] for mode in decodes}
    runs = [("sequential", next(iter(decodes.values())), sequential)]
    runs += [("streamed", decode, streamed[mode]) for mode, decode in decodes.items()]
    verified = True
    for index in range(rounds + 1):  # the first round of each mode warms up, not counted
        for mode, decode, into in runs:
            for tensor in decode.cache.tensors:  # each round checked on what it wrote itself
                tensor.zero_()
            request_id = f"bench-stream-{tokens}-{mode}-{decode.agent.name}-{index}"
            timing = _round(decode, prefill, mode, request_id, remote_ids, local_ids, tokens, layer_s)
            verified = verified and received_correctly(decode.cache, local_ids, expected, remote_ids, tokens)
            if index:
                into.append(timing)
    return _summary(tokens, shape, sequential, streamed, verified)


def _round(
    decode: DecodeRank,
    prefill: PrefillProcess,
    mode: str,
    request_id: str,
    remote_ids: list[int],
    local_ids: list[int],
    tokens: int,
    layer_s: float,
) -> dict[str, float]:
    """One request: seconds from sending the prefill its request to the decode holding the KV, and its parts."""
    host, port = prefill.host, prefill.port
    started = time.perf_counter()
    if mode == "sequential":
        compute_s = float(prefill.request("compute", request_id, remote_ids, layer_s, timeout_s=_TIMEOUT_S)[1])
        computed = time.perf_counter()
        stats = decode.pull(request_id, host, port, remote_ids, local_ids, tokens, timeout_s=_TIMEOUT_S)
        done = time.perf_counter()
        return {"total_s": done - started, "compute_s": compute_s, "transfer_s": done - computed, "tail_s": 0.0}
    pulled: list[PullStats | BaseException] = []

    def pull() -> None:
        try:
            pulled.append(decode.pull_streamed(request_id, host, port, local_ids, tokens, timeout_s=_TIMEOUT_S))
        except BaseException as error:  # reported by the round below
            pulled.append(error)

    puller = threading.Thread(target=pull, name="bench-stream-pull")
    puller.start()
    compute_s = float(prefill.request("compute", request_id, remote_ids, layer_s, timeout_s=_TIMEOUT_S)[1])
    computed = time.perf_counter()
    puller.join(_TIMEOUT_S)
    done = time.perf_counter()
    if puller.is_alive() or not pulled or isinstance(pulled[0], BaseException):
        raise RuntimeError(f"streamed request {request_id} failed: {pulled[0] if pulled else 'no answer in time'}")
    stats = pulled[0]
    end = started + stats.connect_seconds + stats.seconds  # when the pull returned (the join may come later)
    return {
        "total_s": min(done, end) - started,
        "compute_s": compute_s,
        "transfer_s": 0.0,
        "tail_s": max(0.0, min(done, end) - computed),
        "layers": float(stats.layers_streamed),
    }


def _summary(
    tokens: int,
    shape: Shape,
    sequential: list[dict[str, float]],
    by_mode: dict[Verify, list[dict[str, float]]],
    verified: bool,
) -> dict[str, Any]:
    def p50(rows: list[dict[str, float]], key: str) -> float:
        return round(statistics.median(row[key] for row in rows), 4)

    streamed = by_mode.get(DEFAULT_VERIFY) or next(iter(by_mode.values()))
    transfer = p50(sequential, "transfer_s")
    compute = p50(sequential + streamed, "compute_s")
    one_layer = transfer / shape.num_layers
    tail = p50(streamed, "tail_s")
    off = p50(by_mode["off"], "total_s") if "off" in by_mode else None
    modes = {
        mode: {
            "streamed_p50_s": p50(rows, "total_s"),
            "streamed_vs_sequential": round(p50(rows, "total_s") / p50(sequential, "total_s"), 3),
            "tail_p50_s": p50(rows, "tail_s"),
            "verify_cost": round(p50(rows, "total_s") / off, 3) if off else None,
        }
        for mode, rows in by_mode.items()
    }
    return {
        "tokens": tokens,
        "bytes": tokens * shape.num_layers * 2 * shape.num_kv_heads * shape.head_size * 2,
        "compute_s": compute,
        "sequential_transfer_s": transfer,
        "transfer_to_compute": round(transfer / compute, 3) if compute else None,
        "sequential_p50_s": p50(sequential, "total_s"),
        "sequential_max_s": round(max(row["total_s"] for row in sequential), 4),
        "streamed_p50_s": p50(streamed, "total_s"),
        "streamed_max_s": round(max(row["total_s"] for row in streamed), 4),
        "streamed_vs_sequential": round(p50(streamed, "total_s") / p50(sequential, "total_s"), 3),
        "streamed_tail_p50_s": tail,
        "one_layer_transfer_s": round(one_layer, 4),
        "tail_within_one_layer_and_50ms": tail <= one_layer + TAIL_ALLOWANCE_S,
        "by_verify": modes,
        "verified": verified,
    }


def lines(result: dict[str, Any]) -> list[str]:
    if "skipped" in result:
        return [f"skipped: {result['skipped']}"]
    wire = f", wire {result['wire_gbit']} Gbit/s" if result.get("wire_gbit") else ""
    out = [f"{result['path']}{wire}, compute {result['compute_us_per_token']} us/token, {result['rounds']} rounds"]
    for row in result["prompts"]:
        out.append(
            f"  {row['tokens']:5d} tokens ({row['bytes'] / 2**20:.0f} MiB): compute {row['compute_s']:.3f} s,"
            f" transfer alone {row['sequential_transfer_s']:.3f} s ({row['transfer_to_compute']} of it);"
            f" sequential {row['sequential_p50_s']:.3f} s, streamed {row['streamed_p50_s']:.3f} s"
            f" = {row['streamed_vs_sequential']} x; tail {row['streamed_tail_p50_s'] * 1e3:.1f} ms"
            f" (one layer {row['one_layer_transfer_s'] * 1e3:.1f} ms); verified {row['verified']}"
        )
        for mode, figures in row["by_verify"].items():
            cost = f", {figures['verify_cost']} x off" if figures["verify_cost"] is not None else ""
            out.append(
                f"    verify {mode}: streamed {figures['streamed_p50_s']:.3f} s = {figures['streamed_vs_sequential']} x"
                f" sequential{cost}; tail {figures['tail_p50_s'] * 1e3:.1f} ms"
            )
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--prompts", type=int, nargs="+", default=list(PROMPTS), help="prompt lengths, tokens")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per prompt and mode (after one warm-up)")
    parser.add_argument(
        "--compute-us-per-token", type=float, default=150.0, help="the stand-in prefill's compute per token, us"
    )
    parser.add_argument("--no-netns", dest="netns", action="store_false", help="loopback only")
    parser.add_argument(
        "--verify",
        nargs="+",
        choices=VERIFY_MODES,
        default=list(VERIFY_MODES),
        help="the decodes' verify modes, each streamed beside the sequential path (default: all three)",
    )
    add_wire_argument(parser)


def cli_run(args: argparse.Namespace) -> int:
    if args.rounds < 1 or min(args.prompts) < 1 or not args.compute_us_per_token >= 0:
        raise SystemExit("--rounds and every --prompts must be at least 1, --compute-us-per-token at least 0")
    if args.wire_gbit is not None and not args.netns:
        raise SystemExit("--wire-gbit shapes the veth: drop --no-netns")
    result = run(
        tuple(args.prompts),
        rounds=args.rounds,
        compute_us_per_token=args.compute_us_per_token,
        netns=args.netns,
        wire_gbit=args.wire_gbit,
        settings=read_settings(),  # the command's edge
        verify=tuple(dict.fromkeys(args.verify)),
    )
    print(json.dumps(result, indent=2) if args.json else "\n".join(lines(result)))
    return 0
