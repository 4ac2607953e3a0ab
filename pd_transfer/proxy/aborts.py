"""Recognising a decode answer that carries no output and says ``finish_reason: "abort"``.

vLLM's engine, once it got its SIGTERM, refuses every request that reaches it later, and its API server (which goes
on serving until the engine exits) answers such a request 200 with no output: a JSON answer whose choices all
finished ``abort`` with an empty text or message and no completion tokens, or an SSE stream that ends without any
output (vLLM 0.32 skips the empty event that would say ``abort``: a completions stream is then only ``data:
[DONE]``, a chat stream its opening role event and ``[DONE]``; an ``abort`` event with no output is taken the same
way). The request never got into the engine's scheduler (our connector never saw it, so the prefill's blocks were
not read), and the client has seen nothing yet: the proxy may send it to another decode
(:mod:`pd_transfer.proxy.decode_hop`). A stream with output, or a finish other than ``abort``, or anything this module
cannot parse, is relayed as it is.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

ABORT = "abort"
#: Bytes of a stream's opening held back while its events carry no output; past that, the stream is relayed as it
#: comes (an opening with no output is a few hundred bytes).
MAX_HELD_BYTES = 64 * 1024
# Fields of a choice (or of its ``message`` / ``delta``) that carry output when non-empty.
_CHOICE_OUTPUT = ("text", "token_ids")
_MESSAGE_OUTPUT = ("content", "tool_calls", "function_call", "reasoning_content", "reasoning", "refusal", "audio")
_DONE = b"[DONE]"


class Verdict(enum.Enum):
    """What to do with a stream's opening: ``HOLD`` (read on), ``RELAY`` (it has output, a finish other than
    ``abort``, or cannot be judged: send what is held and the rest as it comes), ``ABORTED`` (it ended with no output
    and no other finish: relay nothing)."""

    HOLD = "hold"
    RELAY = "relay"
    ABORTED = "aborted"


def is_empty_abort(raw: bytes) -> bool:
    """Whether a decode's JSON answer ``raw`` (the body of a 200) carries no output and every choice finished
    ``abort``: a non-empty list of choices, each with ``finish_reason: "abort"`` and no text, message content, tool
    call or token, and ``usage.completion_tokens`` 0 when present. False for anything else, unparseable included."""
    if ABORT.encode() not in raw:  # the common case costs one scan, no parse
        return False
    try:
        answer = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return False
    if not isinstance(answer, dict) or "error" in answer or _usage_has_output(answer):
        return False
    choices = answer.get("choices")
    if not isinstance(choices, list) or not choices:
        return False
    return all(isinstance(c, dict) and c.get("finish_reason") == ABORT and not _has_output(c) for c in choices)


class StreamOpening:
    """The opening of a decode's SSE stream, held while its events carry no output (at most ``limit`` bytes).

    :meth:`feed` takes the stream's bytes as they arrive, :meth:`end` says the stream ended; both give a
    :class:`Verdict`. ``held``: the bytes fed so far (what to relay on ``RELAY``)."""

    def __init__(self, limit: int = MAX_HELD_BYTES) -> None:
        self.held = bytearray()
        self._limit = limit
        self._scanned = 0  # bytes of ``held`` already parsed into events

    def feed(self, chunk: bytes) -> Verdict:
        """Adds ``chunk`` and judges the complete events in what is held."""
        self.held += chunk
        while True:
            end, gap = _event_end(self.held, self._scanned)
            if end < 0:
                return Verdict.RELAY if len(self.held) > self._limit else Verdict.HOLD
            verdict = self._event(bytes(self.held[self._scanned : end]))
            self._scanned = end + gap
            if verdict is not Verdict.HOLD:
                return verdict

    def end(self) -> Verdict:
        """The stream ended (``[DONE]``, or the end of the body) while held: it carried no output and no finish
        other than ``abort``, so ``ABORTED``."""
        return Verdict.ABORTED

    def _event(self, event: bytes) -> Verdict:
        data = b"\n".join(
            line[5:].strip() for line in event.replace(b"\r\n", b"\n").split(b"\n") if line.startswith(b"data:")
        )
        if not data:
            return Verdict.HOLD  # a comment or a keep-alive
        if data == _DONE:
            return self.end()
        try:
            payload = msgspec.json.decode(data)
        except msgspec.DecodeError:
            return Verdict.RELAY
        if not isinstance(payload, dict) or "error" in payload or _usage_has_output(payload):
            return Verdict.RELAY
        choices = payload.get("choices", [])
        if not isinstance(choices, list):
            return Verdict.RELAY
        for choice in choices:
            if not isinstance(choice, dict) or _has_output(choice):
                return Verdict.RELAY
            if choice.get("finish_reason") not in (None, ABORT):
                return Verdict.RELAY
        return Verdict.HOLD


def _event_end(buffer: bytearray, start: int) -> tuple[int, int]:
    """(end, separator length) of the first complete SSE event in ``buffer`` from ``start``; (-1, 0) if none."""
    ends = [(buffer.find(sep, start), len(sep)) for sep in (b"\n\n", b"\r\n\r\n")]
    found = [(end, gap) for end, gap in ends if end >= 0]
    return min(found) if found else (-1, 0)


def _has_output(choice: dict[str, Any]) -> bool:
    """Whether one choice (of a JSON answer or a stream event) carries any output."""
    if any(choice.get(key) for key in _CHOICE_OUTPUT):
        return True
    for part in ("message", "delta"):
        message = choice.get(part)
        if message is not None and not isinstance(message, dict):
            return True  # not the shape we know: not ours to judge
        if message and any(message.get(key) for key in _MESSAGE_OUTPUT):
            return True
    return False


def _usage_has_output(answer: dict[str, Any]) -> bool:
    """Whether the answer's ``usage`` (when present) counts completion tokens."""
    usage = answer.get("usage")
    if not isinstance(usage, dict):
        return False
    tokens = usage.get("completion_tokens")
    return tokens is not None and tokens != 0
