"""``pd-transfer serve``: run one vLLM OpenAI server with PdTransferConnector (the process becomes vLLM)."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Mapping, Sequence

from pd_transfer.cluster.launch import (
    ROLES,
    ServerSpec,
    add_verify_argument,
    transport_setting,
    vllm_command,
    vllm_env,
)
from pd_transfer.settings import child_environment

__all__ = ["add_arguments", "main", "run", "shell_line", "spec_from_args"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``pd-transfer serve`` (for wiring into another parser)."""
    parser.add_argument("--role", choices=ROLES, required=True, help="what this server is for (names it only)")
    parser.add_argument("--model", required=True, metavar="DIR", help="model folder (or hub id) for vLLM")
    parser.add_argument("--port", type=int, required=True, metavar="N", help="HTTP port of the OpenAI server")
    parser.add_argument("--side-channel-port", type=int, required=True, metavar="N", help="KV side-channel port")
    parser.add_argument("--host", default="127.0.0.1", help="HTTP address (default 127.0.0.1)")
    parser.add_argument(
        "--side-channel-host",
        default="127.0.0.1",
        help="side-channel address decode servers connect to (default 127.0.0.1)",
    )
    parser.add_argument("--block-size", type=int, default=None, metavar="N", help="KV block size (default: vLLM's)")
    parser.add_argument("--tp", type=int, default=1, metavar="N", help="tensor-parallel size (default 1)")
    parser.add_argument("--lease-seconds", type=float, default=None, metavar="S", help="prefill lease (default 30)")
    parser.add_argument(
        "--failure-policy", choices=("recompute", "fail"), default=None, help="when KV cannot be loaded"
    )
    parser.add_argument(
        "--transport",
        type=transport_setting,
        default=None,
        help="the transports a decode opens prefills with, in order, and a prefill offers: auto (default: same-host"
        " IPC where it can, else NIXL), nixl, ipc, or names (module:attribute for a transport of your own)",
    )
    add_verify_argument(parser)
    parser.add_argument(
        "--secret-env",
        default=None,
        metavar="NAME",
        help="environment variable holding the shared side-channel secret (the value stays off the command line)",
    )
    parser.add_argument(
        "--cpu-bind", default=None, metavar="CPUS", help='VLLM_CPU_OMP_THREADS_BIND, e.g. "0", "0-3", "0|1"'
    )
    parser.add_argument("--kvcache-gib", type=float, default=1.0, metavar="GIB", help="KV cache size (default 1)")
    parser.add_argument("--dtype", default=None, help="vLLM --dtype (default: vLLM's)")
    parser.add_argument("--max-model-len", type=int, default=None, metavar="N", help="vLLM --max-model-len")
    parser.add_argument("--seed", type=int, default=None, metavar="N", help="vLLM --seed")
    parser.add_argument("--print", action="store_true", help="print the command (shell-quoted) instead of running it")
    parser.add_argument("vllm_args", nargs="*", metavar="-- VLLM_ARGS", help="more vLLM arguments, after --")


def spec_from_args(args: argparse.Namespace) -> ServerSpec:
    """The server described by parsed ``serve`` arguments; raises ``ValueError``."""
    return ServerSpec(
        role=args.role,
        model=args.model,
        port=args.port,
        side_channel_port=args.side_channel_port,
        host=args.host,
        side_channel_host=args.side_channel_host,
        block_size=args.block_size,
        tp_size=args.tp,
        lease_seconds=args.lease_seconds,
        failure_policy=args.failure_policy,
        transport=args.transport,
        verify=args.verify,
        secret_env=args.secret_env,
        cpu_bind=args.cpu_bind,
        kvcache_gib=args.kvcache_gib,
        extra_args=tuple(args.vllm_args),
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        seed=args.seed,
    )


def shell_line(command: Sequence[str], env: Mapping[str, str], base_env: Mapping[str, str]) -> str:
    """``command`` as one shell line, prefixed by the variables ``env`` sets or changes relative to ``base_env``."""
    changed = [f"{key}={shlex.quote(value)}" for key, value in sorted(env.items()) if base_env.get(key) != value]
    removed = sorted(key for key in base_env if key not in env)
    prefix = [f"-u {key}" for key in removed]
    words = [*changed, shlex.join(command)]
    return " ".join(["env", *prefix, *words] if removed else words)


def run(args: argparse.Namespace) -> int:
    """Build the server's command and exec it (or print it with ``--print``). Returns an exit code on error."""
    base = child_environment()
    try:
        spec = spec_from_args(args)
        command = vllm_command(spec)
        env = vllm_env(spec, base, require_secret=not args.print)  # printing needs no secret yet
    except ValueError as error:
        print(f"pd-transfer serve: {error}", file=sys.stderr)
        return 2
    if args.print:
        print(shell_line(command, env, base))
        return 0
    print(
        f"pd-transfer serve: {spec.role} server on {spec.url}, side channel {spec.side_channel_host}:"
        f"{spec.side_channel_port}, TP {spec.tp_size}: exec {shlex.join(command[:3])}",
        file=sys.stderr,
        flush=True,
    )
    os.execvpe(command[0], command, env)
    return 1  # not reached


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pd-transfer serve", description="One vLLM server with PdTransferConnector.")
    add_arguments(parser)
    return run(parser.parse_args(argv))
