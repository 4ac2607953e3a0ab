"""``pd-transfer bench soak --kv-standins --minutes M``: the soak under faults (issue 42, item 3). Requests at a
steady load through the proxy on KV stand-ins for ``M`` minutes while faults come on a schedule, and every answer
judged: right, a clear error, or wrong.

The stand-ins and the proxy of :mod:`.kv_standins` (two prefills, two decodes, each its own process; transport and
``verify`` as given), the rounds of its plan sent one after another without a pause (clients that leave included),
for ``M`` minutes and until ``--faults`` faults were done (bounded).
Every ``--fault-every`` seconds the next fault of :data:`FAULTS` hits the second prefill or the second decode: killed
(SIGKILL) and started again on its port, or drained (SIGTERM: it finishes what it holds) and started again. With
``--corrupt-every N`` each prefill changes a byte of every Nth request's KV once it is held (after its forward).
The first prefill, the first decode and the proxy live throughout: their RSS and open descriptors are read when they
are up, after the first round, and at the end.

An answer is *right* (200, the tokens asked for, the decode's report that the KV it used was the prompt's), a *clear
error* (a status and a reason: a peer killed mid-request, a pull that failed), or *wrong* (a 200 that is not right,
or the decode's own byte check failing: the KV it would have used was not the prompt's). Nothing may be wrong; at the
end every block of every stand-in is free. ``injected``: the bytes the prefills changed; ``digest_mismatches``: the
pulls the decodes failed on a digest (each read from the stand-in before it is stopped, and at the end). The proxy
retries a failed decode hop elsewhere, so one corrupted request may fail more than one pull (the retry finds the
request freed by the first one's report: a mismatch too, or an unconfirmed lease), and one whose client left or that a
fault took is never read: the two counts need not be equal; that no answer is wrong is what shows the digests caught
them (``tests/process/test_corrupted_kv.py`` counts them one for one, without a proxy).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from pd_transfer.cluster.http_client import get_text, scrape_metrics
from pd_transfer.cluster.processes import ManagedProcess, stop_all, wait_ready

from .kv_standins import (
    REQUEST_TIMEOUT_S,
    SETTLE_MARGIN_S,
    Planned,
    plan_round,
    problem_of,
    send,
    settle,
    standin_process,
)
from .vllm_pair import counters, proxy_process, write_result

#: The faults, in turn: (what, whom).
FAULTS = (("kill", "prefill-1"), ("kill", "decode-1"), ("drain", "prefill-1"))
SAMPLES = 8
RESTART_TIMEOUT_S = 120.0


@dataclass
class Tally:
    """What the clients saw."""

    right: int = 0
    errors: int = 0
    wrong: int = 0
    left: int = 0  # clients that left on purpose
    error_samples: list[str] = field(default_factory=list)
    wrong_samples: list[str] = field(default_factory=list)

    def add(self, planned: Planned, outcome: str, detail: str) -> None:
        if outcome == "right":
            self.right += 1
        elif outcome == "left":
            self.left += 1
        elif outcome == "wrong":
            self.wrong += 1
            self.wrong_samples = [*self.wrong_samples, f"{planned.kind}#{planned.index}: {detail}"][:SAMPLES]
        else:
            self.errors += 1
            self.error_samples = [*self.error_samples, f"{planned.kind}#{planned.index}: {detail[:300]}"][-SAMPLES:]


def judge(planned: Planned, status: int, raw: bytes) -> tuple[str, str]:
    """(right | error | wrong, why) of a staying client's answer (see the module's doc)."""
    problem = problem_of(planned, status, raw)
    if problem is None:
        return "right", ""
    if status == 200 or b"verification failed" in raw:
        return "wrong", problem
    return "error", raw[:600].decode(errors="replace")


async def _send(session: aiohttp.ClientSession, url: str, planned: Planned, tag: str) -> tuple[str, str]:
    if planned.leaves != "stays":  # it leaves as the plain soak's clients do
        await send(session, url, planned, tag)
        return "left", ""
    path, body = planned.path_and_body(tag)
    try:
        async with session.post(url + path, json=body) as answer:
            return judge(planned, answer.status, await answer.read())
    except (aiohttp.ClientError, TimeoutError) as error:
        return "error", f"client: {type(error).__name__}: {error}"


async def drive(url: str, args: argparse.Namespace, seed: int, another: Callable[[int], bool]) -> Tally:
    """Rounds of the plan through the proxy at ``url``, ``args.concurrency`` at a time, judged, while
    ``another(rounds_done)``."""
    tally = Tally()
    limit = asyncio.Semaphore(args.concurrency)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)

    async def one(planned: Planned, tag: str) -> None:
        async with limit:
            outcome, detail = await _send(session, url, planned, tag)
        tally.add(planned, outcome, detail)

    connector = aiohttp.TCPConnector(limit=args.concurrency)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        for number in itertools.takewhile(another, itertools.count()):
            planned = plan_round(args.requests, args.leave_early, args.leave_mid, seed + number)
            await asyncio.gather(*(one(p, f"f{seed}-{number}") for p in planned))
    return tally


@dataclass
class Faults:
    """The fault schedule, run on a thread of its own until :meth:`stop`; what it did in :attr:`done`, the bytes the
    prefills it stopped had changed in :attr:`injected_before`, the digest mismatches the decodes it stopped had seen
    in :attr:`detected_before`."""

    servers: dict[str, ManagedProcess]
    every_s: float
    started: float
    done: list[dict[str, Any]] = field(default_factory=list)
    injected_before: int = 0
    detected_before: int = 0
    failure: str = ""
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        for kind, name in itertools.cycle(FAULTS):
            if self._stop.wait(self.every_s):
                return
            try:
                self._inject(kind, self.servers[name])
            except Exception as error:  # recorded: the soak ends with it
                self.failure = f"{kind} {name}: {type(error).__name__}: {error}"
                return

    def _inject(self, kind: str, server: ManagedProcess) -> None:
        began = time.monotonic()
        state = json.loads(get_text(server.url + "/control/kv"))
        self.injected_before += int(state.get("corrupted", 0))
        self.detected_before += int(state.get("digest_mismatches", 0))
        server.signal_group(signal.SIGKILL if kind == "kill" else signal.SIGTERM)
        assert server.process is not None
        server.process.wait(timeout=60.0)  # a drain ends once its leases did (bounded by the lease)
        stopped = time.monotonic()
        server.ready_after_s = None
        server.start()
        wait_ready([server], RESTART_TIMEOUT_S)
        self.done.append(
            {
                "at_s": round(began - self.started, 1),
                "fault": f"{kind} {server.name}",
                "stopped_in_s": round(stopped - began, 2),
                "back_in_s": round(time.monotonic() - stopped, 2),
            }
        )
        print(f"fault {len(self.done)}: {kind} {server.name} at {began - self.started:.0f} s", flush=True)

    def stop(self) -> None:
        self._stop.set()


def footprint(servers: Sequence[ManagedProcess]) -> dict[str, dict[str, float]]:
    """RSS (MiB) and open descriptors of each of ``servers``' leading process."""
    out = {}
    for server in servers:
        status = open(f"/proc/{server.pid}/status").read()
        rss_kb = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")))
        out[server.name] = {"rss_mib": round(rss_kb / 1024, 1), "fds": len(os.listdir(f"/proc/{server.pid}/fd"))}
    return out


def soak(args: argparse.Namespace) -> dict[str, Any]:
    """Starts the stand-ins and the proxy, drives them for ``args.minutes`` with faults, settles; stops everything."""
    logs = args.log_dir or Path("runs") / time.strftime("bench-soak-faults-%Y%m%d-%H%M%S")
    standins = [standin_process(role, i, logs, args) for role in ("prefill", "decode") for i in range(2)]
    proxy = proxy_process([s.url for s in standins[:2]], [s.url for s in standins[2:]], logs)
    everything = [*standins, proxy]
    lasting = [standins[0], standins[2], proxy]
    seed = args.seed if args.seed is not None else time.time_ns() % 10**9
    by_name = {s.name: s for s in standins}
    try:
        for process in everything:
            process.start()
        wait_ready(everything, args.startup_timeout)
        at_start = footprint(lasting)
        started = time.monotonic()
        warm = asyncio.run(drive(proxy.url, args, seed - 1, lambda done: done < 1))  # one round, no faults yet
        after_warm_up = footprint(lasting)
        faults = Faults(by_name, args.fault_every, started)
        thread = threading.Thread(target=faults.run, name="soak-faults", daemon=True)
        thread.start()
        try:
            until = started + args.minutes * 60.0
            latest = until + args.faults * (args.fault_every + RESTART_TIMEOUT_S)  # faults come slower under load

            def another(_: int) -> bool:
                now = time.monotonic()
                return now < until or (len(faults.done) < args.faults and now < latest and not faults.failure)

            tally = asyncio.run(drive(proxy.url, args, seed, another))
        finally:
            faults.stop()
            thread.join(timeout=RESTART_TIMEOUT_S + 70.0)
        seconds = time.monotonic() - started
        left, settled_s = settle(standins, args.num_blocks, args.lease + SETTLE_MARGIN_S)
        states = {s.name: json.loads(get_text(s.url + "/control/kv")) for s in standins}
        at_end = footprint(lasting)
        proxy_text = scrape_metrics(proxy.url)
    finally:
        stop_all(everything)
    injected = faults.injected_before + sum(int(states[s.name].get("corrupted", 0)) for s in standins[:2])
    detected = faults.detected_before + sum(int(states[s.name].get("digest_mismatches", 0)) for s in standins[2:])
    return {
        "bench": "soak_faults",
        "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "standins": "2 prefill, 2 decode (pd_transfer.sim.kv_standin), the proxy; each its own process",
        "transport": args.transport,
        "verify": args.verify,
        "minutes": round(seconds / 60.0, 1),
        "concurrency": args.concurrency,
        "requests_per_round": args.requests,
        "fault_every_s": args.fault_every,
        "corrupt_every": args.corrupt_every,
        "seed": seed,
        "warm_up": {"right": warm.right, "errors": warm.errors, "wrong": warm.wrong},
        "answers": {
            "right": tally.right,
            "clear_errors": tally.errors,
            "wrong": tally.wrong,
            "clients_left": tally.left,
        },
        "corrupted": {"injected": injected, "digest_mismatches": detected},
        "faults": faults.done,
        "fault_failure": faults.failure,
        "error_samples": tally.error_samples,
        "wrong_samples": tally.wrong_samples,
        "blocks_held_after": left,
        "settled_s": round(settled_s, 2),
        "footprint": {"start": at_start, "after_first_round": after_warm_up, "end": at_end},
        "proxy_requests_by_status": counters(proxy_text, "pd_proxy_requests_total", "status"),
        "proxy_routes": counters(proxy_text, "pd_proxy_routes_total", "path"),
        "pulls_at_end": {s.name: states[s.name].get("pulls") for s in standins[2:]},
        "load_average": [round(v, 2) for v in os.getloadavg()],
        "cpus": len(os.sched_getaffinity(0)),
    }


def passed(result: dict[str, Any]) -> bool:
    """Nothing wrong, every block free, every fault done."""
    return result["answers"]["wrong"] == 0 and not result["blocks_held_after"] and not result["fault_failure"]


def run(args: argparse.Namespace) -> int:
    """``bench soak --kv-standins --minutes M``: 0 when it passed (:func:`passed`), else 1; 130 when interrupted
    (every server is stopped first)."""
    try:
        result = soak(args)
    except KeyboardInterrupt:
        print("interrupted; every server stopped", file=sys.stderr)
        return 130
    text = write_result(result, args.output if args.output is not None else Path("benchmarks/soak_faults.json"))
    answers, corrupted = result["answers"], result["corrupted"]
    if args.json:
        print(text)
    else:
        print(
            f"{result['minutes']} min, {len(result['faults'])} faults: {answers['right']} right,"
            f" {answers['clear_errors']} clear errors, {answers['wrong']} wrong, {answers['clients_left']} left;"
            f" corrupted {corrupted['injected']}, digest mismatches {corrupted['digest_mismatches']};"
            f" blocks held after: {result['blocks_held_after'] or 'none'}"
        )
    return 0 if passed(result) else 1
