"""A client of the P/D proxy: one completion and one streamed chat through it, then what moved where.

Before and after the requests it reads Prometheus ``/metrics`` of the proxy (``pd_proxy_*``: requests, the path each
took, the time of each hop) and of the decode servers given with ``--decode-metrics``: vLLM's
``vllm:prompt_tokens_by_source_total`` (prompt tokens whose KV came over the wire count under
``source="external_kv_transfer"``) and the connector's ``vllm:pd_transfer_*`` (or ``pd_transfer_*``) where the server
exposes them. It prints the differences, so other traffic on the servers at the same time shows up too. Only the
standard library is used.

    python examples/client.py --proxy http://127.0.0.1:8000 --decode-metrics http://127.0.0.1:8200

Exit code 0 when both requests were answered, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

PROMPT = (
    "The prefill server reads this whole prompt once and the decode server continues it without reading it again, "
    "because the keys and values of every layer were copied from one to the other"
)
SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)")
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@dataclass
class Answer:
    text: str
    request_id: str
    seconds: float
    chunks: int = 0
    first_chunk_s: float | None = None
    usage: dict[str, int] | None = None


def post(url: str, body: dict[str, object]) -> urllib.request.Request:
    return urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )


def completion(proxy: str, model: str, prompt: str, max_tokens: int, timeout_s: float) -> Answer:
    """``POST /v1/completions``, not streamed."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    started = time.perf_counter()
    with urllib.request.urlopen(post(proxy + "/v1/completions", body), timeout=timeout_s) as response:
        answer = json.loads(response.read())
        request_id = response.headers.get("X-Request-Id", "")
    return Answer(answer["choices"][0]["text"], request_id, time.perf_counter() - started, usage=answer.get("usage"))


def sse_data(lines: Iterator[bytes]) -> Iterator[dict[str, object]]:
    """The JSON payloads of a server-sent event stream, up to ``data: [DONE]``."""
    for raw in lines:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


def chat_stream(proxy: str, model: str, prompt: str, max_tokens: int, timeout_s: float) -> Answer:
    """``POST /v1/chat/completions`` streamed; prints each piece as it arrives."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
    }
    started = time.perf_counter()
    pieces: list[str] = []
    answer = Answer("", "", 0.0)
    with urllib.request.urlopen(post(proxy + "/v1/chat/completions", body), timeout=timeout_s) as response:
        answer.request_id = response.headers.get("X-Request-Id", "")
        print("  streamed:", end="", flush=True)
        for chunk in sse_data(response):
            if error := chunk.get("error"):
                raise RuntimeError(f"the stream ended in an error: {error}")
            choices = chunk.get("choices") or [{}]
            piece = (choices[0].get("delta") or {}).get("content") or ""  # type: ignore[union-attr]
            if answer.first_chunk_s is None:
                answer.first_chunk_s = time.perf_counter() - started
            answer.chunks += 1
            pieces.append(piece)
            print(piece, end="", flush=True)
        print()
    answer.text = "".join(pieces)
    answer.seconds = time.perf_counter() - started
    return answer


def scrape(base_url: str, timeout_s: float = 10.0) -> Samples | str:
    """The samples of ``base_url/metrics`` by (name, labels), or why there are none."""
    try:
        with urllib.request.urlopen(base_url + "/metrics", timeout=timeout_s) as response:
            text = response.read().decode()
    except urllib.error.HTTPError as error:
        return f"no metrics (HTTP {error.code})"
    except OSError as error:
        return f"no metrics ({error})"
    samples: Samples = {}
    for line in text.splitlines():
        match = SAMPLE.match(line)
        if match is None or line.startswith("#"):
            continue
        labels = tuple(sorted(LABEL.findall(match["labels"] or "")))
        try:
            samples[match["name"], labels] = float(match["value"])
        except ValueError:
            continue
    return samples


def delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    """How much the samples of ``name`` whose labels include ``labels`` grew."""

    def total(samples: Samples) -> float:
        return sum(
            value
            for (sample, sample_labels), value in samples.items()
            if sample == name and set(labels.items()) <= set(sample_labels)
        )

    return total(after) - total(before)


def label_values(samples: Samples, name: str, label: str) -> list[str]:
    return sorted({dict(labels).get(label, "") for sample, labels in samples if sample == name})


def report_proxy(url: str, before: Samples | str, after: Samples | str) -> None:
    if isinstance(before, str) or isinstance(after, str):
        print(f"  proxy {url}: {before if isinstance(before, str) else after}")
        return
    requests = {
        status: delta(before, after, "pd_proxy_requests_total", status=status)
        for status in label_values(after, "pd_proxy_requests_total", "status")
    }
    routes = {
        path: delta(before, after, "pd_proxy_routes_total", path=path)
        for path in label_values(after, "pd_proxy_routes_total", "path")
    }
    print(
        f"  proxy {url}: requests "
        + (", ".join(f"+{n:.0f} HTTP {status}" for status, n in requests.items() if n) or "+0")
        + "; routes "
        + (", ".join(f"{path} +{n:.0f}" for path, n in routes.items() if n) or "+0")
    )
    for hop in ("prefill", "decode"):
        count = delta(before, after, "pd_proxy_hop_latency_seconds_count", hop=hop)
        seconds = delta(before, after, "pd_proxy_hop_latency_seconds_sum", hop=hop)
        if count:
            print(f"    {hop} hop: {count:.0f} x, mean {seconds / count * 1e3:.1f} ms")
    errors = delta(before, after, "pd_proxy_errors_total")
    if errors:
        print(f"    errors: +{errors:.0f} (see pd_proxy_errors_total by hop and kind)")


def report_decode(url: str, before: Samples | str, after: Samples | str) -> None:
    if isinstance(before, str) or isinstance(after, str):
        print(f"  decode {url}: {before if isinstance(before, str) else after}")
        return
    name = "vllm:prompt_tokens_by_source_total"
    sources = label_values(after, name, "source")
    if sources:
        moved = {source: delta(before, after, name, source=source) for source in sources}
        print(
            f"  decode {url}: prompt tokens by source: "
            + ", ".join(f"{source} +{n:.0f}" for source, n in moved.items())
            + (" (KV pulled from a prefill)" if moved.get("external_kv_transfer") else "")
        )
    else:
        print(f"  decode {url}: no {name} (not a vLLM server?)")
    ours = sorted({sample for sample, _ in after if sample.startswith(("pd_transfer_", "vllm:pd_transfer_"))})
    if not ours:
        print("    pd_transfer_* metrics: not exposed by this server")
    for sample in ours:
        if sample.endswith(("_created", "_bucket")):
            continue
        change = delta(before, after, sample)
        if change:
            print(f"    {sample} +{change:g}")


def first_model(proxy: str, timeout_s: float) -> str:
    """The first model the proxy's decode servers serve (``GET /v1/models``)."""
    with urllib.request.urlopen(proxy + "/v1/models", timeout=timeout_s) as response:
        return json.loads(response.read())["data"][0]["id"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--proxy", default="http://127.0.0.1:8000", help="the proxy's base URL")
    parser.add_argument(
        "--decode-metrics",
        nargs="*",
        default=[],
        metavar="URL",
        help="decode servers' base URLs whose /metrics to read, e.g. http://127.0.0.1:8200",
    )
    parser.add_argument("--model", default=None, help="model name (default: the first of the proxy's /v1/models)")
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per request (default 300)")
    args = parser.parse_args(argv)
    proxy = args.proxy.rstrip("/")
    decodes = [url.rstrip("/") for url in args.decode_metrics]

    try:
        model = args.model or first_model(proxy, args.timeout)
    except (OSError, KeyError, IndexError, ValueError) as error:
        print(f"cannot ask {proxy}/v1/models which model to use ({error}); pass --model", file=sys.stderr)
        return 1
    print(f"proxy {proxy}, model {model}")
    before = {url: scrape(url) for url in [proxy, *decodes]}
    ok = True
    try:
        answer = completion(proxy, model, args.prompt, args.max_tokens, args.timeout)
        tokens = (answer.usage or {}).get("completion_tokens", "?")
        print(f"completion (request {answer.request_id}, {answer.seconds * 1e3:.0f} ms, {tokens} tokens):")
        print(f"  {answer.text!r}")
    except (OSError, KeyError, ValueError) as error:
        print(f"completion failed: {describe(error)}")
        ok = False
    try:
        print("chat, streamed:")
        answer = chat_stream(proxy, model, args.prompt, args.max_tokens, args.timeout)
        first = f"{answer.first_chunk_s * 1e3:.0f} ms" if answer.first_chunk_s is not None else "never"
        print(
            f"  (request {answer.request_id}, {answer.chunks} chunks, first after {first}, all in"
            f" {answer.seconds * 1e3:.0f} ms)"
        )
        ok = ok and answer.chunks > 0
    except (OSError, KeyError, ValueError, RuntimeError) as error:
        print(f"chat failed: {describe(error)}")
        ok = False
    after = {url: scrape(url) for url in [proxy, *decodes]}
    print("transfer figures (metrics after - before):")
    report_proxy(proxy, before[proxy], after[proxy])
    for url in decodes:
        report_decode(url, before[url], after[url])
    if not decodes:
        print("  decode servers: none given (--decode-metrics URL ...)")
    return 0 if ok else 1


def describe(error: BaseException) -> str:
    """An HTTP error with the body the proxy sent (it names the failing hop)."""
    if isinstance(error, urllib.error.HTTPError):
        return f"HTTP {error.code}: {error.read().decode(errors='replace')[:500]}"
    return f"{type(error).__name__}: {error}"


if __name__ == "__main__":
    sys.exit(main())
