"""``pd-transfer proxy``: the command line of the P/D proxy (also ``python -m pd_transfer.proxy``)."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import signal
from collections.abc import Callable, Mapping

from pd_transfer.proxy.config import ProxyConfig
from pd_transfer.proxy.routing.registry import names as policy_names
from pd_transfer.settings import environment


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--prefill",
        nargs="+",
        action="extend",
        required=True,
        metavar="URL",
        help="prefill server base URL(s), e.g. http://127.0.0.1:8100 (repeatable)",
    )
    parser.add_argument(
        "--decode",
        nargs="+",
        action="extend",
        required=True,
        metavar="URL",
        help="decode server base URL(s), e.g. http://127.0.0.1:8200 (repeatable)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000; 0: a free port)")
    parser.add_argument(
        "--policy",
        choices=policy_names(),
        default="round_robin",
        help="how to pick a backend of each role (default round_robin); --prefill-policy and --decode-policy set one"
        " role's apart",
    )
    for role in ("prefill", "decode"):
        parser.add_argument(
            f"--{role}-policy",
            choices=policy_names(),
            default=None,
            help=f"the {role} pool's policy (default: --policy)",
        )
    parser.add_argument(
        "--kv-event-source",
        action="append",
        default=[],
        metavar="URL=ENDPOINT[,REPLAY]",
        help="kv_aware: where the backend at URL publishes its KV events (its vLLM --kv-events-config endpoint and"
        " replay_endpoint), e.g. http://10.0.0.5:8100=tcp://10.0.0.5:5557,tcp://10.0.0.5:5558 (repeatable)",
    )
    parser.add_argument(
        "--kv-hash-seed-env",
        default=None,
        metavar="NAME",
        help="kv_aware: the environment variable holding the engines' PYTHONHASHSEED (their block hashes' seed;"
        " unset: vLLM's default)",
    )
    parser.add_argument(
        "--kv-local-disk",
        action="store_true",
        help="kv_aware: the engines' DISK medium is a disk only its engine reads (default: a directory all mount)",
    )
    parser.add_argument(
        "--no-tokenize",
        action="store_true",
        help="kv_aware: do not ask a backend's POST /tokenize for the token ids of text and chat prompts (they then"
        " go to the least busy backend)",
    )
    for flag, field, kind, metavar, text in _ROUTING_FLAGS:
        default = ProxyConfig.__dataclass_fields__[field].default
        parser.add_argument(
            flag,
            *_ALIASES.get(flag, ()),
            dest=field,
            type=kind,
            default=default,
            metavar=metavar,
            help=f"{text} (default {default})",
        )
    parser.add_argument(
        "--short-prompt-tokens",
        type=int,
        default=0,
        metavar="N",
        help="prompts of fewer tokens skip the prefill hop and go to a decode server directly "
        "(default 0: every prompt is disaggregated). Token-id prompts count exactly; text is "
        "estimated without a tokenizer as max(1.3 x words, characters / 4), chat messages add 4 "
        "tokens each",
    )
    parser.add_argument(
        "--stream-kv",
        action="store_true",
        help="send both legs of a disaggregated request at once: the decode streams the KV layer by layer from the "
        "prefill while it computes it (engines with transport tcp); a prefill's first request goes sequentially",
    )
    parser.add_argument(
        "--max-local-prefill",
        type=int,
        default=0,
        metavar="N",
        help="conditional disaggregation: a prompt a decode holds all but at most N tokens of (the next turn of a "
        "chat it decoded, another user of a system prompt it holds) is prefilled by that decode, with no prefill "
        "hop and no transfer; needs --decode-policy kv_aware and the decodes' KV events (default 0: off)",
    )
    parser.add_argument(
        "--local-prefill-max-busy",
        type=int,
        default=0,
        metavar="N",
        help="with --max-local-prefill: a decode with N or more requests in flight leaves the prompt to the prefill "
        "hop when a prefill has fewer than N (default 0: load not weighed)",
    )
    parser.add_argument(
        "--health-interval",
        type=float,
        default=5.0,
        metavar="S",
        help="seconds between GET /health checks of every backend (default 5)",
    )
    parser.add_argument(
        "--health-timeout", type=float, default=2.0, metavar="S", help="timeout of one health check (default 2)"
    )
    parser.add_argument(
        "--connect-timeout", type=float, default=5.0, metavar="S", help="timeout to connect to a backend (default 5)"
    )
    parser.add_argument(
        "--request-timeout", type=float, default=None, metavar="S", help="timeout of one hop (default: none)"
    )
    parser.add_argument(
        "--handshake-secret-env",
        default=None,
        metavar="NAME",
        help="the environment variable holding the prefills' side-channel secret (the connectors' secret_env), used"
        " to release blocks no decode will read; the secret itself never goes on the command line",
    )
    parser.add_argument(
        "--release-timeout", type=float, default=1.0, metavar="S", help="timeout of one release (default 1)"
    )
    for flag, field, kind, metavar, text in _LIMIT_FLAGS:
        default = ProxyConfig.__dataclass_fields__[field].default
        parser.add_argument(flag, type=kind, default=default, metavar=metavar, help=text)


#: Flags of the proxy's input limits: (flag, ProxyConfig field, type, metavar, help).
_LIMIT_FLAGS: tuple[tuple[str, str, type, str, str], ...] = (
    ("--max-body-bytes", "max_body_bytes", int, "N", "largest request body accepted; larger: 413 (default 16 MiB)"),
    (
        "--max-inflight-body-bytes",
        "max_inflight_body_bytes",
        int,
        "N",
        "bytes of request bodies held at once over all requests; beyond it new requests get 503 (default 256 MiB)",
    ),
    (
        "--header-timeout",
        "header_timeout_s",
        float,
        "S",
        "a connection's request headers must be complete this long after it opened or after its last answer, "
        "or it is closed; this is also the idle keep-alive time (default 15)",
    ),
    (
        "--body-timeout",
        "body_timeout_s",
        float,
        "S",
        "a body must arrive within this of its headers, else 408 (default 30)",
    ),
)


#: Flags of the prefix policies and session affinity: (flag, ProxyConfig field, type, metavar, help).
_ROUTING_FLAGS: tuple[tuple[str, str, type, str, str], ...] = (
    ("--cache-threshold", "cache_threshold", float, "F", "cache_aware: share of a prompt that must match to follow it"),
    (
        "--balance-abs-threshold",
        "balance_abs_threshold",
        int,
        "N",
        "cache_aware, kv_aware: out of balance (the idlest backend gets the request) when the busiest has more than N"
        " requests over the idlest ...",
    ),
    ("--balance-rel-threshold", "balance_rel_threshold", float, "F", "... and more than F times the idlest's count"),
    ("--max-tree-size", "max_tree_size", int, "N", "cache_aware: prefix tree nodes per pool; least recent evicted"),
    (
        "--session-ttl",
        "session_ttl_s",
        float,
        "S",
        "session affinity: a session (--session-header, else the body's user) sticks to its backend while used within"
        " S seconds; 0: off",
    ),
    ("--session-header", "session_header", str, "NAME", "session affinity: the header naming a request's session"),
    ("--max-sessions", "max_sessions", int, "N", "session affinity: sessions remembered; least recent forgotten"),
    ("--kv-block-size", "kv_block_size", int, "N", "kv_aware: the engines' --block-size"),
    ("--kv-hash-algo", "kv_hash_algo", str, "NAME", "kv_aware: the engines' --prefix-caching-hash-algo"),
    ("--kv-penalty-host", "kv_penalty_host", float, "F", "kv_aware: credit of a block in an engine's host tier"),
    (
        "--kv-penalty-shared",
        "kv_penalty_shared",
        float,
        "F",
        "kv_aware: credit of a block in the shared directory tier, to every engine that stored blocks there",
    ),
    ("--kv-penalty-disk", "kv_penalty_disk", float, "F", "kv_aware: credit of a block on an engine's local disk"),
    ("--kv-max-blocks", "kv_max_blocks", int, "N", "kv_aware: (engine, block) entries the index holds at most"),
    (
        "--kv-routed-ttl",
        "kv_routed_ttl_s",
        float,
        "S",
        "kv_aware: a request's blocks count as its backend's own for S seconds after it is routed, until the"
        " engine's events report them (0: not at all)",
    ),
    (
        "--kv-silence",
        "kv_silence_s",
        float,
        "S",
        "kv_aware: a stream silent S seconds is probed on its replay endpoint; no answer drops its entries",
    ),
    (
        "--tokenize-timeout",
        "tokenize_timeout_s",
        float,
        "S",
        "kv_aware: one POST /tokenize of a text or chat prompt; past it the prompt routes without token ids",
    ),
)

#: Other names of routing flags: vLLM's router's, for a user moving from it.
_ALIASES = {"--kv-penalty-shared": ("--kv-penalty-external",)}


def config_from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> ProxyConfig:
    """The config of parsed flags; the secret and the KV hash seed are read from ``environ`` (default: this process's
    environment, read here: the proxy's command is its process's edge)."""
    environ = environment() if environ is None else environ
    secret = None
    if args.handshake_secret_env is not None:
        secret = environ.get(args.handshake_secret_env)
        if not secret:
            raise SystemExit(f"--handshake-secret-env: the environment variable {args.handshake_secret_env} is not set")
    seed = None
    if args.kv_hash_seed_env is not None:
        seed = environ.get(args.kv_hash_seed_env)
        if seed is None:
            raise SystemExit(f"--kv-hash-seed-env: the environment variable {args.kv_hash_seed_env} is not set")
    routing = {field: getattr(args, field) for _, field, *_ in _ROUTING_FLAGS}
    return ProxyConfig(
        **routing,
        prefill_policy=args.prefill_policy,
        decode_policy=args.decode_policy,
        kv_event_sources=list(args.kv_event_source),
        kv_hash_seed=seed,
        kv_shared_directory=not args.kv_local_disk,
        tokenize=not args.no_tokenize,
        handshake_secret=secret,
        release_timeout_s=args.release_timeout,
        prefill=list(args.prefill),
        decode=list(args.decode),
        policy=args.policy,
        short_prompt_tokens=args.short_prompt_tokens,
        max_local_prefill_tokens=args.max_local_prefill,
        local_prefill_max_busy=args.local_prefill_max_busy,
        stream_kv=args.stream_kv,
        health_interval_s=args.health_interval,
        health_timeout_s=args.health_timeout,
        connect_timeout_s=args.connect_timeout,
        request_timeout_s=args.request_timeout,
        max_body_bytes=args.max_body_bytes,
        max_inflight_body_bytes=args.max_inflight_body_bytes,
        header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout,
    )


async def serve(args: argparse.Namespace) -> None:
    from pd_transfer.proxy.server import Proxy

    proxy = Proxy(config_from_args(args))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        url = await proxy.start(args.host, args.port)
        # What start-up made (~42,000 objects: aiohttp, zmq, prometheus_client, the app) is never garbage: out of
        # every collection, so a full one walks only the requests in flight instead of stopping the loop for
        # 19-36 ms (measured here) with every request in flight waiting.
        gc.freeze()
        healthy = {pool.role: len(pool.healthy()) for pool in (proxy.prefill, proxy.decode)}
        policies = (
            proxy.prefill.policy
            if proxy.prefill.policy == proxy.decode.policy
            else f"prefill {proxy.prefill.policy}, decode {proxy.decode.policy}"
        )
        print(
            f"pd-transfer proxy listening on {url} ({policies}; healthy: "
            f"{healthy['prefill']}/{len(proxy.prefill.backends)} prefill, "
            f"{healthy['decode']}/{len(proxy.decode.backends)} decode)",
            flush=True,
        )
        await stop.wait()
    finally:
        await proxy.close()


def run(args: argparse.Namespace) -> int:
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        print("the proxy needs aiohttp: pip install 'pd-transfer[proxy]'")
        return 2
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        runner.run(serve(args))
    return 0


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop where it is installed (the ``proxy`` extra has it), asyncio's otherwise."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pd_transfer.proxy", description="The P/D proxy.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return run(args)
