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

A's drain lasts as long as this test wants, not as long as a generation happens to take: its long requests are
streams this test holds open, too long to end on their own while it checks (``LONG_TOKENS`` each, at a context
vLLM allows only with ``VLLM_ALLOW_LONG_MAX_MODEL_LEN``), and A's drain bound is longer than the test's own.
Before each request the test checks that A's engine still drains (its log has not said it is done, and both long
streams are still receiving); then it closes the long streams (vLLM aborts them), and A's engine, out of work,
exits. A request that reached A after its engine had drained would wait for the teardown and get a 500, which the
proxy also retries on B (``tests/test_decode_abort.py`` covers that with stand-ins).
"""

from __future__ import annotations

import asyncio
import dataclasses
import http.client
import json
import os
import signal
import socket
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

DRAIN_S = 600  # A's --shutdown-timeout: longer than the test; the test ends the drain by closing the long streams
LONG_CONTEXT = 16384  # A's max_model_len, past the tiny model's 2048 positions (vLLM allows it when told to)
LONG_TOKENS = LONG_CONTEXT - 64  # minutes of generation for A's engine: it drains until the streams are closed
LONG_REQUESTS = 2  # 2 x 16,320 tokens of 4 KiB: half of A's 256 MiB cache
ENGINE_DONE = "EngineCore: request processing complete"  # A's log, once its drain has nothing left to run
PROMPT = list(range(100, 140))
TOKENS = 8
WAIT_S = 120.0  # bound of each wait on A's state


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


class LongStream:
    """A streamed completion of ``LONG_TOKENS`` on ``url``, read to the end on a thread of its own; it runs until
    :meth:`close` (A's engine keeps generating for it meanwhile). ``receiving``: it has an event and is not over."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        self._connection = http.client.HTTPConnection(host, int(port), timeout=WAIT_S)
        self._connection.request(
            "POST", "/v1/completions", json.dumps(_body(LONG_TOKENS, stream=True)), {"Content-Type": "application/json"}
        )
        self._answer = self._connection.getresponse()
        assert self._answer.status == 200, self._answer.read(300)
        self.first_event = threading.Event()
        self.over = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            while self._answer.readline():
                self.first_event.set()
        except OSError:
            pass  # closed by close()
        finally:
            self.over.set()

    @property
    def receiving(self) -> bool:
        return self.first_event.is_set() and not self.over.is_set()

    def close(self) -> None:
        """Closes the connection (vLLM aborts the request) and waits for the reader, bounded."""
        sock = self._connection.sock
        if sock is not None:
            sock.shutdown(socket.SHUT_RDWR)
        self._thread.join(WAIT_S)
        self._connection.close()


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[ManagedProcess, ManagedProcess]]:
    model = DEFAULT_MODEL
    if not (Path(model) / "config.json").exists():
        pytest.skip(f"no model at {model} (make it with `pd-transfer make-model`)")
    logs = logs_dir("pd-transfer-vllm-decode-abort")
    a = vllm_server(
        "decode-a",
        model,
        logs,
        cpu_index=0,
        connector=False,
        max_model_len=LONG_CONTEXT,
        extra_args=("--shutdown-timeout", str(DRAIN_S)),
    )
    a = dataclasses.replace(a, env={**a.env, "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"})
    b = vllm_server("decode-b", model, logs, cpu_index=1, connector=False)
    try:
        start_all([a, b])
        yield a, b
    finally:
        stop_all([a, b])


def _wait(condition: Any, what: str, a: ManagedProcess) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"not within {WAIT_S:.0f} s: {what}\n{a.log_tail(30)}"
        time.sleep(0.05)  # polling A's state, bounded by the deadline


def _stop_a_while_busy(a: ManagedProcess) -> list[LongStream]:
    """Opens ``LONG_REQUESTS`` long streams on A, then SIGTERM to A's API server once each has an event (its
    engine runs them); returns once A's engine drains."""
    streams = [LongStream(a.url) for _ in range(LONG_REQUESTS)]
    _wait(lambda: all(s.first_event.is_set() for s in streams), "A's engine running the long streams", a)
    assert a.process is not None
    a.process.send_signal(signal.SIGTERM)
    _wait(lambda: "EngineCore: start mode=drain" in a.log_path.read_text(errors="replace"), "A draining", a)
    return streams


def _still_draining(a: ManagedProcess, streams: list[LongStream]) -> None:
    """A's engine is draining: the state every request to A in this test is sent in."""
    assert all(s.receiving for s in streams), f"a long stream ended: A's drain is over\n{a.log_tail(30)}"
    assert ENGINE_DONE not in a.log_path.read_text(errors="replace"), f"A's engine stopped early\n{a.log_tail(30)}"


async def _through_proxy(
    a: ManagedProcess, b: ManagedProcess, streams: list[LongStream], expected: str
) -> dict[str, float]:
    """Two requests of each kind through the proxy, A first each time (A put back by a real health check, as its
    ``/health`` still answers 200) while A drains: each comes back with B's tokens. Returns the proxy's counts."""
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
            _still_draining(a, streams)
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
    streams = _stop_a_while_busy(a)
    try:
        _still_draining(a, streams)
        status, raw = _post(f"{a.url}/v1/completions", _body(TOKENS))
        assert status == 200 and is_empty_abort(raw), raw[:300]
        _still_draining(a, streams)
        status, raw = _post(f"{a.url}/v1/completions", _body(TOKENS, stream=True))
        opening = StreamOpening()
        verdict = opening.feed(raw)
        assert status == 200 and (opening.end() if verdict is Verdict.HOLD else verdict) is Verdict.ABORTED, raw[:300]
        stream_seen = raw
        counts = asyncio.run(asyncio.wait_for(_through_proxy(a, b, streams, expected), timeout=300))
        assert counts["aborted_retries"] == 4, counts
        _still_draining(a, streams)
    finally:
        for stream in streams:
            stream.close()
    assert a.process is not None
    code = a.process.wait(WAIT_S)  # out of work once the long streams are aborted: A's engine stops, then A
    print(
        f"\nstopping decode: its empty stream {stream_seen!r} recognised; 4 requests through the proxy, each retried"
        f" on B ({counts}); A exited {code}; load {os.getloadavg()[0]:.1f}"
    )
