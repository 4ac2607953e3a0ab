"""``pd-transfer bench soak``: many requests at a fixed concurrency through the proxy on a real vLLM prefill/decode
pair, then what is left over: failed requests, the held-block and in-flight gauges (which must all be back to 0),
the prefill's leases by how they ended, and the resident memory of every process before and after.

The load (:func:`drive`), the leftover gauges (:func:`settle`) and the memory (:func:`group_rss_bytes`) are also
what ``tests/vllm/test_vllm_faults.py`` uses on its own servers; :func:`run` starts a pair and the proxy for the
benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pd_transfer.affinity import allowed_cpu
from pd_transfer.cluster.http_client import RequestFailed, answer_tokens, completion, free_port, scrape_metrics
from pd_transfer.cluster.launch import TINY_MODEL_DIR, ServerSpec, server_process
from pd_transfer.cluster.processes import ManagedProcess, group_members, stop_all, wait_ready
from pd_transfer.settings import child_environment

__all__ = ["SoakLoad", "add_arguments", "drive", "group_rss_bytes", "held_gauges", "rss_bytes", "run", "settle"]

MIB = 2**20
#: Gauge samples that count something held or in flight: all must read 0 once the load is over.
HELD_GAUGES = ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting")
HELD_WORDS = ("blocks_held", "in_flight", "inflight", "body_bytes_held")
LEASES = "vllm:pd_transfer_leases_ended_total"
FAILED_LOADS = "vllm:pd_transfer_failed_loads_total"
UNCONFIRMED = "vllm:pd_transfer_unconfirmed_reads_total"
FAILURE_SAMPLES = 5


@dataclass
class SoakLoad:
    """The outcome of :func:`drive`: ``requests`` sent, ``failed`` of them (an error, a status other than 200, or
    not ``max_tokens`` tokens back), up to 5 ``failures`` (short messages), the wall-clock ``seconds``."""

    requests: int
    concurrency: int
    failed: int = 0
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        rate = self.requests / self.seconds if self.seconds > 0 else 0.0
        return {
            "requests": self.requests,
            "concurrency": self.concurrency,
            "failed": self.failed,
            "failure_samples": self.failures,
            "seconds": round(self.seconds, 1),
            "requests_per_s": round(rate, 2),
        }


def soak_prompt(index: int, salt: int, lengths: tuple[int, int] = (16, 600)) -> list[int]:
    """Request ``index``'s prompt: token ids 3..2047 (the tiny model's vocabulary without <s>, </s>, <pad>) of a
    length drawn from ``lengths`` (inclusive), distinct per ``(index, salt)`` so no request hits another's cache."""
    rng = random.Random(salt * 1_000_003 + index)
    return [rng.randrange(3, 2048) for _ in range(rng.randint(*lengths))]


def drive(
    proxy_url: str,
    model: str,
    requests: int,
    concurrency: int,
    *,
    max_tokens: int = 8,
    salt: int | None = None,
    timeout_s: float = 120.0,
    on_answer: Callable[[int, list[int], list[str]], None] | None = None,
) -> SoakLoad:
    """``requests`` greedy completions of :func:`soak_prompt` prompts, ``concurrency`` at a time, through the proxy
    at ``proxy_url``; each must answer 200 with ``max_tokens`` tokens within ``timeout_s`` seconds. ``on_answer``
    (index, prompt, tokens) sees every good answer (from worker threads)."""
    salt = time.time_ns() % 10**9 if salt is None else salt
    load = SoakLoad(requests, concurrency)
    lock = threading.Lock()

    def one(index: int) -> None:
        prompt = soak_prompt(index, salt)
        try:
            answer = completion(
                proxy_url, model, prompt, max_tokens, request_id=f"soak-{salt}-{index}", timeout_s=timeout_s
            )
            tokens = answer_tokens(answer)
            problem = None if len(tokens) == max_tokens else f"{len(tokens)} tokens instead of {max_tokens}"
        except (RequestFailed, ValueError) as error:
            problem, tokens = str(error)[:200], []
        if problem is None and on_answer is not None:
            on_answer(index, prompt, tokens)
        if problem is not None:
            with lock:
                load.failed += 1
                if len(load.failures) < FAILURE_SAMPLES:
                    load.failures.append(f"request {index}: {problem}")

    started = time.monotonic()
    with ThreadPoolExecutor(concurrency, thread_name_prefix="soak") as pool:
        list(pool.map(one, range(requests)))
    load.seconds = time.monotonic() - started
    return load


def held_gauges(metrics_text: str) -> dict[str, float]:
    """Every sample of ``metrics_text`` (Prometheus text) that counts something held or in flight, by its full
    name and labels: vLLM's cache usage and running/waiting requests, and any ``*blocks_held*``, ``*in_flight*``
    or ``*body_bytes_held*`` gauge (ours, the proxy's)."""
    held = {}
    for line in metrics_text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        sample, value = line.rsplit(" ", 1)
        name = sample.split("{", 1)[0]
        if name.endswith(("_total", "_created")):
            continue
        if name in HELD_GAUGES or any(word in name for word in HELD_WORDS):
            held[sample] = float(value)
    return held


def settle(urls: Mapping[str, str], timeout_s: float = 30.0, poll_s: float = 0.25) -> dict[str, dict[str, float]]:
    """The held-block and in-flight gauges of every server (``name -> base URL``), polled until all read 0 or
    ``timeout_s`` seconds passed (vLLM's gauges follow the engine's next step report): the last reading, by
    server. A server that does not answer reads ``{"unreachable": 1}``."""
    deadline = time.monotonic() + timeout_s
    while True:
        readings: dict[str, dict[str, float]] = {}
        for name, url in urls.items():
            try:
                readings[name] = held_gauges(scrape_metrics(url))
            except RequestFailed:
                readings[name] = {"unreachable": 1.0}
        if all(v == 0 for gauges in readings.values() for v in gauges.values()) or time.monotonic() >= deadline:
            return readings
        time.sleep(poll_s)


def nonzero(readings: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """The gauges of :func:`settle`'s readings that are not 0, as ``server: sample``."""
    return {f"{name}: {sample}": v for name, gauges in readings.items() for sample, v in gauges.items() if v != 0}


def rss_bytes(pid: int) -> int:
    """Resident memory (bytes) of process ``pid``: ``VmRSS`` of ``/proc/PID/status``; ``OSError`` once it is gone."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise OSError(f"process {pid} has no VmRSS (a zombie?)")


def group_rss_bytes(process: ManagedProcess) -> int:
    """Resident memory (bytes) of every live process of ``process``'s group (a vLLM server is its API server, its
    engine core and their helpers), summed from ``/proc/PID/status`` (``VmRSS``); 0 when none is alive."""
    total = 0
    for pid in [] if process.process is None else group_members(process.process.pid):
        try:
            total += rss_bytes(pid)
        except (OSError, ValueError, IndexError):
            continue  # exited meanwhile
    return total


def counters(metrics_text: str, name: str, label: str) -> dict[str, float]:
    """The samples of counter ``name`` in ``metrics_text`` summed by the value of ``label``."""
    out: dict[str, float] = {}
    for line in metrics_text.splitlines():
        if line.startswith(name + "{") and f'{label}="' in line:
            key = line.split(f'{label}="', 1)[1].split('"', 1)[0]
            out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


# ---- the benchmark: a pair and the proxy of its own -------------------------------------------------------------


def _pair(model: str, python: str, logs: Path, lease_s: float) -> list[ManagedProcess]:
    servers = []
    for index, role in enumerate(("prefill", "decode")):
        spec = ServerSpec(
            role=role,  # type: ignore[arg-type]
            model=model,
            port=free_port(),
            side_channel_port=free_port(),
            lease_seconds=lease_s if role == "prefill" else None,
            cpu_bind=allowed_cpu(index),
            kvcache_gib=0.25,
            dtype="float32",
            max_model_len=2048,
            seed=0,
        )
        servers.append(server_process(role, spec, logs / f"{role}.log", python=python))
    return servers


def _plain(model: str, python: str, logs: Path) -> ManagedProcess:
    """The yardstick: a vLLM server without any connector, shaped as the pair's prefill (same core, cache, model)."""
    spec = ServerSpec(
        role="prefill",
        model=model,
        port=free_port(),
        side_channel_port=free_port(),
        cpu_bind=allowed_cpu(0),
        kvcache_gib=0.25,
        dtype="float32",
        max_model_len=2048,
        seed=0,
    )
    return server_process("plain", spec, logs / "plain.log", python=python, connector=False)


def plain_soak(args: argparse.Namespace, logs: Path, salt: int) -> dict[str, Any]:
    """The same warm-up and load (same prompts: ``salt``) sent straight to :func:`_plain`'s server, its RSS before
    and after: how much a vLLM server grows under these prompts without us."""
    plain = _plain(args.model, args.python, logs)
    try:
        plain.start()
        wait_ready([plain], args.startup_timeout)
        drive(plain.url, args.model, 2 * args.concurrency, args.concurrency, max_tokens=args.max_tokens, salt=salt + 1)
        before = group_rss_bytes(plain) / MIB
        load = drive(plain.url, args.model, args.requests, args.concurrency, max_tokens=args.max_tokens, salt=salt)
        after = group_rss_bytes(plain) / MIB
    finally:
        stop_all([plain])
    return {
        "requests": load.requests,
        "failed": load.failed,
        "seconds": round(load.seconds, 1),
        "rss_mib_before": round(before, 1),
        "rss_mib_after": round(after, 1),
    }


def proxy_process(prefill: Sequence[str], decode: Sequence[str], logs: Path, port: int | None = None) -> ManagedProcess:
    """The proxy (``python -m pd_transfer.proxy``, this interpreter) over those servers, on ``port`` (default: a free
    one); not started."""
    port = port or free_port()
    command = [sys.executable, "-m", "pd_transfer.proxy", "--prefill", *prefill, "--decode", *decode]
    command += ["--port", str(port)]
    return ManagedProcess("proxy", command, child_environment(), logs / "proxy.log", f"http://127.0.0.1:{port}")


def portable(readings: Mapping[str, Mapping[str, float]], model: str) -> dict[str, dict[str, float]]:
    """:func:`settle`'s readings with the model's folder named by its last part (vLLM labels samples with the path
    it was given), so that a result names no path of this machine."""
    name = Path(model).name
    return {server: {k.replace(model, name): v for k, v in gauges.items()} for server, gauges in readings.items()}


def _rss_mib(processes: Sequence[ManagedProcess]) -> dict[str, float]:
    return {p.name: round(group_rss_bytes(p) / MIB, 1) for p in processes}


def soak(args: argparse.Namespace) -> dict[str, Any]:
    """Start the pair and the proxy, warm up, measure RSS, run the load, settle, measure again; stop everything."""
    logs = args.log_dir or Path("runs") / time.strftime("bench-soak-%Y%m%d-%H%M%S")
    salt = time.time_ns() % 10**9
    servers = _pair(args.model, args.python, logs, args.lease)
    proxy = proxy_process([servers[0].url], [servers[1].url], logs)
    everything = [*servers, proxy]
    try:
        for process in everything:
            process.start()
        wait_ready(everything, args.startup_timeout)
        warm = drive(
            proxy.url, args.model, 2 * args.concurrency, args.concurrency, max_tokens=args.max_tokens, salt=salt + 1
        )
        before = _rss_mib(everything)
        leases_before = counters(scrape_metrics(servers[0].url), LEASES, "reason")
        load = drive(proxy.url, args.model, args.requests, args.concurrency, max_tokens=args.max_tokens, salt=salt)
        readings = portable(settle({p.name: p.url for p in everything}), args.model)
        after = _rss_mib(everything)
        leases = counters(scrape_metrics(servers[0].url), LEASES, "reason")
        decode_text = scrape_metrics(servers[1].url)
    finally:
        stop_all(everything)
    plain = plain_soak(args, logs, salt) if args.plain else None
    return {
        "bench": "soak",
        "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "model": Path(args.model).name,
        "max_tokens": args.max_tokens,
        "prompt_tokens": "16..600, random, distinct",
        "prefill_lease_s": args.lease,
        "warmup": {"requests": warm.requests, "failed": warm.failed},
        **load.as_dict(),
        "gauges_end": readings,
        "gauges_not_zero": nonzero(readings),
        "leases_ended": {k: leases.get(k, 0.0) - leases_before.get(k, 0.0) for k in sorted(leases)},
        "decode_failed_loads": sum(counters(decode_text, FAILED_LOADS, "engine").values()),
        "decode_unconfirmed_reads": sum(counters(decode_text, UNCONFIRMED, "engine").values()),
        "rss_mib_before": before,
        "rss_mib_after": after,
        "plain_server": plain,
        "load_average": [round(v, 2) for v in os.getloadavg()],
        "cpus": len(os.sched_getaffinity(0)),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``pd-transfer bench soak``."""
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    parser.add_argument(
        "--output", type=Path, default=None, help="write it here too (benchmarks/soak.json, soak_kv.json)"
    )

    parser.add_argument("--requests", type=int, default=2000, help="requests in all (2000)")
    parser.add_argument("--concurrency", type=int, default=32, help="requests at once (32)")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens generated per request (8)")
    parser.add_argument("--lease", type=float, default=30.0, help="the prefill's lease in seconds (30)")
    parser.add_argument("--model", default=str(TINY_MODEL_DIR), help=f"model folder ({TINY_MODEL_DIR})")
    parser.add_argument("--python", default=sys.executable, help="the interpreter that runs vLLM (this one)")
    parser.add_argument("--log-dir", type=Path, default=None, help="server logs (runs/bench-soak-TIMESTAMP)")
    parser.add_argument("--startup-timeout", type=float, default=900.0, help="seconds for servers to be healthy")
    parser.add_argument(
        "--plain",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="then send the same prompts to a vLLM server without connector and record its RSS too (default: on)",
    )


def write_result(result: dict[str, Any], output: Path | None) -> str:
    """``result`` as indented JSON, also written to ``output`` (none, or an empty path: not written)."""
    text = json.dumps(result, indent=1)
    if output is not None and str(output):
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(text + "\n")
    return text


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run(args: argparse.Namespace) -> int:
    """``pd-transfer bench soak``: 0 when no request failed and every gauge read 0 at the end, else 1; 130 when
    interrupted (SIGINT, SIGTERM or SIGHUP: every server is stopped first)."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    if args.output is None:
        args.output = Path("benchmarks/soak.json")
    try:
        result = soak(args)
    except KeyboardInterrupt:
        print("interrupted; every server stopped", file=sys.stderr)
        return 130
    text = write_result(result, args.output)
    if args.json:
        print(text)
    else:
        print(
            f"{result['requests']} requests at concurrency {result['concurrency']}: {result['failed']} failed,"
            f" {result['seconds']} s; gauges not 0 at the end: {result['gauges_not_zero'] or 'none'};"
            f" RSS MiB before {result['rss_mib_before']} after {result['rss_mib_after']}"
        )
    return 0 if result["failed"] == 0 and not result["gauges_not_zero"] else 1
