"""Test helpers: KV-moving stand-in prefill and decode servers (``pd_transfer.sim.kv_standin``: real KV caches, the
real connector, a real ZMQ side channel) started as processes, and requests sent to them through a proxy in the
test's own process. Every wait is bounded; the children die with the test process (``PR_SET_PDEATHSIG``) and are
stopped on the way out."""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from pd_transfer.proxy.server import Proxy, ProxyConfig
from pd_transfer.sim.child import die_with_parent, stop_process

START_TIMEOUT_S = 120.0  # a stand-in imports torch and NIXL and creates an agent: 5-20 s on 2 busy cores
REQUEST_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0
HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # straight to the servers, whatever *_proxy says


def words(count: int, tag: str) -> str:
    return " ".join(f"{tag}{i}" for i in range(count))


def post_json(url: str, body: dict[str, Any], timeout_s: float = REQUEST_TIMEOUT_S) -> tuple[int, str]:
    """POST ``body`` to ``url``: the status and the text of the answer, an error's too."""
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with HTTP.open(request, timeout=timeout_s) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(errors="replace")


# ---- processes ----


@dataclass
class Server:
    role: str
    process: subprocess.Popen[bytes]
    log: Path
    url: str = ""

    def fail(self, message: str) -> None:
        pytest.fail(f"{self.role} stand-in: {message}\n--- its log ---\n{self.log.read_text(errors='replace')[-4000:]}")


def start_standin(role: str, log: Path, env: dict[str, str], args: list[str], netns: str | None = None) -> Server:
    command = [sys.executable, "-m", "pd_transfer.sim.kv_standin", "--role", role, "--engine-id", f"{role}-0", *args]
    if netns is not None:
        command = ["ip", "netns", "exec", netns, *command]
    with log.open("wb") as err:
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=err, env=env, preexec_fn=die_with_parent, cwd=Path.cwd()
        )
    return Server(role, process, log)


def wait_ready(server: Server, deadline: float) -> None:
    """Read the ``kv-standin ROLE URL`` line, then poll ``GET /health`` until 200, both before ``deadline``."""
    assert server.process.stdout is not None
    line = b""
    with selectors.DefaultSelector() as selector:
        selector.register(server.process.stdout, selectors.EVENT_READ)
        while not line.endswith(b"\n"):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                server.fail(f"no ready line within {START_TIMEOUT_S:.0f} s")
            if selector.select(timeout=min(remaining, 1.0)):
                chunk = os.read(server.process.stdout.fileno(), 4096)
                if not chunk:
                    server.fail(f"exited with {server.process.wait(timeout=STOP_TIMEOUT_S)} before it was ready")
                line += chunk
    kind, role, url = line.decode().split()
    assert (kind, role) == ("kv-standin", server.role), line
    server.url = url
    while True:
        try:
            with HTTP.open(url + "/health", timeout=2.0) as answer:
                if answer.status == 200:
                    return
        except OSError as error:
            if time.monotonic() >= deadline:
                server.fail(f"GET /health failed until the deadline: {error}")
        if time.monotonic() >= deadline:
            server.fail("not healthy before the deadline")
        time.sleep(0.05)  # polling pace


@contextlib.contextmanager
def standins(
    tmp_path: Path, specs: dict[str, tuple[dict[str, str], list[str], str | None]]
) -> Iterator[dict[str, Server]]:
    """Starts every ``key: (env, args, netns)`` at once, waits until all serve, stops them all on the way out. A key is
    the server's role, or ``role-name`` for more than one of a role (its log is ``key.log``)."""
    servers: dict[str, Server] = {}
    try:
        for key, (env, args, netns) in specs.items():
            servers[key] = start_standin(key.split("-")[0], tmp_path / f"{key}.log", env, args, netns)
        deadline = time.monotonic() + START_TIMEOUT_S
        for server in servers.values():
            wait_ready(server, deadline)
        yield servers
    finally:
        for server in servers.values():
            stop_process(server.process, STOP_TIMEOUT_S)


def get_json(url: str) -> Any:
    with HTTP.open(url, timeout=5.0) as answer:
        return json.load(answer)


def wait_released(prefill: Server, timeout_s: float = 10.0) -> dict[str, Any]:
    """The prefill's KV state once it holds no blocks: every decode read was reported (the lease ledger is empty)
    and the engine took the blocks back (``finished_sending``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = get_json(prefill.url + "/control/kv")
        if state["blocks_held"] == state["requests_held"] == 0 or time.monotonic() >= deadline:
            return state
        time.sleep(0.02)  # polling pace


# ---- requests through the proxy ----


@dataclass
class Result:
    kind: str
    prompt_tokens: int
    report: dict[str, Any]
    text: str


def report_of(text: str) -> dict[str, Any]:
    """The decode stand-in's transfer report: the completion's first word, as JSON."""
    return json.loads(text.split(" ", 2)[1])


async def through_proxy(prefill_url: str, decode_url: str, requests: list[tuple[str, dict[str, Any]]]) -> list[Result]:
    """Starts a proxy on 127.0.0.1 in front of the stand-ins and sends ``requests`` (kind, body) one by one."""
    proxy = Proxy(
        ProxyConfig(
            prefill=[prefill_url],
            decode=[decode_url],
            health_interval_s=30.0,
            health_timeout_s=2.0,
            connect_timeout_s=5.0,
            request_timeout_s=REQUEST_TIMEOUT_S,
        )
    )
    await proxy.start()
    results = []
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)) as client:
            for kind, body in requests:
                chat = "messages" in body
                path = "/v1/chat/completions" if chat else "/v1/completions"
                async with client.post(proxy.url + path, json=body) as answer:
                    raw = await answer.read()
                    assert answer.status == 200, (kind, answer.status, raw[:2000])
                if body.get("stream"):
                    events = [e[len(b"data: ") :] for e in raw.split(b"\n\n") if e]
                    assert events[-1] == b"[DONE]", events[-3:]
                    chunks = [json.loads(e) for e in events[:-1]]
                    key = "delta" if chat else None
                    parts = [c["choices"][0][key]["content"] if key else c["choices"][0]["text"] for c in chunks]
                    text = "".join(parts)
                    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
                else:
                    answer_body = json.loads(raw)
                    choice = answer_body["choices"][0]
                    text = choice["message"]["content"] if chat else choice["text"]
                    assert answer_body["kv_transfer"] == report_of(text)
                prompt = body["messages"][0]["content"] if chat else body["prompt"]
                # the decode's words: the report, then the prompt's words (max_tokens in all)
                assert text.split()[1:] == prompt.split()[: body["max_tokens"] - 1], text[-200:]
                results.append(Result(kind, len(prompt.split()), report_of(text), text))
    finally:
        await proxy.close()
    return results
