"""Graceful drains of real vLLM servers (CPU) behind our proxy, as a user and an operator see them.

SIGTERM to a server's API server process (what Kubernetes sends to a container) started with ``drain_seconds``
(vLLM's ``--shutdown-timeout`` and our ``DrainMiddleware``): the server answers ``/health`` and every new request
with 503 at once, finishes what it holds (a prefill: every lease, so a decode's outstanding read succeeds; a decode:
the requests it is generating), then exits 0. Our proxy takes it out on its first 503, sends that request to
another server of the role, and routes nothing more to it: no client request fails.

One set of servers serves the module (starting vLLM costs minutes here): prefills A and B, decodes A and B (all with
``drain_seconds``); the plain reference server whose greedy tokens every answer must equal is the session's
(``shared_reference``, tests/vllm/conftest.py: never drained). The prefill drain runs
behind a proxy over both prefills and decode A; the decode drain (prefill A is gone by then) behind a proxy over
prefill B and both decodes. Needs vLLM in the running interpreter and the tiny model, like
``tests/vllm/test_vllm_pd.py``.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from vllm_servers import (
    RequestFailed,
    completion,
    free_port,
    logs_dir,
    metric_value,
    over_tcp,
    ready,
    start_all,
    tokens_of,
    vllm_server,
)

from pd_transfer.cluster.http_client import get_text
from pd_transfer.cluster.processes import ManagedProcess, stop_all

pytestmark = pytest.mark.timeout(1500)

LEASE_S = 20.0  # the prefills' lease: a drain waits at most this long for a decode's read
DRAIN_S = 60.0  # vLLM's --shutdown-timeout: the bound of a drain (lease, then the engine's teardown)
EXIT_WITHIN_S = DRAIN_S + 30.0  # SIGTERM to exit, at most (vLLM force-kills its engine at DRAIN_S)
MAX_TOKENS = 24
PROMPT_TOKENS = 200
EXTERNAL = "external_kv_transfer"
PROMPTS = "vllm:prompt_tokens_by_source_total"
LEASES = "vllm:pd_transfer_leases_ended_total"
USAGE = "vllm:kv_cache_usage_perc"
BUSY = ("vllm:num_requests_running", "vllm:num_requests_waiting")
ENGINE_DRAINS = "EngineCore: start mode=drain"  # vLLM's engine got its SIGTERM (without a drain: killed at once)
SALT = int(os.environ.get("PD_TRANSFER_TEST_SALT", time.time_ns() % 10**9))


@dataclass
class Servers:
    model: str
    prefill_a: ManagedProcess
    prefill_b: ManagedProcess
    decode_a: ManagedProcess
    decode_b: ManagedProcess
    reference: ManagedProcess  # the session's (shared_reference): not this module's to start or stop
    logs: Path
    extra: list[ManagedProcess] = field(default_factory=list)  # proxies
    expected: dict[int, list[str]] = field(default_factory=dict)  # prompt seed -> the reference's tokens

    def everything(self) -> list[ManagedProcess]:
        """The module's own processes (the reference is the session's)."""
        return [self.prefill_a, self.prefill_b, self.decode_a, self.decode_b, *self.extra]

    def proxy(self, prefill: list[ManagedProcess], decode: list[ManagedProcess]) -> ManagedProcess:
        """Our proxy over those servers (health checked every second), started and ready."""
        port = free_port()
        command = [sys.executable, "-m", "pd_transfer.proxy", "--prefill", *(p.url for p in prefill), "--decode"]
        command += [*(d.url for d in decode), "--port", str(port), "--health-interval", "1"]
        name = f"proxy-{len(self.extra) + 1}"
        proxy = ManagedProcess(name, command, dict(os.environ), self.logs / f"{name}.log", f"http://127.0.0.1:{port}")
        self.extra.append(proxy)
        start_all([proxy], timeout_s=60.0)
        return proxy

    def reference_tokens(self, seed: int) -> list[str]:
        if seed not in self.expected:
            self.expected[seed] = tokens_of(completion(self.reference.url, self.model, prompt(seed), MAX_TOKENS))
        return self.expected[seed]


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed * 10**9 + SALT)
    return [rng.randrange(3, 2048) for _ in range(PROMPT_TOKENS)]


@pytest.fixture(scope="module")
def servers(tiny_model: str, shared_reference: ManagedProcess) -> Iterator[Servers]:
    model = tiny_model
    logs = logs_dir("pd-transfer-vllm-drain")
    drained: dict[str, Any] = {"drain_seconds": DRAIN_S}
    made = Servers(
        model,
        over_tcp(
            vllm_server("prefill-a", model, logs, cpu_index=0, lease_seconds=LEASE_S, transport="nixl", **drained)
        ),
        vllm_server("prefill-b", model, logs, cpu_index=1, lease_seconds=LEASE_S, **drained),
        over_tcp(vllm_server("decode-a", model, logs, cpu_index=0, transport="nixl", **drained)),
        vllm_server("decode-b", model, logs, cpu_index=1, **drained),
        shared_reference,
        logs,
    )
    started = time.monotonic()
    start_all(made.everything())
    ready(shared_reference)
    print(f"\n4 vLLM servers and the reference healthy after {time.monotonic() - started:.0f} s")
    try:
        yield made
    finally:
        stop_all(made.everything())


class Traffic:
    """``clients`` threads sending greedy completions through ``proxy``, one after another, each of a new prompt,
    until :meth:`stop`; every answer or failure is kept (seed -> tokens, or the failure)."""

    def __init__(self, servers: Servers, proxy: ManagedProcess, clients: int, first_seed: int) -> None:
        self._servers, self._proxy = servers, proxy
        self._next = first_seed
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self.answers: dict[int, list[str]] = {}
        self.failures: dict[int, str] = {}
        self._threads = [threading.Thread(target=self._client, daemon=True) for _ in range(clients)]
        for thread in self._threads:
            thread.start()

    def _take_seed(self) -> int:
        with self._lock:
            self._next += 1
            return self._next

    def _client(self) -> None:
        while not self._stopping.is_set():
            seed = self._take_seed()
            try:
                answer = completion(self._proxy.url, self._servers.model, prompt(seed), MAX_TOKENS, timeout_s=120)
                self.answers[seed] = tokens_of(answer)
            except (RequestFailed, ValueError) as error:
                self.failures[seed] = f"{type(error).__name__}: {error}"

    @property
    def done(self) -> int:
        return len(self.answers) + len(self.failures)

    def stop(self, timeout_s: float = 180.0) -> None:
        self._stopping.set()
        for thread in self._threads:
            thread.join(max(0.0, timeout_s))
        assert not any(t.is_alive() for t in self._threads), f"clients still running after {timeout_s:.0f} s"

    def check(self, servers: Servers) -> None:
        """No request failed and every answer equals the reference server's greedy tokens."""
        assert not self.failures, f"{len(self.failures)} of {self.done} request(s) failed: {self.failures}"
        wrong = {seed: tokens for seed, tokens in self.answers.items() if tokens != servers.reference_tokens(seed)}
        assert not wrong, f"{len(wrong)} of {self.done} answer(s) differ from the reference server's"


def wait_until(condition: Any, timeout_s: float, what: str, poll_s: float = 0.1) -> float:
    """Poll ``condition()`` until true; its seconds. Fails after ``timeout_s`` naming ``what``."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout_s, f"not within {timeout_s:.0f} s: {what}"
        time.sleep(poll_s)  # polling a condition, bounded by the deadline
    return time.monotonic() - started


def health_status(server: ManagedProcess) -> int | None:
    """The status of ``server``'s ``GET /health`` (None: no answer)."""
    try:
        get_text(f"{server.url}/health", timeout_s=2.0)
        return 200
    except RequestFailed as error:
        return error.status


def proxy_view(proxy: ManagedProcess, server: ManagedProcess) -> dict[str, Any]:
    """The proxy's ``/health`` entry for ``server`` (``healthy``, ``reason``, ``in_flight``)."""
    try:
        body = get_text(f"{proxy.url}/health", timeout_s=5.0)
    except RequestFailed as error:  # 503 while a role has no healthy backend: the body still lists them
        body = error.body
    state = json.loads(body)
    return next(b for b in state["prefill"] + state["decode"] if b["url"] == server.url)


def sigterm(server: ManagedProcess) -> float:
    """SIGTERM to the server's API server process only (not its group); returns ``time.monotonic()``."""
    assert server.process is not None
    server.process.send_signal(signal.SIGTERM)
    return time.monotonic()


def wait_exit(server: ManagedProcess, since: float) -> float:
    """Waits (at most ``EXIT_WITHIN_S`` from ``since``) until the API server exited 0; seconds since ``since``."""
    assert server.process is not None
    code = server.process.wait(max(1.0, since + EXIT_WITHIN_S - time.monotonic()))
    seconds = time.monotonic() - since
    assert code == 0, f"{server.name} exited with {code} after its drain:\n{server.log_tail(40)}"
    return seconds


def expired_leases_logged(server: ManagedProcess) -> list[str]:
    return [line for line in server.log_path.read_text(errors="replace").splitlines() if "expired with" in line]


def test_prefill_drain_lets_the_outstanding_read_finish_and_fails_no_request(servers: Servers) -> None:
    """SIGTERM to prefill A with a request held for a decode not yet read and traffic through the proxy: A answers
    503 at once, the decode's read afterwards succeeds (KV loaded, the reference's tokens), A exits 0 once that lease
    ended, the proxy moved every request to prefill B, none failed; B's leases all ended read, its blocks are free."""
    a, b, decode = servers.prefill_a, servers.prefill_b, servers.decode_a
    proxy = servers.proxy([a, b], [decode])
    held = completion(a.url, servers.model, prompt(1), 1, kv_transfer_params={"do_remote_decode": True})
    params = held["kv_transfer_params"]
    loaded_before = metric_value(decode.url, PROMPTS, source=EXTERNAL)
    traffic = Traffic(servers, proxy, clients=3, first_seed=1000)
    wait_until(lambda: traffic.done >= 3, 120, "three requests through the proxy before the drain")
    since = sigterm(a)
    refused_after = wait_until(lambda: health_status(a) != 200, 10, "the drained prefill's /health leaves 200")
    wait_until(lambda: ENGINE_DRAINS in a.log_path.read_text(errors="replace"), 30, "prefill A's engine drains")
    answer = completion(decode.url, servers.model, prompt(1), MAX_TOKENS, kv_transfer_params=params)
    assert tokens_of(answer) == servers.reference_tokens(1), "the outstanding read gave other tokens"
    loaded = metric_value(decode.url, PROMPTS, source=EXTERNAL) - loaded_before
    assert loaded >= PROMPT_TOKENS - 1, f"the decode loaded {loaded} prompt tokens from the draining prefill"
    wait_until(lambda: proxy_view(proxy, a).get("reason") == "draining", 30, "the proxy sees prefill A draining")
    exited = wait_exit(a, since)
    during = traffic.done
    wait_until(lambda: traffic.done >= during + 3, 120, "three more requests after prefill A exited")
    traffic.stop()
    traffic.check(servers)
    assert not expired_leases_logged(a), f"prefill A let a lease expire: {expired_leases_logged(a)}"
    expired = metric_value(b.url, LEASES, reason="expired") + metric_value(b.url, LEASES, reason="aborted")
    assert expired == 0, f"prefill B ended {expired} lease(s) unread"
    wait_until(lambda: metric_value(b.url, USAGE) == 0, 30, "prefill B holds no block")
    print(
        f"\nprefill drain: /health 503 {refused_after:.2f} s after SIGTERM, exit 0 after {exited:.1f} s (one"
        f" outstanding read); {traffic.done} requests through the proxy, none failed; load {os.getloadavg()[0]:.1f}"
    )


def test_decode_drain_finishes_its_requests_and_fails_no_request(servers: Servers) -> None:
    """SIGTERM to decode A while it generates: its requests finish, new ones go to decode B (the proxy's first 503
    from A is retried there, and so is a request that reached A's engine after the signal: vLLM answers it 200 with
    no tokens and ``finish_reason: "abort"``), A exits 0, no request fails, and prefill B's leases all end read."""
    a, b, prefill = servers.decode_a, servers.decode_b, servers.prefill_b
    proxy = servers.proxy([prefill], [a, b])
    read_before = metric_value(prefill.url, LEASES, reason="read")
    loaded_before = metric_value(b.url, PROMPTS, source=EXTERNAL)
    traffic = Traffic(servers, proxy, clients=4, first_seed=5000)
    wait_until(lambda: sum(metric_value(a.url, name) for name in BUSY) > 0, 120, "decode A busy with requests")
    since = sigterm(a)
    refused_after = wait_until(lambda: health_status(a) != 200, 10, "the drained decode's /health leaves 200")
    wait_until(lambda: proxy_view(proxy, a).get("reason") == "draining", 60, "the proxy sees decode A draining")
    exited = wait_exit(a, since)
    during = traffic.done
    wait_until(lambda: traffic.done >= during + 4, 120, "four more requests after decode A exited")
    traffic.stop()
    traffic.check(servers)
    assert metric_value(b.url, PROMPTS, source=EXTERNAL) > loaded_before, "decode B loaded no KV from the prefill"
    unread = metric_value(prefill.url, LEASES, reason="expired") + metric_value(prefill.url, LEASES, reason="aborted")
    assert unread == 0, f"prefill B ended {unread} lease(s) unread"
    read = wait_until(
        lambda: metric_value(prefill.url, LEASES, reason="read") - read_before >= traffic.done,
        30,
        "a lease ended read on prefill B for every request",
    )
    wait_until(lambda: metric_value(prefill.url, USAGE) == 0, 30, "prefill B holds no block")
    retried = {
        reason: metric_value(proxy.url, "pd_proxy_retries_total", hop="decode", reason=reason)
        for reason in ("draining", "aborted", "connect")
    }
    print(
        f"\ndecode drain: /health 503 {refused_after:.2f} s after SIGTERM, exit 0 after {exited:.1f} s;"
        f" {traffic.done} requests through the proxy, none failed (leases read within {read:.1f} s);"
        f" decode retries by reason {retried}; load {os.getloadavg()[0]:.1f}"
    )
