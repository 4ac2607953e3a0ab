"""What the proxy does to a request, without any HTTP: its checks, and the bodies of the prefill and decode hops.

Pure functions over decoded JSON (dicts), shared by the proxy, the benchmark's direct path and the tests; the prompt
is read apart, once (:mod:`pd_transfer.proxy.prompt`).
"""

from __future__ import annotations

from typing import Any

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
ENDPOINTS = (COMPLETIONS, CHAT)

# What NixlConnector (vLLM 0.32) expects on the prefill hop; our connector reads the same keys.
PREFILL_KV_TRANSFER_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


class BadRequest(ValueError):
    """The client's request is unusable as sent: answered with 400 and this message."""


def validate(endpoint: str, body: Any) -> dict[str, Any]:
    """Checks the fields the proxy relies on besides the prompt (read and checked by
    :meth:`pd_transfer.proxy.prompt.Prompt.read`); returns the body. vLLM validates everything else."""
    if endpoint not in ENDPOINTS:
        raise BadRequest(f"unknown endpoint {endpoint}")
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {_json_type(body)}")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required and must be a non-empty string")
    if "kv_transfer_params" in body:
        raise BadRequest(
            "'kv_transfer_params' is set by the proxy between its prefill and decode hops; clients must not send it"
        )
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean")
    return body


def prefill_body(endpoint: str, body: dict[str, Any], stream_id: str | None = None) -> dict[str, Any]:
    """The prefill hop: same request, one token (no ``min_tokens``), not streamed, asking the prefill to keep the KV
    for a decode (``stream_id``: and to offer it layer by layer while it computes it, to the decode given that id)."""
    out = dict(body)
    out["kv_transfer_params"] = dict(PREFILL_KV_TRANSFER_PARAMS)
    if stream_id is not None:
        out["kv_transfer_params"]["stream_id"] = stream_id
    out["max_tokens"] = 1
    if endpoint == CHAT:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)
    out.pop("min_tokens", None)  # vLLM refuses min_tokens > max_tokens
    return out


#: What a prefill's params say of the engine itself (not of one request): a decode sent a streamed request needs them
#: before the prefill answers (:func:`stream_params`).
TARGET_KEYS = ("remote_engine_id", "remote_host", "remote_port", "tp_size", "remote_block_size")


def stream_target(params: dict[str, Any]) -> dict[str, Any] | None:
    """The engine a prefill's ``params`` name (:data:`TARGET_KEYS`), or None when one is missing."""
    target = {key: params.get(key) for key in TARGET_KEYS}
    return None if any(value is None for value in target.values()) else target


def stream_params(target: dict[str, Any], stream_id: str) -> dict[str, Any]:
    """The decode's ``kv_transfer_params`` for a request streamed from the prefill engine ``target``
    (:func:`stream_target`) as it computes it, both legs given ``stream_id``: no block ids (the decode learns them)."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        **target,
        "remote_request_id": stream_id,
        "stream_id": stream_id,
    }


def decode_body(body: dict[str, Any], kv_transfer_params: dict[str, Any] | None) -> dict[str, Any]:
    """The decode hop: the client's request plus what the prefill answered (or nothing when prefill was skipped)."""
    if kv_transfer_params is None:
        return body
    out = dict(body)
    out["kv_transfer_params"] = kv_transfer_params
    return out


#: The hold window a prefill promises in its params (see :mod:`pd_transfer.connector.params`): a decode whose read ends
#: inside it uses the KV without asking the prefill to confirm the blocks were still held.
HOLD_WINDOW_KEYS = ("remote_hold_seconds", "remote_hold_until", "remote_incarnation")


def without_hold_window(body: dict[str, Any]) -> dict[str, Any]:
    """The decode ``body`` for a second decode after a first one may have seen the params: the same, with the hold
    window's keys dropped from its ``kv_transfer_params`` (if any), so that the second decode confirms its read with
    the prefill instead of trusting a window a first reader's report may have ended (the blocks freed)."""
    params = body.get("kv_transfer_params")
    if not isinstance(params, dict) or not any(key in params for key in HOLD_WINDOW_KEYS):
        return body
    out = dict(body)
    out["kv_transfer_params"] = {k: v for k, v in params.items() if k not in HOLD_WINDOW_KEYS}
    return out


def kv_params_from_prefill(answer: Any) -> dict[str, Any] | None:
    """The prefill answer's kv_transfer_params, or None when it has none (or a non-object)."""
    if not isinstance(answer, dict):
        return None
    params = answer.get("kv_transfer_params")
    return params if isinstance(params, dict) and params else None


def error_body(message: str, type_: str, **extra: Any) -> dict[str, Any]:
    """An OpenAI-style error object."""
    error: dict[str, Any] = {"message": message, "type": type_}
    error.update(extra)
    return {"error": error}


def _json_type(value: Any) -> str:
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str):
        return "a string"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    return type(value).__name__
