"""``pd-transfer bench pd-tcp``: one P/D request's KV load over UCX's tcp transport, end to end and broken down.

Two KV stand-in servers (:mod:`pd_transfer.sim.kv_standin`: the connector's real scheduler and worker halves, a real
KV cache, real NIXL reads, the real ZMQ side channel, no model) in their own OS processes: the prefill computes a
prompt's KV pattern and holds it under a lease, the decode pulls it with ``DecodeRank.pull_confirmed`` as the vLLM
connector's worker does and verifies every byte. Across a veth into a network namespace where one can be made
(two hosts on one wire), else on loopback. For each request size (1 and 64 MiB by default): a first request (the
decode reaches the engine: handshake, NIXL peers, warm-up reads), then ``rounds`` more, each answered by the
decode's report of where the time from its first step to usable KV went:

- ``connect_ms``: reaching the engine (the handshake and NIXL connection on first contact; a lookup after);
- ``read_ms``: the NIXL reads, first post to last completion;
- ``fixup_exposed_ms``: the layout fix-up left after the last read (none when both sides share a layout);
- ``confirm_ms``: waiting for the prefill's lease confirmation (none when the read ended inside the hold window
  the prefill promised, as the vLLM connector does by default: mode ``hold_window``; mode ``confirm`` asks every
  time, the path of a prefill that promises no window);
- ``other_ms``: the rest of ``ms`` (descriptor planning, posting, notifications, locks).

Results in milliseconds, medians over the rounds; GiB/s (2**30 bytes per second) of the reads, and beside them
the path's own limit: a plain TCP stream of the largest request's bytes from the prefill's side to the decode's
(:func:`.tcp_stream.stream_gbps`, median of 5).
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from pd_transfer.settings import Settings, child_environment, read_settings
from pd_transfer.sim.child import die_with_parent, stop_process
from pd_transfer.sim.kv_model import KVModel
from pd_transfer.transfer.tcp import tcp_ucx_env

from .netns import Veth, add_wire_argument, rx_bytes, veth_or_reason
from .tcp_stream import stream_gbps

SIZES_MIB = (1, 64)
MODES = ("hold_window", "confirm")
PARTS = ("connect_ms", "read_ms", "fixup_exposed_ms", "confirm_ms")
MODEL = KVModel()  # 4 layers, 4 KV heads, head size 64, bfloat16: 4 KiB of KV per token, 64 KiB per block
_START_TIMEOUT_S = 120.0
_REQUEST_TIMEOUT_S = 120.0
_STOP_TIMEOUT_S = 10.0


def bytes_per_token(model: KVModel = MODEL) -> int:
    """K and V of every layer for one token, from the stand-in's cache layout."""
    layout = model.layout()
    return model.layers * 2 * layout.plane_block_bytes // layout.block_size


def start_standin(role: str, args: Sequence[str], env: dict[str, str], netns: str | None) -> subprocess.Popen[bytes]:
    """``python -m pd_transfer.sim.kv_standin --role ROLE ARGS`` (inside ``netns`` when given), stderr discarded."""
    command = [sys.executable, "-m", "pd_transfer.sim.kv_standin", "--role", role, "--engine-id", f"bench-{role}"]
    command += list(args)
    if netns is not None:
        command = ["ip", "netns", "exec", netns, *command]
    return subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, preexec_fn=die_with_parent
    )


def ready_url(process: subprocess.Popen[bytes], role: str, timeout_s: float = _START_TIMEOUT_S) -> str:
    """The URL from the stand-in's ``kv-standin ROLE URL`` line; RuntimeError if it exits or stays silent."""
    assert process.stdout is not None
    deadline = time.monotonic() + timeout_s
    line = b""
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        while not line.endswith(b"\n"):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RuntimeError(f"the {role} stand-in printed no ready line within {timeout_s:.0f} s")
            if selector.select(timeout=min(remaining, 1.0)):
                chunk = os.read(process.stdout.fileno(), 4096)
                if not chunk:
                    raise RuntimeError(f"the {role} stand-in exited ({process.wait(_STOP_TIMEOUT_S)}) before serving")
                line += chunk
    words = line.decode().split()
    if len(words) != 3 or words[:2] != ["kv-standin", role]:
        raise RuntimeError(f"the {role} stand-in printed {line[:200]!r}, not its ready line")
    return words[2]


@contextmanager
def standin(role: str, args: Sequence[str], env: dict[str, str], netns: str | None = None) -> Iterator[str]:
    """A running stand-in's URL; stopped on the way out."""
    process = start_standin(role, args, env, netns)
    try:
        yield ready_url(process, role)
    finally:
        stop_process(process, _STOP_TIMEOUT_S)


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=_REQUEST_TIMEOUT_S) as answer:
        result: dict[str, Any] = json.load(answer)
    return result


def one_request(prefill_url: str, decode_url: str, tokens: list[int]) -> dict[str, Any]:
    """Prefill ``tokens`` (the params), then the decode pulls and verifies their KV: the decode's report."""
    prefill = {
        "model": "kv-standin",
        "prompt": tokens,
        "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    params = post(prefill_url + "/v1/completions", prefill)["kv_transfer_params"]
    decode = {"model": "kv-standin", "prompt": tokens, "max_tokens": 1, "kv_transfer_params": params}
    report: dict[str, Any] = post(decode_url + "/v1/completions", decode)["kv_transfer"]
    if not report.get("verified"):
        raise RuntimeError(f"the decode's KV is not the prompt's: {report}")
    return report


def summarize(first: dict[str, Any], rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians of the warm rounds' parts (and of what is left of ``ms``), the first request's own."""

    def median(key: str) -> float:
        return round(statistics.median(report[key] for report in rounds), 3)

    parts = {key: median(key) for key in ("ms", *PARTS)}
    others = [report["ms"] - sum(report[key] for key in PARTS) for report in rounds]
    parts["other_ms"] = round(statistics.median(others), 3)
    read_s = statistics.median(report["read_ms"] for report in rounds) / 1e3
    return {
        "bytes": first["bytes"],
        "rounds": len(rounds),
        **parts,
        "read_gbps": round(first["bytes"] / read_s / 2**30, 3) if read_s > 0 else None,
        "in_window": all(report["in_window"] for report in rounds),
        "first_request": {key: first[key] for key in ("ms", *PARTS)},
    }


def wait_idle(prefill_url: str, timeout_s: float = 10.0) -> None:
    """Until the prefill holds no request (its blocks are back for the next one)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with urllib.request.urlopen(prefill_url + "/control/kv", timeout=5.0) as answer:
            if json.load(answer)["requests_held"] == 0:
                return
        if time.monotonic() >= deadline:
            raise RuntimeError(f"the prefill still holds requests {timeout_s:.0f} s after the last read")
        time.sleep(0.01)  # polling pace


def run_path(
    sizes_mib: Sequence[int], rounds: int, modes: Sequence[str], net: Veth | None, ucx: Mapping[str, str]
) -> dict[str, dict[str, Any]]:
    """Every mode and size over one path: the veth ``net`` (prefill inside its namespace) or loopback; the
    stand-ins' environments carry the UCX variables ``ucx``."""
    largest_blocks = -(-max(sizes_mib) * 2**20 // (bytes_per_token() * MODEL.block_size))
    model_args = ["--num-blocks", str(2 * largest_blocks + 64), "--read-timeout", "60"]
    prefill_host = net.inner_address if net else "127.0.0.1"
    decode_host = net.outer_address if net else "127.0.0.1"
    base = child_environment(ucx)
    prefill_args = ["--host", prefill_host, "--side-channel-host", prefill_host, *model_args]
    prefill_env = {**base, "UCX_NET_DEVICES": net.inner if net else "lo"}
    results: dict[str, dict[str, Any]] = {}
    with standin("prefill", prefill_args, prefill_env, net.ns if net else None) as prefill_url:
        for mode in modes:
            decode_args = ["--host", decode_host, "--transport", "nixl", *model_args]  # over TCP, as between hosts
            decode_args += ["--hold-window"] if mode == "hold_window" else []
            decode_env = {**base, "UCX_NET_DEVICES": net.outer if net else "lo"}
            with standin("decode", decode_args, decode_env) as decode_url:
                for size in sizes_mib:
                    tokens = [(7 * i + size) % 30000 + 5 for i in range(size * 2**20 // bytes_per_token())]
                    reports = []
                    for _ in range(rounds + 1):
                        wait_idle(prefill_url)
                        reports.append(one_request(prefill_url, decode_url, tokens))
                    results[f"{mode}.{size}MiB"] = summarize(reports[0], reports[1:])
    # the wire's own limit on the same path, for the largest request: a plain TCP stream, prefill side sending
    prefix = ["ip", "netns", "exec", net.ns] if net else []
    stream = stream_gbps(max(sizes_mib) * 2**20, 5, host=decode_host, prefix=prefix)
    for row in results.values():
        row["read_ratio_vs_tcp_stream"] = round(row["read_gbps"] / stream["gbps"], 3) if row["read_gbps"] else None
    return {**results, "tcp_stream": stream}


def run(
    sizes_mib: Sequence[int] = SIZES_MIB,
    rounds: int = 5,
    netns: bool = True,
    wire_gbit: float | None = None,
    *,
    settings: Settings,
) -> dict[str, Any]:
    """The whole benchmark: the veth path where it can be built (else the reason), shaped to ``wire_gbit`` Gbit/s
    if given, and loopback. The stand-ins run over TCP with :data:`~pd_transfer.transfer.tcp.TCP_UCX_ENV` (any of
    those variables ``settings`` holds as they are there)."""
    ucx = tcp_ucx_env(settings)
    result: dict[str, Any] = {"ucx_env": ucx, "model": {"bytes_per_token": bytes_per_token()}}
    result["loopback"] = run_path(sizes_mib, rounds, MODES, None, ucx)
    if not netns:
        result["veth"] = {"skipped": "not asked for (--no-netns)"}
    else:
        with veth_or_reason(wire_gbit) as net:
            if isinstance(net, str):
                result["veth"] = {"skipped": net}
            else:
                before = rx_bytes(net.outer)
                result["veth"] = run_path(sizes_mib, rounds, MODES, net, ucx)
                result["veth"]["decode_rx_bytes"] = rx_bytes(net.outer) - before
                result["veth"]["wire_gbit"] = wire_gbit
    result["load_average"] = list(os.getloadavg())
    return result


def lines(result: dict[str, Any]) -> list[str]:
    out = []
    for path in ("loopback", "veth"):
        section = result[path]
        if "skipped" in section:
            out.append(f"{path}: skipped: {section['skipped']}")
            continue
        for name, row in section.items():
            if isinstance(row, dict) and "ms" in row:
                parts = ", ".join(f"{key[:-3]} {row[key]}" for key in (*PARTS, "other_ms"))
                reads = f"reads {row['read_gbps']} GiB/s ({row['read_ratio_vs_tcp_stream']} of the stream)"
                out.append(f"{path} {name}: {row['ms']} ms ({parts}); {reads}")
        out.append(f"{path} TCP stream: {section['tcp_stream']['gbps']} GiB/s")
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=list(SIZES_MIB), help="request sizes, MiB")
    parser.add_argument("--rounds", type=int, default=5, help="warm requests per size and mode")
    parser.add_argument("--no-netns", dest="netns", action="store_false", help="loopback only")
    add_wire_argument(parser)


def cli_run(args: argparse.Namespace) -> int:
    if args.rounds < 1 or min(args.sizes_mib) < 1:
        raise SystemExit("--rounds and every --sizes-mib must be at least 1")
    if args.wire_gbit is not None and not args.netns:
        raise SystemExit("--wire-gbit shapes the veth: drop --no-netns")
    result = run(
        args.sizes_mib, args.rounds, args.netns, args.wire_gbit, settings=read_settings()
    )  # the command's edge
    print(json.dumps(result, indent=2) if args.json else "\n".join(lines(result)))
    return 0
