"""Faults on real vLLM servers (CPU), as a user and an operator see them: a prefill SIGKILLed before the decode's
read and in the middle of a large pull, restarted where it was with the same and with a new engine id, a decode
killed in the middle of a request, 10,000 hostile side-channel frames during real traffic, and a soak through the
proxy. Each case ends within a bound and leaves every held-block and in-flight gauge at 0.

One set of servers serves the module (starting vLLM costs 1-3 minutes here): a prefill (lease ``LEASE_S``), a decode
of failure policy ``recompute``, one of policy ``fail`` behind the proxy; the plain reference server is the
session's (``shared_reference``, tests/vllm/conftest.py: no case here touches it). The prefill is
killed and restarted as the cases go; the ``recompute`` decode is killed last. Needs vLLM in the running interpreter
and the tiny model (``pd-transfer make-model``), like ``tests/vllm/test_vllm_pd.py``.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from fault_kit import (
    FRAME_KINDS,
    Background,
    HeldAnswers,
    fingerprint_of,
    hostile_frames,
    incarnation,
    kill_group,
    kv_config,
    listening_pid,
    pause_group,
    prefill_hops,
    proxy_completion,
    quiet_ports,
    restart,
    resume_group,
    wait_until,
)
from vllm_servers import (
    RequestFailed,
    completion,
    logs_dir,
    metric_value,
    over_tcp,
    ready,
    start_all,
    tokens_of,
    vllm_server,
)

from pd_transfer.bench.soak.vllm_pair import drive, group_rss_bytes, nonzero, proxy_process, rss_bytes, settle
from pd_transfer.cluster.processes import ManagedProcess, stop_all
from pd_transfer.handshake import HandshakeClient
from pd_transfer.proxy.server import Proxy, ProxyConfig
from pd_transfer.sim.handshake_server import RawPeer

pytestmark = pytest.mark.timeout(1200)

LEASE_S = 12.0  # the prefill's lease: short, so that a never-read request is freed within the test
FIRST_ENGINE_ID = "faults-prefill"
MAX_TOKENS = 8
BLOCK = 128  # vLLM's CPU default
ENDS_WITHIN_S = 15.0  # a request whose prefill died ends this soon after the death (confirm timeout 5 s)
EXTERNAL = "external_kv_transfer"
PROMPTS = "vllm:prompt_tokens_by_source_total"
FAILED_LOADS = "vllm:pd_transfer_failed_loads_total"
LEASES = "vllm:pd_transfer_leases_ended_total"
USAGE = "vllm:kv_cache_usage_perc"
WAITING = "vllm:num_requests_waiting"
SALT = int(os.environ.get("PD_TRANSFER_TEST_SALT", time.time_ns() % 10**9))


@dataclass
class Cluster:
    """The module's servers: the prefill's current incarnation (each restart appends one), two decodes, the plain
    reference and the proxy (prefill -> the ``fail`` decode)."""

    model: str
    prefill: ManagedProcess  # the current incarnation
    decode: ManagedProcess  # failure policy recompute
    decode_fail: ManagedProcess  # failure policy fail, behind the proxy
    reference: ManagedProcess  # the session's (shared_reference): not this module's to stop
    proxy: ManagedProcess  # prefill -> decode_fail
    incarnations: list[ManagedProcess] = field(default_factory=list)

    def everything(self) -> list[ManagedProcess]:
        """The module's own processes (the reference is the session's)."""
        return [*self.incarnations, self.decode, self.decode_fail, self.proxy]

    def logs(self) -> str:
        return "\n".join(f"--- {p.name} ---\n{p.log_tail(30)}" for p in (self.prefill, self.decode, self.decode_fail))

    def restart_prefill(self, engine_id: str | None) -> float:
        """Kill the prefill and start it again on the same ports; seconds until the proxy routes to it again."""
        name = f"prefill-{len(self.incarnations) + 1}"
        self.prefill = restart(self.prefill, name, engine_id)
        self.incarnations.append(self.prefill)
        started = time.monotonic()
        self.wait_routable()
        return time.monotonic() - started

    def live_prefill(self) -> None:
        """Restart the prefill (with the first engine id) if a case before this one killed it."""
        if self.prefill.exit_code() is not None:
            self.restart_prefill(FIRST_ENGINE_ID)

    def wait_routable(self, timeout_s: float = 30.0) -> None:
        """Until the proxy counts its prefill and its decode healthy again (a paused or restarted server is taken
        out of its rotation by a failed health check and back in by the next good one, 5 s apart)."""
        healthy = "pd_proxy_backend_healthy"
        wait_until(lambda: metric_value(self.proxy.url, healthy) == 2, timeout_s, "the proxy routes to both")

    def side_channel(self) -> tuple[str, int]:
        extra = kv_config(self.prefill)["kv_connector_extra_config"]
        return str(extra["side_channel_host"]), int(extra["side_channel_port"])


@pytest.fixture(scope="module")
def cluster(tiny_model: str, shared_reference: ManagedProcess) -> Iterator[Cluster]:
    model = tiny_model
    logs = logs_dir("pd-transfer-vllm-faults")
    ports = iter(quiet_ports(7))

    def server(name: str, cpu: int, **changes: Any) -> ManagedProcess:
        return vllm_server(name, model, logs, cpu_index=cpu, port=next(ports), side_channel_port=next(ports), **changes)

    prefill = incarnation(
        over_tcp(server("prefill", 0, lease_seconds=LEASE_S, transport="nixl")), "prefill-1", FIRST_ENGINE_ID
    )
    decode = over_tcp(server("decode", 1, transport="nixl"))
    decode_fail = over_tcp(server("decode-fail", 1, failure_policy="fail", transport="nixl"))
    servers = [prefill, decode, decode_fail]
    started = time.monotonic()
    start_all(servers)
    proxy = proxy_process([prefill.url], [decode_fail.url], logs, next(ports))
    try:
        start_all([proxy], timeout_s=60.0)
        ready(shared_reference)
    except BaseException:
        stop_all(servers)
        raise
    print(f"\nvLLM servers, the reference and the proxy ready after {time.monotonic() - started:.0f} s")
    cluster = Cluster(model, prefill, decode, decode_fail, shared_reference, proxy, [prefill])
    try:
        yield cluster
    finally:
        stop_all(cluster.everything())


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed * 10**9 + SALT)
    return [rng.randrange(3, 2048) for _ in range(length)]


def _reference(cluster: Cluster, prompt: list[int]) -> list[str]:
    return tokens_of(completion(cluster.reference.url, cluster.model, prompt, MAX_TOKENS))


def _hop1(cluster: Cluster, prompt: list[int], tag: str) -> dict[str, Any]:
    first = completion(
        cluster.prefill.url, cluster.model, prompt, 1, kv_transfer_params={"do_remote_decode": True}, request_id=tag
    )
    return dict(first["kv_transfer_params"])


def _hop2(decode: ManagedProcess, model: str, prompt: list[int], params: dict[str, Any]) -> dict[str, Any]:
    return completion(decode.url, model, prompt, MAX_TOKENS, kv_transfer_params=params, timeout_s=60.0)


def _external(server: ManagedProcess) -> float:
    return metric_value(server.url, PROMPTS, source=EXTERNAL)


def _wait_counter(server: ManagedProcess, name: str, at_least: float, timeout_s: float = 15.0, **labels: str) -> None:
    """Our counters reach vLLM's /metrics with the engine's next step report."""
    wait_until(lambda: metric_value(server.url, name, **labels) >= at_least, timeout_s, f"{name}{labels} >= {at_least}")


def _error_json(error: RequestFailed) -> dict[str, Any]:
    try:
        return dict(json.loads(error.body))
    except ValueError:
        return {"unparsed": error.body[:300]}


# ---- a prefill killed before the read, then restarted with the same engine id -----------------------------------


def test_prefill_killed_before_the_read_fails_through_the_proxy_with_502(cluster: Cluster) -> None:
    """Policy ``fail``: the prefill answers the proxy's first hop and dies before the decode reads (the decode is
    paused meanwhile). The client gets a 502 naming the decode hop, within seconds of the decode going on."""
    warm = _prompt(40, seed=10)  # the decode holds this prefill's metadata: what fails is the read, not a handshake
    assert tokens_of(proxy_completion(cluster.proxy.url, cluster.model, warm, MAX_TOKENS, "warm-1"))
    prompt = _prompt(3 * BLOCK + 11, seed=1)
    hops = prefill_hops(cluster.proxy.url)
    failed = metric_value(cluster.decode_fail.url, FAILED_LOADS)
    pause_group(cluster.decode_fail)
    try:
        request = Background(lambda: proxy_completion(cluster.proxy.url, cluster.model, prompt, MAX_TOKENS, "kill-1"))
        wait_until(lambda: prefill_hops(cluster.proxy.url) > hops, 60.0, "the proxy's prefill hop")
        kill_group(cluster.prefill)
    finally:
        resume_group(cluster.decode_fail)
    resumed = time.monotonic()
    answer, error = request.outcome(60.0)
    seconds = time.monotonic() - resumed
    assert error is not None, f"the request succeeded with its prefill dead: {answer}"
    body = _error_json(error).get("error", {})
    print(f"\nprefill killed before the read, policy fail: HTTP {error.status} after {seconds:.1f} s: {body}")
    assert error.status == 502 and body.get("hop") == "decode", body
    assert seconds < ENDS_WITHIN_S
    _wait_counter(cluster.decode_fail, FAILED_LOADS, failed + 1)
    host, port = cluster.side_channel()
    assert f"{host}:{port}" in cluster.decode_fail.log_path.read_text(errors="replace"), "no log line names the peer"


def test_prefill_restarted_with_the_same_engine_id_serves_the_next_request(cluster: Cluster) -> None:
    """The prefill comes back on the same ports and engine id: the next request through the proxy is loaded (every
    prompt token external on the decode), not recomputed, and equals the reference."""
    ready_s = cluster.restart_prefill(FIRST_ENGINE_ID)
    prompt = _prompt(2 * BLOCK + 5, seed=2)
    expected = _reference(cluster, prompt)
    external = _external(cluster.decode_fail)
    started = time.monotonic()
    answer = proxy_completion(cluster.proxy.url, cluster.model, prompt, MAX_TOKENS, "same-id-1")
    print(
        f"\nrestart, same engine id: the proxy routes to it {ready_s:.1f} s after it is healthy,"
        f" next request {time.monotonic() - started:.2f} s"
    )
    assert tokens_of(answer) == expected, cluster.logs()
    assert _external(cluster.decode_fail) - external == len(prompt), "recomputed, not loaded"


# ---- a prefill killed before the read under recompute, then restarted with a new engine id ---------------------


def test_prefill_killed_before_the_read_recomputes(cluster: Cluster) -> None:
    warm = _prompt(40, seed=30)  # the decode holds this prefill's metadata: what fails is the read, not a handshake
    assert tokens_of(_hop2(cluster.decode, cluster.model, warm, _hop1(cluster, warm, f"warm-3-{SALT}")))
    prompt = _prompt(2 * BLOCK + 30, seed=3)
    expected = _reference(cluster, prompt)
    params = _hop1(cluster, prompt, f"kill-2-{SALT}")
    kill_group(cluster.prefill)
    failed, external = metric_value(cluster.decode.url, FAILED_LOADS), _external(cluster.decode)
    started = time.monotonic()
    answer = _hop2(cluster.decode, cluster.model, prompt, params)
    seconds = time.monotonic() - started
    print(f"\nprefill killed before the read, policy recompute: answered in {seconds:.1f} s")
    assert tokens_of(answer) == expected
    assert seconds < ENDS_WITHIN_S
    assert _external(cluster.decode) == external, "tokens counted as loaded from a dead prefill"
    _wait_counter(cluster.decode, FAILED_LOADS, failed + 1)


def test_prefill_restarted_with_a_new_engine_id_serves_the_next_request(cluster: Cluster) -> None:
    ready_s = cluster.restart_prefill(None)  # vLLM draws a new engine id
    prompt = _prompt(3 * BLOCK, seed=4)
    expected = _reference(cluster, prompt)
    params = _hop1(cluster, prompt, f"new-id-{SALT}")
    assert params["remote_engine_id"] != FIRST_ENGINE_ID, params
    external, failed = _external(cluster.decode), metric_value(cluster.decode.url, FAILED_LOADS)
    started = time.monotonic()
    answer = _hop2(cluster.decode, cluster.model, prompt, params)
    print(
        f"\nrestart, new engine id {params['remote_engine_id']}: healthy after {ready_s:.1f} s,"
        f" next decode {time.monotonic() - started:.2f} s"
    )
    assert tokens_of(answer) == expected, cluster.logs()
    assert _external(cluster.decode) - external == len(prompt), "recomputed, not loaded"
    assert metric_value(cluster.decode.url, FAILED_LOADS) == failed


# ---- a prefill killed in the middle of a large pull --------------------------------------------------------------


def test_prefill_killed_during_a_large_pull_ends_with_each_policy(cluster: Cluster) -> None:
    """Two prompts of 15 blocks prefilled, then the prefill paused (SIGSTOP) and each decode sent its request: over
    UCX's TCP transport a read needs the prefill's progress, so both pulls hang in the read until the prefill is
    SIGKILLed. Then ``recompute`` answers the reference's tokens and ``fail`` answers an error, within seconds."""
    for decode in (cluster.decode, cluster.decode_fail):  # both have the current prefill's metadata before it stops
        warm = _prompt(40, seed=50 + len(decode.name))
        assert tokens_of(_hop2(decode, cluster.model, warm, _hop1(cluster, warm, f"warm-{decode.name}-{SALT}")))
    prompts = {
        decode.name: _prompt(15 * BLOCK, seed=60 + len(decode.name)) for decode in (cluster.decode, cluster.decode_fail)
    }
    expected = _reference(cluster, prompts[cluster.decode.name])
    params = {name: _hop1(cluster, prompt, f"large-{name}-{SALT}") for name, prompt in prompts.items()}
    pause_group(cluster.prefill)
    requests = {
        d.name: Background(lambda d=d: _hop2(d, cluster.model, prompts[d.name], params[d.name]))
        for d in (cluster.decode, cluster.decode_fail)
    }
    for decode in (cluster.decode, cluster.decode_fail):
        wait_until(lambda d=decode: metric_value(d.url, WAITING) >= 1, 30.0, f"{decode.name} waits for its pull")
    kill_group(cluster.prefill)
    killed = time.monotonic()
    recomputed, error = requests[cluster.decode.name].outcome(60.0)
    assert error is None, f"recompute failed: {error}\n{cluster.logs()}"
    failed_answer, failed = requests[cluster.decode_fail.name].outcome(60.0)
    ends = {name: (request.finished or killed) - killed for name, request in requests.items()}
    print(f"\nprefill killed mid-pull: requests ended {ends} s after the kill; fail policy: {failed}")
    assert tokens_of(recomputed) == expected
    assert failed is not None and failed.status == 500, f"policy fail answered {failed_answer}"
    assert max(ends.values()) < ENDS_WITHIN_S, ends


# ---- a client gone during the prefill hop ------------------------------------------------------------------------


def test_client_gone_after_the_prefill_answered_frees_its_blocks_at_once(cluster: Cluster) -> None:
    """Issue 24 item 6. A client that leaves while the proxy waits for the prefill: if the prefill's engine is still
    computing, closing the connection makes vLLM abort the request and our connector holds nothing for an aborted
    one; but once the engine has finished, its blocks are held for a decode the proxy will never send them to. The
    proxy reads that answer on (``PREFILL_LEFTOVER_S``) and releases them: freed at once, counted ``released``.
    Before, it closed the connection with the answer unread and the blocks stayed held to the lease's end (counted
    ``expired``). Here the answer waits in a relay until the client has gone, so the proxy cannot have it before."""
    cluster.live_prefill()  # the case before kills it
    prefill = cluster.prefill
    before = {reason: metric_value(prefill.url, LEASES, reason=reason) for reason in ("released", "expired")}
    prompt = _prompt(3 * BLOCK, seed=80)

    async def scenario() -> tuple[float, dict[str, float]]:
        relay = HeldAnswers(prefill.url)
        await relay.start()
        try:
            config = ProxyConfig(prefill=[relay.url], decode=[cluster.decode_fail.url], health_interval_s=600.0)
            async with Proxy(config) as proxy:
                await proxy.start()
                relay.hold()
                async with aiohttp.ClientSession() as client:
                    body = {"model": cluster.model, "prompt": prompt, "max_tokens": MAX_TOKENS}
                    request = asyncio.create_task(client.post(proxy.url + "/v1/completions", json=body))
                    await asyncio.wait_for(relay.answered.wait(), 60.0)  # vLLM answered: it holds the blocks
                    request.cancel()  # the client leaves: its connection to the proxy closes
                    await asyncio.gather(request, return_exceptions=True)
                    hop = proxy.prefill.backends[0]
                    await _poll(lambda: hop.in_flight == 0, 10.0, "the proxy's handler has ended")
                left = time.monotonic()
                relay.release()
                await asyncio.to_thread(
                    _wait_counter, prefill, LEASES, before["released"] + 1, LEASE_S / 2, reason="released"
                )
                return time.monotonic() - left, _releases(proxy)
        finally:
            await relay.stop()

    seconds, releases = asyncio.run(scenario())
    print(f"\nclient gone during the prefill hop: the blocks released {seconds:.2f} s later (lease {LEASE_S:g} s)")
    assert releases == {"releasing": 1}, releases
    assert metric_value(prefill.url, LEASES, reason="expired") == before["expired"]
    wait_until(lambda: metric_value(prefill.url, USAGE) <= 0, 15.0, "the prefill holds nothing")


async def _poll(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Until ``condition()`` holds, on the event loop (which the proxy shares); fails after ``timeout_s``."""
    try:
        async with asyncio.timeout(timeout_s):
            while not condition():
                await asyncio.sleep(0.01)  # polling pace
    except TimeoutError:
        pytest.fail(f"not within {timeout_s:g} s: {what}")


def _releases(proxy: Proxy) -> dict[str, float]:
    """The proxy's ``pd_proxy_releases_total`` by outcome, those above 0."""
    found: dict[str, float] = {}
    for line in proxy.metrics.render().decode().splitlines():
        if line.startswith("pd_proxy_releases_total{"):
            outcome, value = line.split('outcome="', 1)[1].split('"', 1)[0], float(line.rsplit(" ", 1)[1])
            if value:
                found[outcome] = value
    return found


# ---- a decode killed in the middle of a request ------------------------------------------------------------------


def test_decode_killed_mid_request_prefill_frees_at_lease_end(cluster: Cluster) -> None:
    """The decode has the prefill's metadata (a request went through), then is paused, sent a request whose prompt
    the prefill holds, and SIGKILLed. The prefill frees the blocks when the lease ends, counted as expired."""
    cluster.live_prefill()  # restarted by the client-gone case, after the large pull's kill
    warm = _prompt(40, seed=70)
    assert tokens_of(_hop2(cluster.decode, cluster.model, warm, _hop1(cluster, warm, f"warm-kill-{SALT}")))
    wait_until(lambda: metric_value(cluster.prefill.url, USAGE) <= 0, 15.0, "the prefill frees the warm request")
    expired = metric_value(cluster.prefill.url, LEASES, reason="expired")
    prompt = _prompt(4 * BLOCK, seed=71)
    params = _hop1(cluster, prompt, f"orphan-{SALT}")
    held_since = time.monotonic()
    assert metric_value(cluster.prefill.url, USAGE) > 0, "the prefill does not hold the request's blocks"
    pause_group(cluster.decode)
    request = Background(lambda: _hop2(cluster.decode, cluster.model, prompt, params))
    kill_group(cluster.decode)
    _, error = request.outcome(30.0)
    assert error is not None, "a killed decode answered"
    freed = wait_until(lambda: metric_value(cluster.prefill.url, USAGE) <= 0, LEASE_S + 15, "the prefill frees")
    freed_after = time.monotonic() - held_since
    print(
        f"\ndecode killed mid-request ({error}): prefill freed {freed_after:.1f} s after its answer (lease {LEASE_S:g})"
    )
    assert freed_after >= LEASE_S - 2.0, f"freed after {freed_after:.1f} s, before the lease ended"
    _wait_counter(cluster.prefill, LEASES, expired + 1, reason="expired")
    assert freed >= 0


# ---- hostile frames on the side channel during real traffic ------------------------------------------------------

FUZZ_FRAMES = 10_000
#: Bytes the process serving the side channel (vLLM's engine core) may grow by over the frames. Measured: 0-1 MiB
#: for 10,000 frames (30,000 alone: 0); the worker beside it grows with the traffic's first prompts, not the frames.
RSS_GROWTH_BOUND = 16 * 2**20


def test_fuzzed_frames_during_traffic(cluster: Cluster) -> None:
    """10,000 hostile frames (kinds in turn: random, truncated, bit-flipped, wrong msgpack types, unknown tags, and
    one oversized frame in 100) at the prefill's live side channel while requests go through the proxy: every
    request is right, the process serving the side channel grows by less than 16 MiB, and a real handshake
    still succeeds after."""
    cluster.wait_routable()
    host, port = cluster.side_channel()
    fingerprint = fingerprint_of(cluster.model)
    drive(cluster.proxy.url, cluster.model, 16, 8)  # warm
    server = listening_pid(cluster.prefill, port)
    before, group_before = rss_bytes(server), group_rss_bytes(cluster.prefill)
    answers: dict[int, tuple[list[int], list[str]]] = {}
    stop = {"now": False}

    def traffic() -> int:
        index = 0
        while not stop["now"]:
            load = drive(
                cluster.proxy.url,
                cluster.model,
                4,
                4,
                salt=SALT + index,
                on_answer=lambda i, p, t, base=index: answers.__setitem__(base * 4 + i, (p, t)),
            )
            assert load.failed == 0, load.failures
            index += 1
        return index * 4

    background = Background(traffic)
    answered, kinds = _send_frames(host, port, fingerprint)
    stop["now"] = True
    sent = background.result(120.0)
    after, group_after = rss_bytes(server), group_rss_bytes(cluster.prefill)
    with HandshakeClient(fingerprint, timeout_s=5.0, retries=0) as client:
        engine = client.fetch(host, port, fresh=True)
    wrong = [i for i, (prompt, tokens) in answers.items() if tokens != _reference(cluster, prompt)]
    print(
        f"\n{FUZZ_FRAMES} hostile frames ({kinds}), {answered} answered, during {sent} requests: side-channel"
        f" process RSS {before / 2**20:.0f} -> {after / 2**20:.0f} MiB (the prefill's processes"
        f" {group_before / 2**20:.0f} -> {group_after / 2**20:.0f} MiB); handshake after: engine {engine.engine_id}"
    )
    assert sent > 0 and len(answers) == sent and not wrong, f"{len(wrong)} wrong answers of {sent}"
    assert after - before < RSS_GROWTH_BOUND
    assert engine.engine_id == FIRST_ENGINE_ID


def _send_frames(host: str, port: int, fingerprint: Any) -> tuple[int, dict[str, int]]:
    """Send the frames one at a time, waiting (5 s at most) for each reply; a fresh connection after an oversized
    frame (ZMQ drops it and the connection). Returns (replies, frames by kind)."""
    kinds = dict.fromkeys(FRAME_KINDS, 0)
    answered = 0
    peer = RawPeer(host, port)
    try:
        for kind, frame in hostile_frames(FUZZ_FRAMES, fingerprint, seed=SALT):
            kinds[kind] += 1
            peer.send(frame)
            if kind == "oversized":
                peer.close()
                peer = RawPeer(host, port)
                continue
            peer.receive_frames(5.0)
            answered += 1
    finally:
        peer.close()
    return answered, kinds


# ---- the soak ----------------------------------------------------------------------------------------------------

SOAK_REQUESTS = int(os.environ.get("PD_TRANSFER_SOAK_REQUESTS", "1500"))
SOAK_CONCURRENCY = 32


def test_soak_through_the_proxy_leaves_nothing_held(cluster: Cluster) -> None:
    """Requests at concurrency 32 through the proxy (prefill -> the ``fail`` decode): none fails, every held-block
    and in-flight gauge is back to 0 at the end, and every prefill lease ended by its read."""
    cluster.wait_routable()
    leases = {r: metric_value(cluster.prefill.url, LEASES, reason=r) for r in ("read", "expired", "aborted")}
    before = {p.name: group_rss_bytes(p) for p in (cluster.prefill, cluster.decode_fail, cluster.proxy)}
    load = drive(cluster.proxy.url, cluster.model, SOAK_REQUESTS, SOAK_CONCURRENCY)
    servers = {p.name: p.url for p in (cluster.prefill, cluster.decode_fail, cluster.proxy)}
    readings = settle(servers, timeout_s=30.0)
    _wait_counter(cluster.prefill, LEASES, leases["read"] + SOAK_REQUESTS, 30.0, reason="read")
    ended = {r: metric_value(cluster.prefill.url, LEASES, reason=r) - leases[r] for r in leases}
    after = {p.name: group_rss_bytes(p) for p in (cluster.prefill, cluster.decode_fail, cluster.proxy)}
    rss = {name: f"{before[name] / 2**20:.0f} -> {after[name] / 2**20:.0f} MiB" for name in before}
    print(f"\nsoak: {load.as_dict()}; leases ended {ended}; RSS {rss}; load average {os.getloadavg()[0]:.1f}")
    assert load.failed == 0, load.failures
    assert not nonzero(readings), nonzero(readings)
    assert ended == {"read": SOAK_REQUESTS, "expired": 0, "aborted": 0}, ended
