"""The requests of ``pd-transfer up --demo``: a few greedy completions and chats through the proxy, each with
what the decode servers' ``/metrics`` say was loaded over the network for it (and, with a reference server,
whether the answer equals a plain vLLM server's)."""

from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

__all__ = ["DemoResult", "metric_sum", "post_json", "post_stream", "run_demo"]

EXTERNAL_TOKENS = ("vllm:prompt_tokens_by_source_total", {"source": "external_kv_transfer"})
# The connector's own figures, where the server exports them (vLLM's /metrics names them vllm:pd_transfer_*).
PD_PREFIXES = ("vllm:pd_transfer_", "pd_transfer_")
PULLED_BYTES = "pulled_bytes_total"
PULL_SECONDS = "pull_seconds_sum"
REQUEST_TIMEOUT_S = 120.0
MAX_TOKENS = 16


class RequestFailed(RuntimeError):
    """An HTTP request got an error status; the message has the body's start."""


def post_json(url: str, payload: Mapping[str, object], timeout_s: float = REQUEST_TIMEOUT_S) -> dict:
    request = urllib.request.Request(
        url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as error:
        raise RequestFailed(f"{url}: HTTP {error.code}: {error.read().decode(errors='replace')[:300]}") from None


def post_stream(url: str, payload: Mapping[str, object], timeout_s: float = REQUEST_TIMEOUT_S) -> list[dict]:
    """POST with ``stream: true``; returns the server-sent events' JSON objects up to ``[DONE]``."""
    request = urllib.request.Request(
        url,
        data=json.dumps({**payload, "stream": True}).encode(),
        headers={"Content-Type": "application/json", "Accept": "text/event-stream"},
        method="POST",
    )
    events = []
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    return events
                events.append(json.loads(data))
    except urllib.error.HTTPError as error:
        raise RequestFailed(f"{url}: HTTP {error.code}: {error.read().decode(errors='replace')[:300]}") from None
    raise RequestFailed(f"{url}: the stream ended without [DONE]")


def get_text(url: str, timeout_s: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return response.read().decode()


def metric_sum(text: str, name: str, labels: Mapping[str, str]) -> float:
    """Sum of the Prometheus samples of ``name`` in ``text`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{key}="{value}"' in line for key, value in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


def _figures(decode_urls: Sequence[str]) -> dict[str, float]:
    texts = [get_text(f"{url}/metrics") for url in decode_urls]
    name, labels = EXTERNAL_TOKENS
    figures = {"external_tokens": sum(metric_sum(text, name, labels) for text in texts)}
    for key, suffix in (("pulled_bytes", PULLED_BYTES), ("pull_seconds", PULL_SECONDS)):
        figures[key] = sum(metric_sum(text, prefix + suffix, {}) for text in texts for prefix in PD_PREFIXES)
    figures["has_pd_metrics"] = float(any(prefix + PULLED_BYTES in text for text in texts for prefix in PD_PREFIXES))
    return figures


@dataclass
class DemoResult:
    name: str
    answer: str
    prompt_tokens: int
    seconds: float
    external_tokens: float
    pulled_bytes: float | None
    pull_seconds: float | None
    same_as_reference: bool | None


def _text(events_or_body: dict | list[dict], chat: bool) -> str:
    if isinstance(events_or_body, dict):
        choice = events_or_body["choices"][0]
        return choice["message"]["content"] if chat else choice["text"]
    pieces = []
    for event in events_or_body:
        for choice in event.get("choices") or []:
            pieces.append((choice.get("delta") or {}).get("content") or "" if chat else choice.get("text") or "")
    return "".join(pieces)


def _usage(events_or_body: dict | list[dict]) -> int:
    items = [events_or_body] if isinstance(events_or_body, dict) else events_or_body
    for item in reversed(items):
        if item.get("usage"):
            return int(item["usage"]["prompt_tokens"])
    return -1


def demo_requests(model: str, passage: str) -> list[tuple[str, str, dict[str, object], bool]]:
    """(name, endpoint, payload, streamed) of the demo, greedy with a fixed number of tokens."""
    common = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
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
            "chat, short",
            "/v1/chat/completions",
            {**common, "messages": [{"role": "user", "content": "Tell me something about trains."}]},
            False,
        ),
        (
            "chat, multi-block, streamed",
            "/v1/chat/completions",
            {**common, "messages": [{"role": "user", "content": "What happened next? " + passage}], **usage},
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


def run_demo(
    proxy_url: str,
    decode_urls: Sequence[str],
    model: str,
    reference_url: str | None = None,
    say: Callable[[str], None] = print,
    block_size: int | None = None,
) -> list[DemoResult]:
    """Send the demo requests one after another through the proxy and report each (via ``say``)."""
    results = []
    say(f"demo: {len(demo_requests(model, ''))} greedy requests ({MAX_TOKENS} tokens each) through {proxy_url}")
    for name, endpoint, payload, streamed in demo_requests(model, demo_passage()):
        chat = endpoint.endswith("chat/completions")
        before = _figures(decode_urls)
        started = time.perf_counter()
        body = post_stream(proxy_url + endpoint, payload) if streamed else post_json(proxy_url + endpoint, payload)
        seconds = time.perf_counter() - started
        after = _figures(decode_urls)
        answer = _text(body, chat)
        same = None
        if reference_url is not None:
            plain = {k: v for k, v in payload.items() if k != "stream_options"}
            same = _text(post_json(reference_url + endpoint, plain), chat) == answer
        has_pd = bool(after["has_pd_metrics"])
        result = DemoResult(
            name=name,
            answer=answer,
            prompt_tokens=_usage(body),
            seconds=seconds,
            external_tokens=after["external_tokens"] - before["external_tokens"],
            pulled_bytes=after["pulled_bytes"] - before["pulled_bytes"] if has_pd else None,
            pull_seconds=after["pull_seconds"] - before["pull_seconds"] if has_pd else None,
            same_as_reference=same,
        )
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
    transfer = f"KV of {result.external_tokens:.0f} prompt tokens loaded over NIXL"
    if result.pulled_bytes is not None and result.pull_seconds is not None and result.pulled_bytes > 0:
        transfer += f" ({result.pulled_bytes / 1024:.0f} KiB in {result.pull_seconds * 1e3:.1f} ms)"
    check = ""
    if result.same_as_reference is not None:
        check = "; same as plain vLLM: " + ("yes" if result.same_as_reference else "NO")
    return f"  {result.name}: {prompt}, {result.seconds:.2f} s; {transfer}{check}\n    -> {result.answer!r}"
