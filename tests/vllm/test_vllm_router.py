"""vLLM's own router (PyPI ``vllm-router``, a Rust binary) in P/D mode in front of a ``pd-transfer up`` cluster,
unchanged: ``vllm-router --vllm-pd-disaggregation --kv-connector nixl --prefill URL --decode URL``.

Real processes: ``pd-transfer up`` (a vLLM prefill and a vLLM decode with PdTransferConnector, and our proxy, which
this test does not use), a plain vLLM server (no connector: the session's ``shared_reference``,
tests/vllm/conftest.py) as the reference, and the router. Completions and chats,
streamed and not, go through the router; each greedy answer must equal the plain server's, the decode must have
loaded every prompt token from outside (``vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}``) by
our pulls (``vllm:pd_transfer_pull_seconds_count``), and the prefill must have seen its lease read
(``vllm:pd_transfer_leases_ended_total{reason="read"}``). Skips, with the reason, without vLLM, the test model or
the router (``scripts/setup-deploy`` installs it).

The same cluster runs ``up --routing kv_aware --max-local-prefill 200``: its engines publish vLLM's KV events; a text
prompt extended and sent again through our proxy (tokenized by the engine's ``/tokenize``) is routed the second time
by the prefix blocks the prefill's events say it holds, and a third time, extended by a few words only, is prefilled
by the decode itself, by the blocks the decode's events say it holds (the answer equal to the plain server's).

``pd-transfer bench proxy`` measures the router beside our proxy over the same stand-ins: a short run here checks
that both fronts answer and that the router's figures sit beside ours.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterator
from typing import Any

import pytest
from deploy_tools import deploy_tool, missing_tool
from up_cluster import UP_TIMEOUT_S, UpCluster, up_cluster
from vllm_servers import DEFAULT_MODEL, free_port, metric_value, ready

from pd_transfer.bench.proxy.router import router_command
from pd_transfer.cluster.http_client import answer_tokens, post_json, post_stream, prompt_tokens, wait_metric
from pd_transfer.cluster.processes import ManagedProcess, stop_all, wait_ready

EXTERNAL = {"source": "external_kv_transfer"}
PROMPT_METRIC = "vllm:prompt_tokens_by_source_total"
PULLS = "vllm:pd_transfer_pull_seconds_count"
LEASES_READ = ("vllm:pd_transfer_leases_ended_total", {"reason": "read"})
MAX_TOKENS = 12
LOCAL_PREFILL = 200  # tokens the decode computes of a prompt it holds the rest of (more than a 128-token block)
ROUTER_START_TIMEOUT_S = 60.0
RUN_SALT = time.time_ns() % 10**9
E2E_TIMEOUT = pytest.mark.timeout(UP_TIMEOUT_S + 900)  # the first test also waits for the servers' startup


def _token_ids(length: int, seed: int) -> list[int]:
    rng = random.Random(seed * 10**9 + RUN_SALT)
    return [rng.randrange(3, 2048) for _ in range(length)]  # 0..2 are <s>, </s>, <pad>


def _words(count: int, seed: int) -> str:
    from pd_transfer.tiny_model import synthetic_corpus

    return " ".join(" ".join(synthetic_corpus(count * 8, corpus_seed=seed + RUN_SALT)).split()[:count])


@pytest.fixture(scope="module")
def setup(
    tiny_model: str, shared_reference: ManagedProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[UpCluster, ManagedProcess, ManagedProcess]]:
    """The cluster, the plain reference server (the session's) and the router in front of the cluster's prefill and
    decode."""
    if (reason := missing_tool("vllm-router")) is not None:
        pytest.skip(reason)
    reference = shared_reference
    work = tmp_path_factory.mktemp("router")
    started = time.monotonic()
    router: ManagedProcess | None = None
    try:
        # our proxy routes kv_aware, with local prefills (the engines publish their KV events): the last tests
        with up_cluster(work, "--routing", "kv_aware", "--max-local-prefill", str(LOCAL_PREFILL)) as cluster:
            command = router_command(
                str(deploy_tool("vllm-router")),
                cluster.urls("prefill"),
                cluster.urls("decode"),
                free_port(),
                free_port(),
            )
            router = ManagedProcess("vllm-router", command, dict(os.environ), work / "router.log", _url(command))
            router.start()
            wait_ready([router], ROUTER_START_TIMEOUT_S)
            ready(reference, UP_TIMEOUT_S)
            print(f"\ncluster, reference and router ready after {time.monotonic() - started:.0f} s: {command}")
            yield cluster, reference, router
    finally:
        if router is not None:
            stop_all([router])


def _url(command: list[str]) -> str:
    return f"http://127.0.0.1:{command[command.index('--port') + 1]}"


CASES = [
    ("completion, 50 token ids", "/v1/completions", False, {"prompt": _token_ids(50, 1)}),
    ("completion, 677 token ids, streamed", "/v1/completions", True, {"prompt": _token_ids(5 * 128 + 37, 2)}),
    ("chat, short", "/v1/chat/completions", False, {"messages": [{"role": "user", "content": _words(12, 3)}]}),
    (
        "chat, multi-block, streamed",
        "/v1/chat/completions",
        True,
        {"messages": [{"role": "user", "content": _words(400, 4)}]},
    ),
]


def _ask(url: str, body: dict[str, Any], streamed: bool) -> dict[str, Any] | list[dict[str, Any]]:
    if streamed:
        return post_stream(url, body | {"stream_options": {"include_usage": True}})
    return post_json(url, body)


@E2E_TIMEOUT
@pytest.mark.parametrize(("name", "endpoint", "streamed", "body"), CASES, ids=[c[0] for c in CASES])
def test_router_answers_equal_a_plain_server_and_the_decode_loads_the_kv(
    setup: tuple[UpCluster, ManagedProcess, ManagedProcess], name: str, endpoint: str, streamed: bool, body: dict
) -> None:
    cluster, reference, router = setup
    chat = endpoint.endswith("chat/completions")
    (prefill,), (decode,) = cluster.urls("prefill"), cluster.urls("decode")
    common = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True, "logprobs": True if chat else 1}
    expected = answer_tokens(post_json(reference.url + endpoint, {**body, **common, "model": DEFAULT_MODEL}), chat=chat)
    loaded_before, pulls_before = metric_value(decode, PROMPT_METRIC, **EXTERNAL), metric_value(decode, PULLS)
    leases_before = metric_value(prefill, LEASES_READ[0], **LEASES_READ[1])
    started = time.perf_counter()
    answer = _ask(router.url + endpoint, {**body, **common, "model": cluster.model}, streamed)
    seconds = time.perf_counter() - started
    got, prompted = answer_tokens(answer, chat=chat), prompt_tokens(answer)
    loaded = metric_value(decode, PROMPT_METRIC, **EXTERNAL) - loaded_before
    pulls = wait_metric(decode, PULLS, lambda v: v > pulls_before, 30.0).value - pulls_before
    leases = wait_metric(prefill, LEASES_READ[0], lambda v: v > leases_before, 30.0, labels=LEASES_READ[1])
    print(f"\n{name}: {prompted} prompt tokens, {seconds:.2f} s through vllm-router, external +{loaded:.0f},")
    print(f"  pulls +{pulls:.0f}, prefill leases read +{leases.value - leases_before:.0f}")
    assert len(expected) == MAX_TOKENS
    assert got == expected, f"{name}: the router's answer differs from a plain vLLM server's\n{got}\n{expected}"
    assert loaded == prompted > 0, f"{name}: the decode loaded {loaded} of {prompted} prompt tokens"
    assert pulls >= 1, f"{name}: no pull counted on the decode"
    assert leases.reached, f"{name}: the prefill's lease was not ended by a read"


def test_bench_proxy_measures_the_router_beside_ours() -> None:
    reason = missing_tool("vllm-router")
    if reason is not None:
        pytest.skip(reason)
    from pd_transfer.bench.proxy.latency import run_bench

    result = run_bench(
        requests=40,
        concurrencies=(1, 8),
        rounds=2,
        warmup=4,
        requests_at_1=10,
        token_delay_s=0.001,
        saturation=False,
        router=deploy_tool("vllm-router"),
    )
    assert result["vllm_router"]["binary"] == "vllm-router"  # by name: no path of this machine in a result
    for key in ("concurrency_1", "concurrency_8"):
        ours, router = result[key], result[key]["vllm_router"]
        print(f"\n{key}: ours +{ours['added_ms_p50']} ms p50, vllm-router +{router['added_ms_p50']} ms p50")
        assert ours["failed"] == {"direct": 0, "proxy": 0} and router["failed"] == 0
        assert router["ms_p50"] > 8  # 20 ms prefill + 8 x 1 ms in the backends
        assert router["cpu_ms_per_request"] >= 0  # /proc counts 10 ms ticks: a short run's ~12 ms can read as 0
        assert router["added_ms_p50"] == pytest.approx(router["ms_p50"] - ours["direct_ms_p50"], abs=1e-3)


@E2E_TIMEOUT
def test_our_proxy_kv_aware_follows_the_prefills_kv_events(
    setup: tuple[UpCluster, ManagedProcess, ManagedProcess],
) -> None:
    """``up --routing kv_aware`` wired the engines' KV events to our proxy: a text prompt extended by more than
    the decode would compute itself (the engine's /tokenize gives its ids, hashed as the engine hashes its blocks)
    matches the blocks its first run stored on the prefill, and no stream reports a hash mismatch."""
    cluster, _, _ = setup
    proxy = cluster.proxy
    body = {"model": cluster.model, "prompt": _words(400, 9), "max_tokens": 2, "temperature": 0.0}
    matched = ("pd_proxy_route_matched_blocks_total", {"role": "prefill", "tier": "engine"})
    post_json(proxy + "/v1/completions", body)
    entries = wait_metric(proxy, "pd_proxy_kv_index_entries", lambda v: v > 0, 30.0)
    assert entries.reached, "the prefill's KV events never reached the proxy's index"
    before = metric_value(proxy, matched[0], **matched[1])
    post_json(proxy + "/v1/completions", body | {"prompt": body["prompt"] + " " + _words(300, 10)})
    gained = metric_value(proxy, matched[0], **matched[1]) - before
    print(f"\nkv_aware: index {entries.value:.0f} entries, the repeat matched {gained:.0f} engine blocks")
    assert metric_value(proxy, "pd_proxy_tokenize_total", result="ok") >= 2
    assert metric_value(proxy, "pd_proxy_kv_event_faults_total", kind="hash_mismatch") == 0
    assert gained > 0, "the repeated prompt matched no block the prefill's events reported"
    assert metric_value(proxy, "pd_proxy_route_choices_total", role="prefill", reason="prefix") >= 1


@E2E_TIMEOUT
def test_our_proxy_prefills_on_the_decode_what_the_decode_holds(
    setup: tuple[UpCluster, ManagedProcess, ManagedProcess],
) -> None:
    """``--max-local-prefill``: once the decode's KV events report a prompt's blocks (it pulled them in a P/D
    request), the same prompt and a few words more goes to the decode alone: no prefill hop, no pull, the decode's
    own prefix cache hit; the answer equals a plain vLLM server's."""
    cluster, reference, _ = setup
    proxy, (prefill,), (decode,) = cluster.proxy, cluster.urls("prefill"), cluster.urls("decode")
    common = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True, "logprobs": 1}
    prompt = _words(400, 11)
    batches = ("pd_proxy_kv_event_batches", {"backend": decode})
    batches_before = metric_value(proxy, batches[0], **batches[1])
    post_json(proxy + "/v1/completions", {**common, "model": cluster.model, "prompt": prompt})  # through P/D
    heard = wait_metric(proxy, batches[0], lambda v: v > batches_before, 30.0, labels=batches[1])
    assert heard.reached, "the decode's KV events never reached the proxy's index"
    local = ("pd_proxy_routes_total", {"path": "local_prefill"})
    held = ("pd_proxy_route_matched_blocks_total", {"role": "decode", "tier": "engine"})
    before = {name: metric_value(proxy, name, **labels) for name, labels in (local, held)}
    prefill_queries, pulls = metric_value(prefill, "vllm:prefix_cache_queries_total"), metric_value(decode, PULLS)
    hits = metric_value(decode, "vllm:prefix_cache_hits_total")
    next_turn = {**common, "prompt": prompt + " and then what happened"}
    answer = post_json(proxy + "/v1/completions", {**next_turn, "model": cluster.model})
    expected = post_json(reference.url + "/v1/completions", {**next_turn, "model": DEFAULT_MODEL})
    gained = {name: metric_value(proxy, name, **labels) - before[name] for name, labels in (local, held)}
    hits_gained = metric_value(decode, "vllm:prefix_cache_hits_total") - hits
    print(f"\nlocal prefill: {gained}, decode prefix hits +{hits_gained:.0f}")
    assert gained[local[0]] == 1, "the next turn was not prefilled on the decode"
    assert gained[held[0]] > 0, "the decode was chosen without its own events' blocks"
    assert metric_value(prefill, "vllm:prefix_cache_queries_total") == prefill_queries, "the prefill saw the request"
    assert metric_value(decode, PULLS) == pulls, "the decode pulled"
    assert hits_gained > 0, "the decode's own cache was not hit"
    assert answer_tokens(answer) == answer_tokens(expected)
