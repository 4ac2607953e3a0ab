"""``pd-transfer bench vllm-stream``: time to first token through our proxy, streamed P/D against sequential P/D,
alternated request by request in one sitting, with real vLLM servers.

A prefill (core 0) and a decode (core 1) with PdTransferConnector over the ``tcp`` transport, the prefill inside a
network namespace behind a veth (two hosts on one wire; shaped to ``--wire-gbit`` if given) where one can be made,
else both on this host. One proxy in this process (:class:`~pd_transfer.proxy.server.Proxy`) carries every request;
``stream_kv`` is switched between requests: off, the prefill hop then the decode hop (sequential); on, both legs at
once, the decode streaming each layer as the prefill writes it. The first request (a warm-up) goes sequentially and
teaches the proxy the prefill's engine. Each measured prompt is sent in both modes, the order alternating (prefix
caching off on both servers: the second send finds nothing cached), and each answer is a greedy streamed completion
timed at the client (request sent to first token). Reported per prompt length:
TTFT p50 of both modes and their ratio, whether both modes' tokens were equal for every prompt, and the KV bytes of
one prompt. ``--nixl`` then runs a NixlConnector pair on the same wire (UCX on TCP, as between hosts), sequential,
the same prompts: its TTFT p50 beside ours. The plain server's TTFT (no P/D) is ``bench vllm --scale``'s.
``--verify-cost`` (issue 42) runs a decode of each ``verify`` mode (``off``, ``sample``, ``all``: what the decode
checks of the KV it moved) beside the one prefill, each behind a proxy of its own, every prompt sent through each
(both ways, the decodes' order turning): each mode's TTFT p50 against ``off``'s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from pd_transfer.affinity import allowed_cpu
from pd_transfer.bench.transfer.netns import Veth, add_wire_argument, veth_or_reason
from pd_transfer.bench.vllm.pairs import nixl_server
from pd_transfer.bench.vllm.requests import make_prompt, vocab_size
from pd_transfer.bench.vllm.scale import stream_completion
from pd_transfer.cluster.http_client import answer_tokens, free_port, metric_value
from pd_transfer.cluster.launch import TINY_MODEL_DIR, ServerSpec, server_process
from pd_transfer.cluster.processes import ManagedProcess, stop_all, wait_ready
from pd_transfer.connector.config import ConnectorConfig
from pd_transfer.proxy.server import Proxy, ProxyConfig
from pd_transfer.transfer.digests import VERIFY_MODES

LENGTHS = (512, 1024, 1792)
MAX_TOKENS = 4
TAIL = "vllm:pd_transfer_stream_tail_seconds"  # the decode's histogram: last layer to usable KV, per streamed request
STARTUP_TIMEOUT_S = 900.0
DEFAULT_VERIFY = ConnectorConfig().verify  # the rows of --verify-cost that make the summary: the default decode's


def _servers(
    model: str,
    logs: Path,
    net: Veth | None,
    python: str,
    kvcache_gib: float,
    nixl: bool = False,
    batched_tokens: int | None = None,
    verify_modes: tuple[str | None, ...] = (None,),
) -> list[ManagedProcess]:
    """The prefill (in ``net``'s namespace when given) and a decode of each of ``verify_modes`` (None: the connector's
    default), not started: with PdTransferConnector over the tcp transport, or (``nixl``) with vLLM's NixlConnector,
    UCX on TCP between them as between hosts; ``batched_tokens``: vLLM's ``--max-num-batched-tokens`` (a prompt
    longer than it is computed in several steps, and streams only at its hold)."""
    batching = ("--max-num-batched-tokens", str(batched_tokens)) if batched_tokens else ()
    servers = []
    roles = [("prefill", None), *(("decode", verify) for verify in verify_modes)]
    for index, (role, verify) in enumerate(roles):
        host = net.inner_address if net is not None and role == "prefill" else "127.0.0.1"
        spec = ServerSpec(
            role=role,  # type: ignore[arg-type]
            model=model,
            port=free_port(),
            side_channel_port=free_port(),
            host=host,
            side_channel_host=host,
            transport="tcp",
            verify=verify,
            cpu_bind=allowed_cpu(min(index, 1)),  # the prefill on the first core, the decodes on the second
            kvcache_gib=kvcache_gib,
            dtype="float32",
            max_model_len=2048 if Path(model).name == Path(TINY_MODEL_DIR).name else 4608,
            seed=0,
            eager=True,
            extra_args=("--no-enable-prefix-caching", *batching),  # no prefix caching: each prompt goes both ways
        )
        name = f"nixl-{role}" if nixl else role if verify is None else f"{role}-{verify}"
        server = (nixl_server if nixl else server_process)(name, spec, logs / f"{name}.log", python=python)
        device = (net.inner if role == "prefill" else net.outer) if net is not None else "lo"
        env = {**server.env, "UCX_NET_DEVICES": device, **({"UCX_TLS": "tcp,self"} if nixl else {})}
        command = ["ip", "netns", "exec", net.ns, *server.command] if net is not None and role == "prefill" else None
        servers.append(dataclasses.replace(server, env=env, command=command or server.command))
    return servers


async def _sitting(
    prefill: str,
    decodes: dict[str | None, str],
    model: str,
    lengths: tuple[int, ...],
    requests: int,
    modes: tuple[bool, ...] = (False, True),
) -> list[dict[str, Any]]:
    """Each prompt through a proxy of each of ``decodes`` (its verify mode, None for the default -> its URL), in each
    of ``modes`` (``stream_kv`` off, on), the orders alternating (the decodes' turning by one each prompt)."""
    vocab = vocab_size(model)
    rows: list[dict[str, Any]] = []
    async with contextlib.AsyncExitStack() as stack:
        proxies: dict[str | None, tuple[Proxy, str, str]] = {}
        for verify, decode in decodes.items():
            config = ProxyConfig(prefill=[prefill], decode=[decode], tokenize=False, health_interval_s=600.0)
            proxy = await stack.enter_async_context(Proxy(config))
            proxies[verify] = (proxy, await proxy.start(), decode)

        def ask(verify: str | None, prompt: list[int], stream_kv: bool, tag: str) -> dict[str, Any]:
            proxy, url, decode = proxies[verify]
            proxy.config.stream_kv = stream_kv  # read by the proxy per request
            tails = _tails(decode) if stream_kv else None
            answer = stream_completion(url, model, prompt, MAX_TOKENS, None, tag)
            out = {"ttft_s": answer["ttft_s"], "tokens": answer_tokens(answer["events"])}
            if tails is not None:  # reported with the decode's steps that generated the answer
                total, count = (after - before for after, before in zip(_tails(decode), tails, strict=True))
                out["tail_s"] = round(total / count, 4) if count > 0 else None
            return out

        for verify in proxies:  # each proxy learns the prefill's engine from its first answer
            await asyncio.to_thread(ask, verify, make_prompt(min(lengths), 1, vocab), False, f"warm-up-{verify}")
        turn = 0
        for index in range(requests):
            for length in lengths:
                prompt = make_prompt(length, 1000 + 10 * index + length, vocab)
                order = modes if (index + length) % 2 == 0 else modes[::-1]
                verifies = list(proxies)[turn % len(proxies) :] + list(proxies)[: turn % len(proxies)]
                turn += 1
                for verify in verifies:
                    answers = {}
                    for stream_kv in order:
                        tag = f"{'stream' if stream_kv else 'seq'}-{length}-{index}-{verify}-{time.time_ns()}"
                        answers[stream_kv] = await asyncio.to_thread(ask, verify, prompt, stream_kv, tag)
                    row: dict[str, Any] = {"length": length, "prompt": index, "tokens": answers[modes[0]]["tokens"]}
                    if verify is not None:
                        row["verify"] = verify
                    for stream_kv, answer in answers.items():
                        row["streamed_ttft_s" if stream_kv else "sequential_ttft_s"] = answer["ttft_s"]
                        if "tail_s" in answer:
                            row["stream_tail_s"] = answer["tail_s"]
                    row["tokens_equal"] = all(answer["tokens"] == row["tokens"] for answer in answers.values())
                    rows.append(row)
                    print(json.dumps({k: v for k, v in row.items() if k != "tokens"}), file=sys.stderr, flush=True)
    return rows


def _tails(decode: str) -> tuple[float, float]:
    """The decode's ``vllm:pd_transfer_stream_tail_seconds`` (the last layer's arrival to usable KV, per streamed
    request): its sum (s) and count."""
    return metric_value(decode, TAIL + "_sum"), metric_value(decode, TAIL + "_count")


def _summary(
    rows: list[dict[str, Any]], nixl: list[dict[str, Any]], lengths: tuple[int, ...], kv_bytes_per_token: int | None
) -> list[dict]:
    out = []
    for length in lengths:
        mine = [row for row in rows if row["length"] == length]
        sequential = statistics.median(row["sequential_ttft_s"] for row in mine)
        streamed = statistics.median(row["streamed_ttft_s"] for row in mine)
        summary = {
            "length": length,
            "kv_mib": None if kv_bytes_per_token is None else round(length * kv_bytes_per_token / 2**20, 1),
            "sequential_ttft_p50_s": round(sequential, 4),
            "streamed_ttft_p50_s": round(streamed, 4),
            "streamed_vs_sequential": round(streamed / sequential, 3),
            "stream_tail_p50_s": _median(row.get("stream_tail_s") for row in mine),
            "tokens_equal": all(row["tokens_equal"] for row in mine),
            "requests": len(mine),
        }
        theirs = [row for row in nixl if row["length"] == length]
        if theirs:
            nixl_ttft = statistics.median(row["sequential_ttft_s"] for row in theirs)
            summary["nixl_ttft_p50_s"] = round(nixl_ttft, 4)
            summary["streamed_vs_nixl"] = round(streamed / nixl_ttft, 3)
            summary["sequential_vs_nixl"] = round(sequential / nixl_ttft, 3)
            summary["nixl_tokens_equal_ours"] = [row["tokens"] for row in theirs] == [row["tokens"] for row in mine]
        out.append(summary)
    return out


def _median(values: Any) -> float | None:
    """The median of the values that are not None, or None when there are none."""
    known = [value for value in values if value is not None]
    return round(statistics.median(known), 4) if known else None


def _kv_bytes_per_token(model: str) -> int | None:
    """K and V of every layer for one float32 token, from the model's config (None where it cannot be read)."""
    try:
        config = json.loads((Path(model) / "config.json").read_text())
        heads = config.get("num_key_value_heads") or config["num_attention_heads"]
        head = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        return int(2 * config["num_hidden_layers"] * heads * head * 4)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = str(Path(args.model or TINY_MODEL_DIR).resolve())
    lengths = tuple(args.lengths)
    logs = Path(args.log_dir or f"runs/bench-vllm-stream-{time.strftime('%Y%m%d-%H%M%S')}")
    result: dict[str, Any] = {"model": Path(model).name, "lengths": list(lengths), "requests": args.requests}
    with veth_or_reason(args.wire_gbit) if args.netns else contextlib.nullcontext() as net:
        if isinstance(net, str):
            result["veth_skipped"] = net
            net = None
        result["path"] = "loopback" if net is None else "veth"
        result["wire_gbit"] = args.wire_gbit
        result["max_num_batched_tokens"] = args.max_num_batched_tokens
        verify_modes: tuple[str | None, ...] = VERIFY_MODES if args.verify_cost else (None,)
        ours = _servers(
            model, logs, net, args.python, args.kvcache_gib, False, args.max_num_batched_tokens, verify_modes
        )
        rows = _phase(ours, model, lengths, args.requests, verify_modes=verify_modes)
        nixl: list[dict[str, Any]] = []
        if args.nixl:  # after ours, never beside it: four servers on two cores would measure their contention
            servers = _servers(model, logs, net, args.python, args.kvcache_gib, True, args.max_num_batched_tokens)
            nixl = _phase(servers, model, lengths, args.requests, modes=(False,))
    result["rows"], result["nixl_rows"] = rows, nixl
    default = [row for row in rows if row.get("verify", DEFAULT_VERIFY) == DEFAULT_VERIFY]
    result["summary"] = _summary(default, nixl, lengths, _kv_bytes_per_token(model))
    if args.verify_cost:
        result["verify_cost"] = _verify_summary(rows, lengths)
    for each in (*rows, *nixl):
        each.pop("tokens", None)
    return result


def _phase(
    servers: list[ManagedProcess],
    model: str,
    lengths: tuple[int, ...],
    requests: int,
    modes: tuple[bool, ...] = (False, True),
    verify_modes: tuple[str | None, ...] = (None,),
) -> list[dict[str, Any]]:
    """``servers`` (the prefill, then a decode of each of ``verify_modes``) started, the sitting run through them,
    stopped."""
    try:
        for server in servers:
            server.start()
        wait_ready(servers, STARTUP_TIMEOUT_S)
        decodes = dict(zip(verify_modes, (server.url for server in servers[1:]), strict=True))
        return asyncio.run(_sitting(servers[0].url, decodes, model, lengths, requests, modes))
    finally:
        stop_all(servers)


def _verify_summary(rows: list[dict[str, Any]], lengths: tuple[int, ...]) -> list[dict[str, Any]]:
    """Per prompt length and verify mode: TTFT p50 both ways, and each against ``off``'s (1.05: 5 % slower)."""
    out = []
    for length in lengths:
        mine = [row for row in rows if row["length"] == length]
        p50 = {
            (verify, way): statistics.median(row[f"{way}_ttft_s"] for row in mine if row["verify"] == verify)
            for verify in VERIFY_MODES
            for way in ("sequential", "streamed")
        }
        for verify in VERIFY_MODES:
            summary: dict[str, Any] = {"length": length, "verify": verify}
            for way in ("sequential", "streamed"):
                summary[f"{way}_ttft_p50_s"] = round(p50[(verify, way)], 4)
                summary[f"{way}_vs_off"] = round(p50[(verify, way)] / p50[("off", way)], 3)
            out.append(summary)
        answers: dict[int, set[tuple[str, ...]]] = {}
        for row in mine:
            answers.setdefault(row["prompt"], set()).add(tuple(row["tokens"]))
        for summary in out[-len(VERIFY_MODES) :]:  # every mode answered each prompt alike, both ways
            summary["tokens_equal"] = all(len(seen) == 1 for seen in answers.values()) and all(
                row["tokens_equal"] for row in mine
            )
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--model", default=None, help=f"model folder ({TINY_MODEL_DIR})")
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS), help="prompt lengths, tokens")
    parser.add_argument("--requests", type=int, default=3, help="prompts per length (each sent in both modes)")
    parser.add_argument("--kvcache-gib", type=float, default=1.0, help="each server's KV cache, GiB")
    parser.add_argument("--python", default=sys.executable, help="the interpreter that runs vLLM (this one)")
    parser.add_argument("--log-dir", default=None, help="server logs (runs/bench-vllm-stream-TIMESTAMP)")
    parser.add_argument("--no-netns", dest="netns", action="store_false", help="both servers on this host")
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        metavar="N",
        help="vLLM's, on every server (default: vLLM's, 2048 on CPU): a longer prompt is computed in several steps"
        " and streams only at its hold",
    )
    parser.add_argument(
        "--nixl", action="store_true", help="then a NixlConnector pair on the same wire, sequential (UCX on TCP)"
    )
    parser.add_argument(
        "--verify-cost",
        action="store_true",
        help="a decode of each verify mode (off, sample, all) beside the prefill: each one's TTFT against off's",
    )
    add_wire_argument(parser)


def cli_run(args: argparse.Namespace) -> int:
    if args.requests < 1 or min(args.lengths) < 1:
        raise SystemExit("--requests and every --lengths must be at least 1")
    if args.wire_gbit is not None and not args.netns:
        raise SystemExit("--wire-gbit shapes the veth: drop --no-netns")
    result = run(args)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for row in result["summary"]:
            print(
                f"{row['length']:5d} tokens ({row['kv_mib']} MiB): sequential {row['sequential_ttft_p50_s']:.3f} s,"
                f" streamed {row['streamed_ttft_p50_s']:.3f} s = {row['streamed_vs_sequential']} x;"
                f" tokens equal {row['tokens_equal']}"
                + (
                    f"; NixlConnector {row['nixl_ttft_p50_s']:.3f} s (streamed / it {row['streamed_vs_nixl']})"
                    if "nixl_ttft_p50_s" in row
                    else ""
                )
            )
        for row in result.get("verify_cost", []):
            print(
                f"{row['length']:5d} tokens, verify {row['verify']:6s}: sequential {row['sequential_ttft_p50_s']:.3f} s"
                f" ({row['sequential_vs_off']} x off's), streamed {row['streamed_ttft_p50_s']:.3f} s"
                f" ({row['streamed_vs_off']} x off's); tokens equal {row['tokens_equal']}"
            )
    return 0
