"""HTTP to vLLM's OpenAI servers and the proxy, with the standard library only (``urllib``): health, POST JSON,
streamed POST (server-sent events), greedy completions and what their answers hold, Prometheus ``/metrics``, and
free local ports. ``pd-transfer up``, its demo, ``pd-transfer bench vllm`` and the tests all talk HTTP through here.

Every call is bounded by a timeout in seconds. An error status, a timeout or a refused connection raises
:class:`RequestFailed`, whose message is short enough to record in a result.
"""

from __future__ import annotations

import json
import random
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from http.client import HTTPResponse
from typing import Any

__all__ = [
    "REQUEST_TIMEOUT_S",
    "MetricWait",
    "RequestFailed",
    "answer_text",
    "answer_tokens",
    "busy_ports",
    "completion",
    "free_port",
    "get_text",
    "is_healthy",
    "metric_sum",
    "metric_value",
    "post_json",
    "post_stream",
    "prompt_tokens",
    "scrape_metrics",
    "wait_metric",
]

REQUEST_TIMEOUT_S = 120.0  # one request to a vLLM server on a small CPU machine, prompt and decode included
METRICS_TIMEOUT_S = 10.0
HEALTH_TIMEOUT_S = 2.0
ERROR_BODY_CHARS = 300

#: A JSON answer (not streamed) or the events of a streamed one.
Answer = Mapping[str, Any] | Sequence[Mapping[str, Any]]


class RequestFailed(RuntimeError):
    """A request got an error status (``status``, with the start of the body in ``body``), no answer in time or
    no connection (``status`` None). The message is short and names no URL; ``url`` holds it."""

    def __init__(self, url: str, message: str, status: int | None = None, body: str = "") -> None:
        super().__init__(message)
        self.url = url
        self.status = status
        self.body = body


@contextmanager
def _opened(request: urllib.request.Request | str, timeout_s: float) -> Iterator[HTTPResponse]:
    """``urlopen`` whose failures, while opening or while reading within the block, raise ``RequestFailed``."""
    url = request if isinstance(request, str) else request.full_url
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            yield response
    except urllib.error.HTTPError as error:
        body = error.read().decode(errors="replace")
        raise RequestFailed(url, f"HTTP {error.code}: {body[:ERROR_BODY_CHARS]}", error.code, body) from None
    except TimeoutError:
        raise RequestFailed(url, f"no answer in {timeout_s:.0f} s") from None
    except (urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", error)
        raise RequestFailed(url, f"{type(reason).__name__}: {reason}") from None


def _json_request(url: str, payload: Mapping[str, object], headers: Mapping[str, str] | None) -> urllib.request.Request:
    return urllib.request.Request(
        url,
        data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
        method="POST",
    )


def get_text(url: str, timeout_s: float = METRICS_TIMEOUT_S) -> str:
    """The body of ``GET url`` as text; raises ``RequestFailed``."""
    with _opened(url, timeout_s) as response:
        return response.read().decode()


def is_healthy(url: str, timeout_s: float = HEALTH_TIMEOUT_S) -> bool:
    """Whether ``GET url`` (a ``/health`` endpoint) answers 200 within ``timeout_s`` seconds."""
    try:
        with _opened(url, timeout_s) as response:
            return response.status == 200
    except (RequestFailed, ValueError):
        return False


def post_json(
    url: str,
    payload: Mapping[str, object],
    timeout_s: float = REQUEST_TIMEOUT_S,
    headers: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """``POST url`` with ``payload`` as JSON; the JSON answer. Raises ``RequestFailed``."""
    with _opened(_json_request(url, payload, headers), timeout_s) as response:
        return dict(json.loads(response.read()))


def _sse_events(lines: Iterable[bytes]) -> Iterator[dict[str, Any]]:
    """The JSON payloads of ``data:`` lines of a server-sent event stream, up to ``data: [DONE]`` (then stops)."""
    for raw in lines:
        line = raw.decode().strip()
        if line.startswith("data:"):
            data = line.removeprefix("data:").strip()
            if data == "[DONE]":
                return
            yield json.loads(data)
    raise ValueError("the stream ended without [DONE]")


def post_stream(
    url: str,
    payload: Mapping[str, object],
    timeout_s: float = REQUEST_TIMEOUT_S,
    headers: Mapping[str, str] | None = None,
) -> list[dict[str, Any]]:
    """``POST url`` with ``payload`` and ``"stream": true``; the events' JSON objects up to ``[DONE]``.
    ``timeout_s`` bounds each read of the stream, not the whole. Raises ``RequestFailed`` on an error status, on
    an answer that is not ``text/event-stream`` and on a stream that ends without ``[DONE]``."""
    request = _json_request(url, {**payload, "stream": True}, {"Accept": "text/event-stream", **(headers or {})})
    with _opened(request, timeout_s) as response:
        kind = response.headers.get("Content-Type", "")
        if not kind.startswith("text/event-stream"):
            raise RequestFailed(url, f"not an event stream: Content-Type {kind!r}", response.status)
        try:
            return list(_sse_events(response))
        except ValueError as error:
            raise RequestFailed(url, str(error), response.status) from None


def completion(
    base_url: str,
    model: str,
    prompt: Sequence[int] | str,
    max_tokens: int,
    *,
    kv_transfer_params: Mapping[str, object] | None = None,
    request_id: str | None = None,
    timeout_s: float = REQUEST_TIMEOUT_S,
) -> dict[str, Any]:
    """A greedy, non-streamed ``/v1/completions`` of ``max_tokens`` tokens (``ignore_eos``), logprobs on so that
    :func:`answer_tokens` can read the generated tokens. ``request_id`` goes in ``X-Request-Id``."""
    payload: dict[str, object] = {
        "model": model,
        "prompt": prompt if isinstance(prompt, str) else list(prompt),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "logprobs": 1,
    }
    if kv_transfer_params is not None:
        payload["kv_transfer_params"] = dict(kv_transfer_params)
    headers = {"X-Request-Id": request_id} if request_id else None
    return post_json(f"{base_url}/v1/completions", payload, timeout_s, headers)


def _items(answer: Answer) -> Sequence[Mapping[str, Any]]:
    return [answer] if isinstance(answer, Mapping) else answer


def _choices(answer: Answer) -> Iterator[Mapping[str, Any]]:
    for item in _items(answer):
        yield from item.get("choices") or []


def answer_text(answer: Answer, *, chat: bool) -> str:
    """The generated text of a completion (``chat`` False) or chat completion, streamed (events) or not."""
    if not chat:
        return "".join(choice.get("text") or "" for choice in _choices(answer))
    return "".join(
        (choice.get("message") or choice.get("delta") or {}).get("content") or "" for choice in _choices(answer)
    )


def answer_tokens(answer: Answer, *, chat: bool = False) -> list[str]:
    """The generated tokens as text pieces, from the logprobs the request asked for (``logprobs: 1`` for a
    completion, ``logprobs: true`` for a chat); they compare exactly under greedy decoding. Raises ``ValueError``
    when the answer has no logprobs."""
    tokens: list[str] = []
    found = False
    for choice in _choices(answer):
        logprobs = choice.get("logprobs")
        if logprobs:
            found = True
            tokens += [item["token"] for item in logprobs["content"]] if chat else list(logprobs["tokens"])
    if not found:
        raise ValueError(f"no logprobs in the answer: {str(answer)[:ERROR_BODY_CHARS]}")
    return tokens


def prompt_tokens(answer: Answer) -> int:
    """The prompt's token count from the answer's ``usage`` (streamed: ``stream_options.include_usage``), or -1."""
    for item in reversed(_items(answer)):
        if item.get("usage"):
            return int(item["usage"]["prompt_tokens"])
    return -1


def scrape_metrics(base_url: str, timeout_s: float = METRICS_TIMEOUT_S) -> str:
    """The Prometheus text of ``base_url/metrics``; raises ``RequestFailed``."""
    return get_text(f"{base_url}/metrics", timeout_s)


def metric_sum(text: str, name: str, **labels: str) -> float:
    """Sum of the samples named exactly ``name`` (a histogram's ``_sum`` or ``_count`` is a name of its own) whose
    labels include ``labels``, in Prometheus text; 0 when there are none."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line[len(name) : len(name) + 1] not in ("{", " "):
            continue
        if all(f'{key}="{value}"' in line for key, value in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def metric_value(base_url: str, name: str, **labels: str) -> float:
    """:func:`metric_sum` of ``base_url``'s ``/metrics`` now."""
    return metric_sum(scrape_metrics(base_url), name, **labels)


@dataclass(frozen=True)
class MetricWait:
    """The end of :func:`wait_metric`: the last value read, the seconds waited, whether ``until`` held."""

    value: float
    seconds: float
    reached: bool


def wait_metric(
    base_url: str,
    name: str,
    until: Callable[[float], bool],
    timeout_s: float,
    *,
    poll_s: float = 0.05,
    labels: Mapping[str, str] | None = None,
) -> MetricWait:
    """Reads :func:`metric_value` every ``poll_s`` seconds until ``until(value)`` holds or ``timeout_s`` seconds
    have passed (then ``reached`` is False). Counters of vLLM's engine reach ``/metrics`` with a later step."""
    started = time.monotonic()
    while True:
        value = metric_value(base_url, name, **(labels or {}))
        waited = time.monotonic() - started
        reached = until(value)
        if reached or waited >= timeout_s:
            return MetricWait(value, waited, reached)
        time.sleep(poll_s)


#: Ports :func:`free_port` picks from: below Linux's default ephemeral range (32768-60999), which the kernel hands
#: out to outgoing connections and ``bind(0)`` callers, so a port picked now is rarely taken before a slow server
#: (vLLM starts in minutes) binds it.
LISTEN_PORT_RANGE = (20000, 32768)


#: Ports :func:`free_port` returned in this process: not returned again, since the servers they went to may not
#: have bound them yet (a vLLM server binds its ports a minute or more after its command is made).
_HANDED_OUT: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now and not returned before by this process: a random one of
    :data:`LISTEN_PORT_RANGE` that can be bound, else the kernel's choice. Another process may still take it before
    it is used; the range makes that unlikely."""
    rng = random.SystemRandom()
    for _ in range(64):
        port = rng.randrange(*LISTEN_PORT_RANGE)
        if port not in _HANDED_OUT and not busy_ports([port], host):
            _HANDED_OUT.add(port)
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def busy_ports(ports: Iterable[int], host: str = "127.0.0.1") -> list[int]:
    """The ``ports`` that cannot be bound on ``host`` now (in use)."""
    busy = []
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError:
                busy.append(port)
    return busy
