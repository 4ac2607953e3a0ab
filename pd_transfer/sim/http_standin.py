"""Stand-in prefill and decode servers: vLLM's OpenAI HTTP surface and NixlConnector's kv_transfer_params flow,
without a model. For the proxy's tests and benchmark.

- role ``prefill``: expects ``kv_transfer_params.do_remote_decode`` true, ``max_tokens`` 1 and no streaming (400
  otherwise, so a proxy that gets the flow wrong fails loudly); answers one token and ``kv_transfer_params`` as a
  vLLM prefill with NixlConnector does (``do_remote_prefill`` true, ``remote_engine_id``, ``remote_block_ids``,
  ``remote_host``/``remote_port``, ...).
- role ``decode``: records the ``kv_transfer_params`` it got (None: it computed the prompt "locally"); refuses
  params that do not look like a prefill's answer; answers a deterministic completion echoing the prompt's words,
  streamed as SSE chunks ending in ``data: [DONE]`` when asked; records an abort when its client goes away
  mid-stream.
- ``prefill_delay_s``: a prefill's time to compute the prompt; ``token_delay_s``: a decode's time per token
  (between streamed chunks; all at once before a non-streamed answer). A request's ``standin_token_delay_s``
  overrides the server's;
  ``standin_drop_after: N`` makes a decode close the connection after N streamed tokens.
- ``POST /tokenize`` (vLLM's, for the proxy's kv_aware): a deterministic tokenization, :func:`standin_tokens`
  (one id per whitespace-separated word; a chat renders ``<|role|>`` markers and, with ``add_generation_prompt``
  (default true), a closing ``<|assistant|>``). Its calls count in ``tokenize_calls``; ``tokenize_fail`` makes it
  answer that status; ``tokenize_held`` (an event) holds its answers until the event is set (a backend too slow).
- ``/health`` (toggled with ``POST /control/health {"healthy": false}``), ``/v1/models``, ``POST /control/fail
  {"status": 500, "count": 2}`` (the next requests answer that status), ``GET /control/stats``.

Every request is recorded (request id, endpoint, kv_transfer_params) so tests can check what the proxy sent.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web

from pd_transfer.proxy.server import REQUEST_ID, bind_socket

ROLES = ("prefill", "decode")


@dataclass
class Record:
    request_id: str
    endpoint: str
    kv_transfer_params: dict[str, Any] | None
    body: dict[str, Any]
    aborted: bool = False
    finished: bool = False


@dataclass
class StandIn:
    role: str
    engine_id: str = ""
    model: str = "standin-model"
    default_tokens: int = 8
    token_delay_s: float = 0.0  # between streamed tokens (a decode's pace)
    prefill_delay_s: float = 0.0  # a prefill's time to compute the prompt before answering
    side_channel_port: int = 5600  # what a prefill reports as remote_port
    keep_bodies: bool = True
    omit_kv_transfer_params: bool = False  # a prefill misconfigured without a KV connector
    healthy: bool = True
    tokenize_calls: int = 0
    tokenize_fail: int = 0  # a status /tokenize answers instead of ids (0: it tokenizes)
    tokenize_held: asyncio.Event | None = None  # /tokenize answers only once it is set (None: at once)
    records: list[Record] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    host: str = ""
    port: int = 0

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}")
        self.engine_id = self.engine_id or f"standin-{self.role}-{id(self):x}"
        self._fail: list[int] = []
        self._changed = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self._next_block = 0
        self.app = web.Application()
        self.app.router.add_get("/health", self._health)
        self.app.router.add_get("/v1/models", self._models)
        self.app.router.add_post("/v1/completions", self._completions)
        self.app.router.add_post("/v1/chat/completions", self._chat)
        self.app.router.add_post("/tokenize", self._tokenize)
        self.app.router.add_post("/control/health", self._control_health)
        self.app.router.add_post("/control/fail", self._control_fail)
        self.app.router.add_get("/control/stats", self._control_stats)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serves on ``host:port`` (0: a free port; after ``stop()``, the same port again). Returns the URL."""
        self._runner = web.AppRunner(self.app, access_log=None, handler_cancellation=True, shutdown_timeout=1.0)
        await self._runner.setup()
        sock = bind_socket(host, port or self.port)
        await web.SockSite(self._runner, sock, backlog=1024).start()
        self.host, self.port = host, sock.getsockname()[1]
        return self.url

    async def stop(self) -> None:
        """Stops listening and drops every connection (clients see connection errors)."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def fail_next(self, status: int, count: int = 1) -> None:
        self._fail.extend([status] * count)

    async def wait_for(self, predicate: Callable[[StandIn], bool], timeout_s: float = 5.0) -> None:
        """Returns once ``predicate(self)`` holds (checked after each request event); TimeoutError after the wait."""
        deadline = time.monotonic() + timeout_s
        while not predicate(self):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"stand-in {self.role} {self.url}: condition not reached in {timeout_s} s")
            event = self._changed
            try:
                await asyncio.wait_for(event.wait(), remaining)
            except TimeoutError:
                if not predicate(self):
                    raise

    def _fire(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    # ---- control ----

    async def _health(self, _request: web.Request) -> web.Response:
        return json_response({"status": "ok" if self.healthy else "down"}, 200 if self.healthy else 503)

    async def _control_health(self, request: web.Request) -> web.Response:
        self.healthy = bool((await request.json()).get("healthy", True))
        return json_response({"healthy": self.healthy})

    async def _control_fail(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.fail_next(int(body.get("status", 500)), int(body.get("count", 1)))
        return json_response({"pending_failures": len(self._fail)})

    async def _control_stats(self, _request: web.Request) -> web.Response:
        return json_response({"role": self.role, "requests": len(self.records), "aborts": list(self.aborts)})

    async def _models(self, _request: web.Request) -> web.Response:
        return json_response(
            {"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "pd-transfer"}]}
        )

    async def _tokenize(self, request: web.Request) -> web.Response:
        self.tokenize_calls += 1
        rid = request.headers.get(REQUEST_ID, "")
        if self.tokenize_held is not None:
            await self.tokenize_held.wait()  # the test sets it once the proxy gave up (or the client left)
        if self.tokenize_fail:
            return error_response(self.tokenize_fail, "injected /tokenize failure", rid)
        try:
            body = msgspec.json.decode(await request.read())
        except msgspec.DecodeError:
            return error_response(400, "invalid JSON", rid)
        if not isinstance(body, dict) or not (isinstance(body.get("prompt"), str) or "messages" in body):
            return error_response(400, "/tokenize needs a prompt (text) or messages", rid)
        tokens = standin_tokens(body)
        return json_response({"tokens": tokens, "count": len(tokens), "max_model_len": 4096, "token_strs": None})

    # ---- inference ----

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "/v1/completions")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "/v1/chat/completions")

    async def _serve(self, request: web.Request, endpoint: str) -> web.StreamResponse:
        rid = request.headers.get(REQUEST_ID, "")
        try:
            body = msgspec.json.decode(await request.read())
        except msgspec.DecodeError:
            return error_response(400, "invalid JSON", rid)
        if not isinstance(body, dict):
            return error_response(400, "body must be an object", rid)
        params = body.get("kv_transfer_params")
        record = Record(rid, endpoint, params, body if self.keep_bodies else {})
        self.records.append(record)
        self._fire()
        if self._fail:
            return error_response(self._fail.pop(0), f"injected failure of stand-in {self.role}", rid)
        problem = self._check(body, params)
        if problem:
            return error_response(400, problem, rid)
        chat = endpoint == "/v1/chat/completions"
        if self.role == "prefill":
            if self.prefill_delay_s:
                await asyncio.sleep(self.prefill_delay_s)
            answer = self._answer(chat, body, rid, [self._word(body, 0)], "length")
            if not self.omit_kv_transfer_params:
                answer["kv_transfer_params"] = self._prefill_params(rid, body)
            record.finished = True
            return json_response(answer, rid=rid)
        limit = body.get("max_completion_tokens") if chat else None
        limit = limit or body.get("max_tokens") or self.default_tokens
        words = [self._word(body, i) for i in range(int(limit))]
        # A request may set its own pace (tests hold one decode busy while others are not).
        delay = float(body.get("standin_token_delay_s", self.token_delay_s))
        if not body.get("stream"):
            if delay:
                await asyncio.sleep(delay * len(words))
            record.finished = True
            self._fire()
            return json_response(self._answer(chat, body, rid, words, "length"), rid=rid)
        return await self._stream(request, chat, body, rid, words, record, delay)

    def _check(self, body: dict[str, Any], params: Any) -> str:
        if self.role == "prefill":
            if not isinstance(params, dict) or params.get("do_remote_decode") is not True:
                return "prefill stand-in: kv_transfer_params.do_remote_decode must be true"
            if body.get("max_tokens") != 1 or body.get("stream") or "stream_options" in body:
                return "prefill stand-in: max_tokens must be 1, without streaming"
            return ""
        if params is None:
            return ""
        if not isinstance(params, dict) or params.get("do_remote_prefill") is not True:
            return "decode stand-in: kv_transfer_params must come from a prefill (do_remote_prefill true)"
        for key in ("remote_engine_id", "remote_block_ids", "remote_host", "remote_port"):
            if params.get(key) in (None, "", []):
                return f"decode stand-in: kv_transfer_params.{key} missing"
        return ""

    def _prefill_params(self, rid: str, body: dict[str, Any]) -> dict[str, Any]:
        tokens = max(1, len(prompt_text(body).split()))
        blocks = -(-tokens // 16)
        first = self._next_block
        self._next_block += blocks
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [list(range(first, first + blocks))],
            "remote_engine_id": self.engine_id,
            "remote_request_id": rid,
            "remote_host": self.host,
            "remote_port": self.side_channel_port,
            "tp_size": 1,
            "remote_num_tokens": tokens,
        }

    def _word(self, body: dict[str, Any], i: int) -> str:
        words = prompt_text(body).split() or ["token"]
        return words[i % len(words)]

    def _answer(self, chat: bool, body: dict[str, Any], rid: str, words: list[str], finish: str) -> dict[str, Any]:
        text = "".join(" " + w for w in words)
        prompt_tokens = len(prompt_text(body).split())
        base = {
            "id": ("chatcmpl-" if chat else "cmpl-") + (rid or _digest(body)),
            "created": int(time.time()),
            "model": body.get("model", self.model),
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": len(words),
                "total_tokens": prompt_tokens + len(words),
            },
            "kv_transfer_params": None,
        }
        if chat:
            base["object"] = "chat.completion"
            base["choices"] = [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}]
        else:
            base["object"] = "text_completion"
            base["choices"] = [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]
        return base

    async def _stream(
        self,
        request: web.Request,
        chat: bool,
        body: dict[str, Any],
        rid: str,
        words: list[str],
        record: Record,
        delay: float,
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", REQUEST_ID: rid})
        cid = ("chatcmpl-" if chat else "cmpl-") + (rid or _digest(body))
        created = int(time.time())
        model = body.get("model", self.model)
        try:
            await response.prepare(request)
            drop_after = body.get("standin_drop_after")
            for i, word in enumerate(words):
                if i and delay:
                    await asyncio.sleep(delay)
                if i == drop_after:  # a decode server dying mid-stream: the connection just closes
                    assert request.transport is not None
                    request.transport.close()
                    return response
                finish = "length" if i == len(words) - 1 else None
                if chat:
                    delta: dict[str, Any] = {"content": " " + word}
                    if i == 0:
                        delta["role"] = "assistant"
                    choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
                    chunk = {
                        "id": cid,
                        "object": "chat.completion.chunk",
                        "created": created,
                        "model": model,
                        "choices": [choice],
                    }
                else:
                    choice = {"index": 0, "text": " " + word, "logprobs": None, "finish_reason": finish}
                    chunk = {
                        "id": cid,
                        "object": "text_completion",
                        "created": created,
                        "model": model,
                        "choices": [choice],
                    }
                await response.write(b"data: " + msgspec.json.encode(chunk) + b"\n\n")
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            record.aborted = True
            self.aborts.append(rid)
            self._fire()
            raise
        record.finished = True
        self._fire()
        return response


def prompt_text(body: dict[str, Any]) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        return " ".join(str(p) for p in prompt)
    parts = []
    for message in body.get("messages") or []:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts.extend(p.get("text", "") for p in content if isinstance(p, dict))
    return " ".join(parts)


def standin_tokens(body: dict[str, Any]) -> list[int]:
    """The stand-ins' deterministic token ids of a completions prompt or chat messages (a /tokenize body, or a
    completions or chat request): one id per whitespace-separated word of the rendered text, from its hash."""
    if isinstance(body.get("prompt"), str):
        text = body["prompt"]
    else:
        parts = []
        for message in body.get("messages") or []:
            role = message.get("role") if isinstance(message, dict) else None
            parts.append(f"<|{role}|> {prompt_text({'messages': [message]})}")
        if body.get("add_generation_prompt", True):
            parts.append("<|assistant|>")
        text = " ".join(parts)
    return [int.from_bytes(hashlib.blake2b(w.encode(), digest_size=4).digest(), "big") % 50000 for w in text.split()]


def _digest(body: dict[str, Any]) -> str:
    return hashlib.sha256(msgspec.json.encode(body)).hexdigest()[:16]


def json_response(body: Any, status: int = 200, rid: str | None = None) -> web.Response:
    headers = {"Content-Type": "application/json"}
    if rid:
        headers[REQUEST_ID] = rid
    return web.Response(body=msgspec.json.encode(body), status=status, headers=headers)


def error_response(status: int, message: str, rid: str) -> web.Response:
    return json_response({"error": {"message": message, "type": "standin_error", "code": status}}, status, rid)


async def _serve_forever(
    roles: list[str], host: str, token_delay_s: float, prefill_delay_s: float, tokens: int
) -> None:
    servers = [
        StandIn(
            role, token_delay_s=token_delay_s, prefill_delay_s=prefill_delay_s, default_tokens=tokens, keep_bodies=False
        )
        for role in roles
    ]
    for server in servers:
        await server.start(host, 0)
        print(f"{server.role} {server.url}", flush=True)
    print("ready", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for server in servers:
        await server.stop()


def main(argv: list[str] | None = None) -> int:
    """``python -m pd_transfer.sim.http_standin prefill decode``: serves the stand-ins, prints ``ROLE URL`` each."""
    parser = argparse.ArgumentParser(prog="pd_transfer.sim.http_standin", description=__doc__.split("\n")[0])
    parser.add_argument("roles", nargs="+", choices=ROLES)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument(
        "--token-delay", type=float, default=0.0, help="decode: seconds per generated token (streamed or not)"
    )
    parser.add_argument("--prefill-delay", type=float, default=0.0, help="prefill: seconds before answering")
    parser.add_argument("--tokens", type=int, default=8, help="tokens when the request sets no max_tokens")
    args = parser.parse_args(argv)
    from pd_transfer.proxy.cli import loop_factory

    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        runner.run(_serve_forever(args.roles, args.host, args.token_delay, args.prefill_delay, args.tokens))
    return 0


if __name__ == "__main__":
    sys.exit(main())
