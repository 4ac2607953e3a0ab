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

The stand-ins answer after a model's latency (``BACKEND_DELAY``): real backends spend a request's time generating
on a GPU, not on the CPU the proxy runs on, and that time sets how many requests per second 64 clients send. With
2 or more cores the proxy is pinned to one core and the client and stand-ins to the others, as a proxy would have
its own core(s) in a deployment. ``saturation`` repeats concurrency 64 against instant stand-ins: the rate is then
bounded only by CPU and the proxy's CPU per request turns into queueing (a worst case, not a deployment).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from pd_transfer.affinity import allowed_cpus
from pd_transfer.proxy import flow
from pd_transfer.proxy.cli import loop_factory

PROMPT = " ".join(f"word{i}" for i in range(64))  # ~83 tokens by the proxy's estimate
TOKENS = 8
BODY = {"model": "standin-model", "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0}
HEADERS = {"Content-Type": "application/json"}
# A small model (~8B) on one current datacenter GPU under load: the prefill of a ~80-token prompt takes ~20 ms
# (time to first token), each generated token ~10 ms (inter-token latency at batch ~64). So a request here takes
# ~20 + 8 x 10 = 100 ms in its backends, and 64 clients send ~640 requests/s.
BACKEND_DELAY = {"prefill_s": 0.020, "decode_token_s": 0.010}


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
) -> dict[str, Any]:
    """Direct vs proxied requests at each concurrency, ``requests`` of each kind per concurrency
    (``requests_at_1`` at concurrency 1: default ``requests // 5``, each takes a backend round trip)."""
    cpus = allowed_cpus()
    pinning = {"proxy": cpus[:1], "client_and_stand_ins": cpus[1:]} if pin and len(cpus) >= 2 else None
    own_affinity = set(cpus)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    procs: list[subprocess.Popen[str]] = []
    try:
        if pinning is not None:
            os.sched_setaffinity(0, pinning["client_and_stand_ins"])  # the client; children inherit it
        delayed = _setup(env, procs, pinning, prefill_delay_s, token_delay_s)
        instant = _setup(env, procs, pinning, 0.0, 0.0) if saturation else None
        counts = {c: (requests_at_1 or max(1, requests // 5)) if c == 1 else requests for c in concurrencies}
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            result = runner.run(_measure(*delayed, counts, rounds, warmup))
            if instant is not None:
                result["saturation"] = runner.run(_measure(*instant, {max(concurrencies): requests}, rounds, warmup))
    finally:
        os.sched_setaffinity(0, own_affinity)
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
            "event_loop": "uvloop" if loop_factory() else "asyncio",
            "load_average_1m": round(os.getloadavg()[0], 2),
        }
    )
    return result


def _setup(
    env: dict[str, str],
    procs: list[subprocess.Popen[str]],
    pinning: dict[str, list[int]] | None,
    prefill_delay_s: float,
    token_delay_s: float,
) -> tuple[str, str, str, int]:
    """Stand-ins and a proxy in front of them: (prefill URL, decode URL, proxy URL, proxy pid)."""
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
    return urls["prefill"], urls["decode"], line.split(" listening on ", 1)[1].split()[0], proxy.pid


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
    prefill: str, decode: str, proxy: str, proxy_pid: int, counts: dict[int, int], rounds: int, warmup: int
) -> dict[str, Any]:
    import aiohttp  # the 'proxy' extra; imported here so the CLI can list this command without it

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:
        endpoint = flow.COMPLETIONS
        proxied_payload = msgspec.json.encode(BODY)

        async def direct() -> float:
            headers = {**HEADERS, "X-Request-Id": uuid.uuid4().hex}
            started = time.perf_counter()
            payload = msgspec.json.encode(flow.prefill_body(endpoint, BODY))
            async with session.post(prefill + endpoint, data=payload, headers=headers) as r:
                raw = await r.read()
                if r.status != 200:
                    raise RuntimeError(f"prefill answered {r.status}: {raw[:300].decode(errors='replace')}")
            params = flow.kv_params_from_prefill(msgspec.json.decode(raw))
            payload = msgspec.json.encode(flow.decode_body(BODY, params))
            async with session.post(decode + endpoint, data=payload, headers=headers) as r:
                raw = await r.read()
                if r.status != 200:
                    raise RuntimeError(f"decode answered {r.status}: {raw[:300].decode(errors='replace')}")
            return time.perf_counter() - started

        async def proxied() -> float:
            headers = {**HEADERS, "X-Request-Id": uuid.uuid4().hex}
            started = time.perf_counter()
            async with session.post(proxy + endpoint, data=proxied_payload, headers=headers) as r:
                raw = await r.read()
                if r.status != 200:
                    raise RuntimeError(f"proxy answered {r.status}: {raw[:300].decode(errors='replace')}")
            return time.perf_counter() - started

        out: dict[str, Any] = {}
        for concurrency, requests in counts.items():
            await _batch(direct, min(warmup, requests), concurrency, [])
            await _batch(proxied, min(warmup, requests), concurrency, [])
            times: dict[str, list[float]] = {"direct": [], "proxy": []}
            failures: dict[str, list[str]] = {"direct": [], "proxy": []}
            wall = {"direct": 0.0, "proxy": 0.0}
            proxy_cpu = 0.0
            per_round = max(1, requests // rounds)
            for i in range(rounds):
                order = (("direct", direct), ("proxy", proxied))
                for name, fn in order if i % 2 == 0 else order[::-1]:
                    started, cpu = time.perf_counter(), _cpu_seconds(proxy_pid)
                    times[name] += await _batch(fn, per_round, concurrency, failures[name])
                    wall[name] += time.perf_counter() - started
                    if name == "proxy":
                        proxy_cpu += _cpu_seconds(proxy_pid) - cpu
            for name in ("direct", "proxy"):
                if not times[name]:
                    raise RuntimeError(f"every {name} request failed at concurrency {concurrency}: {failures[name][0]}")
            d = _percentiles(times["direct"])
            p = _percentiles(times["proxy"])
            out[f"concurrency_{concurrency}"] = {
                "added_ms_p50": round(p["p50"] - d["p50"], 3),
                "added_ms_p99": round(p["p99"] - d["p99"], 3),
                "direct_ms_p50": d["p50"],
                "direct_ms_p99": d["p99"],
                "proxy_ms_p50": p["p50"],
                "proxy_ms_p99": p["p99"],
                "direct_requests_per_s": round(len(times["direct"]) / wall["direct"], 1),
                "proxy_requests_per_s": round(len(times["proxy"]) / wall["proxy"], 1),
                "concurrency": concurrency,
                "requests_each": per_round * rounds,
                "proxy_cpu_ms_per_request": round(proxy_cpu / len(times["proxy"]) * 1e3, 3),
                "failed": {name: len(failed) for name, failed in failures.items()},  # not in the latencies
            }
            first = failures["direct"][:1] + failures["proxy"][:1]
            if first:
                out[f"concurrency_{concurrency}"]["first_failures"] = first
        return out


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


def run(args: argparse.Namespace) -> int:
    """``pd-transfer bench proxy [--json] [--quick] [--requests N] [--prefill-delay S] [--token-delay S]``."""
    result = run_bench(
        requests=200 if args.quick else args.requests,
        warmup=20 if args.quick else 100,
        prefill_delay_s=args.prefill_delay,
        token_delay_s=args.token_delay,
        pin=not args.no_pin,
    )
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pd_transfer.bench.proxy", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
