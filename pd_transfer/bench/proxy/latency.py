"""``pd-transfer bench proxy``: the latency the proxy adds per request, against calling the backends directly.

Processes: stand-in backends (one prefill and one decode in one process), the proxy (``python -m
pd_transfer.proxy``), and this one, the client. The client times each request end to end, either

- direct: the proxy's flow done by the client itself (prefill with ``kv_transfer_params.do_remote_decode``,
  ``max_tokens`` 1, then the decode with the returned params), same client session, same bodies; or
- proxy: one request to the proxy, which does the same two hops.

Both run at each concurrency in the same run, interleaved in rounds (direct then proxy, then proxy then direct,
...), after a warm-up; closed loop (each of ``concurrency`` workers sends its next request when the last one is
answered). ``added_ms_*`` is the proxy's percentile minus the direct one; ``proxy_cpu_ms_per_request`` is the proxy
process's CPU time (user + system) over its requests.

vLLM's router (``vllm-router``, Rust) runs beside our proxy in the same run when it is installed
(:mod:`pd_transfer.bench.proxy.router`): P/D mode over the same stand-ins, pinned to the proxy's core, its requests
interleaved with the others in every round; its figures go in a ``vllm_router`` object beside ours at each
concurrency (``added_ms_p50`` / ``_p99`` against the same direct requests, ``cpu_ms_per_request``), and ours over
the router's in ``vs_vllm_router`` (CPU per request, p50, p99: ratios of the same run). ``goal`` says whether ours
spends at most ``GOAL_CPU_X`` times the router's CPU per request at a latency at most ``GOAL_LATENCY_X`` times its
(p50 and p99) at the largest concurrency. The host's in-process copy rate (GiB/s) before and after the run, and the
load average at both ends, say how busy the machine was (the command measures the copy, not :func:`run_bench`).

The stand-ins answer after a model's latency (``BACKEND_DELAY``): real backends spend a request's time generating
on a GPU, not on the CPU the proxy runs on, and that time sets how many requests per second 64 clients send. With
2 or more cores the proxy is pinned to one core and the client and stand-ins to the others, as a proxy would have
its own core(s) in a deployment. ``saturation`` repeats concurrency 64 against instant stand-ins: the rate is then
bounded only by CPU and the proxy's CPU per request turns into queueing (a worst case, not a deployment).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import queue
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from pd_transfer.affinity import allowed_cpus
from pd_transfer.bench.proxy.router import RouterProcess, find_router, start_router
from pd_transfer.bench.vllm.scale import host_copy_gbps
from pd_transfer.proxy import flow
from pd_transfer.proxy.cli import loop_factory
from pd_transfer.settings import child_environment

PROMPT = " ".join(f"word{i}" for i in range(64))  # ~83 tokens by the proxy's estimate
TOKENS = 8
BODY = {"model": "standin-model", "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0}
HEADERS = {"Content-Type": "application/json"}
# A small model (~8B) on one current datacenter GPU under load: the prefill of a ~80-token prompt takes ~20 ms
# (time to first token), each generated token ~10 ms (inter-token latency at batch ~64). So a request here takes
# ~20 + 8 x 10 = 100 ms in its backends, and 64 clients send ~640 requests/s.
BACKEND_DELAY = {"prefill_s": 0.020, "decode_token_s": 0.010}
# Issue 24's goal beside vLLM's router, at the largest concurrency: CPU per request at most 1.5 times the router's,
# latency (p50 and p99) at most the router's.
GOAL_CPU_X = 1.5
GOAL_LATENCY_X = 1.0
MIN_CPU_TICKS = 10  # fewer and a CPU ratio is mostly rounding


def run_bench(
    requests: int = 2000,
    concurrencies: tuple[int, ...] = (1, 64),
    rounds: int = 10,
    warmup: int = 100,
    *,
    requests_at_1: int | None = None,
    prefill_delay_s: float = BACKEND_DELAY["prefill_s"],
    token_delay_s: float = BACKEND_DELAY["decode_token_s"],
    saturation: bool = True,
    pin: bool = True,
    router: str | None = None,
    with_router: bool = True,
    stream: bool = False,
) -> dict[str, Any]:
    """Direct vs proxied requests at each concurrency, ``requests`` of each kind per concurrency
    (``requests_at_1`` at concurrency 1: default ``requests // 5``, each takes a backend round trip); vLLM's
    router beside our proxy when ``with_router`` and a ``vllm-router`` is found (``router``: its path); ``stream``:
    the decode hop streamed (SSE, a chunk per token), read to its end by the client."""
    cpus = allowed_cpus()
    pinning = {"proxy": cpus[:1], "client_and_stand_ins": cpus[1:]} if pin and len(cpus) >= 2 else None
    own_affinity = set(cpus)
    started = datetime.datetime.now(datetime.UTC)
    load_before = os.getloadavg()[0]
    env = child_environment({"PYTHONUNBUFFERED": "1"})
    procs: list[subprocess.Popen[str]] = []
    routers: list[RouterProcess] = []
    binary = find_router(router) if with_router else None
    try:
        if pinning is not None:
            os.sched_setaffinity(0, pinning["client_and_stand_ins"])  # the client; children inherit it
        delayed = _setup(env, procs, pinning, prefill_delay_s, token_delay_s, binary, routers)
        instant = _setup(env, procs, pinning, 0.0, 0.0, binary, routers) if saturation else None
        counts = {c: (requests_at_1 or max(1, requests // 5)) if c == 1 else requests for c in concurrencies}
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            body = dict(BODY, stream=True) if stream else BODY
            result = runner.run(_measure(*delayed, counts, rounds, warmup, body))
            if instant is not None:
                saturated = {max(concurrencies): requests}
                result["saturation"] = runner.run(_measure(*instant, saturated, rounds, warmup, body))
    finally:
        os.sched_setaffinity(0, own_affinity)
        for front in routers:
            front.stop()
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    result.update(
        {
            "goal": goal_verdict(result[f"concurrency_{max(concurrencies)}"]),
            "started_utc": started.isoformat(timespec="seconds"),
            "stream": stream,
            "requests_per_setting": counts,
            "rounds": rounds,
            "backend_delay": {
                "prefill_ms": prefill_delay_s * 1e3,
                "decode_ms_per_token": token_delay_s * 1e3,
                "tokens": TOKENS,
                "why": "a ~8B model on one current GPU under load: ~20 ms prefill of an ~80-token prompt, ~10 ms"
                " per generated token; saturation: instant stand-ins (CPU-bound worst case)",
            },
            "cpu_count": os.cpu_count(),
            "cpus_available": len(cpus),
            "pinning": pinning,
            "setup": "stand-in prefill + decode (one process), proxy (one process), client (this process)",
            "vllm_router": {"binary": os.path.basename(binary), "version": _router_version(binary)}
            if binary
            else {"skipped": "vllm-router not found (scripts/setup-deploy installs it)" if with_router else "off"},
            "event_loop": "uvloop" if loop_factory() else "asyncio",
            "load_average_1m": round(os.getloadavg()[0], 2),
            "load_average_1m_at_start": round(load_before, 2),
        }
    )
    return result


def goal_verdict(summary: dict[str, Any]) -> dict[str, Any]:
    """Whether ``summary`` (one concurrency's) meets the goal beside vLLM's router (see the module)."""
    if "vs_vllm_router" not in summary:
        return {"met": None, "why": "no vllm-router in this run"}
    x = summary["vs_vllm_router"]
    if x["cpu_per_request"] is None:
        return {"met": None, "why": "too few CPU clock ticks to compare CPU per request; run more requests", **x}
    met = x["cpu_per_request"] <= GOAL_CPU_X and max(x["p50"], x["p99"]) <= GOAL_LATENCY_X
    return {
        "concurrency": summary["concurrency"],
        "cpu_per_request_at_most_x": GOAL_CPU_X,
        "latency_at_most_x": GOAL_LATENCY_X,
        **x,
        "met": met,
    }


def _setup(
    env: dict[str, str],
    procs: list[subprocess.Popen[str]],
    pinning: dict[str, list[int]] | None,
    prefill_delay_s: float,
    token_delay_s: float,
    router: str | None,
    routers: list[RouterProcess],
) -> tuple[str, str, dict[str, tuple[str, int]]]:
    """Stand-ins, our proxy in front of them and vLLM's router when ``router`` names its binary (appended to
    ``routers``): (prefill URL, decode URL, {"proxy" | "vllm_router": (URL, pid)})."""
    standins = _spawn(
        [sys.executable, "-m", "pd_transfer.sim.http_standin", "prefill", "decode",
         "--prefill-delay", str(prefill_delay_s), "--token-delay", str(token_delay_s)],
        env,
        procs,
    )  # fmt: skip
    urls: dict[str, str] = {}
    deadline = time.monotonic() + 30
    while True:
        line = _read_line(standins, deadline)
        if line == "ready":
            break
        role, url = line.split()
        urls[role] = url
    proxy = _spawn(
        [sys.executable, "-m", "pd_transfer.proxy", "--prefill", urls["prefill"], "--decode", urls["decode"],
         "--port", "0", "--health-interval", "60", "--health-timeout", "30"],  # no backend out on a slow check
        env,
        procs,
    )  # fmt: skip
    if pinning is not None:
        _pin(proxy.pid, pinning["proxy"])
    line = _read_line(proxy, time.monotonic() + 30)
    if pinning is not None:
        _pin(proxy.pid, pinning["proxy"])  # again: threads started meanwhile
    fronts = {"proxy": (line.split(" listening on ", 1)[1].split()[0], proxy.pid)}
    if router is not None:
        routers.append(start_router(router, urls["prefill"], urls["decode"], env))
        if pinning is not None:
            _pin(routers[-1].pid, pinning["proxy"])
        fronts["vllm_router"] = (routers[-1].url, routers[-1].pid)
    return urls["prefill"], urls["decode"], fronts


def _router_version(binary: str) -> str:
    """The version of the ``vllm_router`` package beside ``binary`` (its own interpreter), or "unknown"."""
    python = os.path.join(os.path.dirname(binary), "python")
    try:
        out = subprocess.run(
            [python, "-c", "import importlib.metadata as m; print(m.version('vllm-router'))"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() or "unknown"


def _pin(pid: int, cpus: list[int]) -> None:
    """Every thread of ``pid`` on ``cpus``."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        tids = [pid]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:
            pass


def _spawn(cmd: list[str], env: dict[str, str], procs: list[subprocess.Popen[str]]) -> subprocess.Popen[str]:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=env)
    procs.append(proc)
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line.strip())
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    proc.lines = lines  # type: ignore[attr-defined]
    return proc


def _read_line(proc: subprocess.Popen[str], deadline: float) -> str:
    try:
        line = proc.lines.get(timeout=max(0.0, deadline - time.monotonic()))  # type: ignore[attr-defined]
    except queue.Empty:
        raise TimeoutError(f"{proc.args!r} printed nothing in time") from None
    if line is None:
        raise RuntimeError(f"{proc.args!r} exited with {proc.wait()}")
    return line


async def _measure(
    prefill: str,
    decode: str,
    fronts: dict[str, tuple[str, int]],
    counts: dict[int, int],
    rounds: int,
    warmup: int,
    body: dict[str, Any],
) -> dict[str, Any]:
    """Per concurrency (``counts``: concurrency -> requests of each kind): direct requests and requests through each
    front (``fronts``: name -> (URL, pid)) of ``body``, interleaved in ``rounds``; the summary of :func:`_summary`."""
    import aiohttp  # the 'proxy' extra; imported here so the CLI can list this command without it

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:
        kinds = {"direct": _direct(session, prefill, decode, body)}
        kinds |= {name: _through(session, name, url, body) for name, (url, _pid) in fronts.items()}
        pids = {name: pid for name, (_url, pid) in fronts.items()}
        out: dict[str, Any] = {}
        for concurrency, requests in counts.items():
            for fn in kinds.values():
                await _batch(fn, min(warmup, requests), concurrency, [])
            runs = await _interleaved(kinds, pids, concurrency, requests, rounds)
            out[f"concurrency_{concurrency}"] = _summary(runs, concurrency)
        return out


def _direct(session: Any, prefill: str, decode: str, body: dict[str, Any]) -> Callable[[], Awaitable[float]]:
    """The proxy's flow done by the client itself: prefill with ``do_remote_decode``, then the decode."""
    endpoint = flow.COMPLETIONS

    async def direct() -> float:
        headers = {**HEADERS, "X-Request-Id": uuid.uuid4().hex}
        started = time.perf_counter()
        raw = await _post(session, "prefill", prefill + endpoint, flow.prefill_body(endpoint, body), headers)
        params = flow.kv_params_from_prefill(msgspec.json.decode(raw))
        await _post(session, "decode", decode + endpoint, flow.decode_body(body, params), headers)
        return time.perf_counter() - started

    return direct


def _through(session: Any, name: str, url: str, body: dict[str, Any]) -> Callable[[], Awaitable[float]]:
    """One request to a front (our proxy, vLLM's router), which does both hops."""

    async def through() -> float:
        headers = {**HEADERS, "X-Request-Id": uuid.uuid4().hex}
        started = time.perf_counter()
        await _post(session, name, url + flow.COMPLETIONS, body, headers)
        return time.perf_counter() - started

    return through


async def _post(session: Any, who: str, url: str, body: dict[str, Any], headers: dict[str, str]) -> bytes:
    """POST ``body`` as JSON; the answer's bytes. Raises ``RuntimeError`` naming ``who`` on a status other than 200."""
    async with session.post(url, data=msgspec.json.encode(body), headers=headers) as r:
        raw: bytes = await r.read()
        if r.status != 200:
            raise RuntimeError(f"{who} answered {r.status}: {raw[:300].decode(errors='replace')}")
    return raw


@dataclass
class _Runs:
    """What one concurrency's rounds measured, per kind: latencies (s), failures, wall seconds, front CPU s."""

    times: dict[str, list[float]] = field(default_factory=dict)
    failures: dict[str, list[str]] = field(default_factory=dict)
    wall: dict[str, float] = field(default_factory=dict)
    cpu: dict[str, float] = field(default_factory=dict)


async def _interleaved(
    kinds: dict[str, Callable[[], Awaitable[float]]], pids: dict[str, int], concurrency: int, requests: int, rounds: int
) -> _Runs:
    """``requests // rounds`` of each kind per round, the kinds' order rotated every round."""
    runs = _Runs({k: [] for k in kinds}, {k: [] for k in kinds}, dict.fromkeys(kinds, 0.0), dict.fromkeys(pids, 0.0))
    order = list(kinds.items())
    per_round = max(1, requests // rounds)
    for i in range(rounds):
        for name, fn in order[i % len(order) :] + order[: i % len(order)]:
            started, cpu = time.perf_counter(), _cpu_seconds(pids[name]) if name in pids else 0.0
            runs.times[name] += await _batch(fn, per_round, concurrency, runs.failures[name])
            runs.wall[name] += time.perf_counter() - started
            if name in pids:
                runs.cpu[name] += _cpu_seconds(pids[name]) - cpu
    for name, times in runs.times.items():
        if not times:
            raise RuntimeError(f"every {name} request failed at concurrency {concurrency}: {runs.failures[name][0]}")
    return runs


def _summary(runs: _Runs, concurrency: int) -> dict[str, Any]:
    """Our proxy's figures as before (``added_ms_*``, ``direct_*``, ``proxy_*``), vLLM's router's in a
    ``vllm_router`` object of the same meaning."""
    d, p = _percentiles(runs.times["direct"]), _percentiles(runs.times["proxy"])
    out: dict[str, Any] = {
        "added_ms_p50": round(p["p50"] - d["p50"], 3),
        "added_ms_p99": round(p["p99"] - d["p99"], 3),
        "direct_ms_p50": d["p50"],
        "direct_ms_p99": d["p99"],
        "proxy_ms_p50": p["p50"],
        "proxy_ms_p99": p["p99"],
        "direct_requests_per_s": round(len(runs.times["direct"]) / runs.wall["direct"], 1),
        "proxy_requests_per_s": round(len(runs.times["proxy"]) / runs.wall["proxy"], 1),
        "concurrency": concurrency,
        "requests_each": len(runs.times["direct"]) + len(runs.failures["direct"]),
        "proxy_cpu_ms_per_request": round(runs.cpu["proxy"] / len(runs.times["proxy"]) * 1e3, 3),
        "proxy_cpu_s": round(runs.cpu["proxy"], 2),
        "failed": {name: len(runs.failures[name]) for name in ("direct", "proxy")},  # not in the latencies
    }
    if "vllm_router" in runs.times:
        r = _percentiles(runs.times["vllm_router"])
        router_requests = len(runs.times["vllm_router"])
        out["vllm_router"] = {
            "added_ms_p50": round(r["p50"] - d["p50"], 3),
            "added_ms_p99": round(r["p99"] - d["p99"], 3),
            "ms_p50": r["p50"],
            "ms_p99": r["p99"],
            "requests_per_s": round(len(runs.times["vllm_router"]) / runs.wall["vllm_router"], 1),
            "cpu_ms_per_request": round(runs.cpu["vllm_router"] / len(runs.times["vllm_router"]) * 1e3, 3),
            "cpu_s": round(runs.cpu["vllm_router"], 2),
            "failed": len(runs.failures["vllm_router"]),
        }
        out["vs_vllm_router"] = {
            "cpu_per_request": cpu_per_request_ratio(
                runs.cpu["proxy"], len(runs.times["proxy"]), runs.cpu["vllm_router"], router_requests
            ),
            "p50": round(p["p50"] / r["p50"], 3),
            "p99": round(p["p99"] / r["p99"], 3),
        }
    first = [failures[0] for failures in runs.failures.values() if failures]
    if first:
        out["first_failures"] = first
    return out


def cpu_per_request_ratio(ours_s: float, ours_n: int, theirs_s: float, theirs_n: int) -> float | None:
    """Our CPU per request over theirs, or None when either total is under ``MIN_CPU_TICKS`` clock ticks (``/proc``
    counts CPU in ticks, 10 ms on Linux; a fast router may spend less than one over a short run)."""
    least = MIN_CPU_TICKS / os.sysconf("SC_CLK_TCK")
    if ours_s < least or theirs_s < least or not ours_n or not theirs_n:
        return None
    return round((ours_s / ours_n) / (theirs_s / theirs_n), 2)


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux ``/proc``; 0 elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _batch(fn: Callable[[], Awaitable[float]], count: int, concurrency: int, failures: list[str]) -> list[float]:
    """``count`` calls of ``fn`` with ``concurrency`` in flight (closed loop); the latencies in seconds of those
    that succeeded (the others' errors go to ``failures``)."""
    latencies: list[float] = []
    remaining = count

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            try:
                latencies.append(await fn())
            except Exception as error:  # counted and reported, not hidden
                failures.append(f"{type(error).__name__}: {error}")

    await asyncio.gather(*(worker() for _ in range(min(concurrency, count))))
    return latencies


def _percentiles(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3, 3)

    return {"p50": at(0.50), "p99": at(0.99)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--requests", type=int, default=2000, help="requests of each kind per concurrency (a fifth at concurrency 1)"
    )
    parser.add_argument("--quick", action="store_true", help="200 requests of each kind, for smoke checks")
    parser.add_argument(
        "--prefill-delay", type=float, default=BACKEND_DELAY["prefill_s"], help="stand-in prefill latency (s)"
    )
    parser.add_argument(
        "--token-delay", type=float, default=BACKEND_DELAY["decode_token_s"], help="stand-in decode s per token"
    )
    parser.add_argument("--no-pin", action="store_true", help="do not pin the proxy and the rest to separate cores")
    parser.add_argument(
        "--vllm-router",
        default=None,
        metavar="PATH",
        help="vLLM's router binary to measure beside our proxy (default: found as scripts/setup-deploy installs it)",
    )
    parser.add_argument("--no-vllm-router", action="store_true", help="measure our proxy alone")
    parser.add_argument("--stream", action="store_true", help="streamed decode answers (SSE), read to their end")
    parser.add_argument(
        "--runs", type=int, default=1, metavar="N", help='N whole runs back to back: {"runs": [...]} (default 1)'
    )


def run(args: argparse.Namespace) -> int:
    """``pd-transfer bench proxy [--json] [--quick] [--requests N] [--prefill-delay S] [--token-delay S] [--runs
    N]``."""
    runs = []
    for _ in range(max(1, args.runs)):
        copy_before = host_copy_gbps()
        result = run_bench(
            requests=200 if args.quick else args.requests,
            warmup=20 if args.quick else 100,
            prefill_delay_s=args.prefill_delay,
            token_delay_s=args.token_delay,
            pin=not args.no_pin,
            router=args.vllm_router,
            with_router=not args.no_vllm_router,
            stream=args.stream,
        )
        result["host_copy_gbps"] = {"before": copy_before, "after": host_copy_gbps()}  # 256 MiB, numpy, median of 5
        runs.append(result)
    result = runs[0] if len(runs) == 1 else {"runs": runs}
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pd_transfer.bench.proxy.latency", description=__doc__.split("\n")[0]
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
