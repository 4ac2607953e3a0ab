"""Streamed requests' ``kv_transfer_params`` (issue 41): the prefill leg ``{"do_remote_decode": true, "stream_id": ID}``
and the decode leg naming the prefill engine and ``stream_id`` without block ids parse to typed structs; a bad
``stream_id`` is refused naming the key; the proxy's ``stream_target`` / ``stream_params`` / ``prefill_body`` make
params that parse back to what they say."""

from __future__ import annotations

from typing import Any

import pytest

from pd_transfer.connector.params import (
    MAX_ID_CHARS,
    InvalidTransferParams,
    RemoteDecodeRequest,
    RemotePrefill,
    parse_transfer_params,
    remote_prefill_params,
)
from pd_transfer.proxy import flow

DECODE_LEG: dict[str, Any] = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "prefill-0",
    "remote_request_id": "stream-1",
    "remote_host": "10.0.0.2",
    "remote_port": 5600,
    "tp_size": 2,
    "remote_block_size": 16,
    "stream_id": "stream-1",
}


def parse(
    params: object, prompt_len: int | None = 40, local_block_size: int = 16
) -> RemotePrefill | RemoteDecodeRequest | None:
    return parse_transfer_params(params, prompt_len=prompt_len, local_block_size=local_block_size)


def test_the_prefill_leg_names_its_stream() -> None:
    assert parse({"do_remote_decode": True, "stream_id": "s-7"}) == RemoteDecodeRequest(stream_id="s-7")
    assert parse({"do_remote_decode": True}) == RemoteDecodeRequest(stream_id=None)
    assert parse({"do_remote_decode": True, "stream_id": None}) == RemoteDecodeRequest(stream_id=None)


def test_the_decode_leg_without_block_ids_is_a_stream() -> None:
    parsed = parse(DECODE_LEG)
    assert parsed == RemotePrefill(
        engine_id="prefill-0",
        request_id="stream-1",
        block_ids=(),
        host="10.0.0.2",
        port=5600,
        tp_size=2,
        num_tokens=40,  # the prompt: the prefill says nothing of its tokens yet
        block_size=16,
        stream=True,
    )
    unknown_prompt = parse(DECODE_LEG, prompt_len=None)
    assert isinstance(unknown_prompt, RemotePrefill) and unknown_prompt.stream and unknown_prompt.num_tokens is None


def test_a_decode_leg_with_a_stream_id_and_block_ids_is_an_ordinary_pull() -> None:
    parsed = parse({**DECODE_LEG, "remote_block_ids": [[3, 4, 5]], "remote_num_tokens": 40})
    assert isinstance(parsed, RemotePrefill)
    assert parsed.stream is False and parsed.block_ids == (3, 4, 5) and parsed.num_tokens == 40
    # the prefill's own answer with a stream id added: the same
    params = remote_prefill_params(
        engine_id="p", request_id="r", block_ids=[7, 8], host="h", port=1234, tp_size=1, num_tokens=20, block_size=16
    )
    again = parse({**params, "stream_id": "s"}, prompt_len=20)
    assert isinstance(again, RemotePrefill) and not again.stream and again.block_ids == (7, 8)


BAD_STREAM_IDS: dict[str, tuple[object, str]] = {
    "empty": ("", "must not be empty"),
    "blank": ("   ", "must not be empty"),
    "an int": (7, "expected a string, got int"),
    "a list": (["s"], "expected a string, got list"),
    "a bool": (True, "expected a string, got bool"),
    "too long": ("s" * (MAX_ID_CHARS + 1), f"longer than {MAX_ID_CHARS} characters"),
}


@pytest.mark.parametrize("leg", ["prefill", "decode"])
@pytest.mark.parametrize("case", sorted(BAD_STREAM_IDS))
def test_a_bad_stream_id_is_refused_naming_the_key(leg: str, case: str) -> None:
    value, fragment = BAD_STREAM_IDS[case]
    base: dict[str, Any] = {"do_remote_decode": True} if leg == "prefill" else DECODE_LEG
    with pytest.raises(InvalidTransferParams) as caught:
        parse({**base, "stream_id": value})
    assert caught.value.key == "stream_id", str(caught.value)
    assert fragment in str(caught.value)
    assert str(caught.value).startswith("kv_transfer_params: stream_id: ")


def test_a_stream_id_of_the_longest_length_is_fine() -> None:
    longest = "s" * MAX_ID_CHARS
    assert parse({"do_remote_decode": True, "stream_id": longest}) == RemoteDecodeRequest(stream_id=longest)


def prefill_answer(**changes: object) -> dict[str, Any]:
    """What a prefill engine answers for an earlier (sequential) request."""
    params = remote_prefill_params(
        engine_id="prefill-7",
        request_id="cmpl-earlier",
        block_ids=[1, 2],
        host="10.1.2.3",
        port=6100,
        tp_size=4,
        num_tokens=20,
        block_size=32,
    )
    params.update(changes)
    return params


def test_stream_target_names_the_engine_or_nothing() -> None:
    target = flow.stream_target(prefill_answer())
    assert target == {
        "remote_engine_id": "prefill-7",
        "remote_host": "10.1.2.3",
        "remote_port": 6100,
        "tp_size": 4,
        "remote_block_size": 32,
    }
    for key in flow.TARGET_KEYS:
        params = prefill_answer()
        del params[key]
        assert flow.stream_target(params) is None, key
        assert flow.stream_target(prefill_answer(**{key: None})) is None, key


def test_stream_params_parse_into_a_stream_from_the_target() -> None:
    target = flow.stream_target(prefill_answer())
    assert target is not None
    params = flow.stream_params(target, "stream-abc")
    assert params["stream_id"] == params["remote_request_id"] == "stream-abc"
    assert "remote_block_ids" not in params
    parsed = parse(params, prompt_len=100)
    assert parsed == RemotePrefill(
        engine_id="prefill-7",
        request_id="stream-abc",
        block_ids=(),
        host="10.1.2.3",
        port=6100,
        tp_size=4,
        num_tokens=100,
        block_size=32,
        stream=True,
    )
    assert target == flow.stream_target(prefill_answer())  # not changed by making the params


@pytest.mark.parametrize("endpoint", flow.ENDPOINTS)
def test_prefill_body_carries_the_stream_id(endpoint: str) -> None:
    body = {"model": "m", "prompt": "hi", "max_tokens": 9, "stream": True}
    streamed = flow.prefill_body(endpoint, body, "stream-abc")
    assert streamed["kv_transfer_params"]["stream_id"] == "stream-abc"
    assert streamed["max_tokens"] == 1 and streamed["stream"] is False
    assert parse(streamed["kv_transfer_params"]) == RemoteDecodeRequest(stream_id="stream-abc")
    plain = flow.prefill_body(endpoint, body)
    assert "stream_id" not in plain["kv_transfer_params"]
    assert "stream_id" not in flow.PREFILL_KV_TRANSFER_PARAMS  # the shared template is not changed
    assert parse(plain["kv_transfer_params"]) == RemoteDecodeRequest()
    assert body == {"model": "m", "prompt": "hi", "max_tokens": 9, "stream": True}  # the client's body untouched
