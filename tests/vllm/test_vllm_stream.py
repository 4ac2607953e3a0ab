"""Streamed P/D through real vLLM (issue 41): a prefill and a decode server with the ``tcp`` transport, our proxy (in
this process) with ``stream_kv``. A prefill's first request goes the sequential way (its answer names its engine);
from then on both legs go at once, the decode streaming the KV layer by layer from the prefill as vLLM's
``save_kv_layer`` says each layer is written. Every answer must equal the plain reference server's greedy tokens,
every streamed request's KV must have been loaded (no load failed, so nothing was recomputed in its place), and every
prefill lease must end as read. A streamed request whose prefill leg was lost still gets the reference's answer: the
decode computes the prompt itself once its wait for the stream ends.

Needs vLLM in the running interpreter and the tiny model, like ``tests/vllm/test_vllm_pd.py``.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from dataclasses import dataclass
from typing import Any

import pytest
from vllm_servers import PREFILL_LEASE_S, Serve, completion, logs_dir, metric_value, ready, tokens_of, vllm_missing

_MISSING = vllm_missing()
pytestmark = [pytest.mark.skipif(_MISSING is not None, reason=_MISSING or ""), pytest.mark.timeout(900)]

aiohttp = pytest.importorskip("aiohttp", reason="the proxy needs the 'proxy' extra (aiohttp)")

from fault_kit import Background, kill_group, pause_group  # noqa: E402
from vllm_servers import vllm_server, wait_at_least  # noqa: E402

from pd_transfer.cluster.http_client import wait_metric  # noqa: E402
from pd_transfer.cluster.processes import ManagedProcess  # noqa: E402
from pd_transfer.proxy.flow import stream_params, stream_target  # noqa: E402
from pd_transfer.proxy.server import Proxy, ProxyConfig  # noqa: E402

MAX_TOKENS = 8
PULLS = "vllm:pd_transfer_pull_seconds_count"
LEASES = "vllm:pd_transfer_leases_ended_total"
FAILED_LOADS = "vllm:pd_transfer_failed_loads_total"
ROUTES = "pd_proxy_routes_total"
USAGE = "vllm:kv_cache_usage_perc"
TAILS = "vllm:pd_transfer_stream_tail_seconds_count"
STREAMED_LAYERS = "vllm:pd_transfer_streamed_layers_total"
STREAMED_BYTES = "vllm:pd_transfer_streamed_bytes_total"
WAITING = "vllm:num_requests_waiting"
READ_TIMEOUT_S = 10.0  # the decode's wait for a stream (its connector's read_timeout_s)
RUN_SALT = int(os.environ.get("PD_TRANSFER_TEST_SALT", time.time_ns() % 10**9))


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed * 10**9 + RUN_SALT)
    return [rng.randrange(3, 2048) for _ in range(length)]  # 0..2 are <s>, </s>, <pad>


@dataclass(frozen=True)
class Engines:
    """The module's servers: prefill and decode with the tcp transport (each decode waiting at most
    ``READ_TIMEOUT_S`` for a stream), a second decode for the fault that kills one, and the session's reference."""

    prefill: ManagedProcess
    decode: ManagedProcess
    spare_decode: ManagedProcess
    reference: str


@pytest.fixture(scope="module")
def engines(serve: Serve, shared_reference: ManagedProcess, tiny_model: str) -> Engines:
    logs = logs_dir("pd-transfer-vllm-stream")
    prefill, decode, spare = serve(
        [
            vllm_server("prefill", tiny_model, logs, cpu_index=0, lease_seconds=PREFILL_LEASE_S, transport="tcp"),
            *(
                vllm_server(name, tiny_model, logs, cpu_index=1, transport="tcp", read_timeout_s=READ_TIMEOUT_S)
                for name in ("decode", "decode-spare")
            ),
        ]
    )
    return Engines(prefill, decode, spare, ready(shared_reference).url)


async def _through_proxy(prefill: str, decode: str, model: str, prompts: list[list[int]]) -> tuple[list[dict], float]:
    """Each prompt through a proxy with ``stream_kv``, one after another; (the answers, requests it streamed)."""
    config = ProxyConfig(prefill=[prefill], decode=[decode], stream_kv=True, tokenize=False, health_interval_s=600.0)
    async with Proxy(config) as proxy:
        url = await proxy.start()
        answers = [await asyncio.to_thread(completion, url, model, prompt, MAX_TOKENS) for prompt in prompts]
        streamed = await asyncio.to_thread(metric_value, url, ROUTES, path="streamed")
    return answers, streamed


def test_streamed_requests_through_the_proxy_answer_as_one_engine(engines: Engines, tiny_model: str) -> None:
    prefill, decode, reference = engines.prefill.url, engines.decode.url, engines.reference
    prompts = [_prompt(length, seed) for seed, length in enumerate((300, 3 * 128 + 5, 700, 128))]
    expected = [tokens_of(completion(reference, tiny_model, prompt, MAX_TOKENS)) for prompt in prompts]
    pulls = metric_value(decode, PULLS)
    failed = metric_value(decode, FAILED_LOADS)
    reads = metric_value(prefill, LEASES, reason="read")
    tails = metric_value(decode, TAILS)
    sent = {when: metric_value(prefill, STREAMED_BYTES, when=when) for when in ("computing", "held")}
    answers, streamed = asyncio.run(_through_proxy(prefill, decode, tiny_model, prompts))
    assert [tokens_of(answer) for answer in answers] == expected
    assert streamed == len(prompts) - 1, "the first request learns the prefill's engine; the others stream"
    wait_at_least(decode, PULLS, pulls + len(prompts))  # each one's KV loaded: none computed by the decode instead
    assert metric_value(decode, FAILED_LOADS) == failed
    wait_at_least(prefill, LEASES, reads + len(prompts), reason="read")  # every lease ended by its reader's report
    wait_at_least(decode, TAILS, tails + streamed)  # each streamed load's tail observed
    layers = wait_at_least(decode, STREAMED_LAYERS, streamed)
    during = metric_value(prefill, STREAMED_BYTES, when="computing") - sent["computing"]
    after = metric_value(prefill, STREAMED_BYTES, when="held") - sent["held"]
    assert during > 0, "no layer was sent while the prefill computed (before its hold)"
    print(f"\nstreamed {streamed:.0f} requests, {layers:.0f} layers: {during:.0f} B sent during the forward,")
    print(f"  {after:.0f} B after it")


def test_a_streamed_request_no_prefill_computes_is_computed_by_the_decode(engines: Engines, tiny_model: str) -> None:
    """The decode leg of a streamed request whose prefill leg was lost (it names a stream id no prefill computes):
    the decode's wait for the stream ends after ``READ_TIMEOUT_S``, the load counts as failed, and the decode computes
    the prompt itself: the answer is the reference's, and the prefill holds nothing for it."""
    prefill, decode = engines.prefill.url, engines.decode.url
    target = _target(prefill, decode, tiny_model, seed=100)
    prompt = _prompt(300, 101)
    expected = tokens_of(completion(engines.reference, tiny_model, prompt, MAX_TOKENS))
    failed = metric_value(decode, FAILED_LOADS)
    started = time.monotonic()
    lost = stream_params(target, f"lost-{time.time_ns()}")
    answer = completion(decode, tiny_model, prompt, MAX_TOKENS, kv_transfer_params=lost, timeout_s=READ_TIMEOUT_S + 60)
    waited = time.monotonic() - started
    assert tokens_of(answer) == expected
    assert READ_TIMEOUT_S <= waited < READ_TIMEOUT_S + 60, waited
    wait_at_least(decode, FAILED_LOADS, failed + 1)
    _wait_idle(prefill, 30.0)


def test_a_decode_killed_while_it_waits_on_a_stream_leaves_the_prefill_nothing_held(
    engines: Engines, tiny_model: str
) -> None:
    """A decode waits on a request's stream; it is paused (SIGSTOP: it reads nothing more), the prefill computes the
    request (streaming into the decode's socket whatever the decode had asked for before its pause: with the tiny
    model's forward of milliseconds, often nothing), then the decode is SIGKILLed. The prefill holds the request until
    its lease ends, counts it expired, and then holds nothing."""
    prefill, spare = engines.prefill, engines.spare_decode
    target = _target(prefill.url, spare.url, tiny_model, seed=200)
    prompt = _prompt(700, 201)
    stream_id = f"killed-decode-{time.time_ns()}"
    sent = sum(metric_value(prefill.url, STREAMED_BYTES, when=when) for when in ("computing", "held"))
    expired = metric_value(prefill.url, LEASES, reason="expired")
    decode_leg = _decode_leg(spare, tiny_model, prompt, stream_params(target, stream_id))
    pause_group(spare)
    held = completion(prefill.url, tiny_model, prompt, 1, kv_transfer_params=_prefill_params(stream_id))
    assert held.get("kv_transfer_params"), held
    kill_group(spare)
    _, error = decode_leg.outcome(30.0)
    assert error is not None, "a killed decode answered"
    wait_at_least(prefill.url, LEASES, expired + 1, reason="expired", timeout_s=PREFILL_LEASE_S + 30)
    _wait_idle(prefill.url, 30.0)
    streamed = sum(metric_value(prefill.url, STREAMED_BYTES, when=when) for when in ("computing", "held")) - sent
    print(f"\ndecode killed waiting on its stream ({error}): {streamed:.0f} B streamed; freed at the lease's end")


def test_a_prefill_killed_while_a_decode_waits_on_its_stream(engines: Engines, tiny_model: str) -> None:
    """The module's last test (the prefill does not come back). A decode waits on a request's stream; the prefill is
    paused, sent the request's prefill leg, and SIGKILLed: the decode's connection to it breaks, its load fails at
    once (well before its ``READ_TIMEOUT_S`` wait), it computes the prompt itself, the reference's answer, and then
    holds nothing."""
    prefill, decode = engines.prefill, engines.decode
    target = _target(prefill.url, decode.url, tiny_model, seed=300)
    prompt = _prompt(700, 301)
    expected = tokens_of(completion(engines.reference, tiny_model, prompt, MAX_TOKENS))
    stream_id = f"killed-prefill-{time.time_ns()}"
    failed = metric_value(decode.url, FAILED_LOADS)
    decode_leg = _decode_leg(decode, tiny_model, prompt, stream_params(target, stream_id))
    pause_group(prefill)
    prefill_leg = Background(
        lambda: completion(prefill.url, tiny_model, prompt, 1, kv_transfer_params=_prefill_params(stream_id))
    )
    kill_group(prefill)
    killed = time.monotonic()
    answer = decode_leg.result(READ_TIMEOUT_S + 60)
    after_kill = (decode_leg.finished or killed) - killed
    assert tokens_of(answer) == expected
    assert after_kill < READ_TIMEOUT_S, f"the decode answered {after_kill:.1f} s after the kill: it waited, not noticed"
    _, lost = prefill_leg.outcome(30.0)
    assert lost is not None, "a killed prefill answered"
    wait_at_least(decode.url, FAILED_LOADS, failed + 1)
    _wait_idle(decode.url, 30.0)
    print(f"\nprefill killed while the decode waited on its stream: answered {after_kill:.2f} s after the kill")


def _target(prefill: str, decode: str, model: str, seed: int) -> dict[str, Any]:
    """The prefill engine's params for a streamed decode leg (:func:`stream_target`), learnt from one sequential
    request that ``decode`` reads (so that it has the prefill's metadata too); the prefill frees it."""
    warm = _prompt(200, seed)
    first = completion(prefill, model, warm, 1, kv_transfer_params={"do_remote_decode": True})
    params = first["kv_transfer_params"]
    completion(decode, model, warm, MAX_TOKENS, kv_transfer_params=params)
    target = stream_target(params)
    assert target is not None, params
    return target


def _prefill_params(stream_id: str) -> dict[str, Any]:
    return {"do_remote_decode": True, "stream_id": stream_id}


def _decode_leg(decode: ManagedProcess, model: str, prompt: list[int], params: dict[str, Any]) -> Background:
    """The decode leg sent in the background; returns once the decode holds it waiting for its KV."""
    waiting = metric_value(decode.url, WAITING)
    leg = Background(
        lambda: completion(decode.url, model, prompt, MAX_TOKENS, kv_transfer_params=params, timeout_s=120)
    )
    wait_at_least(decode.url, WAITING, waiting + 1)
    return leg


def _wait_idle(server: str, timeout_s: float) -> None:
    idle = wait_metric(server, USAGE, lambda value: value == 0, timeout_s, poll_s=0.1)
    assert idle.reached, f"{server} still uses {idle.value} of its cache"
