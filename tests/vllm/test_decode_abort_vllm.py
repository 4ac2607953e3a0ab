"""A real vLLM decode whose engine is stopping: what it answers a request that reaches it late, and what our proxy
makes of it.

Decode A is a plain vLLM server (CPU, the tiny model) started with vLLM's own drain (``--shutdown-timeout``) but
without ``DrainMiddleware``, so that after its SIGTERM every request reaches its engine late (with the middleware
only a request past it just before the signal does: ``tests/faults/test_drain.py`` meets that by chance). While its
engine finishes long requests, A's API server answers new ones 200 with no output; this test checks that
:mod:`pd_transfer.proxy.aborts` recognises both forms vLLM sends (a JSON answer, a stream), then sends requests
through our proxy (in this process) over A and a second plain server B: each goes to A first, comes back empty, and
is retried on B: the client gets B's greedy tokens, streamed or not. Needs vLLM in the running interpreter and the
tiny model, like ``tests/test_vllm_pd.py``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm_servers import vllm_missing

_MISSING = vllm_missing()
pytestmark = [pytest.mark.skipif(_MISSING is not None, reason=_MISSING or ""), pytest.mark.timeout(900)]

aiohttp = pytest.importorskip("aiohttp", reason="the proxy needs the 'proxy' extra (aiohttp)")

from vllm_servers import DEFAULT_MODEL, logs_dir, start_all, vllm_server  # noqa: E402

from pd_transfer.cluster.processes import ManagedProcess, stop_all  # noqa: E402
from pd_transfer.proxy.aborts import StreamOpening, Verdict, is_empty_abort  # noqa: E402
from pd_transfer.proxy.server import Proxy, ProxyConfig  # noqa: E402

DRAIN_S = 60  # A's --shutdown-timeout: its engine finishes the long requests, refusing new ones meanwhile
LONG_TOKENS = 1900  # each long request keeps A's engine stepping for a while after the SIGTERM
LONG_REQUESTS = 4
PROMPT = list(range(100, 140))
TOKENS = 8


def _post(url: str, body: dict[str, Any], timeout_s: float = 120.0) -> tuple[int, bytes]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as answer:
        return answer.status, answer.read()


def _body(max_tokens: int, stream: bool = False) -> dict[str, Any]:
    return {
        "model": DEFAULT_MODEL,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": stream,
    }


def _text(raw: bytes, stream: bool) -> str:
    """The generated text of a JSON answer or an SSE stream."""
    if not stream:
        return "".join(c["text"] for c in json.loads(raw)["choices"])
    events = [e[len(b"data: ") :] for e in raw.split(b"\n\n") if e.startswith(b"data: ")]
    return "".join(c.get("text", "") for e in events if e != b"[DONE]" for c in json.loads(e)["choices"])


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[ManagedProcess, ManagedProcess]]:
    model = DEFAULT_MODEL
    if not (Path(model) / "config.json").exists():
        pytest.skip(f"no model at {model} (make it with `pd-transfer make-model`)")
    logs = logs_dir("pd-transfer-vllm-decode-abort")
    a = vllm_server("decode-a", model, logs, cpu_index=0, connector=False, extra_args=("--shutdown-timeout", "60"))
    b = vllm_server("decode-b", model, logs, cpu_index=1, connector=False)
    try:
        start_all([a, b])
        yield a, b
    finally:
        stop_all([a, b])


def _stop_a_while_busy(a: ManagedProcess) -> list[threading.Thread]:
    """Starts ``LONG_REQUESTS`` long requests on A, then SIGTERM to A's API server once its engine runs them."""
    threads = [
        threading.Thread(target=_post, args=(f"{a.url}/v1/completions", _body(LONG_TOKENS)), daemon=True)
        for _ in range(LONG_REQUESTS)
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 120
    while "vllm:num_requests_running" not in _running_line(a):
        assert time.monotonic() < deadline, "A never ran the long requests"
        time.sleep(0.1)  # polling A's metrics, bounded by the deadline
    assert a.process is not None
    a.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 30
    while "EngineCore: start mode=drain" not in a.log_path.read_text(errors="replace"):
        assert time.monotonic() < deadline, f"A's engine did not start draining:\n{a.log_tail(30)}"
        time.sleep(0.1)  # polling A's log, bounded by the deadline
    return threads


def _running_line(a: ManagedProcess) -> str:
    """A's ``vllm:num_requests_running`` line when it is above 0, else ''."""
    with urllib.request.urlopen(f"{a.url}/metrics", timeout=5) as answer:
        text = answer.read().decode()
    lines = [x for x in text.splitlines() if x.startswith("vllm:num_requests_running") and not x.endswith(" 0.0")]
    return lines[0] if lines else ""


async def _through_proxy(a: ManagedProcess, b: ManagedProcess, expected: str) -> dict[str, float]:
    """Two requests of each kind through the proxy, A first each time (A put back by a real health check, as its
    ``/health`` still answers 200): each comes back with B's tokens. Returns the proxy's counts."""
    config = ProxyConfig(
        prefill=[b.url],  # unused: every prompt is "short", so every request goes straight to a decode
        decode=[a.url, b.url],
        policy="round_robin",
        short_prompt_tokens=10**6,
        health_interval_s=3600.0,  # only this test's own health rounds
        request_timeout_s=120.0,
    )
    async with Proxy(config) as proxy, aiohttp.ClientSession() as client:
        await proxy.start()
        backend_a = proxy.decode.backends[0]
        for stream in (False, True, False, True):
            await proxy.check_health()
            assert backend_a.healthy, f"A left rotation: {backend_a.reason}"
            async with client.post(f"{proxy.url}/v1/completions", json=_body(TOKENS, stream)) as answer:
                raw = await answer.read()
                assert answer.status == 200, raw[:300]
            assert _text(raw, stream) == expected, raw[:300]
            assert not backend_a.healthy and backend_a.reason == "draining"
        async with client.get(f"{proxy.url}/metrics") as answer:
            text = await answer.text()
        retried = [
            x for x in text.splitlines() if x.startswith('pd_proxy_retries_total{hop="decode",reason="aborted"}')
        ]
        return {"aborted_retries": float(retried[0].rsplit(" ", 1)[1]) if retried else 0.0, "tried_a": backend_a.served}


def test_a_stopping_engines_empty_answers_are_recognised_and_retried_on_another_decode(
    servers: tuple[ManagedProcess, ManagedProcess],
) -> None:
    a, b = servers
    expected = _text(_post(f"{b.url}/v1/completions", _body(TOKENS))[1], stream=False)
    assert expected, "B generated nothing"
    threads = _stop_a_while_busy(a)
    status, raw = _post(f"{a.url}/v1/completions", _body(TOKENS))
    assert status == 200 and is_empty_abort(raw), raw[:300]
    status, raw = _post(f"{a.url}/v1/completions", _body(TOKENS, stream=True))
    opening = StreamOpening()
    verdict = opening.feed(raw)
    assert status == 200 and (opening.end() if verdict is Verdict.HOLD else verdict) is Verdict.ABORTED, raw[:300]
    stream_seen = raw
    counts = asyncio.run(asyncio.wait_for(_through_proxy(a, b, expected), timeout=300))
    assert counts["aborted_retries"] == 4, counts
    assert a.process is not None and a.process.poll() is None, "A exited before the checks ended: too fast"
    for thread in threads:
        thread.join(DRAIN_S + 30)
    code = a.process.wait(DRAIN_S + 60)
    print(
        f"\nstopping decode: its empty stream {stream_seen!r} recognised; 4 requests through the proxy, each retried"
        f" on B ({counts}); A exited {code}; load {os.getloadavg()[0]:.1f}"
    )
