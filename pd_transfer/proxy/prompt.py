"""A client request's prompt, read once: checked, sorted by its form, and what routing and the hops derive from it.

A completions ``prompt`` is a string, a list of strings, a list of token ids or a list of token-id lists; a chat
request's ``messages`` a list of objects with a string ``role``. :meth:`Prompt.read` checks that shape (a
:class:`~pd_transfer.proxy.flow.BadRequest` otherwise) and notes its :class:`Form` in the same pass; what the proxy
derives from it is computed from that form on first use and kept for the request: whether it is a batch, the token
ids the client sent, the text a prefix is read from, and its size in tokens. The routing policies
(:mod:`pd_transfer.proxy.routing.request`), the engines' tokenization (:mod:`pd_transfer.proxy.tokenize`) and the
short-prompt rule read these; none of them reads the body's prompt again.

Sizes are counted without a tokenizer: token-id prompts exactly; text as ``ceil(max(1.3 x whitespace words,
characters / 4))`` (words x 1.3 tracks English prose under BPE tokenizers; characters / 4 catches text with few spaces:
code, numbers, CJK; taking the larger errs toward disaggregating); chat messages add
:data:`CHAT_TOKENS_PER_MESSAGE` each for the template.
"""

from __future__ import annotations

import enum
import math
from typing import Any

from pd_transfer.proxy.flow import CHAT, COMPLETIONS, BadRequest

#: Chat templates add a few tokens per message (role markers); a cheap allowance, not a tokenizer.
CHAT_TOKENS_PER_MESSAGE = 4


class Form(enum.Enum):
    """The form of a prompt: a completions ``prompt`` as ``TEXT`` (a string), ``TEXTS`` (a list of them), ``IDS`` (a
    list of token ids) or ``ID_LISTS`` (a list of such lists); a chat request's ``CHAT`` messages."""

    TEXT = "text"
    TEXTS = "texts"
    IDS = "ids"
    ID_LISTS = "id_lists"
    CHAT = "chat"


class Prompt:
    """One request's prompt (``endpoint``, ``body``: the request's decoded JSON object, ``form``), made by
    :meth:`read`. The derived values are computed on first use, once."""

    __slots__ = ("_text", "_tokens", "body", "endpoint", "form")

    def __init__(self, endpoint: str, body: dict[str, Any], form: Form) -> None:
        self.endpoint = endpoint
        self.body = body
        self.form = form
        self._text: str | None = None
        self._tokens: int | None = None

    @classmethod
    def read(cls, endpoint: str, body: dict[str, Any]) -> Prompt:
        """The prompt of ``body`` (a request to ``endpoint``, its other fields checked by
        :func:`~pd_transfer.proxy.flow.validate`); :class:`BadRequest` naming the field when it has none, or one of
        no form the proxy knows."""
        if endpoint == CHAT:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise BadRequest("'messages' is required and must be a non-empty list")
            for i, message in enumerate(messages):
                if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                    raise BadRequest(f"'messages[{i}]' must be an object with a string 'role'")
            return cls(endpoint, body, Form.CHAT)
        if endpoint != COMPLETIONS:
            raise BadRequest(f"unknown endpoint {endpoint}")
        if "prompt" not in body:
            raise BadRequest("'prompt' is required")
        form = _form_of(body["prompt"])
        if form is None:
            raise BadRequest(
                "'prompt' must be a non-empty string, a list of strings, a list of token ids"
                " or a list of token-id lists"
            )
        return cls(endpoint, body, form)

    @property
    def batch(self) -> bool:
        """Several prompts in one completions request: one ``kv_transfer_params`` cannot describe them."""
        return self.form in (Form.TEXTS, Form.ID_LISTS) and len(self.body["prompt"]) > 1

    def sent_ids(self) -> list[int] | None:
        """The token ids the client sent (a prompt of ids, or a list of one list of them); None for anything else."""
        if self.form is Form.IDS:
            ids: list[int] = self.body["prompt"]
            return ids
        if self.form is Form.ID_LISTS and len(self.body["prompt"]) == 1:
            first: list[int] = self.body["prompt"][0]
            return first
        return None

    def single_text(self) -> str | None:
        """The one text of a completions prompt (a string, or a list of one string); None for anything else."""
        if self.form is Form.TEXT:
            text: str = self.body["prompt"]
            return text
        if self.form is Form.TEXTS and len(self.body["prompt"]) == 1:
            only: str = self.body["prompt"][0]
            return only
        return None

    def text(self) -> str:
        """The text a request's prefix is read from: the prompt (a batch's first), or the chat messages' roles and
        text in order; empty for token ids."""
        if self._text is None:
            self._text = _text_of(self)
        return self._text

    def tokens(self) -> int:
        """The prompt's size in tokens: exact for token ids, estimated for text (a batch: its largest prompt)."""
        if self._tokens is None:
            self._tokens = _tokens_of(self)
        return self._tokens


def estimate_text_tokens(text: str) -> int:
    """A tokenizer-free estimate of ``text``'s tokens: the larger of 1.3 per whitespace word and 1 per 4 characters."""
    if not text:
        return 0
    return math.ceil(max(len(text.split()) * 1.3, len(text) / 4))


def _form_of(prompt: Any) -> Form | None:
    """The form of a completions ``prompt``, None when it has none the proxy knows (or is empty)."""
    if isinstance(prompt, str):
        return Form.TEXT if prompt else None
    if not isinstance(prompt, list) or not prompt:
        return None
    if all(isinstance(p, str) for p in prompt):
        return Form.TEXTS
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        return Form.IDS
    if all(
        isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p) for p in prompt
    ):
        return Form.ID_LISTS
    return None


def _message_texts(message: dict[str, Any]) -> list[str]:
    """The text of one chat message: its ``content`` string, or the ``text`` of its content parts."""
    content = message.get("content")
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        return [p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
    return []


def _text_of(prompt: Prompt) -> str:
    form, body = prompt.form, prompt.body
    if form is Form.TEXT:
        text: str = body["prompt"]
        return text
    if form is Form.TEXTS:
        first: str = body["prompt"][0]
        return first
    if form is Form.CHAT:
        parts: list[str] = []
        for message in body["messages"]:
            parts.append(f"<{message['role']}>")
            parts.extend(_message_texts(message))
        return "\n".join(parts)
    return ""


def _tokens_of(prompt: Prompt) -> int:
    form, body = prompt.form, prompt.body
    if form is Form.TEXT:
        return estimate_text_tokens(body["prompt"])
    if form is Form.TEXTS:
        return max(estimate_text_tokens(p) for p in body["prompt"])
    if form is Form.IDS:
        return len(body["prompt"])
    if form is Form.ID_LISTS:
        return max(len(p) for p in body["prompt"])
    return sum(
        CHAT_TOKENS_PER_MESSAGE + sum(estimate_text_tokens(t) for t in _message_texts(m)) for m in body["messages"]
    )
