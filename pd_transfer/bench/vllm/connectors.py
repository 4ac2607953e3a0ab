"""``pd-transfer bench vllm``: PdTransferConnector against vLLM's own NixlConnector, same engine, same model, one run.

Its command line (this module); the servers (:mod:`.pairs`), the requests and what each moved (:mod:`.requests`),
the robustness row (:mod:`.robustness`), the run (:mod:`.run`) and the result and its table (:mod:`.report`)
live beside it, on the cluster toolkit (``pd_transfer.cluster``: launch, processes, http_client).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from pd_transfer.bench.vllm.model import KV8B_MODEL_DIR
from pd_transfer.bench.vllm.pairs import CONNECTORS
from pd_transfer.bench.vllm.report import render_table
from pd_transfer.bench.vllm.run import DEFAULT_LENGTHS, MAX_TOKENS, BenchSettings, run_bench
from pd_transfer.bench.vllm.scale import SCALE_LENGTHS, run_scale
from pd_transfer.bench.vllm.scale_report import plot_ttft, render_scale_table
from pd_transfer.cluster.launch import TINY_MODEL_DIR

__all__ = ["add_arguments", "run"]

MAX_PROMPT_TOKENS = 2000  # under --max-model-len 2048, with room for the decoded tokens
SCALE_MAX_PROMPT_TOKENS = 4400  # --scale: under --max-model-len 4608
SCALE_REQUESTS = 3  # --scale: measured requests per prompt length


def _lengths(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") from None
    if not values or any(not 1 <= v <= SCALE_MAX_PROMPT_TOKENS for v in values):
        raise argparse.ArgumentTypeError(
            f"lengths must be 1..{SCALE_MAX_PROMPT_TOKENS} tokens (max-model-len 4608 with --scale): {text!r}"
        )
    return values


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``pd-transfer bench vllm`` (for wiring into another parser)."""
    parser.add_argument("--json", action="store_true", help="print one JSON object (progress goes to stderr)")
    parser.add_argument("--output", type=Path, default=None, help="also write the JSON result to this file")
    parser.add_argument(
        "--requests", type=_positive, default=None, help="measured requests per connector (30; --scale: per length, 3)"
    )
    parser.add_argument(
        "--lengths",
        type=_lengths,
        default=None,
        help="prompt lengths, interleaved (50,677,1500; --scale: 256,1024,4096)",
    )
    parser.add_argument("--max-tokens", type=_positive, default=MAX_TOKENS, help="decode tokens per request (16)")
    parser.add_argument("--model", default=None, help=f"model folder ({TINY_MODEL_DIR}; --scale: {KV8B_MODEL_DIR})")
    parser.add_argument("--python", default=sys.executable, help="the interpreter that runs vLLM (this one)")
    parser.add_argument("--log-dir", type=Path, default=None, help="server logs (runs/bench-vllm-TIMESTAMP)")
    parser.add_argument("--startup-timeout", type=float, default=900.0, help="seconds for servers to be healthy")
    parser.add_argument("--no-reference", action="store_true", help="no plain server: compare the connectors only")
    parser.add_argument("--ours-first", action="store_true", help="run PdTransferConnector's pair first")
    parser.add_argument(
        "--scale",
        action="store_true",
        help=f"TTFT at Llama-3-8B's KV geometry: a plain server, then each pair ({KV8B_MODEL_DIR} by default, built"
        " by `make-model --kv-8b`)",
    )
    parser.add_argument("--plot", type=Path, default=None, help="--scale: also draw TTFT by prompt length (PNG)")
    parser.add_argument(
        "--eager", action="store_true", help="--scale: every server with --enforce-eager (no minutes of compiling)"
    )


def _settings(args: argparse.Namespace) -> BenchSettings:
    default_lengths, default_requests = (SCALE_LENGTHS, SCALE_REQUESTS) if args.scale else (DEFAULT_LENGTHS, 30)
    return BenchSettings(
        model=args.model or str(KV8B_MODEL_DIR if args.scale else TINY_MODEL_DIR),
        log_dir=args.log_dir or Path("runs") / time.strftime("bench-vllm-%Y%m%d-%H%M%S"),
        lengths=args.lengths or list(default_lengths),
        requests=args.requests or default_requests,
        max_tokens=args.max_tokens,
        python=args.python,
        startup_timeout_s=args.startup_timeout,
        reference=not args.no_reference,
        order=("ours", "nixl") if args.ours_first else CONNECTORS,
    )


def _write(args: argparse.Namespace, result: dict[str, Any], table: str) -> None:
    text = json.dumps(result, indent=1)
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text + "\n")
    print(text if args.json else table)


def _run_scale(args: argparse.Namespace, settings: BenchSettings) -> int:
    """``--scale``: 0 when every setup ran and every decode's tokens equal the plain server's, else 1."""
    if not Path(settings.model).is_dir():
        print(f"no model at {settings.model}: build it with `pd-transfer make-model --kv-8b`", file=sys.stderr)
        return 2
    result = run_scale(settings, extra_args=["--enforce-eager"] if args.eager else [])
    _write(args, result, render_scale_table(result))
    if args.plot is not None:
        print(plot_ttft(result, args.plot), file=sys.stderr)
    ok = not any(entry.get("error") for entry in result["setups"].values())
    return 0 if ok and result["tokens_equal"] else 1


def run(args: argparse.Namespace) -> int:
    """``pd-transfer bench vllm``: 0 when both pairs ran and every answer matched; 1 otherwise; 2 on a bad argument;
    130 on Ctrl-C."""
    settings = _settings(args)
    if not args.scale and max(settings.lengths) > MAX_PROMPT_TOKENS:
        print(f"lengths above {MAX_PROMPT_TOKENS} tokens need --scale (max-model-len 2048)", file=sys.stderr)
        return 2
    try:
        if args.scale:
            return _run_scale(args, settings)
        result = run_bench(settings)
    except KeyboardInterrupt:
        print("interrupted; every server stopped", file=sys.stderr)
        return 130
    _write(args, result, render_table(result))
    ok = all(not c.get("error") and c.get("summary") for c in result["connectors"].values())
    equal = result["greedy_tokens_equal"]
    return 0 if ok and equal and all(v.split("/")[0] == v.split("/")[1] for v in equal.values()) else 1
