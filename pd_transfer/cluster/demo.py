"""The requests of ``pd-transfer up --demo``: a few greedy completions and chats through the proxy, each with
what the decode servers' ``/metrics`` say was loaded over the network for it (and, with a reference server,
whether the answer equals a plain vLLM server's)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pd_transfer.cluster.http_client import (
    answer_text,
    metric_sum,
    post_json,
    post_stream,
    prompt_tokens,
    scrape_metrics,
)
from pd_transfer.connector.config import BUILT_IN_TRANSPORTS

__all__ = ["DemoResult", "demo_passage", "demo_requests", "run_demo"]

EXTERNAL_TOKENS = "vllm:prompt_tokens_by_source_total"
EXTERNAL_SOURCE = "external_kv_transfer"
# The connector's own figures, where the server exports them (vLLM's /metrics names them vllm:pd_transfer_*).
PD_PREFIXES = ("vllm:pd_transfer_", "pd_transfer_")
PULLED_BYTES = "pulled_bytes_total"
PULL_SECONDS = "pull_seconds_sum"
PULLS = "pulls_total"  # labelled with the transport that moved each load
#: How the demo says what moved a load: "KV of N prompt tokens loaded ...".
TRANSPORT_PHRASES = {
    "nixl": "over NIXL",
    "host_cma": "in place (host_cma)",
    "host_ipc": "from shared memory (host_ipc)",
    "cuda_ipc": "through CUDA IPC (cuda_ipc)",
}
MAX_TOKENS = 16
MAX_CHAT_TOKENS = 40
QUESTION = "What is the capital of France? Answer in one sentence."


def _figures(decode_urls: Sequence[str]) -> dict[str, float]:
    """The decode servers' cumulative figures now: external prompt tokens, the connector's pulled bytes, pull
    seconds and pulls by transport (``pulls_<transport>``; summed over the servers), and ``has_pd_metrics`` (1.0 when
    any server exports the connector's)."""
    texts = [scrape_metrics(url) for url in decode_urls]
    figures = {"external_tokens": sum(metric_sum(text, EXTERNAL_TOKENS, source=EXTERNAL_SOURCE) for text in texts)}
    for key, suffix in (("pulled_bytes", PULLED_BYTES), ("pull_seconds", PULL_SECONDS)):
        figures[key] = sum(metric_sum(text, prefix + suffix) for text in texts for prefix in PD_PREFIXES)
    for transport in BUILT_IN_TRANSPORTS:
        figures[f"pulls_{transport}"] = sum(
            metric_sum(text, prefix + PULLS, transport=transport) for text in texts for prefix in PD_PREFIXES
        )
    figures["has_pd_metrics"] = float(any(prefix + PULLED_BYTES in text for text in texts for prefix in PD_PREFIXES))
    return figures


@dataclass
class DemoResult:
    """One demo request: its answer, prompt tokens (-1: not reported), seconds through the proxy, what the decode
    servers loaded for it (external prompt tokens; the connector's bytes and seconds, None where not exported;
    the transports its loads went by, empty where not exported), and whether the answer equals the plain server's
    (None: no reference)."""

    name: str
    answer: str
    prompt_tokens: int
    seconds: float
    external_tokens: float
    pulled_bytes: float | None
    pull_seconds: float | None
    same_as_reference: bool | None
    transports: tuple[str, ...] = ()


def demo_requests(model: str, passage: str) -> list[tuple[str, str, dict[str, object], bool]]:
    """(name, endpoint, payload, streamed) of the demo, all greedy: completions of ``MAX_TOKENS`` tokens, chats of
    at most ``MAX_CHAT_TOKENS`` that end where the model ends its answer."""
    common = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
    chat = {"model": model, "max_tokens": MAX_CHAT_TOKENS, "temperature": 0.0}
    usage = {"stream_options": {"include_usage": True}}
    return [
        (
            "completion, short prompt",
            "/v1/completions",
            {**common, "prompt": "Alice saw the old castle near the river and"},
            False,
        ),
        ("completion, multi-block prompt, streamed", "/v1/completions", {**common, "prompt": passage, **usage}, True),
        (
            f"chat, short, {QUESTION!r}",
            "/v1/chat/completions",
            {**chat, "messages": [{"role": "user", "content": QUESTION}]},
            False,
        ),
        (
            "chat, multi-block, streamed",
            "/v1/chat/completions",
            {
                **chat,
                "messages": [{"role": "user", "content": "Summarise this story in one sentence. " + passage}],
                **usage,
            },
            True,
        ),
    ]


def demo_passage(chars: int = 2400) -> str:
    """Deterministic English-like text of about ``chars`` characters (several KV blocks of the tiny model)."""
    from pd_transfer.tiny_model import synthetic_corpus

    text = ""
    for paragraph in synthetic_corpus(chars * 2, corpus_seed=99):
        if len(text) + len(paragraph) > chars and text:
            break
        text = f"{text} {paragraph}".strip()
    return text


def _one_request(
    name: str,
    endpoint: str,
    payload: dict[str, object],
    streamed: bool,
    urls: tuple[str, Sequence[str], str | None],
) -> DemoResult:
    """One demo request through the proxy, with the decode servers' figures before and after it and, with a
    reference server, the same request (not streamed) to it. ``urls``: (proxy, decode servers, reference or None)."""
    proxy_url, decode_urls, reference_url = urls
    chat = endpoint.endswith("chat/completions")
    before = _figures(decode_urls)
    started = time.perf_counter()
    body = post_stream(proxy_url + endpoint, payload) if streamed else post_json(proxy_url + endpoint, payload)
    seconds = time.perf_counter() - started
    after = _figures(decode_urls)
    answer = answer_text(body, chat=chat)
    same = None
    if reference_url is not None:
        plain = {k: v for k, v in payload.items() if k != "stream_options"}
        same = answer_text(post_json(reference_url + endpoint, plain), chat=chat) == answer
    has_pd = bool(after["has_pd_metrics"])
    return DemoResult(
        name=name,
        answer=answer,
        prompt_tokens=prompt_tokens(body),
        seconds=seconds,
        external_tokens=after["external_tokens"] - before["external_tokens"],
        pulled_bytes=after["pulled_bytes"] - before["pulled_bytes"] if has_pd else None,
        pull_seconds=after["pull_seconds"] - before["pull_seconds"] if has_pd else None,
        same_as_reference=same,
        transports=tuple(t for t in BUILT_IN_TRANSPORTS if after[f"pulls_{t}"] > before[f"pulls_{t}"]),
    )


def run_demo(
    proxy_url: str,
    decode_urls: Sequence[str],
    model: str,
    reference_url: str | None = None,
    say: Callable[[str], None] = print,
    block_size: int | None = None,
) -> list[DemoResult]:
    """Send the demo requests one after another through the proxy and report each (via ``say``). Raises
    ``RequestFailed`` (an error status, a timeout, no connection) and ``ValueError``/``KeyError`` (odd answers)."""
    results = []
    say(
        f"demo: {len(demo_requests(model, ''))} greedy requests through {proxy_url} (completions of {MAX_TOKENS}"
        f" tokens, chats of up to {MAX_CHAT_TOKENS})"
    )
    for name, endpoint, payload, streamed in demo_requests(model, demo_passage()):
        result = _one_request(name, endpoint, payload, streamed, (proxy_url, decode_urls, reference_url))
        results.append(result)
        say(_describe(result, block_size))
    loaded = sum(r.external_tokens for r in results)
    line = f"demo: the decode servers loaded {loaded:.0f} prompt tokens' KV from the prefill servers"
    if reference_url is not None:
        line += (
            f"; {sum(bool(r.same_as_reference) for r in results)}/{len(results)} answers equal a plain vLLM server's"
        )
    say(line)
    return results


def _describe(result: DemoResult, block_size: int | None) -> str:
    prompt = f"{result.prompt_tokens} prompt tokens" if result.prompt_tokens >= 0 else "prompt"
    if block_size and result.prompt_tokens > 0:
        prompt += f" ({math.ceil(result.prompt_tokens / block_size)} blocks of {block_size})"
    transfer = f"KV of {result.external_tokens:.0f} prompt tokens loaded"
    if result.transports:
        transfer += " " + " and ".join(TRANSPORT_PHRASES.get(t, t) for t in result.transports)
    if result.pulled_bytes is not None and result.pull_seconds is not None and result.pulled_bytes > 0:
        transfer += f" ({result.pulled_bytes / 1024:.0f} KiB in {result.pull_seconds * 1e3:.1f} ms)"
    check = ""
    if result.same_as_reference is not None:
        check = "; same as plain vLLM: " + ("yes" if result.same_as_reference else "NO")
    return f"  {result.name}: {prompt}, {result.seconds:.2f} s; {transfer}{check}\n    -> {result.answer!r}"
