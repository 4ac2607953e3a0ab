"""``pd-transfer bench proxy``: the latency the proxy adds per request, against calling the backends directly.

Three processes: stand-in backends (one prefill, one decode, instant answers), the proxy (``python -m
pd_transfer.proxy``), and this one, the client. The client times each request end to end, either

- direct: the proxy's flow done by the client itself (prefill with ``kv_transfer_params.do_remote_decode``,
  ``max_tokens`` 1, then the decode with the returned params), same client session, same bodies; or
- proxy: one request to the proxy, which does the same two hops.

Both run at each concurrency in the same run, interleaved in rounds (direct then proxy, then proxy then direct,
...), after a warm-up. ``added_ms_*`` is the proxy's percentile minus the direct one;
``proxy_cpu_ms_per_request`` is the proxy process's CPU time over its requests (load-independent, unlike the
latencies: at concurrency 64 the three processes saturate a 2-core machine and the proxy's CPU becomes queueing).
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

from pd_transfer.proxy import flow
from pd_transfer.proxy.cli import loop_factory

PROMPT = " ".join(f"word{i}" for i in range(64))
BODY = {"model": "standin-model", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
HEADERS = {"Content-Type": "application/json"}


def run_bench(
    requests: int = 2000, concurrencies: tuple[int, ...] = (1, 64), rounds: int = 10, warmup: int = 100
) -> dict[str, Any]:
    """Measures direct vs proxied requests at each concurrency; ``requests`` of each kind per concurrency."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    procs: list[subprocess.Popen[str]] = []
    try:
        standins = _spawn([sys.executable, "-m", "pd_transfer.proxy.standin", "prefill", "decode"], env, procs)
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
             "--port", "0", "--health-interval", "5"],
            env,
            procs,
        )  # fmt: skip
        line = _read_line(proxy, time.monotonic() + 30)
        proxy_url = line.split(" listening on ", 1)[1].split()[0]
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            result = runner.run(
                _measure(urls["prefill"], urls["decode"], proxy_url, proxy.pid, requests, concurrencies, rounds, warmup)
            )
    finally:
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
            "requests_per_setting": requests,
            "rounds": rounds,
            "cpu_count": os.cpu_count(),
            "setup": "stand-in prefill + decode (one process), proxy (one process), client (this process)",
            "event_loop": "uvloop" if loop_factory() else "asyncio",
            "load_average_1m": round(os.getloadavg()[0], 2),
        }
    )
    return result


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
    proxy: str,
    proxy_pid: int,
    requests: int,
    concurrencies: tuple[int, ...],
    rounds: int,
    warmup: int,
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
                    raise RuntimeError(f"prefill answered {r.status}")
            params = flow.kv_params_from_prefill(msgspec.json.decode(raw))
            payload = msgspec.json.encode(flow.decode_body(BODY, params))
            async with session.post(decode + endpoint, data=payload, headers=headers) as r:
                await r.read()
                if r.status != 200:
                    raise RuntimeError(f"decode answered {r.status}")
            return time.perf_counter() - started

        async def proxied() -> float:
            headers = {**HEADERS, "X-Request-Id": uuid.uuid4().hex}
            started = time.perf_counter()
            async with session.post(proxy + endpoint, data=proxied_payload, headers=headers) as r:
                await r.read()
                if r.status != 200:
                    raise RuntimeError(f"proxy answered {r.status}")
            return time.perf_counter() - started

        out: dict[str, Any] = {}
        for concurrency in concurrencies:
            await _batch(direct, warmup, concurrency)
            await _batch(proxied, warmup, concurrency)
            times: dict[str, list[float]] = {"direct": [], "proxy": []}
            wall = {"direct": 0.0, "proxy": 0.0}
            proxy_cpu = 0.0
            per_round = max(1, requests // rounds)
            for i in range(rounds):
                order = (("direct", direct), ("proxy", proxied))
                for name, fn in order if i % 2 == 0 else order[::-1]:
                    started, cpu = time.perf_counter(), _cpu_seconds(proxy_pid)
                    times[name] += await _batch(fn, per_round, concurrency)
                    wall[name] += time.perf_counter() - started
                    if name == "proxy":
                        proxy_cpu += _cpu_seconds(proxy_pid) - cpu
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
                "requests_each": len(times["direct"]),
                "proxy_cpu_ms_per_request": round(proxy_cpu / len(times["proxy"]) * 1e3, 3),
            }
        return out


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux ``/proc``; 0 elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _batch(fn: Callable[[], Awaitable[float]], count: int, concurrency: int) -> list[float]:
    """``count`` calls of ``fn`` with ``concurrency`` in flight (closed loop); their latencies in seconds."""
    latencies: list[float] = []
    remaining = count

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            latencies.append(await fn())

    await asyncio.gather(*(worker() for _ in range(min(concurrency, count))))
    return latencies


def _percentiles(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3, 3)

    return {"p50": at(0.50), "p99": at(0.99)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--requests", type=int, default=2000, help="requests of each kind per concurrency")
    parser.add_argument("--quick", action="store_true", help="200 requests of each kind, for smoke checks")


def run(args: argparse.Namespace) -> int:
    """``pd-transfer bench proxy [--json] [--quick] [--requests N]``."""
    result = run_bench(requests=200 if args.quick else args.requests, warmup=20 if args.quick else 100)
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pd_transfer.proxy.bench", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
