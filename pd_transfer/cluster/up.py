"""``pd-transfer up``: a local P/D cluster in one command.

Builds the tiny model when no ``--model`` is given, starts the vLLM prefill and decode servers (each in its own
process group, CPU binding spread over the machine's cores, logs in ``--log-dir``), shows their progress until
every ``/health`` answers (bounded by ``--startup-timeout``), starts the proxy (``python -m pd_transfer.proxy``)
and prints how to use it. ``--demo`` then sends a few greedy requests through the proxy. Ctrl-C or SIGTERM stops
every process it started; so does a failed startup, after printing the failing server's log tail. The running
cluster is described in ``LOG_DIR/cluster.json`` (URLs, pids, logs).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import shutil
import signal
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pd_transfer.affinity import allowed_cpus
from pd_transfer.cluster.launch import ServerSpec, vllm_command, vllm_env
from pd_transfer.cluster.processes import ManagedProcess, stop_all

__all__ = ["add_arguments", "cpu_binds", "main", "plan_servers", "run", "validate"]

MODEL_ENV = "PD_TRANSFER_MODEL"
DEFAULT_MODEL_DIR = Path(".models/tiny-llama-f32")
SIDE_CHANNEL_OFFSET = 100  # server k: HTTP on base_port + k, side channel on base_port + 100 + k
MAX_SERVERS = 64
PROXY_START_TIMEOUT_S = 60.0
STATE_FILE = "cluster.json"


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
        help=f"model folder (default: ${MODEL_ENV} or {DEFAULT_MODEL_DIR}, the tiny model, built if missing)",
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
        "--routing", choices=("round_robin", "least_outstanding"), default="round_robin", help="proxy policy"
    )
    parser.add_argument("--log-dir", type=Path, default=None, metavar="DIR", help="default: runs/up-TIMESTAMP")
    parser.add_argument(
        "--startup-timeout", type=float, default=900.0, metavar="S", help="bound on the servers' startup (900)"
    )
    parser.add_argument("--dtype", default="float32", help="vLLM --dtype of every server (default float32)")
    parser.add_argument("--max-model-len", type=int, default=2048, metavar="N", help="vLLM --max-model-len (2048)")
    parser.add_argument("--kvcache-gib", type=float, default=1.0, metavar="GIB", help="KV cache per server (1)")


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
    elif args.proxy_port in _server_ports(args.base_port, servers):
        problems.append(f"--proxy-port {args.proxy_port} is one of the servers' ports (--base-port {args.base_port})")
    if args.model is not None and not (args.model / "config.json").is_file():
        problems.append(f"--model {args.model}: no model folder there (no config.json)")
    return problems


def _server_ports(base_port: int, servers: int) -> list[int]:
    return [base_port + k for k in range(servers)] + [base_port + SIDE_CHANNEL_OFFSET + k for k in range(servers)]


def cpu_binds(rank_counts: Sequence[int], cpus: Sequence[int]) -> list[str]:
    """``VLLM_CPU_OMP_THREADS_BIND`` of each server (its ranks separated by ``|``): every rank gets an equal,
    separate share of ``cpus`` when there are enough, else the ranks take the cores in turn."""
    total = sum(rank_counts)
    if len(cpus) >= total:
        per = len(cpus) // total
        shares = [list(cpus[i * per : (i + 1) * per]) for i in range(total)]
    else:
        shares = [[cpus[i % len(cpus)]] for i in range(total)]
    binds, at = [], 0
    for ranks in rank_counts:
        binds.append("|".join(_cpu_list(shares[at + r]) for r in range(ranks)))
        at += ranks
    return binds


def _cpu_list(cpus: Sequence[int]) -> str:
    if len(cpus) > 1 and list(cpus) == list(range(cpus[0], cpus[-1] + 1)):
        return f"{cpus[0]}-{cpus[-1]}"
    return ",".join(str(c) for c in cpus)


@dataclass(frozen=True)
class PlannedServer:
    name: str
    spec: ServerSpec
    connector: bool  # False: the plain reference server of --demo


def plan_servers(args: argparse.Namespace, model: str, served_name: str) -> list[PlannedServer]:
    """The servers of the cluster: prefills, decodes, then the plain reference (``--demo``),
    ports and CPUs assigned."""
    kinds = [("prefill", args.prefill_tp, args.prefill_block_size, True)] * args.prefill
    kinds += [("decode", args.decode_tp, args.decode_block_size, True)] * args.decode
    if args.check:
        kinds.append(("reference", 1, args.decode_block_size, False))
    binds = cpu_binds([tp for _, tp, _, _ in kinds], allowed_cpus())
    planned, counts = [], {"prefill": 0, "decode": 0, "reference": 0}
    for k, ((kind, tp, block_size, connector), bind) in enumerate(zip(kinds, binds, strict=True)):
        name = f"{kind}-{counts[kind]}" if kind != "reference" else kind
        counts[kind] += 1
        spec = ServerSpec(
            role="decode" if kind == "reference" else kind,  # type: ignore[arg-type]
            model=model,
            port=args.base_port + k,
            side_channel_port=args.base_port + SIDE_CHANNEL_OFFSET + k,
            block_size=block_size,
            tp_size=tp,
            cpu_bind=bind,
            kvcache_gib=args.kvcache_gib,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            seed=0,
            extra_args=("--served-model-name", served_name),
        )
        planned.append(PlannedServer(name, spec, connector))
    return planned


def _busy_ports(ports: Sequence[int], host: str = "127.0.0.1") -> list[int]:
    busy = []
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError:
                busy.append(port)
    return busy


class _Output:
    """Progress lines: rewritten in place on a terminal, one line at a time (throttled) otherwise."""

    def __init__(self) -> None:
        self.tty = sys.stdout.isatty()
        self._status = False
        self._last_plain = 0.0

    def say(self, text: str) -> None:
        self._clear()
        print(text, flush=True)

    def status(self, text: str, changed: bool) -> None:
        if self.tty:
            width = shutil.get_terminal_size((120, 20)).columns - 1
            sys.stdout.write("\r\x1b[K" + text[:width])
            sys.stdout.flush()
            self._status = True
        elif changed or time.monotonic() - self._last_plain >= 15.0:
            self._last_plain = time.monotonic()
            print(text, flush=True)

    def _clear(self) -> None:
        if self._status:
            sys.stdout.write("\r\x1b[K")
            self._status = False


class StartupFailed(RuntimeError):
    pass


def _wait_servers(servers: Sequence[ManagedProcess], timeout_s: float, out: _Output) -> None:
    """Until every server is healthy, showing progress; raises ``StartupFailed`` (with a log tail) on an exit or
    when ``timeout_s`` passes."""
    started = time.monotonic()
    deadline = started + timeout_s
    ready_before = -1
    while True:
        for server in servers:
            code = server.exit_code()
            if code is not None:
                raise StartupFailed(
                    f"{server.name} exited with code {code} while starting; the end of {server.log_path}:\n"
                    + server.log_tail()
                )
        ready = [s for s in servers if s.check_ready()]
        elapsed = time.monotonic() - started
        waiting = [s for s in servers if s.ready_after_s is None]
        line = f"[{elapsed:4.0f} s] healthy {len(ready)}/{len(servers)}"
        if ready:
            line += " (" + ", ".join(s.name for s in ready) + ")"
        if waiting:
            line += f" | {waiting[0].name}: {waiting[0].last_line()}"
        out.status(line, changed=len(ready) != ready_before)
        ready_before = len(ready)
        if not waiting:
            return
        if time.monotonic() >= deadline:
            tails = "\n".join(f"--- the end of {s.log_path} ---\n{s.log_tail()}" for s in waiting)
            raise StartupFailed(
                f"not healthy after {timeout_s:.0f} s: {', '.join(s.name for s in waiting)}"
                f" (--startup-timeout)\n{tails}"
            )
        time.sleep(1.0)


def _write_state(
    log_dir: Path, state: str, proxy_url: str, served_name: str, children: Sequence[ManagedProcess]
) -> None:
    data = {
        "state": state,
        "pid": os.getpid(),
        "proxy": proxy_url,
        "model": served_name,
        "log_dir": str(log_dir),
        "processes": [
            {
                "name": c.name,
                "pid": c.pid,
                "pgid": c.pid,
                "url": c.health_url.removesuffix("/health"),
                "log": str(c.log_path),
                "ready_after_s": None if c.ready_after_s is None else round(c.ready_after_s, 1),
                **c.info,
            }
            for c in children
            if c.process is not None
        ],
    }
    tmp = log_dir / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, log_dir / STATE_FILE)


def _mark_stopped(children: Sequence[ManagedProcess]) -> None:
    """Rewrites ``cluster.json`` (if written) to say the cluster is stopped."""
    path = children[0].log_path.parent / STATE_FILE
    try:
        data = json.loads(path.read_text())
        path.write_text(json.dumps({**data, "state": "stopped"}, indent=2) + "\n")
    except (OSError, ValueError):
        pass


def _resolve_model(args: argparse.Namespace, out: _Output) -> Path:
    if args.model is not None:
        return args.model.expanduser().resolve()
    model = Path(os.environ.get(MODEL_ENV) or DEFAULT_MODEL_DIR).expanduser().resolve()
    from pd_transfer.tiny_model import MARKER, build_tiny_model

    if not (model / MARKER).is_file():
        out.say(f"building the tiny model into {model} ...")
    started = time.monotonic()
    try:
        build_tiny_model(model, dtype="float32")
    except (ImportError, OSError, ValueError) as error:
        raise StartupFailed(f"could not build the tiny model in {model}: {error}") from error
    if time.monotonic() - started > 1.0:
        out.say(f"  built in {time.monotonic() - started:.0f} s")
    return model


def _missing_software() -> list[str]:
    missing = []
    if importlib.util.find_spec("vllm") is None:
        missing.append(f"vLLM is not installed for {sys.executable} (scripts/up sets up .venv-vllm with it)")
    if importlib.util.find_spec("aiohttp") is None:
        missing.append(f"the proxy needs aiohttp, not installed for {sys.executable}: pip install 'pd-transfer[proxy]'")
    return missing


def _raise_interrupt(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    """Bring the cluster up, serve until interrupted (or run the demo); returns an exit code."""
    problems = validate(args) or _missing_software()
    if problems:
        for problem in problems:
            print(f"pd-transfer up: {problem}", file=sys.stderr)
        return 2
    out = _Output()
    children: list[ManagedProcess] = []
    # Ctrl-C must stop the cluster even when we were started with SIGINT ignored (from a background job or
    # nohup, which Python would otherwise keep ignoring)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        return _run(args, out, children)
    except KeyboardInterrupt:
        out.say("interrupted")
        return 130 if not children or any(c.ready_after_s is None for c in children) else 0
    except StartupFailed as error:
        out.say(f"pd-transfer up: {error}")
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the stop below is bounded; let it finish
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            if children:
                out.say(f"stopping {len(children)} processes ...")
                stopping = time.monotonic()
                left = stop_all(children)
                _mark_stopped(children)
                if left:
                    out.say(f"pd-transfer up: still running after SIGKILL: {', '.join(left)}")
                else:
                    out.say(f"stopped ({time.monotonic() - stopping:.1f} s)")
        finally:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, previous)


def _run(args: argparse.Namespace, out: _Output, children: list[ManagedProcess]) -> int:
    ports = _server_ports(args.base_port, args.prefill + args.decode + (1 if args.check else 0))
    busy = _busy_ports([args.proxy_port, *ports])
    if busy:
        print(
            f"pd-transfer up: port(s) in use: {', '.join(map(str, busy))} (see --base-port, --proxy-port)",
            file=sys.stderr,
        )
        return 2
    model = _resolve_model(args, out)
    served_name = model.name
    log_dir = (args.log_dir or Path("runs") / time.strftime("up-%Y%m%d-%H%M%S")).expanduser().resolve()
    log_dir.mkdir(parents=True, exist_ok=True)
    planned = plan_servers(args, str(model), served_name)
    if args.prefill_block_size != args.decode_block_size:
        out.say("note: prefill and decode block sizes differ; requests the connector cannot map are computed locally")
    base_env = dict(os.environ)
    for server in planned:
        spec = server.spec
        process = ManagedProcess(
            name=server.name,
            command=vllm_command(spec, connector=server.connector),
            env=vllm_env(spec, base_env),
            log_path=log_dir / f"{server.name}.log",
            health_url=f"{spec.url}/health",
            info={"role": server.name.split("-")[0], "cpu_bind": spec.cpu_bind, "tp": spec.tp_size}
            | ({"side_channel": f"{spec.side_channel_host}:{spec.side_channel_port}"} if server.connector else {}),
        )
        children.append(process)
        process.start()
    proxy_url = f"http://127.0.0.1:{args.proxy_port}"
    _write_state(log_dir, "starting", proxy_url, served_name, children)
    started = time.monotonic()
    out.say(
        f"starting {len(planned)} vLLM servers ({served_name}; logs in {log_dir}); this takes a few minutes"
        " on a small CPU machine"
    )
    for server, process in zip(planned, children, strict=True):
        out.say(f"  {server.name:<10} pid {process.pid:<7} {server.spec.url}  CPU {server.spec.cpu_bind}")
    _wait_servers(children, args.startup_timeout, out)
    out.say(f"vLLM servers healthy after {time.monotonic() - started:.0f} s")

    backends = [(p, s) for p, s in zip(children, planned, strict=True) if s.connector]
    prefill_urls = [s.spec.url for _, s in backends if s.name.startswith("prefill")]
    decode_urls = [s.spec.url for _, s in backends if s.name.startswith("decode")]
    proxy_command = [
        sys.executable,
        "-m",
        "pd_transfer.proxy",
        "--prefill",
        *prefill_urls,
        "--decode",
        *decode_urls,
        "--host",
        "127.0.0.1",
        "--port",
        str(args.proxy_port),
        "--policy",
        args.routing,
    ]
    proxy = ManagedProcess(
        "proxy",
        proxy_command,
        {**base_env, "PYTHONUNBUFFERED": "1"},
        log_dir / "proxy.log",
        f"{proxy_url}/health",
        info={"role": "proxy"},
    )
    children.append(proxy)
    proxy.start()
    _wait_servers([proxy], PROXY_START_TIMEOUT_S, out)
    total = time.monotonic() - started
    _write_state(log_dir, "ready", proxy_url, served_name, children)
    _print_ready(out, proxy_url, served_name, planned, children, total, log_dir, args)

    if args.demo:
        from pd_transfer.cluster.demo import RequestFailed, run_demo

        reference = next((s.spec.url for s in planned if not s.connector), None)
        try:
            results = run_demo(
                proxy_url, decode_urls, served_name, reference, say=out.say, block_size=args.decode_block_size
            )
            problems = [
                f"{r.name}: its answer differs from plain vLLM's" for r in results if r.same_as_reference is False
            ]
            problems += [
                f"{r.name}: computed on the decode server, no KV loaded (its log says why)"
                for r in results
                if r.external_tokens <= 0
            ]
        except (RequestFailed, OSError, ValueError, KeyError) as error:  # HTTP errors, timeouts, odd answers
            problems = [f"a request failed: {type(error).__name__}: {error}"]
        for problem in problems:
            out.say(f"demo: FAILED: {problem}")
        if args.exit_after_demo:
            return 1 if problems else 0
        if problems:
            out.say("demo: the cluster keeps running")
    out.say("Ctrl-C stops the cluster.")
    while True:
        for child in children:
            code = child.exit_code()
            if code is not None:
                out.say(f"pd-transfer up: {child.name} exited with code {code}; the end of {child.log_path}:")
                out.say(child.log_tail())
                return 1
        time.sleep(1.0)


def _print_ready(
    out: _Output,
    proxy_url: str,
    served_name: str,
    planned: Sequence[PlannedServer],
    children: Sequence[ManagedProcess],
    total_s: float,
    log_dir: Path,
    args: argparse.Namespace,
) -> None:
    out.say(f"cluster ready after {total_s:.0f} s: proxy {proxy_url} ({args.routing})")
    for server, process in zip(planned, children, strict=False):
        spec = server.spec
        role = "reference (no connector)" if not server.connector else f"side channel {spec.side_channel_port}"
        out.say(
            f"  {server.name:<10} {spec.url}  {role}, TP {spec.tp_size}, CPU {spec.cpu_bind},"
            f" healthy after {process.ready_after_s or 0:.0f} s"
        )
    out.say(f"  state: {log_dir / STATE_FILE}")
    body = json.dumps({"model": served_name, "prompt": "Alice saw the old castle", "max_tokens": 16, "temperature": 0})
    out.say("try:")
    out.say(f"  curl -s {proxy_url}/v1/completions -H 'Content-Type: application/json' -d {shlex.quote(body)}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pd-transfer up", description="A local P/D cluster: vLLM servers + proxy.")
    add_arguments(parser)
    return run(parser.parse_args(argv))
