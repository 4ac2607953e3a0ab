"""``pd-transfer bench routing``: prefix reuse and TTFT of routing policies on a shared-prefix chat workload, for our
proxy and for vLLM's router, over one real cluster, in one sitting.

The cluster: ``pd-transfer up`` with 2 prefills and 1 decode of the default model (SmolLM2-135M-Instruct), every
engine with 32-token blocks (vLLM-CPU's smallest; vLLM's router is told so with ``--kv-event-block-size``, its
``--pd-kv-events`` otherwise assuming 16) and publishing its KV events (``--routing kv_aware``: an ipc socket each,
which every subscriber reads; ``up``'s own proxy is not measured). In front of it, one after another: our proxy
(``python -m pd_transfer.proxy``) with the prefill policy ``round_robin``, ``cache_aware``, ``kv_aware`` (the
prefills' events, text tokenized by their ``/tokenize``) and ``kv_aware_local`` (``kv_aware`` on both roles and
``--max-local-prefill``: a prompt the decode holds all but that many tokens of is prefilled by the decode itself),
then vLLM's router (``vllm-router``, P/D mode) with ``round_robin``, ``cache_aware`` and ``kv_aware``
(``--pd-kv-events`` naming the prefills' streams). The decode hop is round robin elsewhere (one decode).

Each engine's KV cache is ``kvcache_gib`` (0.2 GiB: about 150 blocks of 32 tokens of the float32 model), which
holds about two thirds of the default workload's prefixes: a policy that sends each system prompt to one prefill
keeps its half of them cached, one that spreads them makes each engine cycle through all of them. (``--kvcache-gib
1`` holds them all: every policy then misses each system prompt once per engine it reaches, and little separates
them.)

The workload: ``systems`` long system prompts, each shared by ``users`` users, each user holding a ``turns``-turn
chat (the history grows by a fixed assistant reply and the next question each turn); each turn's requests of all
users are sent interleaved (in an order shuffled the same way for every front), ``concurrency`` at a time, streamed,
``max_tokens`` each.
Every front gets its own text (a fresh salt): what an earlier front left in the engines' prefix caches never serves
a later one.

Per front: ``prefix_hit_tokens`` (the prefills' ``vllm:prefix_cache_hits`` over the front's run, out of
``prefix_query_tokens``); ``prompt_tokens`` (the answers' usage), ``computed_tokens`` (prompt tokens computed on any
engine: ``vllm:prompt_tokens_by_source{source="local_compute"}`` of all three) and ``reused_tokens``, their
difference (the prompt tokens no engine computed: equal to the prefills' hits when every request goes through P/D, a
decode computing nothing of a prompt it pulled; counting the decode's own hits when it prefills a request itself);
``ttft_ms_p50``/``_p99`` (client side, request sent to first streamed token),
``total_s``, the front's process ``cpu_s`` (user + system), and how its choices fell (ours: the proxy's route
metrics). The load average at both ends says how busy the host was. Results go to ``--out`` (default
``benchmarks/routing.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

from pd_transfer.bench.proxy.router import find_router, router_command
from pd_transfer.cluster.http_client import (
    RequestFailed,
    busy_ports,
    free_port,
    is_healthy,
    metric_value,
    scrape_metrics,
)
from pd_transfer.settings import child_environment

BLOCK = 32  # vLLM-CPU's attention takes multiples of 32 only
READY_LINE = "Ctrl-C stops the cluster."
FRONT_START_S = 120.0
REQUEST_TIMEOUT_S = 300.0
OURS = ("round_robin", "cache_aware", "kv_aware", "kv_aware_local", "kv_aware_local_busy")
MAX_LOCAL_PREFILL = 256  # kv_aware_local: tokens a decode computes of a prompt it holds the rest of
LOCAL_PREFILL_MAX_BUSY = 2  # kv_aware_local_busy: requests in flight from which a decode leaves it to a prefill
ROUTER = ("round_robin", "cache_aware", "kv_aware")
#: Every front, in the order they run: (front, policy); named ``FRONT:POLICY`` by ``--fronts``.
FRONTS = (*(("ours", p) for p in OURS), *(("vllm_router", p) for p in ROUTER))
HITS, QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"
BY_SOURCE = "vllm:prompt_tokens_by_source_total"
REPLY = "Understood. I have noted that and will keep it in mind for what follows."


@dataclass(frozen=True)
class Workload:
    systems: int = 8
    users: int = 3
    turns: int = 3
    system_words: int = 600
    max_tokens: int = 4
    concurrency: int = 2


KVCACHE_GIB = 0.2


def _words(rng: random.Random, count: int) -> str:
    vocabulary = "ship harbour river castle garden letter window engine market winter silver forest".split()
    vocabulary += "answer careful simple question history number detail reason travel morning".split()
    return " ".join(rng.choice(vocabulary) for _ in range(count))


def conversations(workload: Workload, salt: int) -> list[list[list[dict[str, str]]]]:
    """``[turn][request]`` -> the chat messages of that request (users of all system prompts interleaved)."""
    rng = random.Random(salt)
    systems = [f"System prompt {s} ({salt}): {_words(rng, workload.system_words)}" for s in range(workload.systems)]
    histories: dict[tuple[int, int], list[dict[str, str]]] = {
        (s, u): [{"role": "system", "content": systems[s]}]
        for u in range(workload.users)
        for s in range(workload.systems)
    }
    turns = []
    for turn in range(workload.turns):
        requests = []
        for u in range(workload.users):
            for s in range(workload.systems):
                history = histories[s, u]
                if turn:
                    history.append({"role": "assistant", "content": REPLY})
                history.append({"role": "user", "content": f"User {u}, turn {turn}: {_words(rng, 12)}?"})
                requests.append([dict(m) for m in history])
        # a fixed shuffle (the same for every front): a plain rotation of system prompts would line up with round
        # robin over the prefills whenever their counts share a factor
        random.Random(turn).shuffle(requests)
        turns.append(requests)
    return turns


async def stream_ttft(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], path: str = "/v1/chat/completions"
) -> float:
    """Seconds from sending a streamed request (``body`` to ``url + path``, a chat or a completion) to its first
    chunk of content (the stream read to its end)."""
    return (await stream_request(session, url, body, path))[0]


async def stream_request(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], path: str = "/v1/chat/completions"
) -> tuple[float, int | None]:
    """:func:`stream_ttft`, and the prompt's tokens by the stream's usage chunk (None: it sent none; ask for one
    with ``stream_options: {"include_usage": true}``)."""
    marker = b'"content":"' if path.endswith("/chat/completions") else b'"text":"'
    started = time.perf_counter()
    first: float | None = None
    prompt_tokens: int | None = None
    async with session.post(url + path, json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"{url} answered {response.status}: {(await response.text())[:200]}")
        async for line in response.content:
            if first is None and line.startswith(b"data: {") and marker in line:
                first = time.perf_counter() - started
            elif line.startswith(b"data: {") and b'"usage":{' in line:
                usage = json.loads(line[len(b"data: ") :]).get("usage") or {}
                prompt_tokens = usage.get("prompt_tokens", prompt_tokens)
    if first is None:
        raise RuntimeError(f"{url}: a stream without content")
    return first, prompt_tokens


async def _drive(url: str, model: str, workload: Workload, salt: int) -> tuple[list[float], int]:
    """The workload through the front at ``url``: each request's TTFT, and the prompt tokens of all (their usage)."""
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    gate = asyncio.Semaphore(workload.concurrency)
    ttfts: list[float] = []
    prompt_tokens = [0]

    async def one(session: aiohttp.ClientSession, messages: list[dict[str, str]]) -> None:
        body = {"model": model, "messages": messages, "max_tokens": workload.max_tokens, "temperature": 0.0}
        body |= {"stream": True, "stream_options": {"include_usage": True}}
        async with gate:
            ttft, tokens = await stream_request(session, url, body)
        if tokens is None:
            raise RuntimeError(f"{url}: a stream without usage")
        ttfts.append(ttft)
        prompt_tokens[0] += tokens

    async with aiohttp.ClientSession(timeout=timeout) as session:
        for requests in conversations(workload, salt):
            await asyncio.gather(*(one(session, messages) for messages in requests))
    return ttfts, prompt_tokens[0]


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _prefix_counts(prefills: Sequence[str]) -> tuple[float, float]:
    return sum(metric_value(u, HITS) for u in prefills), sum(metric_value(u, QUERIES) for u in prefills)


def _computed(engines: Sequence[str]) -> float:
    """Prompt tokens the ``engines`` computed so far (not found in a cache, not transferred)."""
    return sum(metric_value(u, BY_SOURCE, source="local_compute") for u in engines)


@dataclass
class Cluster:
    process: subprocess.Popen[bytes]
    log_dir: Path
    prefills: list[str]
    decodes: list[str]
    events: dict[str, tuple[str, str]]  # prefill URL -> (endpoint, replay endpoint)
    decode_events: dict[str, tuple[str, str]]  # decode URL -> (endpoint, replay endpoint)
    model: str  # the served name
    model_dir: str = ""  # the model's folder (its tokenizer)


@contextmanager
def up_cluster(
    work: Path, model: Path | None, startup_s: float, kvcache_gib: float, extra: Sequence[str] = ()
) -> Iterator[Cluster]:
    """``pd-transfer up``: 2 prefills and 1 decode, all publishing KV events, ``BLOCK``-token blocks, eager,
    ``kvcache_gib`` of KV cache each, ``extra`` flags of ``up``; stopped after."""
    for _ in range(100):
        base = random.randrange(20001, 30000)
        ports = [base - 1] + [base + o + k for o in (0, 100, 300) for k in range(3)]
        if not busy_ports(ports):
            break
    command = [sys.executable, "-m", "pd_transfer.cluster", "up", "--prefill", "2", "--decode", "1", "--eager"]
    command += ["--routing", "kv_aware", "--prefill-block-size", str(BLOCK), "--decode-block-size", str(BLOCK)]
    command += ["--base-port", str(base), "--proxy-port", str(base - 1), "--log-dir", str(work / "logs")]
    command += ["--startup-timeout", str(startup_s), "--kvcache-gib", str(kvcache_gib)]
    # vLLM's router tokenizes a P/D request through the prefill's render endpoints (403 without this flag: its
    # cache_aware and kv_aware then see no tokens and balance load only)
    command += ["--vllm-arg=--enable-scale-out"]
    command += [*extra, "--model", str(model)] if model else [*extra]
    output = work / "up.out"
    with open(output, "wb") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
    try:
        deadline = time.monotonic() + startup_s + 120
        while READY_LINE not in output.read_text(errors="replace"):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"pd-transfer up did not come up: {output.read_text(errors='replace')[-2000:]}")
            time.sleep(1.0)
        state = json.loads((work / "logs" / "cluster.json").read_text())
        events: dict[str, dict[str, tuple[str, str]]] = {"prefill": {}, "decode": {}}
        for p in state["processes"]:
            if p.get("role") in events:
                endpoint, replay = str(p["kv_events"]).split(",")
                events[p["role"]][str(p["url"])] = (endpoint, replay)
        prefills, decodes = events["prefill"], events["decode"]
        model_dir = str(state["model_dir"])
        yield Cluster(
            process, work / "logs", list(prefills), list(decodes), prefills, decodes, str(state["model"]), model_dir
        )
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(10)


def our_command(
    cluster: Cluster,
    policy: str,
    port: int,
    max_local_prefill: int = MAX_LOCAL_PREFILL,
    max_busy: int = LOCAL_PREFILL_MAX_BUSY,
) -> list[str]:
    """Our proxy with ``policy`` on the prefills (``kv_aware_local``: ``kv_aware`` on both roles and local
    prefills of up to ``max_local_prefill`` tokens; ``kv_aware_local_busy``: the same, weighing load: a decode with
    ``max_busy`` requests in flight or more leaves the prompt to a prefill with fewer), round robin on the decode
    otherwise."""
    command = [sys.executable, "-m", "pd_transfer.proxy", "--prefill", *cluster.prefills, "--decode", *cluster.decodes]
    local = policy.startswith("kv_aware_local")
    prefill_policy = "kv_aware" if local else policy
    command += ["--port", str(port), "--prefill-policy", prefill_policy]
    command += ["--decode-policy", "kv_aware" if local else "round_robin"]
    if prefill_policy == "kv_aware":
        command += ["--kv-block-size", str(BLOCK), "--kv-hash-algo", "sha256"]
        if child_environment().get("PYTHONHASHSEED") is not None:
            command += ["--kv-hash-seed-env", "PYTHONHASHSEED"]
        sources = {**cluster.events, **(cluster.decode_events if local else {})}
        for url, (endpoint, replay) in sources.items():
            command += ["--kv-event-source", f"{url}={endpoint},{replay}"]
    if local:
        command += ["--max-local-prefill", str(max_local_prefill)]
    if policy == "kv_aware_local_busy":
        command += ["--local-prefill-max-busy", str(max_busy)]
    return command


def front_environment(front: str, cluster: Cluster) -> dict[str, str]:
    """The front's environment: vLLM's router is given the model's tokenizer too (``VLLM_ROUTER_TOKENIZER``, a
    local folder), beside the prefills' render endpoints it asks in P/D mode (``--enable-scale-out``)."""
    env = child_environment()
    if front != "ours" and cluster.model_dir:
        env["VLLM_ROUTER_TOKENIZER"] = cluster.model_dir
    return env


def their_command(binary: str, cluster: Cluster, policy: str, port: int) -> list[str]:
    command = router_command(binary, cluster.prefills, cluster.decodes, port, free_port(), policy)
    if policy == "kv_aware":
        command[command.index("--policy") : command.index("--policy") + 2] = [
            "--prefill-policy",
            "kv_aware",
            "--decode-policy",
            "round_robin",
        ]
        command += ["--kv-event-block-size", str(BLOCK)]
        for url, (endpoint, _replay) in cluster.events.items():
            command += ["--pd-kv-events", f"{url}={endpoint}"]
    return command


def start_front(command: list[str], log: Path, url: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    deadline = time.monotonic() + FRONT_START_S
    while not is_healthy(url + "/health"):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            process.wait(10)
            raise RuntimeError(f"{command[0]} did not become healthy: {log.read_text(errors='replace')[-1500:]}")
        time.sleep(0.2)
    return process


def _our_choices(url: str) -> dict[str, float]:
    text = scrape_metrics(url)
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("pd_proxy_route_choices_total{") and 'role="prefill"' in line:
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            out[reason] = out.get(reason, 0.0) + float(line.rsplit(" ", 1)[1])
        elif line.startswith("pd_proxy_routes_total{"):
            path = line.split('path="', 1)[1].split('"', 1)[0]
            out[f"routes.{path}"] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("pd_proxy_kv_index_entries "):
            out["kv_index_entries"] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("pd_proxy_kv_event_faults_total{") and float(line.rsplit(" ", 1)[1]) > 0:
            kind = line.split('kind="', 1)[1].split('"', 1)[0]
            out[f"kv_event_faults.{kind}"] = out.get(f"kv_event_faults.{kind}", 0.0) + float(line.rsplit(" ", 1)[1])
        elif line.startswith(("pd_proxy_route_matched_blocks_total{", "pd_proxy_tokenize_total{")):
            name = line.split("{", 1)[0].removeprefix("pd_proxy_").removesuffix("_total")
            label = line.split('="')[-1].split('"', 1)[0]
            if 'role="decode"' not in line:
                out[f"{name}.{label}"] = float(line.rsplit(" ", 1)[1])
    return out


def _router_kv_metrics(command: list[str]) -> dict[str, float]:
    """vLLM's router's own Prometheus series about KV events, caches and policy choices (whatever it names so), to
    show what its ``kv_aware`` made of our engines' streams; empty when it exports none or cannot be read."""
    port = command[command.index("--prometheus-port") + 1]
    try:
        text = scrape_metrics(f"http://127.0.0.1:{port}")
    except RequestFailed:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if line.startswith("#") or not any(word in name for word in ("kv", "cache", "event", "policy", "prefix")):
            continue
        try:
            out[line.rsplit(" ", 1)[0][:160]] = float(line.rsplit(" ", 1)[1])
        except ValueError:
            continue
    return dict(list(out.items())[:40])


def measure(
    front: str, policy: str, command: list[str], port: int, cluster: Cluster, workload: Workload, work: Path, salt: int
) -> dict[str, Any]:
    """One front's run of the workload: its figures, or ``error`` when it could not run it."""
    url = f"http://127.0.0.1:{port}"
    result: dict[str, Any] = {"front": front, "policy": policy}
    try:
        process = start_front(command, work / f"{front}-{policy}.log", url, front_environment(front, cluster))
    except RuntimeError as e:
        return result | {"error": str(e)[-600:]}
    try:
        engines = [*cluster.prefills, *cluster.decodes]
        hits, queries, computed = *_prefix_counts(cluster.prefills), _computed(engines)
        cpu, started = cpu_seconds(process.pid), time.perf_counter()
        try:
            ttfts, prompt_tokens = asyncio.run(_drive(url, cluster.model, workload, salt))
        except (RuntimeError, aiohttp.ClientError, TimeoutError) as e:
            return result | {"error": f"{type(e).__name__}: {str(e)[-600:]}"}
        total = time.perf_counter() - started
        result["cpu_s"] = round(cpu_seconds(process.pid) - cpu, 3)
        # the prefills finished their requests before the decode streamed: their counters are final by now
        hits_after, queries_after = _prefix_counts(cluster.prefills)
        computed_tokens = int(_computed(engines) - computed)
        result |= {
            "requests": len(ttfts),
            "prefix_hit_tokens": int(hits_after - hits),
            "prefix_query_tokens": int(queries_after - queries),
            "prompt_tokens": prompt_tokens,
            "computed_tokens": computed_tokens,
            "reused_tokens": prompt_tokens - computed_tokens,
            "ttft_ms_p50": round(1000 * _percentile(ttfts, 0.5), 1),
            "ttft_ms_p99": round(1000 * _percentile(ttfts, 0.99), 1),
            "total_s": round(total, 2),
        }
        if front == "ours":
            result["choices"] = _our_choices(url)
        else:
            result["router_metrics"] = _router_kv_metrics(command)
        log = (work / f"{front}-{policy}.log").read_text(errors="replace").splitlines()
        notes = [line[-300:] for line in log if "ERROR" in line or "WARN" in line or "error" in line]
        if notes:
            result["log_notes"] = notes[:5]
        return result
    finally:
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def run_bench(
    workload: Workload,
    model: Path | None,
    startup_s: float,
    router: str | None,
    kvcache_gib: float = KVCACHE_GIB,
    max_local_prefill: int = MAX_LOCAL_PREFILL,
    max_busy: int = LOCAL_PREFILL_MAX_BUSY,
    only: Sequence[str] = (),
) -> dict[str, Any]:
    """Each front over one cluster, one after another (``only``: those named ``FRONT:POLICY``; all when empty)."""
    started_utc = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    load_before = os.getloadavg()
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="pd-bench-routing-") as folder:
        work = Path(folder)
        with up_cluster(work, model, startup_s, kvcache_gib) as cluster:
            for k, (front, policy) in enumerate(FRONTS):
                if (only and f"{front}:{policy}" not in only) or (front == "vllm_router" and not router):
                    continue
                port = free_port()
                command = (
                    our_command(cluster, policy, port, max_local_prefill, max_busy)
                    if front == "ours"
                    else their_command(str(router), cluster, policy, port)
                )
                result = measure(front, policy, command, port, cluster, workload, work, salt=1000 + k)
                print(json.dumps(result), flush=True)
                results.append(result)
            model_name = cluster.model
    return {
        "benchmark": "routing",
        "started_utc": started_utc,
        "model": model_name,
        "cluster": {
            "prefills": 2,
            "decodes": 1,
            "block_size": BLOCK,
            "kvcache_gib": kvcache_gib,
            "max_local_prefill": max_local_prefill,
            "local_prefill_max_busy": max_busy,
            "device": "cpu",
            "cpus": os.cpu_count(),
        },
        "workload": asdict(workload),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "vllm_router": router is not None,
        "results": results,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = Workload()
    for name in ("systems", "users", "turns", "system_words", "max_tokens", "concurrency"):
        flag = "--" + name.replace("_", "-")
        parser.add_argument(
            flag, type=int, default=getattr(defaults, name), metavar="N", help=f"default {getattr(defaults, name)}"
        )
    parser.add_argument("--model", type=Path, default=None, metavar="DIR", help="default: pd-transfer up's (SmolLM2)")
    parser.add_argument(
        "--kvcache-gib", type=float, default=KVCACHE_GIB, metavar="GIB", help=f"KV cache per engine ({KVCACHE_GIB})"
    )
    parser.add_argument(
        "--max-local-prefill",
        type=int,
        default=MAX_LOCAL_PREFILL,
        metavar="N",
        help=f"kv_aware_local: tokens the decode computes of a prompt it holds the rest of ({MAX_LOCAL_PREFILL})",
    )
    parser.add_argument(
        "--local-prefill-max-busy",
        type=int,
        default=LOCAL_PREFILL_MAX_BUSY,
        metavar="N",
        help=f"kv_aware_local_busy: requests in flight from which a decode leaves a prompt to a prefill with fewer"
        f" ({LOCAL_PREFILL_MAX_BUSY})",
    )
    parser.add_argument(
        "--fronts",
        nargs="+",
        default=[],
        metavar="FRONT:POLICY",
        choices=[f"{front}:{policy}" for front, policy in FRONTS],
        help="only these fronts, in the usual order (default: all)",
    )
    parser.add_argument("--startup-timeout", type=float, default=900.0, metavar="S", help="the servers' startup (900)")
    parser.add_argument(
        "--vllm-router", default=None, metavar="PATH", help="vllm-router (default: found as bench proxy)"
    )
    parser.add_argument("--no-router", action="store_true", help="our proxy only")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/routing.json"), help="benchmarks/routing.json")


def run(args: argparse.Namespace) -> int:
    workload = Workload(args.systems, args.users, args.turns, args.system_words, args.max_tokens, args.concurrency)
    if min(asdict(workload).values()) < 1:
        print("bench routing: every workload size must be at least 1", file=sys.stderr)
        return 2
    router = None if args.no_router else find_router(args.vllm_router)
    if not args.kvcache_gib > 0 or args.max_local_prefill < 1 or args.local_prefill_max_busy < 1:
        print(
            "bench routing: --kvcache-gib, --max-local-prefill and --local-prefill-max-busy must be positive",
            file=sys.stderr,
        )
        return 2
    report = run_bench(
        workload,
        args.model,
        args.startup_timeout,
        router,
        args.kvcache_gib,
        args.max_local_prefill,
        args.local_prefill_max_busy,
        args.fronts,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"written to {args.out}")
    return 0 if all("error" not in r for r in report["results"] if r["front"] == "ours") else 1
