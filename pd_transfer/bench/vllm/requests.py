"""The requests of ``pd-transfer bench vllm`` and what each moved.

Prompts are seeded token ids, lengths interleaved (50, 677, 1500, 50, ...), each different from the others from its
first token. A P/D request is sent as a proxy would: the prompt to the prefill with ``kv_transfer_params
{"do_remote_decode": true}`` and ``max_tokens`` 1, then the prompt with the returned params to the decode (greedy,
``max_tokens`` 16). Per request, from ``/metrics`` deltas: the decode's KV load (NixlConnector:
``vllm:nixl_xfer_time_seconds`` and ``vllm:nixl_bytes_transferred``, NIXL's own transfer telemetry; ours:
``vllm:pd_transfer_pull_seconds`` and ``vllm:pd_transfer_pull_bytes``, first read to usable KV), the decode's
``external_kv_transfer`` prompt tokens, and the seconds from the decode's answer until the prefill's
``vllm:kv_cache_usage_perc`` is back to 0 (its blocks freed).
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pd_transfer.bench.vllm.pairs import Pair
from pd_transfer.cluster.http_client import (
    REQUEST_TIMEOUT_S,
    answer_tokens,
    completion,
    metric_sum,
    scrape_metrics,
    wait_metric,
)

__all__ = [
    "EXTERNAL",
    "LOAD_METRICS",
    "DecodeCounters",
    "decode_hop",
    "make_prompt",
    "pd_request",
    "plan_prompts",
    "prefill_hop",
    "reference_tokens",
    "vocab_size",
]

EXTERNAL = "vllm:prompt_tokens_by_source_total"
USAGE = "vllm:kv_cache_usage_perc"
#: per connector: (seconds histogram, bytes histogram) of the decode's KV loads
LOAD_METRICS = {
    "nixl": ("vllm:nixl_xfer_time_seconds", "vllm:nixl_bytes_transferred"),
    "ours": ("vllm:pd_transfer_pull_seconds", "vllm:pd_transfer_pull_bytes"),
}
METRIC_WAIT_S = 10.0  # connector stats reach /metrics with a later engine step
FREE_WAIT_S = 45.0  # longer than both connectors' 30 s lease: blocks are freed by then either way
ROBUSTNESS_PROMPT_TOKENS = 300

#: The prompts of a run: "warmup" (one), "measured", "robustness" (the malformed request's, the next one's).
Prompts = Mapping[str, list[list[int]]]


def make_prompt(length: int, seed: int, vocab: int) -> list[int]:
    """``length`` seeded token ids, avoiding ids 0-2 (the tiny model's specials)."""
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(length)]


def vocab_size(model: str) -> int:
    """The model folder's ``vocab_size`` (config.json), 2048 (the tiny model's) where it cannot be read."""
    try:
        return int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])
    except (OSError, ValueError, KeyError):
        return 2048


def plan_prompts(lengths: Sequence[int], requests: int, vocab: int) -> dict[str, list[list[int]]]:
    """The prompts: a warm-up, the measured ones (lengths interleaved), and the robustness row's two. Each prompt
    differs from the others from its first token, so no request is helped by another's cached prefix."""
    seeds = iter(range(1, 10**6))
    robustness = ROBUSTNESS_PROMPT_TOKENS
    return {
        "warmup": [make_prompt(lengths[0], next(seeds), vocab)],
        "measured": [make_prompt(lengths[i % len(lengths)], next(seeds), vocab) for i in range(requests)],
        "robustness": [make_prompt(robustness, next(seeds), vocab), make_prompt(robustness, next(seeds), vocab)],
    }


@dataclass(frozen=True)
class DecodeCounters:
    """The decode's cumulative counters that one request moves: KV load seconds, loads, bytes; external tokens."""

    load_seconds: float
    load_count: float
    load_bytes: float
    external_tokens: float

    @classmethod
    def read(cls, base_url: str, connector: str) -> DecodeCounters:
        text = scrape_metrics(base_url)
        seconds, nbytes = LOAD_METRICS[connector]
        return cls(
            metric_sum(text, f"{seconds}_sum"),
            metric_sum(text, f"{seconds}_count"),
            metric_sum(text, f"{nbytes}_sum"),
            metric_sum(text, EXTERNAL, source="external_kv_transfer"),
        )


def _counters_after(pair: Pair, before: DecodeCounters) -> DecodeCounters:
    """The decode's counters once its load of the request shows (or after ``METRIC_WAIT_S`` seconds regardless)."""
    count = f"{LOAD_METRICS[pair.connector][0]}_count"
    wait_metric(pair.decode.url, count, lambda value: value > before.load_count, METRIC_WAIT_S)
    return DecodeCounters.read(pair.decode.url, pair.connector)


def prefill_hop(pair: Pair, prompt: list[int], request_id: str, timeout_s: float = REQUEST_TIMEOUT_S) -> dict[str, Any]:
    """The proxy's first hop: ``prompt`` to the prefill, 1 token, ``do_remote_decode``; its answer (within
    ``timeout_s`` seconds)."""
    params = {"do_remote_decode": True}
    url, model = pair.prefill.url, pair.model
    return completion(url, model, prompt, 1, kv_transfer_params=params, request_id=request_id, timeout_s=timeout_s)


def decode_hop(
    pair: Pair, prompt: list[int], request_id: str, params: Mapping[str, object], timeout_s: float = REQUEST_TIMEOUT_S
) -> dict[str, Any]:
    """The proxy's second hop: ``prompt`` to the decode with the prefill's ``kv_transfer_params``; its answer."""
    return completion(
        pair.decode.url,
        pair.model,
        prompt,
        pair.max_tokens,
        kv_transfer_params=params,
        request_id=request_id,
        timeout_s=timeout_s,
    )


def pd_request(pair: Pair, prompt: list[int], request_id: str) -> dict[str, Any]:
    """One P/D request, then what it moved: seconds (prefill, decode, KV load, until the prefill freed its blocks),
    bytes, ``external_kv_transfer`` tokens, the decode's tokens. Raises ``RequestFailed``, and ``RuntimeError``
    when the prefill returns no ``kv_transfer_params``."""
    before = DecodeCounters.read(pair.decode.url, pair.connector)
    started = time.perf_counter()
    first = prefill_hop(pair, prompt, request_id)
    prefill_s = time.perf_counter() - started
    params = first.get("kv_transfer_params")
    if not params:
        raise RuntimeError(f"{pair.connector}: the prefill returned no kv_transfer_params")
    started = time.perf_counter()
    second = decode_hop(pair, prompt, request_id, params)
    decode_s = time.perf_counter() - started
    freed = wait_metric(pair.prefill.url, USAGE, lambda usage: usage <= 0, FREE_WAIT_S)
    after = _counters_after(pair, before)
    loads = after.load_count - before.load_count
    return {
        "length": len(prompt),
        "prefill_s": round(prefill_s, 4),
        "decode_s": round(decode_s, 4),
        "load_s": round(after.load_seconds - before.load_seconds, 6) if loads else None,
        "loads": int(loads),
        "bytes": int(after.load_bytes - before.load_bytes),
        "external_tokens": int(after.external_tokens - before.external_tokens),
        "freed_s": round(freed.seconds, 3) if freed.reached else None,
        "tokens": answer_tokens(second),
    }


def reference_tokens(url: str, model: str, prompts: Prompts, max_tokens: int) -> dict[str, Any]:
    """The plain server's greedy tokens at ``url``: ``measured`` (one list per measured prompt), ``zzz`` and
    ``after`` (the robustness row's two prompts)."""

    def tokens(prompt: list[int], tag: str) -> list[str]:
        request_id = f"bench-ref-{tag}-{time.time_ns()}"
        return answer_tokens(completion(url, model, prompt, max_tokens, request_id=request_id))

    return {
        "measured": [tokens(p, str(i)) for i, p in enumerate(prompts["measured"])],
        "zzz": tokens(prompts["robustness"][0], "zzz"),
        "after": tokens(prompts["robustness"][1], "after"),
    }
