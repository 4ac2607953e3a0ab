"""A network cut between a prefill and a decode heals without restarting either engine (issue 42, item 2).

A KV-moving stand-in prefill (``pd_transfer.sim.kv_standin``, offering ``nixl`` and ``tcp``) in one network
namespace, two stand-in decodes in another (one reading by NIXL, UCX forced onto TCP over the veth; one by the
``tcp`` transport), on a bridge with the proxy on this host, as in ``test_multihost.py``. A read is cut mid-way,
once its first MiB crossed the decode's veth (the wire toward the decode shaped to a few MB/s with ``tc tbf`` so
that a read lasts long enough to be cut): the prefill's link goes down (``ip link set ... down`` at its host end),
or ``tc`` drops only the prefill's data path to the decode (all but the side channel's port), or only its side
channel; for shorter and for longer than the decodes' read timeout; then the wire heals.

What each case asserts: the request in flight ends within a bound, either with the right KV (the stand-in decode
compares every byte it read with the KV of its own prompt, so wrong KV would be a wrong answer) or with a clear
error naming the failed pull, never with wrong KV; once the wire is back, new requests move their KV over the wire
again (the decode's veth received at least the KV's bytes), through the proxy too, with the same processes (same
PIDs, still running); at the end neither side holds a block, and nothing was written into the blocks of a failed
pull after it failed (the decodes keep those blocks from reuse for ``WATCH_S``, a canary in them: a read or push
that timed out and still landed, after the heal, was wrong KV in whatever request got those blocks next; issue 42,
fixed by draining and severing a stalled transfer, ``pd_transfer.transfer.sever``). A case whose prefill died (a crash
in UCX seen now and then under load, ``PREFILL_DIED``), and every case after it, fails expectedly, naming it.

What it prints: how the request in flight ended and when, how long after the heal KV moved again, the handshakes
the decode made (a dropped engine is handshaken afresh), the bytes over the veth.

Skipped where network namespaces cannot be made (not root, no ``ip``/``tc``, no permission). Every wait is
bounded; the processes are stopped and the namespaces deleted in ``finally`` blocks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

aiohttp = pytest.importorskip("aiohttp", reason="the proxy needs the 'proxy' extra (aiohttp)")

from kv_standins import Server, get_json, post_json, report_of, standins, through_proxy, wait_released, words  # noqa: E402
from namespaces import Network, network_or_skip, run  # noqa: E402

pytestmark = pytest.mark.timeout(300)

BLOCK_BYTES = 4 * 2 * 4 * 16 * 64 * 2  # kv_standin's default model: layers x K,V x heads x tokens x dim x bf16
BLOCK_SIZE = 16
NUM_BLOCKS = 256  # each side's cache: 16 MiB
PROMPT_TOKENS = 1024  # 64 blocks, 4 MiB of KV a request
READ_TIMEOUT_S = 4.0  # the decodes' --read-timeout: one request's reads
LEASE_S = 8.0  # the prefill's --lease-seconds: what an unreported lease holds its blocks for at most
WIRE_MBIT = 40  # the wire toward the decodes while a read is cut: 4 MiB take 0.8 s
CUT_AFTER_BYTES = 2**20  # a read is cut once this much more reached the decode's veth
SIDE_CHANNEL_PORT = 5600
HTTP_PORT = {"prefill": 8100, "decode-nixl": 8200, "decode-push": 8201, "decode-tcp": 8202}
# the decodes: (transport, environment). UCX over TCP makes a NIXL decode ask for pushes (PD_TRANSFER_PUSH=auto) of
# requests from 4 MiB: decode-nixl reads everything, decode-push has every request pushed (the prefill writes it)
DECODES = {
    "decode-nixl": ("nixl", {"PD_TRANSFER_PUSH": "off"}),
    "decode-push": ("nixl", {"PD_TRANSFER_PUSH": "on", "PD_TRANSFER_PUSH_MIN_BYTES": "0"}),
    "decode-tcp": ("tcp", {}),
}
# A NIXL read or push that timed out is not over: over UCX's TCP transport its bytes wait in a stalled TCP connection
# and land in the decode's blocks once the wire is back, when the decode may have given those blocks to another
# request (seen here as "verification failed" on the first request after the heal, by reads and pushes, until the
# decode drained a timed-out transfer and severed its connections to the prefill's host). The canary watch below
# catches a late landing even when no later request reads those blocks.
LATE_LANDING = "a NIXL read or push that timed out landed in the decode's blocks after its pull failed"
#: the decodes' --watch-failed-blocks: a failed pull's blocks are kept from reuse this long, a canary in them, so that a
#: transfer that still writes after its pull failed is caught even when nothing reads those blocks again (it covers the
#: longest cut, its heal and TCP's retransmission back-off after it)
WATCH_S = 12.0
HOP_TIMEOUT_S = 30.0  # one HTTP hop, bounded
IN_FLIGHT_BOUND_S = READ_TIMEOUT_S + 12.0  # a request in flight during a cut ends by then after the cut began
HEAL_BOUND_S = 20.0  # after the heal, KV moves again by then
# UCX connects its TCP endpoints without blocking. By default (n) it connect()s inside NIXL's loadRemoteMD, under
# the agent's lock: a decode adding the prefill's agent while the data path drops its packets (the ``data`` cut,
# after the timed-out read dropped the engine) blocked there 35 s, until the kernel gave the SYNs up ("UCX endpoint
# create failed: Destination is unreachable"), whatever the read timeout, every read of that agent waiting behind
# it. Non-blocking, the connect fails the first read on the endpoint, within the read timeout.
UCX_CONNECT = {"UCX_TCP_CONN_NB": "y"}


def kv_bytes(tokens: int) -> int:
    return -(-tokens // BLOCK_SIZE) * BLOCK_BYTES


@dataclass
class Cluster:
    network: Network
    servers: dict[str, Server]
    pids: dict[str, int]

    def check_same_processes(self) -> None:
        for key, server in self.servers.items():
            assert server.process.poll() is None, f"{key} exited with {server.process.returncode}"
            assert server.process.pid == self.pids[key], key


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """The prefill (namespace ``p``) and the decodes (namespace ``d``), started once for the module's cases."""
    tmp_path = tmp_path_factory.mktemp("network-cut")
    with network_or_skip(needs_tc=True) as net:
        specs: dict[str, tuple[dict[str, str], list[str], str | None]] = {}
        roles = {"prefill": ("p", "nixl,tcp", {})} | {key: ("d", *how) for key, how in DECODES.items()}
        for key, (side, transport, extra) in roles.items():
            env = {**os.environ, "UCX_TLS": "tcp", "UCX_NET_DEVICES": net.veth(side), **UCX_CONNECT, **extra}
            address = net.address(side)
            args = ["--host", address, "--port", str(HTTP_PORT[key]), "--engine-id", key, "--transport", transport]
            args += ["--side-channel-host", address, "--side-channel-port", str(SIDE_CHANNEL_PORT)]
            args += ["--num-blocks", str(NUM_BLOCKS), "--read-timeout", str(READ_TIMEOUT_S)]
            args += ["--lease-seconds", str(LEASE_S)]
            if key != "prefill":
                args += ["--watch-failed-blocks", str(WATCH_S)]
            specs[key] = (env, args, net.ns(side))
        with standins(tmp_path, specs) as servers:
            cluster = Cluster(net, servers, {key: server.process.pid for key, server in servers.items()})
            for key in DECODES:  # first contact (handshake, peers) before any cut
                outcome = decode_hop(servers[key], prefill_hop(cluster, f"warm-{key}-"))
                assert outcome.kind == "right", outcome
            yield cluster


# ---- hops ----


@dataclass
class Outcome:
    kind: str  # "right" (200 and the right KV), "error" (a clear error), "wrong" (anything else)
    status: int
    seconds: float
    detail: str
    started: float = 0.0  # time.monotonic() when the hop was sent
    report: dict[str, Any] | None = None


def post(url: str, body: dict[str, Any]) -> tuple[int, str]:
    return post_json(url, body, HOP_TIMEOUT_S)


def prefill_hop(cluster: Cluster, tag: str, tokens: int = PROMPT_TOKENS) -> tuple[str, dict[str, Any]]:
    """The prompt and the ``kv_transfer_params`` its prefill returned (blocks held for a decode)."""
    prompt = words(tokens, tag)
    body = {"model": "m", "prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    status, text = post(cluster.servers["prefill"].url + "/v1/completions", body)
    assert status == 200, (status, text[:2000])
    return prompt, json.loads(text)["kv_transfer_params"]


def decode_hop(decode: Server, prompt_and_params: tuple[str, dict[str, Any]]) -> Outcome:
    """The decode hop of ``prompt``, judged: the right KV, a clear error, or wrong."""
    prompt, params = prompt_and_params
    body = {"model": "m", "prompt": prompt, "max_tokens": 3, "kv_transfer_params": params}
    started = time.monotonic()
    status, text = post(decode.url + "/v1/completions", body)
    seconds = time.monotonic() - started
    if status == 200:
        answer = json.loads(text)["choices"][0]["text"]
        report = report_of(answer)
        right = (
            report["verified"] is True
            and report["bytes"] == kv_bytes(len(prompt.split()))
            and answer.split()[1:] == prompt.split()[:2]
        )
        return Outcome("right" if right else "wrong", status, seconds, answer[:300], started, report)
    clear = status in (500, 502, 503) and "pulling the KV" in text and "verification failed" not in text
    return Outcome("error" if clear else "wrong", status, seconds, text[:500], started)


# ---- the cases ----


@dataclass
class Cut:
    """What a cut did: the outcome of the request it cut, of one sent while it lasted (a ``tc`` cut), the seconds
    after it began when the cut request ended and when the wire healed, the packets ``tc`` dropped."""

    outcome: Outcome
    during: Outcome | None
    ended: float
    healed: float
    healed_at: float  # time.monotonic()
    dropped: int


def cut_mid_read(cluster: Cluster, decode_key: str, tag: str, cut: str, seconds: float) -> Cut:
    """Starts a decode hop, cuts the wire (``cut``) once the read is under way and heals it ``seconds`` later. With a
    ``tc`` cut (the prefill's side channel or its data path still reachable) a second request is sent once the cut
    one ended, while the cut lasts (the heal waits for it: each hop is bounded)."""
    net = cluster.network
    decode = cluster.servers[decode_key]
    shaped = ["tc", "qdisc", "add", "dev", net.host_end("d"), "root", "tbf"]
    shaped += ["rate", f"{WIRE_MBIT}mbit", "burst", "32kb", "latency", "400ms"]
    hop = prefill_hop(cluster, tag)
    rx = net.counters("d")["rx"]
    during = None
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        run(shaped)
        try:
            future = pool.submit(decode_hop, decode, hop)
            deadline = time.monotonic() + 10.0
            while net.counters("d")["rx"] - rx < CUT_AFTER_BYTES:
                assert not future.done(), ("the read ended before it could be cut", future.result())
                assert time.monotonic() < deadline, "the read did not start within 10 s"
                time.sleep(0.002)  # polling pace
            began = time.monotonic()
            apply_cut(net, cut, True)
            try:
                assert not future.done(), ("the read ended before the cut", future.result())
                if cut != "link":
                    future.result(timeout=IN_FLIGHT_BOUND_S + HOP_TIMEOUT_S)
                    during = decode_hop(decode, prefill_hop(cluster, tag + "during-", 256))
                # the rest of the cut's length: the fault itself, not a wait for anything
                time.sleep(max(0.0, began + seconds - time.monotonic()))
            finally:
                dropped = apply_cut(net, cut, False)
            healed = time.monotonic()
        finally:
            run(["tc", "qdisc", "del", "dev", net.host_end("d"), "root"])
        outcome = future.result(timeout=IN_FLIGHT_BOUND_S + HOP_TIMEOUT_S)
    return Cut(outcome, during, outcome.started + outcome.seconds - began, healed - began, healed, dropped)


def apply_cut(net: Network, cut: str, on: bool) -> int:
    """Cuts (``on``) or heals the wire; on healing a ``tc`` cut, returns the packets it dropped (a link cut: 0)."""
    if cut == "link":  # the prefill off the network: nothing reaches it, nothing leaves it
        net.set_link("p", not on)
        return 0
    if not on:
        dropped = net.dropped("p")
        net.undrop("p")
        return dropped
    if cut == "data":  # the prefill's side channel answers, its data path to the decodes is gone
        net.drop_to("p", "d", but_port=SIDE_CHANNEL_PORT)
    elif cut == "side-channel":  # the reverse: the data path stays, the side channel is gone
        net.drop_to("p", "d", port=SIDE_CHANNEL_PORT)
    else:
        raise ValueError(cut)
    return 0


def moves_again(cluster: Cluster, decode_key: str, tag: str, healed_at: float) -> tuple[float, int]:
    """Polls (bounded) until a new request's KV moves to ``decode_key`` again; then two more through the proxy, their
    KV over the veth. Returns the seconds from the heal (``healed_at``, ``time.monotonic()``) to the first request
    whose KV moved, and the failed requests before it."""
    decode = cluster.servers[decode_key]
    started = healed_at
    failed = 0
    n = 0
    while True:
        outcome = decode_hop(decode, prefill_hop(cluster, f"{tag}{n}-", 256))
        n += 1
        assert outcome.kind != "wrong", (outcome, LATE_LANDING)
        if outcome.kind == "right":
            break
        failed += 1
        assert time.monotonic() - started < HEAL_BOUND_S, ("no KV moved within the bound after the heal", outcome)
    took = time.monotonic() - started
    net = cluster.network
    before = net.counters("d")["rx"]
    requests = [
        ("completion", {"model": "m", "prompt": words(PROMPT_TOKENS, tag + "x"), "max_tokens": 3}),
        ("streamed", {"model": "m", "prompt": words(500, tag + "y"), "max_tokens": 3, "stream": True}),
    ]
    results = asyncio.run(through_proxy(cluster.servers["prefill"].url, decode.url, requests))
    moved = 0
    for result in results:
        assert result.report["verified"] is True and result.report["bytes"] == kv_bytes(result.prompt_tokens)
        moved += result.report["bytes"]
    into_decode = net.counters("d")["rx"] - before
    assert into_decode >= moved, (into_decode, moved)
    print(f"  then {len(results)} through the proxy: {moved} B of KV, {into_decode} B into the decode's veth")
    return took, failed


def all_free(cluster: Cluster) -> None:
    """Neither side holds a block, once the decodes' watched blocks (of failed pulls) were checked: none was written
    into after its pull failed."""
    state = wait_released(cluster.servers["prefill"], timeout_s=LEASE_S + 5.0)
    assert state["blocks_held"] == state["requests_held"] == 0 and state["blocks_free"] == NUM_BLOCKS, state
    for key in DECODES:
        deadline = time.monotonic() + WATCH_S + 5.0
        while (state := get_json(cluster.servers[key].url + "/control/kv"))["blocks_watched"]:
            assert time.monotonic() < deadline, (key, state)
            time.sleep(0.1)  # polling pace
        assert state["late_landings"] == 0, (key, state, LATE_LANDING)
        assert state["blocks_free"] == NUM_BLOCKS, (key, state)


# Seen three times in full scripts/test runs on 2 busy cores (2026-11-29), never in the module's runs alone (about
# 20): the prefill stand-in died a fraction of a second after a heal, without a Python traceback, once after the 10 s
# data-path cut and twice after the 8 s link cut with NIXL reads; the kernel logged a general protection fault in UCX
# 1.23.0's libucp at the same address each time (docs/faults.md, "Network cuts"). Every case after it fails
# (connection refused). Not fixed here (UCX's, not reproduced on demand): a case whose prefill died, and every case
# after it, fails expectedly, naming it.
PREFILL_DIED = (
    "known, UCX's: the prefill stand-in died of a general protection fault in libucp (ucp_request_progress_wrapper)"
    " as a cut healed, now and then under load"
)
CASES = [
    # (decode, cut, seconds): a short cut heals inside the read timeout, a long one outlasts it
    ("decode-nixl", "link", 1.0),
    ("decode-nixl", "link", 2 * READ_TIMEOUT_S),
    ("decode-tcp", "link", 1.0),
    ("decode-tcp", "link", 2 * READ_TIMEOUT_S),
    ("decode-nixl", "side-channel", 2 * READ_TIMEOUT_S),  # the side channel gone, the data path answers
    ("decode-push", "link", 1.0),
    ("decode-push", "link", 2 * READ_TIMEOUT_S),
    ("decode-nixl", "data", 2.5 * READ_TIMEOUT_S),  # the reverse
]


@pytest.mark.parametrize(
    ("decode_key", "cut", "seconds"),
    [pytest.param(*case, id=f"{case[0][7:]}-{case[1]}-{case[2]:g}s") for case in CASES],
)
def test_a_cut_mid_read_heals_without_a_restart(cluster: Cluster, decode_key: str, cut: str, seconds: float) -> None:
    prefill = cluster.servers["prefill"].process
    if prefill.poll() is not None:
        pytest.xfail(f"{PREFILL_DIED} (in a case before this one: exit {prefill.returncode})")
    try:
        heals(cluster, decode_key, cut, seconds)
    except Exception:
        if prefill.poll() is None:
            raise
        pytest.xfail(f"{PREFILL_DIED} (exit {prefill.returncode})")


def heals(cluster: Cluster, decode_key: str, cut: str, seconds: float) -> None:
    """The case: a cut mid-read, what the request in flight did, KV moving again, the same processes, nothing held."""
    tag = f"{decode_key[7:]}-{cut}-{seconds:g}-"
    decode = cluster.servers[decode_key]
    handshakes = get_json(decode.url + "/control/kv")["handshakes"]
    done = cut_mid_read(cluster, decode_key, tag, cut, seconds)
    outcome = done.outcome
    print(
        f"\n{decode_key}, {cut} cut for {seconds:g} s mid-read (read timeout {READ_TIMEOUT_S:g} s): the request in"
        f" flight: {outcome.kind} {outcome.status}, {done.ended:.2f} s after the cut began (healed at"
        f" {done.healed:.2f} s; {outcome.detail[:240]!r})"
    )
    assert outcome.kind in ("right", "error"), outcome
    assert done.ended < IN_FLIGHT_BOUND_S, (done, outcome)
    if seconds < READ_TIMEOUT_S:  # the read waits through a short cut: the KV arrives, right
        assert outcome.kind == "right", outcome
    if done.during is not None:
        during = done.during
        print(
            f"  a request sent while cut: {during.kind} {during.status} after {during.seconds:.2f} s"
            f" ({during.detail[:200]!r}); tc dropped {done.dropped} packets"
        )
        assert during.seconds < IN_FLIGHT_BOUND_S, during
    if cut == "data":  # nothing crosses: the request in flight and the one sent meanwhile fail, clearly
        assert outcome.kind == "error" and done.during is not None and done.during.kind == "error", done
        assert done.dropped > 0, done
    if cut == "side-channel":  # once connected, the data path needs no side channel: the KV moves
        assert outcome.kind == "right" and done.during is not None and done.during.kind == "right", done
    took, failed = moves_again(cluster, decode_key, tag, done.healed_at)
    after = get_json(decode.url + "/control/kv")["handshakes"]
    print(
        f"  KV moved again {took:.2f} s after the heal ({failed} failed before); the decode handshook"
        f" {after - handshakes} times"
    )
    cluster.check_same_processes()
    all_free(cluster)
