"""``pd-transfer up``: a local P/D cluster in one command.

Builds the default model when no ``--model`` is given (SmolLM2-135M-Instruct, or the tiny model when that
cannot be built or split over the TP sizes), starts the vLLM prefill and decode servers (each in its own
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
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pd_transfer.affinity import allowed_cpus
from pd_transfer.cluster.http_client import RequestFailed, busy_ports
from pd_transfer.cluster.launch import ServerSpec, cpu_binds, server_process
from pd_transfer.cluster.monitoring import write_scrape_config
from pd_transfer.cluster.processes import ManagedProcess, StartupFailed, stop_all, wait_ready
from pd_transfer.cluster.up_args import (
    DEFAULT_MODEL_DIR,
    KV_REPLAY_OFFSET,
    SIDE_CHANNEL_OFFSET,
    add_arguments,
    kv_block_size,
    kv_event_roles,
    policy_of,
    server_ports,
    validate,
)
from pd_transfer.settings import Settings, child_environment, read_settings

__all__ = ["add_arguments", "cpu_binds", "main", "plan_servers", "proxy_command", "run", "validate"]

PROXY_START_TIMEOUT_S = 60.0
#: kv_aware: the engines' --prefix-caching-hash-algo (vLLM's default), and the variable that seeds it
KV_HASH_ALGO = "sha256"
HASH_SEED_ENV = "PYTHONHASHSEED"
IPC_PATH_MAX = 100  # a Unix socket's path: 107 bytes at most on Linux, less "ipc://"
#: A stop drains each connector server for at most this long (the connector's default 30 s lease, then vLLM's
#: teardown): SIGTERM to its API server, vLLM's --shutdown-timeout, then what stop_all does.
DRAIN_S = 45.0
STATE_FILE = "cluster.json"


@dataclass(frozen=True)
class PlannedServer:
    name: str
    spec: ServerSpec
    connector: bool  # False: the plain reference server of --demo


def plan_servers(
    args: argparse.Namespace, model: str, served_name: str, log_dir: Path | None = None
) -> list[PlannedServer]:
    """The servers of the cluster: prefills, decodes, then the plain reference (``--demo``),
    ports and CPUs assigned; a kv_aware role's engines publish their KV events on an ipc socket in ``log_dir``
    (default: the working directory)."""
    kv_roles = kv_event_roles(args)
    block_sizes = {
        role: kv_block_size(args) if role in kv_roles else getattr(args, f"{role}_block_size")
        for role in ("prefill", "decode")
    }
    kinds = [("prefill", args.prefill_tp, block_sizes["prefill"], True)] * args.prefill
    kinds += [("decode", args.decode_tp, block_sizes["decode"], True)] * args.decode
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
            extra_args=("--served-model-name", served_name, *args.vllm_arg),
            drain_seconds=DRAIN_S if connector else None,
            eager=args.eager,
            transport=args.transport if connector else None,
            verify=args.verify if connector else None,
            **(_kv_events(args.base_port, k, log_dir or Path(".")) if connector and kind in kv_roles else {}),
            **(_offload(args) if connector and _mounts_offload(args, kind, counts[kind] - 1) else {}),
        )
        planned.append(PlannedServer(name, spec, connector))
    return planned


def _kv_events(base_port: int, k: int, folder: Path) -> dict[str, Any]:
    """The KV event fields of server ``k``'s spec: its PUB socket an ipc socket in ``folder`` (vLLM binds ipc
    endpoints and wildcard tcp ones, and connects to any other tcp one, which no subscriber could then reach; ipc
    keeps the stream of prompt token ids off the network), its replay endpoint on loopback; block hashes as the
    proxy computes them (sha256; the seed is the environment's PYTHONHASHSEED, which the proxy is told the name of)."""
    endpoint = f"ipc://{folder.resolve() / f'kv-events-{k}'}"
    replay = f"tcp://127.0.0.1:{base_port + KV_REPLAY_OFFSET + k}"
    return {"kv_events": (endpoint, replay), "hash_algo": KV_HASH_ALGO}


def _mounts_offload(args: argparse.Namespace, kind: str, index: int) -> bool:
    """Whether the ``index``-th server of ``kind`` mounts ``--offload-dir`` (every decode; the first
    ``--offload-prefills`` prefills, default all)."""
    return kind != "prefill" or args.offload_prefills is None or index < args.offload_prefills


def _offload(args: argparse.Namespace) -> dict[str, Any]:
    """The offload fields of a connector server's spec (none without ``--offload-dir``)."""
    if args.offload_dir is None:
        return {}
    fields: dict[str, Any] = {"offload_dir": str(args.offload_dir.expanduser().resolve())}
    if args.offload_dir_bytes is not None:
        fields["offload_dir_bytes"] = args.offload_dir_bytes
    if args.offload_host_bytes is not None:
        fields["offload_host_bytes"] = args.offload_host_bytes
    return fields


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


def _wait_servers(servers: Sequence[ManagedProcess], timeout_s: float, out: _Output) -> None:
    """Until every server is healthy (at most ``timeout_s`` seconds), showing progress: seconds waited, which are
    healthy, the last log line of one still starting. Raises ``StartupFailed`` as ``wait_ready`` does."""
    ready_before = -1

    def show(waited: float, waiting: Sequence[ManagedProcess]) -> None:
        nonlocal ready_before
        ready = [s for s in servers if s not in waiting]
        line = f"[{waited:4.0f} s] healthy {len(ready)}/{len(servers)}"
        if ready:
            line += " (" + ", ".join(s.name for s in ready) + ")"
        if waiting:
            line += f" | {waiting[0].name}: {waiting[0].last_line()}"
        out.status(line, changed=len(ready) != ready_before)
        ready_before = len(ready)

    wait_ready(servers, timeout_s, on_poll=show, hint=" (--startup-timeout)")


def _write_state(log_dir: Path, state: str, proxy_url: str, model: Path, children: Sequence[ManagedProcess]) -> None:
    data = {
        "state": state,
        "pid": os.getpid(),
        "proxy": proxy_url,
        "model": model.name,  # the served name
        "model_dir": str(model.resolve()),
        "log_dir": str(log_dir),
        "processes": [
            {
                "name": c.name,
                "pid": c.pid,
                "pgid": c.pid,
                "url": c.url,
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


def _resolve_model(args: argparse.Namespace, out: _Output, settings: Settings) -> Path:
    """The model folder to serve: ``--model``; else ``$PD_TRANSFER_MODEL`` (``settings.model``; the tiny model built
    there if it holds none); else SmolLM2-135M-Instruct, built once into ``$PD_TRANSFER_MODELS_DIR``
    (``settings.models_dir``, default ``.models``), or the tiny model, with a one-line note, when a TP size cannot
    split its 3 KV heads or it cannot be built here (no network, a package missing)."""
    if args.model is not None:
        return args.model.expanduser().resolve()
    if settings.model:
        model = Path(settings.model).expanduser().resolve()
        return model if (model / "config.json").is_file() else _tiny_model(model, out)
    from pd_transfer.real_model import KV_HEADS, SMOLLM2_DIR, RealModelUnavailable, ensure_smollm2, is_built

    models = Path(settings.models_dir or DEFAULT_MODEL_DIR.parent).expanduser().resolve()
    tiny, real = models / DEFAULT_MODEL_DIR.name, models / SMOLLM2_DIR.name
    split = [tp for tp in (args.prefill_tp, args.decode_tp) if KV_HEADS % tp]
    if split:
        out.say(
            f"note: SmolLM2-135M-Instruct has {KV_HEADS} KV heads, TP {split[0]} cannot split them: serving the tiny"
            f" model instead (--model DIR for another)"
        )
        return _tiny_model(tiny, out)
    if not is_built(real):
        out.say(f"building SmolLM2-135M-Instruct into {real} (a 93 MB download, about 30 s) ...")
    started = time.monotonic()
    try:
        model = ensure_smollm2(real)
    except RealModelUnavailable as error:
        out.say(f"note: cannot build SmolLM2-135M-Instruct ({error}); serving the tiny model instead")
        return _tiny_model(tiny, out)
    if time.monotonic() - started > 1.0:
        out.say(f"  built in {time.monotonic() - started:.0f} s")
    return model


def _tiny_model(model: Path, out: _Output) -> Path:
    """The tiny seeded model in ``model``, built there first if missing."""
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
    drain = False  # interrupted while serving: requests may be in flight
    try:
        return _run(args, out, children)
    except KeyboardInterrupt:
        out.say("interrupted")
        drain = bool(children) and all(c.ready_after_s is not None for c in children)
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
                left = _drain_then_stop(children, out) if drain else stop_all(children)
                _mark_stopped(children)
                if left:
                    out.say(f"pd-transfer up: still running after SIGKILL: {', '.join(left)}")
                else:
                    out.say(f"stopped ({time.monotonic() - stopping:.1f} s)")
        finally:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, previous)


def _drain_then_stop(children: Sequence[ManagedProcess], out: _Output) -> list[str]:
    """Drain every started vLLM server at once (SIGTERM to its API server only: its engine finishes the requests
    and the leases it holds, its ``/health`` answers 503), wait for them (at most ``DRAIN_S`` + 15 s, or until a
    second Ctrl-C or SIGTERM) with the proxy still relaying, then :func:`stop_all` of everything. Returns the names
    of children still alive."""
    servers = [c for c in children if c.process is not None and c.info.get("role") != "proxy"]
    out.say(
        f"draining {len(servers)} vLLM servers: what they hold finishes (at most {DRAIN_S + 15:.0f} s;"
        " Ctrl-C again stops at once) ..."
    )
    for server in servers:
        if server.process is not None and server.exit_code() is None:
            server.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + DRAIN_S + 15.0
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        while any(s.exit_code() is None for s in servers) and time.monotonic() < deadline:
            time.sleep(0.2)  # polling the servers' exits, bounded by the deadline
    except KeyboardInterrupt:
        out.say("interrupted again: stopping at once")
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return stop_all(children)


def _run(args: argparse.Namespace, out: _Output, children: list[ManagedProcess]) -> int:
    """Start the servers and the proxy (appending each process to ``children`` as it starts), then run the demo
    and/or serve until a child exits. Returns the exit code; the caller stops ``children``."""
    servers = args.prefill + args.decode + (1 if args.check else 0)
    ports = server_ports(args.base_port, servers, kv_events=bool(kv_event_roles(args)))
    busy = busy_ports([args.proxy_port, *ports])
    if busy:
        print(
            f"pd-transfer up: port(s) in use: {', '.join(map(str, busy))} (see --base-port, --proxy-port)",
            file=sys.stderr,
        )
        return 2
    model = _resolve_model(args, out, read_settings())  # this process's edge: its settings, read once
    served_name = model.name
    log_dir = (args.log_dir or Path("runs") / time.strftime("up-%Y%m%d-%H%M%S")).expanduser().resolve()
    log_dir.mkdir(parents=True, exist_ok=True)
    planned = plan_servers(args, str(model), served_name, log_dir)
    too_long = [s.spec.kv_events[0] for s in planned if s.spec.kv_events and len(s.spec.kv_events[0]) > IPC_PATH_MAX]
    if too_long:
        print(
            f"pd-transfer up: --log-dir is too long for an ipc socket path ({too_long[0]}); give a shorter one",
            file=sys.stderr,
        )
        return 2
    if args.prefill_block_size != args.decode_block_size:
        out.say("note: prefill and decode block sizes differ; requests the connector cannot map are computed locally")
    base_env = child_environment()
    _start_servers(planned, log_dir, base_env, children)
    proxy_url = f"http://127.0.0.1:{args.proxy_port}"
    _write_state(log_dir, "starting", proxy_url, model, children)
    started = time.monotonic()
    out.say(
        f"starting {len(planned)} vLLM servers ({served_name}; logs in {log_dir}); this takes a few minutes"
        " on a small CPU machine"
    )
    for server, process in zip(planned, children, strict=True):
        out.say(f"  {server.name:<10} pid {process.pid:<7} {server.spec.url}  CPU {server.spec.cpu_bind}")
    _wait_servers(children, args.startup_timeout, out)
    out.say(f"vLLM servers healthy after {time.monotonic() - started:.0f} s")
    children.append(_start_proxy(args, planned, log_dir, base_env))
    _wait_servers(children[-1:], PROXY_START_TIMEOUT_S, out)
    _write_state(log_dir, "ready", proxy_url, model, children)
    _print_ready(out, proxy_url, served_name, planned, children, time.monotonic() - started, log_dir, args)
    if args.demo:
        problems = _demo(args, out, planned, proxy_url, served_name)
        if args.exit_after_demo:
            return 1 if problems else 0
        if problems:
            out.say("demo: the cluster keeps running")
    out.say("Ctrl-C stops the cluster.")
    return _serve_until_an_exit(children, out)


def _start_servers(
    planned: Sequence[PlannedServer], log_dir: Path, base_env: Mapping[str, str], children: list[ManagedProcess]
) -> None:
    """Start a process for each planned server, logging to ``log_dir/NAME.log``; each goes into ``children``."""
    for server in planned:
        spec = server.spec
        process = server_process(
            server.name,
            spec,
            log_dir / f"{server.name}.log",
            connector=server.connector,
            base_env=base_env,
            info={"role": server.name.split("-")[0], "cpu_bind": spec.cpu_bind, "tp": spec.tp_size}
            | ({"side_channel": f"{spec.side_channel_host}:{spec.side_channel_port}"} if server.connector else {})
            | ({"kv_events": ",".join(spec.kv_events)} if spec.kv_events else {}),
        )
        children.append(process)
        process.start()


def _backend_urls(planned: Sequence[PlannedServer], kind: str) -> list[str]:
    return [s.spec.url for s in planned if s.connector and s.name.startswith(kind)]


def proxy_command(args: argparse.Namespace, planned: Sequence[PlannedServer], base_env: Mapping[str, str]) -> list[str]:
    """``python -m pd_transfer.proxy ...`` over the planned prefill and decode servers: the policies and, for
    kv_aware, each publishing engine's event endpoints and how the engines hash their blocks."""
    command = [sys.executable, "-m", "pd_transfer.proxy", "--prefill", *_backend_urls(planned, "prefill")]
    command += ["--decode", *_backend_urls(planned, "decode"), "--host", "127.0.0.1"]
    command += ["--port", str(args.proxy_port), "--policy", args.routing]
    for role in ("prefill", "decode"):
        command += [f"--{role}-policy", policy_of(args, role)]
    if args.max_local_prefill:
        command += ["--max-local-prefill", str(args.max_local_prefill)]
        if args.local_prefill_max_busy:
            command += ["--local-prefill-max-busy", str(args.local_prefill_max_busy)]
    if args.stream_kv:
        command += ["--stream-kv"]
    if kv_event_roles(args):
        command += ["--kv-block-size", str(kv_block_size(args)), "--kv-hash-algo", KV_HASH_ALGO]
        if base_env.get(HASH_SEED_ENV) is not None:  # the engines seed their block hashes with it
            command += ["--kv-hash-seed-env", HASH_SEED_ENV]
        for server in planned:
            if server.spec.kv_events is not None:
                command += ["--kv-event-source", f"{server.spec.url}={','.join(server.spec.kv_events)}"]
    return command


def _start_proxy(
    args: argparse.Namespace, planned: Sequence[PlannedServer], log_dir: Path, base_env: Mapping[str, str]
) -> ManagedProcess:
    """The proxy (:func:`proxy_command`), started."""
    command = proxy_command(args, planned, base_env)
    proxy = ManagedProcess(
        "proxy",
        command,
        {**base_env, "PYTHONUNBUFFERED": "1"},
        log_dir / "proxy.log",
        f"http://127.0.0.1:{args.proxy_port}",
        info={"role": "proxy"},
    )
    proxy.start()
    return proxy


def _demo(
    args: argparse.Namespace, out: _Output, planned: Sequence[PlannedServer], proxy_url: str, served_name: str
) -> list[str]:
    """``--demo``: the demo's requests through the proxy; what went wrong, one line each (also printed)."""
    from pd_transfer.cluster.demo import run_demo

    reference = next((s.spec.url for s in planned if not s.connector), None)
    decode_urls = _backend_urls(planned, "decode")
    try:
        results = run_demo(
            proxy_url, decode_urls, served_name, reference, say=out.say, block_size=args.decode_block_size
        )
        problems = [f"{r.name}: its answer differs from plain vLLM's" for r in results if r.same_as_reference is False]
        problems += [
            f"{r.name}: computed on the decode server, no KV loaded (its log says why)"
            for r in results
            if r.external_tokens <= 0
        ]
    except RequestFailed as error:  # an error status, a timeout, no connection
        problems = [f"a request failed: {error.url}: {error}"]
    except (ValueError, KeyError) as error:  # an answer of an unexpected shape
        problems = [f"a request failed: {type(error).__name__}: {error}"]
    for problem in problems:
        out.say(f"demo: FAILED: {problem}")
    return problems


def _serve_until_an_exit(children: Sequence[ManagedProcess], out: _Output) -> int:
    """Watch ``children`` (once a second) until one exits; print its log's end and return 1."""
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
    policies = {policy_of(args, role) for role in ("prefill", "decode")}
    routing = (
        args.routing
        if policies == {args.routing}
        else ", ".join(f"{role} {policy_of(args, role)}" for role in ("prefill", "decode"))
    )
    out.say(f"cluster ready after {total_s:.0f} s: proxy {proxy_url} ({routing})")
    for server, process in zip(planned, children, strict=False):
        spec = server.spec
        role = "reference (no connector)" if not server.connector else f"side channel {spec.side_channel_port}"
        out.say(
            f"  {server.name:<10} {spec.url}  {role}, TP {spec.tp_size}, CPU {spec.cpu_bind},"
            f" healthy after {process.ready_after_s or 0:.0f} s"
        )
    out.say(f"  state: {log_dir / STATE_FILE}")
    out.say(f"  metrics: prometheus --config.file={write_scrape_config(log_dir)}  (every server and the proxy)")
    body = json.dumps({"model": served_name, "prompt": "Alice saw the old castle", "max_tokens": 16, "temperature": 0})
    out.say("try:")
    out.say(f"  curl -s {proxy_url}/v1/completions -H 'Content-Type: application/json' -d {shlex.quote(body)}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pd-transfer up", description="A local P/D cluster: vLLM servers + proxy.")
    add_arguments(parser)
    return run(parser.parse_args(argv))
