"""The command line of ``pd-transfer up``: its arguments and what is wrong with a given set of them."""

from __future__ import annotations

import argparse
from pathlib import Path

from pd_transfer.cluster.launch import TINY_MODEL_DIR, add_verify_argument, transport_setting
from pd_transfer.connector.config import transport_names
from pd_transfer.proxy.routing import registry

MODEL_ENV = "PD_TRANSFER_MODEL"
MODELS_DIR_ENV = "PD_TRANSFER_MODELS_DIR"  # where the default models are built (default: .models)
DEFAULT_MODEL_DIR = TINY_MODEL_DIR
SIDE_CHANNEL_OFFSET = 100  # server k: HTTP on base_port + k, side channel on base_port + 100 + k
#: kv_aware: server k's KV event replay endpoint is on base_port + 300 + k (its stream: an ipc socket in the log dir)
KV_REPLAY_OFFSET = 300
#: vLLM-CPU's block size when none is given (its CPU attention's default); kv_aware hashes blocks of this size then
VLLM_CPU_BLOCK_SIZE = 128
MAX_SERVERS = 64


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``pd-transfer up`` (for wiring into another parser)."""
    parser.add_argument(
        "--demo",
        action="store_true",
        help="once up, send a few greedy requests through the proxy, compare every answer with a plain vLLM server"
        " (no connector, started alongside), print them with what moved, then stop everything (exit 1 on a failure)",
    )
    parser.add_argument(
        "--no-check", action="store_true", help="with --demo: no plain server, no comparison (one server fewer)"
    )
    parser.add_argument("--keep", action="store_true", help="with --demo: keep the cluster running after the demo")
    parser.add_argument(
        "--model",
        type=Path,
        default=None,
        metavar="DIR",
        help=f"model folder (default: ${MODEL_ENV}, else SmolLM2-135M-Instruct built once into ${MODELS_DIR_ENV}"
        f" ({DEFAULT_MODEL_DIR.parent}); the tiny model when that cannot be built or a TP size cannot split its 3 KV"
        " heads)",
    )
    parser.add_argument("--prefill", type=int, default=1, metavar="N", help="prefill servers (default 1)")
    parser.add_argument("--decode", type=int, default=1, metavar="N", help="decode servers (default 1)")
    parser.add_argument("--prefill-tp", type=int, default=1, metavar="N", help="TP size of each prefill (default 1)")
    parser.add_argument("--decode-tp", type=int, default=1, metavar="N", help="TP size of each decode (default 1)")
    parser.add_argument("--prefill-block-size", type=int, default=None, metavar="N", help="default: vLLM's")
    parser.add_argument("--decode-block-size", type=int, default=None, metavar="N", help="default: vLLM's")
    parser.add_argument("--proxy-port", type=int, default=8000, metavar="N", help="proxy port (default 8000)")
    parser.add_argument(
        "--base-port",
        type=int,
        default=8100,
        metavar="N",
        help=f"server k listens on N+k, its side channel on N+{SIDE_CHANNEL_OFFSET}+k (default 8100)",
    )
    parser.add_argument(
        "--routing",
        choices=registry.names(),
        default="round_robin",
        help="the proxy's policy for both roles (default round_robin); a policy reading the engines' KV events"
        " (kv_aware) turns them on (vLLM's --kv-events-config: an ipc socket in the log dir, replay on base port + 300"
        " + k) and wires them to the proxy",
    )
    for role in ("prefill", "decode"):
        parser.add_argument(
            f"--{role}-policy",
            choices=registry.names(),
            default=None,
            help=f"the proxy's {role} policy (default: --routing)",
        )
    parser.add_argument(
        "--max-local-prefill",
        type=int,
        default=0,
        metavar="N",
        help="the proxy's conditional disaggregation: a prompt a decode holds all but at most N tokens of is"
        " prefilled by that decode, no prefill hop (needs a decode policy reading KV events, kv_aware; default 0: off)",
    )
    parser.add_argument(
        "--local-prefill-max-busy",
        type=int,
        default=0,
        metavar="N",
        help="with --max-local-prefill: a decode with N or more requests in flight leaves the prompt to a prefill with"
        " fewer (default 0: load not weighed)",
    )
    parser.add_argument(
        "--stream-kv",
        action="store_true",
        help="streamed P/D: the proxy sends both legs at once and the decode streams each layer as the prefill writes"
        " it (needs --transport tcp, or names with tcp in them)",
    )
    parser.add_argument("--log-dir", type=Path, default=None, metavar="DIR", help="default: runs/up-TIMESTAMP")
    parser.add_argument(
        "--startup-timeout", type=float, default=900.0, metavar="S", help="bound on the servers' startup (900)"
    )
    parser.add_argument("--dtype", default="float32", help="vLLM --dtype of every server (default float32)")
    parser.add_argument(
        "--eager",
        action="store_true",
        help="vLLM --enforce-eager on every server: no torch.compile at startup, which on CPU is most of a small"
        " model's start",
    )
    parser.add_argument("--max-model-len", type=int, default=2048, metavar="N", help="vLLM --max-model-len (2048)")
    parser.add_argument("--kvcache-gib", type=float, default=1.0, metavar="GIB", help="KV cache per server (1)")
    parser.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more argument of every vLLM server's command line (repeatable; a flag that starts with a dash is"
        " given as --vllm-arg=--flag), e.g. --vllm-arg=--enable-scale-out, the render endpoints vLLM's router"
        " tokenizes with",
    )
    parser.add_argument(
        "--offload-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="a directory shared by every prefill and decode as an offload tier (PdOffloadConnector next to"
        " PdTransferConnector in vLLM's MultiConnector): prefills load the prefixes it holds, decodes load them when"
        " their pull fails or their prefill is gone; TP 1 only",
    )
    parser.add_argument(
        "--offload-dir-bytes", type=int, default=None, metavar="N", help="with --offload-dir: its size (10 GiB)"
    )
    parser.add_argument(
        "--offload-prefills",
        type=int,
        default=None,
        metavar="N",
        help="with --offload-dir: only the first N prefills mount it (default: all), as in a pool where some nodes"
        " reach the shared store and others do not",
    )
    parser.add_argument(
        "--transport",
        type=transport_setting,
        default="auto",
        help="the transports a decode opens prefills with, in order, and a prefill offers: auto (default: same-host"
        " IPC where it can, else NIXL), nixl, ipc, or names (module:attribute for a transport of your own)",
    )
    add_verify_argument(parser)
    parser.add_argument(
        "--offload-host-bytes",
        type=int,
        default=None,
        metavar="N",
        help="with --offload-dir: a host-memory tier of N bytes per server too (default none)",
    )


def validate(args: argparse.Namespace) -> list[str]:
    """What is wrong with the arguments, one message each (empty: fine). Sets ``args.check`` and
    ``args.exit_after_demo`` from ``--demo``, ``--no-check`` and ``--keep``."""
    problems = []
    args.check = bool(args.demo and not args.no_check)
    args.exit_after_demo = bool(args.demo and not args.keep)
    for name in ("prefill", "decode"):
        value = getattr(args, name)
        if not 1 <= value <= MAX_SERVERS:
            problems.append(f"--{name} must be between 1 and {MAX_SERVERS}, not {value}")
    for name in ("prefill_tp", "decode_tp"):
        if getattr(args, name) < 1:
            problems.append(f"--{name.replace('_', '-')} must be at least 1, not {getattr(args, name)}")
    for name in ("prefill_block_size", "decode_block_size"):
        value = getattr(args, name)
        if value is not None and value < 1:
            problems.append(f"--{name.replace('_', '-')} must be positive, not {value}")
    if not args.startup_timeout > 0:
        problems.append(f"--startup-timeout must be positive, not {args.startup_timeout}")
    if args.max_model_len < 1:
        problems.append(f"--max-model-len must be positive, not {args.max_model_len}")
    if not args.kvcache_gib > 0:
        problems.append(f"--kvcache-gib must be positive, not {args.kvcache_gib}")
    for flag in ("no_check", "keep"):
        if getattr(args, flag) and not args.demo:
            problems.append(f"--{flag.replace('_', '-')} goes with --demo")
    servers = max(0, args.prefill) + max(0, args.decode) + (1 if args.check else 0)
    if not 1 <= args.proxy_port <= 65535:
        problems.append(f"--proxy-port {args.proxy_port} is outside 1..65535")
    if not 1 <= args.base_port <= 65535 - SIDE_CHANNEL_OFFSET - servers:
        problems.append(
            f"--base-port {args.base_port}: the servers need ports {args.base_port}..{args.base_port + servers - 1}"
            f" and {args.base_port + SIDE_CHANNEL_OFFSET}..{args.base_port + SIDE_CHANNEL_OFFSET + servers - 1}"
        )
    elif args.proxy_port in server_ports(args.base_port, servers):
        problems.append(f"--proxy-port {args.proxy_port} is one of the servers' ports (--base-port {args.base_port})")
    if args.offload_prefills is not None and args.offload_dir is None:
        problems.append("--offload-prefills goes with --offload-dir")
    elif args.offload_prefills is not None and not 0 <= args.offload_prefills <= args.prefill:
        problems.append(
            f"--offload-prefills must be between 0 and --prefill ({args.prefill}), not {args.offload_prefills}"
        )
    for name in ("offload_dir_bytes", "offload_host_bytes"):
        value = getattr(args, name)
        if value is not None and args.offload_dir is None:
            problems.append(f"--{name.replace('_', '-')} goes with --offload-dir")
        elif value is not None and value < (1 if name == "offload_dir_bytes" else 0):
            problems.append(f"--{name.replace('_', '-')} must be positive, not {value}")
    if args.offload_dir is not None and max(args.prefill_tp, args.decode_tp) > 1:
        problems.append("--offload-dir supports TP 1 only (PdOffloadConnector)")
    if args.stream_kv and "tcp" not in transport_names(args.transport):
        problems.append(f"--stream-kv streams over the tcp transport: --transport {args.transport} names none")
    if args.max_local_prefill < 0:
        problems.append(f"--max-local-prefill must be >= 0 tokens, not {args.max_local_prefill}")
    if args.local_prefill_max_busy < 0:
        problems.append(f"--local-prefill-max-busy must be >= 0 requests, not {args.local_prefill_max_busy}")
    policies = {role: policy_of(args, role) for role in registry.ROLES}
    routing_problems = registry.problems(policies, local_prefill=args.max_local_prefill > 0)
    problems += routing_problems  # the proxy's own check of its policies and what they need
    kv_roles = [] if routing_problems else kv_event_roles(args)
    if len(kv_roles) == 2 and args.prefill_block_size != args.decode_block_size:
        problems.append(
            "KV events on both roles need one block size (the proxy hashes blocks of one size): give"
            " --prefill-block-size and --decode-block-size the same value"
        )
    if kv_roles and args.base_port + KV_REPLAY_OFFSET + servers - 1 > 65535:
        problems.append(f"--base-port {args.base_port}: KV events need ports up to base port + {KV_REPLAY_OFFSET}")
    if args.model is not None and not (args.model / "config.json").is_file():
        problems.append(f"--model {args.model}: no model folder there (no config.json)")
    return problems


def policy_of(args: argparse.Namespace, role: str) -> str:
    """The proxy's policy for ``role`` (``prefill`` or ``decode``)."""
    chosen: str | None = getattr(args, f"{role}_policy", None)
    return chosen or str(args.routing)


def kv_event_roles(args: argparse.Namespace) -> list[str]:
    """The roles whose engines publish KV events: those whose proxy policy reads them (the proxy's registry says)."""
    return [role for role in registry.ROLES if registry.needs_of(policy_of(args, role)).events]


def kv_block_size(args: argparse.Namespace) -> int:
    """The block size of the engines that publish KV events (given, else vLLM-CPU's default)."""
    roles = kv_event_roles(args)
    given = getattr(args, f"{roles[0]}_block_size", None) if roles else None
    return given or VLLM_CPU_BLOCK_SIZE


def server_ports(base_port: int, servers: int, kv_events: bool = False) -> list[int]:
    """The HTTP ports then the side-channel ports of ``servers`` servers from ``base_port`` (then, with
    ``kv_events``, their KV event replay ports)."""
    offsets = [0, SIDE_CHANNEL_OFFSET] + ([KV_REPLAY_OFFSET] if kv_events else [])
    return [base_port + offset + k for offset in offsets for k in range(servers)]
