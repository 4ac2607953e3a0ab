"""``pd-transfer bench soak --kv-standins``: the release soak. Requests of every kind through the proxy on KV stand-ins
(real KV, NIXL or reads in place, leases, releases), with clients that leave, then every block back to free.

Two prefill and two decode stand-ins (:mod:`pd_transfer.sim.kv_standin`) and the proxy, each its own process. One
round sends ``requests`` requests, ``concurrency`` at a time, of five kinds in turn (completions, streamed
completions, chats, streamed chats, token-id prompts); ``leave_early`` of them are abandoned by their client a few
milliseconds after they were sent (before any byte of the answer: the proxy sees the client leave during a hop,
mostly the prefill's) and ``leave_mid`` streamed ones after their first bytes. Every other request must answer 200
with its tokens and the decode's report that the KV it pulled was the prompt's (``verified``). After each round
every stand-in's blocks must be back to free (the prefills hold no lease) within the lease and a margin.

A request whose client stayed and that failed anyway is a failure; so is a block still held once the round settled.
Issue 33 was found this way: 1-2 requests in 2,000 answered 502 because another request's cancelled prefill hop
released their blocks (:mod:`pd_transfer.proxy.upstream`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import aiohttp

from pd_transfer.bench.soak.vllm_pair import counters, proxy_process, write_result
from pd_transfer.cluster.http_client import RequestFailed, free_port, get_text, scrape_metrics
from pd_transfer.cluster.processes import ManagedProcess, stop_all, wait_ready
from pd_transfer.settings import child_environment
from pd_transfer.sim.kv_model import KVModel
from pd_transfer.transfer.digests import VERIFY_MODES

KINDS = ("completion", "completion_stream", "chat", "chat_stream", "token_ids")
STREAMED = frozenset({"completion_stream", "chat_stream"})
Leaves = Literal["stays", "early", "mid_stream"]
FAILURE_SAMPLES = 8
SETTLE_MARGIN_S = 5.0
REQUEST_TIMEOUT_S = 60.0
#: A leaving client's stream is paced (seconds per token) so that it is still going when the client leaves.
MID_STREAM_TOKEN_S = 0.01


@dataclass(frozen=True)
class Planned:
    """Request ``index`` of a round: its ``kind``, how its client ``leaves``, its prompt's ``words`` and ``tokens``
    to generate; ``early_s``: when an early leaver leaves (seconds after sending)."""

    index: int
    kind: str
    leaves: Leaves
    words: int
    tokens: int
    early_s: float = 0.0

    def path_and_body(self, tag: str) -> tuple[str, dict[str, Any]]:
        """The endpoint and JSON body of this request; ``tag`` makes its prompt distinct from other rounds'."""
        text = " ".join(f"{tag}-{self.index}-{i}" for i in range(self.words))
        body: dict[str, Any] = {"model": "kv-standin", "max_tokens": self.tokens}
        if self.kind.startswith("chat"):
            body["messages"] = [{"role": "user", "content": text}]
        elif self.kind == "token_ids":
            body["prompt"] = [(self.index * 7919 + i * 104729) % 50000 + 1 for i in range(self.words)]
        else:
            body["prompt"] = text
        if self.kind in STREAMED:
            body["stream"] = True
            if self.leaves == "mid_stream":
                body["standin_token_delay_s"] = MID_STREAM_TOKEN_S
        return ("/v1/chat/completions" if self.kind.startswith("chat") else "/v1/completions"), body


def plan_round(requests: int, leave_early: int, leave_mid: int, seed: int) -> list[Planned]:
    """``requests`` requests of the kinds in turn; ``leave_early`` of them (any kind) and ``leave_mid`` streamed ones
    (others) drawn at random (``seed``) to have their client leave."""
    rng = random.Random(seed)
    kinds = [KINDS[i % len(KINDS)] for i in range(requests)]
    early = set(rng.sample(range(requests), min(leave_early, requests)))
    streamed = [i for i in range(requests) if kinds[i] in STREAMED and i not in early]
    mid = set(rng.sample(streamed, min(leave_mid, len(streamed))))
    planned = []
    for i, kind in enumerate(kinds):
        leaves: Leaves = "early" if i in early else "mid_stream" if i in mid else "stays"
        planned.append(Planned(i, kind, leaves, rng.randint(16, 256), rng.randint(2, 8), rng.uniform(0.0, 0.004)))
    return planned


def problem_of(planned: Planned, status: int, raw: bytes) -> str | None:
    """Why a staying client's answer is wrong (None: it is right): not 200, not the tokens asked for, or the
    decode's report (the first word) does not say the pulled KV was verified."""
    if status != 200:
        return f"{status} {raw[:160]!r}"
    chat = planned.kind.startswith("chat")
    try:
        if planned.kind in STREAMED:
            events = [e[len(b"data: ") :] for e in raw.split(b"\n\n") if e.startswith(b"data: ")]
            if not events or events[-1] != b"[DONE]":
                return "the stream did not end with [DONE]"
            chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
            text = "".join(c["delta"].get("content", "") if chat else c["text"] for c in chunks)
        else:
            choice = json.loads(raw)["choices"][0]
            text = choice["message"]["content"] if chat else choice["text"]
        words = text.split()
        report = json.loads(words[0])
    except (ValueError, KeyError, IndexError, TypeError) as error:
        return f"unreadable answer ({type(error).__name__}): {raw[:160]!r}"
    if len(words) != planned.tokens:
        return f"{len(words)} tokens instead of {planned.tokens}"
    if report.get("verified") is not True:
        return f"the decode's KV was not the prompt's: {report}"
    return None


async def send(session: aiohttp.ClientSession, url: str, planned: Planned, tag: str) -> str | None:
    path, body = planned.path_and_body(tag)
    if planned.leaves == "early":

        async def post() -> aiohttp.ClientResponse:
            return await session.post(url + path, json=body)

        posting = asyncio.create_task(post())
        await asyncio.sleep(planned.early_s)  # the client's own behaviour: it leaves this long after sending
        posting.cancel()
        try:
            answer = await posting
        except (asyncio.CancelledError, aiohttp.ClientError):
            return None
        answer.close()  # its head came first: it leaves now
        return None
    try:
        async with session.post(url + path, json=body) as answer:
            if planned.leaves == "mid_stream" and answer.status == 200:
                await answer.content.readany()
                answer.close()  # leaves after its first bytes
                return None
            raw = await answer.read()
            return problem_of(planned, answer.status, raw)
    except (aiohttp.ClientError, TimeoutError) as error:
        return f"{type(error).__name__}: {error}"


async def drive_round(url: str, planned: Sequence[Planned], concurrency: int, tag: str) -> tuple[list[str], float]:
    """Sends ``planned`` through the proxy at ``url``, ``concurrency`` at a time; (failures as ``kind#index: why``,
    seconds)."""
    limit = asyncio.Semaphore(concurrency)
    failures: list[str] = []
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    connector = aiohttp.TCPConnector(limit=concurrency)

    async def one(p: Planned) -> None:
        async with limit:
            problem = await send(session, url, p, tag)
        if problem is not None:
            failures.append(f"{p.kind}#{p.index}: {problem}")

    started = time.monotonic()
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        await asyncio.gather(*(one(p) for p in planned))
    return failures, time.monotonic() - started


def kv_states(standins: Sequence[ManagedProcess]) -> dict[str, dict[str, Any]]:
    """``GET /control/kv`` of every stand-in, by name."""
    return {s.name: json.loads(get_text(s.url + "/control/kv")) for s in standins}


def held(states: dict[str, dict[str, Any]], num_blocks: int) -> dict[str, str]:
    """What each stand-in still holds (empty when every block is free)."""
    out = {}
    for name, state in states.items():
        busy = num_blocks - int(state["blocks_free"])
        leases = int(state.get("blocks_held", 0)) + int(state.get("requests_held", 0))
        if busy or leases:
            out[name] = f"{busy} block(s) not free, {state.get('blocks_held', 0)} held under lease"
    return out


def settle(standins: Sequence[ManagedProcess], num_blocks: int, timeout_s: float) -> tuple[dict[str, str], float]:
    """Polls the stand-ins until every block is free, at most ``timeout_s``: (what is still held, seconds waited)."""
    started = time.monotonic()
    while True:
        left = held(kv_states(standins), num_blocks)
        waited = time.monotonic() - started
        if not left or waited >= timeout_s:
            return left, waited
        time.sleep(0.05)  # polling pace


def standin_process(role: str, index: int, logs: Path, args: argparse.Namespace) -> ManagedProcess:
    """Stand-in ``role``-``index`` as ``args`` say (not started)."""
    port = free_port()
    command = [sys.executable, "-m", "pd_transfer.sim.kv_standin", "--role", role, "--port", str(port)]
    command += ["--engine-id", f"{role}-{index}", "--num-blocks", str(args.num_blocks)]
    command += ["--lease-seconds", str(args.lease), "--transport", args.transport]
    if role == "prefill" and args.corrupt_every:
        command += ["--corrupt-every", str(args.corrupt_every)]
    if role == "decode":
        command += ["--verify", args.verify]
    return ManagedProcess(
        f"{role}-{index}", command, child_environment(), logs / f"{role}-{index}.log", f"http://127.0.0.1:{port}"
    )


def soak(args: argparse.Namespace) -> dict[str, Any]:
    """Starts the stand-ins and the proxy, runs ``args.rounds`` rounds, each settled; stops everything."""
    logs = args.log_dir or Path("runs") / time.strftime("bench-soak-kv-%Y%m%d-%H%M%S")
    standins = [standin_process(role, i, logs, args) for role in ("prefill", "decode") for i in range(2)]
    proxy = proxy_process([s.url for s in standins[:2]], [s.url for s in standins[2:]], logs)
    everything = [*standins, proxy]
    rounds = []
    seed = args.seed if args.seed is not None else time.time_ns() % 10**9
    try:
        for process in everything:
            process.start()
        wait_ready(everything, args.startup_timeout)
        for number in range(args.rounds):
            planned = plan_round(args.requests, args.leave_early, args.leave_mid, seed + number)
            failures, seconds = asyncio.run(drive_round(proxy.url, planned, args.concurrency, f"r{seed}-{number}"))
            left, settled_s = settle(standins, args.num_blocks, args.lease + SETTLE_MARGIN_S)
            rounds.append(
                {
                    "round": number + 1,
                    "failed": len(failures),
                    "failure_samples": sorted(failures)[:FAILURE_SAMPLES],
                    "seconds": round(seconds, 1),
                    "held_after": left,
                    "settled_s": round(settled_s, 2),
                }
            )
            print(
                f"round {number + 1}: {len(failures)} failed, {seconds:.1f} s, held after: {left or 'nothing'}",
                flush=True,
            )
        proxy_text = scrape_metrics(proxy.url)
    except RequestFailed as error:
        raise SystemExit(f"bench soak --kv-standins: {error}; logs in {logs}") from None
    finally:
        stop_all(everything)
    return {
        "bench": "soak_kv",
        "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "standins": "2 prefill, 2 decode (pd_transfer.sim.kv_standin), the proxy; each its own process",
        "transport": args.transport,
        "requests_per_round": args.requests,
        "concurrency": args.concurrency,
        "leave_early": args.leave_early,
        "leave_mid_stream": args.leave_mid,
        "lease_s": args.lease,
        "seed": seed,
        "rounds": rounds,
        "failed": sum(r["failed"] for r in rounds),
        "rounds_with_blocks_held": sum(1 for r in rounds if r["held_after"]),
        "proxy_releases": counters(proxy_text, "pd_proxy_releases_total", "outcome"),
        "proxy_retries": counters(proxy_text, "pd_proxy_retries_total", "reason"),
        "load_average": [round(v, 2) for v in os.getloadavg()],
        "cpus": len(os.sched_getaffinity(0)),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of the stand-in soak, added to ``bench soak``'s."""
    parser.add_argument(
        "--kv-standins",
        action="store_true",
        help="the release soak: KV stand-ins (2 prefills, 2 decodes) instead of vLLM, clients that leave, rounds",
    )
    parser.add_argument("--rounds", type=int, default=1, help="--kv-standins: rounds of --requests, each settled (1)")
    parser.add_argument("--leave-early", type=int, default=40, help="--kv-standins: clients leaving at once (40)")
    parser.add_argument("--leave-mid", type=int, default=40, help="--kv-standins: clients leaving mid-stream (40)")
    parser.add_argument("--num-blocks", type=int, default=KVModel().num_blocks, help="--kv-standins: cache blocks")
    parser.add_argument(
        "--transport",
        choices=("auto", "nixl", "ipc", "tcp"),
        default="auto",
        help="--kv-standins: the stand-ins' transport",
    )
    parser.add_argument(
        "--minutes",
        type=float,
        default=0.0,
        help="--kv-standins: run this long under faults (bench.soak.faults) instead of --rounds (0: rounds)",
    )
    parser.add_argument("--fault-every", type=float, default=30.0, help="--minutes: seconds between faults (30)")
    parser.add_argument(
        "--faults", type=int, default=0, help="--minutes: go on past the minutes until this many faults were done (0)"
    )
    parser.add_argument(
        "--corrupt-every",
        type=int,
        default=0,
        help="--kv-standins: the prefills change a byte of every Nth request's KV once held (0: never)",
    )
    parser.add_argument(
        "--verify", choices=VERIFY_MODES, default="sample", help="--kv-standins: the decodes' digest checks (sample)"
    )
    parser.add_argument("--seed", type=int, default=None, help="--kv-standins: the plan's seed (default: the clock)")


def run(args: argparse.Namespace) -> int:
    """0 when no staying client's request failed and every round ended with every block free, else 1; 130 when
    interrupted (every process is stopped first)."""
    try:
        result = soak(args)
    except KeyboardInterrupt:
        print("interrupted; every server stopped", file=sys.stderr)
        return 130
    text = write_result(result, args.output if args.output is not None else Path("benchmarks/soak_kv.json"))
    if args.json:
        print(text)
    else:
        print(
            f"{len(result['rounds'])} round(s) of {args.requests} requests at concurrency {args.concurrency}:"
            f" {result['failed']} failed; rounds that left blocks held: {result['rounds_with_blocks_held']}"
        )
    return 0 if result["failed"] == 0 and result["rounds_with_blocks_held"] == 0 else 1
