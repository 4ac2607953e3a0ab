"""Token ids of a text or chat prompt for a policy that reads ids (``kv_aware``), from the engines' own tokenizer:
vLLM's ``POST /tokenize``.

The proxy has no tokenizer, and a second copy of the model's tokenizer and chat template here could drift from the
engines'. So a prompt that is not token ids is sent, before routing, to ``/tokenize`` on a healthy backend (the least
busy prefill; the decodes when no prefill is healthy), with the fields that change what the engine feeds its model:

* completions: ``prompt`` and ``add_special_tokens`` (vLLM's default True for completions);
* chat: ``messages``, ``add_generation_prompt`` (default True), ``continue_final_message``, ``add_special_tokens``
  (default False), ``chat_template``, ``chat_template_kwargs``, ``tools``: vLLM 0.32's ``/tokenize`` renders the
  messages with the same ``preprocess_chat`` as ``/v1/chat/completions`` and the same server defaults, so the ids
  are the ones the engine hashes into its blocks.

The answer's ``tokens`` become the request's token ids (the first
:data:`~pd_transfer.proxy.routing.request.MAX_HASHED_TOKENS`). Every wait is bounded (``timeout_s``); a failure (no
backend, a connection error, a timeout, a non-200 answer such as vLLM's 400 for messages it cannot render, an answer
without ids) leaves the prompt without ids, which kv_aware routes as before (``no_prompt``: the least busy), and
counts in ``pd_proxy_tokenize_total{result}``. A batch of prompts is not tokenized (no prefix to follow)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import msgspec

from pd_transfer.proxy.prompt import Form, Prompt
from pd_transfer.proxy.routing.pool import Backend, Pool
from pd_transfer.proxy.routing.request import RouteRequest
from pd_transfer.proxy.upstream import Endpoint, Upstream, UpstreamError

log = logging.getLogger(__name__)

PATH = "/tokenize"
#: ``pd_proxy_tokenize_total{result}``: ``ok``; ``no_backend``; ``error`` (connection, bad answer); ``timeout``;
#: ``refused`` (the backend answered a non-200 status).
RESULTS = ("ok", "no_backend", "error", "timeout", "refused")
#: The chat fields copied to ``/tokenize`` when the client set them (they change the rendered prompt).
CHAT_FIELDS = (
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "tools",
)


def tokenize_body(prompt: Prompt) -> dict[str, Any] | None:
    """The ``/tokenize`` request for a client's ``prompt``, or None when it has nothing to tokenize (token ids, a
    batch)."""
    body = prompt.body
    out: dict[str, Any] = {}
    model = body.get("model")
    if isinstance(model, str):
        out["model"] = model
    if prompt.form is Form.CHAT:
        out["messages"] = body["messages"]
        for name in CHAT_FIELDS:
            if name in body:
                out[name] = body[name]
        return out
    text = prompt.single_text()
    if text is None:
        return None
    out["prompt"] = text
    if "add_special_tokens" in body:
        out["add_special_tokens"] = body["add_special_tokens"]
    return out


class Tokenizer:
    """Asks ``pools`` (in order: the first with a healthy backend) for token ids; ``count(result)`` is told of each
    attempt's outcome."""

    def __init__(
        self,
        pools: list[Pool],
        upstream: Upstream,
        timeout_s: float,
        count: Callable[[str], None],
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"the tokenize timeout must be positive, got {timeout_s}")
        self.pools = pools
        self.timeout_s = timeout_s
        self._upstream = upstream
        self._count = count
        self._endpoints: dict[str, Endpoint] = {}

    def backend(self) -> Backend | None:
        """The least busy healthy backend of the first pool that has one."""
        for pool in self.pools:
            healthy = pool.healthy()
            if healthy:
                return min(healthy, key=lambda b: b.in_flight)
        return None

    async def fill(self, route: RouteRequest, headers: dict[str, str]) -> None:
        """Gives ``route`` the prompt's token ids when it has none yet and the engines tokenize it; never raises
        (a failure is counted and leaves the prompt without ids)."""
        if route.token_ids() is not None:
            return
        request = tokenize_body(route.prompt)
        if request is None:
            return
        backend = self.backend()
        if backend is None:
            self._count("no_backend")
            return
        endpoint = self._endpoints.get(backend.url)
        if endpoint is None:
            endpoint = self._endpoints[backend.url] = Endpoint.of(backend.url + PATH)
        try:
            async with asyncio.timeout(self.timeout_s):
                async with await self._upstream.post(endpoint, headers, msgspec.json.encode(request)) as answer:
                    raw = await answer.read()
        except TimeoutError:
            self._count("timeout")
            log.debug("tokenize on %s: no answer within %.3g s", backend.url, self.timeout_s)
            return
        except UpstreamError as e:
            self._count("error")
            log.debug("tokenize on %s failed: %s", backend.url, type(e).__name__)
            return
        if answer.status != 200:
            self._count("refused")
            log.debug("tokenize on %s answered %d", backend.url, answer.status)
            return
        tokens = _tokens_of(raw)
        if tokens is None:
            self._count("error")
            log.debug("tokenize on %s: an answer without token ids", backend.url)
            return
        route.set_token_ids(tokens)
        self._count("ok")


class _Answer(msgspec.Struct):
    tokens: list[int]


def _tokens_of(raw: bytes) -> list[int] | None:
    try:
        return msgspec.json.decode(raw, type=_Answer).tokens
    except msgspec.DecodeError:  # ValidationError is a DecodeError
        return None
