"""kv_transfer_params at the edge: every malformed kind is refused naming the key (never KeyError /
TypeError), the scheduler side computes such requests locally, and what only the network can tell (an
unknown engine id, out-of-range block ids, a host that does not answer) fails at the pull, bounded, under
the failure policy, without touching the engine (the engines in this process, their agents fakes:
tests/unit/conftest.py)."""

from __future__ import annotations

import socket
import time

import pytest
from engine_specs import FINGERPRINT, decode_config, layouts
from hypothesis import given, settings
from hypothesis import strategies as st

from pd_transfer.connector.config import ConfigError, ConnectorConfig
from pd_transfer.connector.metadata import RemoteRef
from pd_transfer.connector.params import (
    InvalidTransferParams,
    RemoteDecodeRequest,
    RemotePrefill,
    RepeatedBlockIds,
    parse_transfer_params,
    remote_prefill_params,
)
from pd_transfer.connector.scheduler import SchedulerSide
from pd_transfer.handshake.messages import RankMetadata
from pd_transfer.settings import DEFAULTS, SettingError, Settings
from pd_transfer.sim.engines import DecodeEngine, LocalPrefillEngines
from pd_transfer.transfer.agent_protocol import AgentFactory

GOOD = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "prefill-0",
    "remote_request_id": "cmpl-1-0-abcd",
    "remote_block_ids": [[3, 4, 5]],
    "remote_host": "10.0.0.2",
    "remote_port": 5600,
    "tp_size": 2,
    "remote_num_tokens": 40,
    "remote_block_size": 16,
}


def parse(params: object, prompt_len: int | None = 40, local_block_size: int = 16) -> object:
    return parse_transfer_params(params, prompt_len=prompt_len, local_block_size=local_block_size)


def without(key: str) -> dict[str, object]:
    return {k: v for k, v in GOOD.items() if k != key}


def test_good_params_parse_to_a_typed_struct() -> None:
    assert parse(GOOD) == RemotePrefill(
        engine_id="prefill-0",
        request_id="cmpl-1-0-abcd",
        block_ids=(3, 4, 5),
        host="10.0.0.2",
        port=5600,
        tp_size=2,
        num_tokens=40,
        block_size=16,
    )
    flat = parse({**GOOD, "remote_block_ids": [3, 4, 5]})
    assert isinstance(flat, RemotePrefill) and flat.block_ids == (3, 4, 5)
    # vLLM's own keys, unknown keys and nulls for optional keys are fine
    vllm = {**without("remote_block_size"), "dcp_size": 1, "pp_size": 1, "transfer_mode": "pull"}
    vllm |= {"remote_blocks_expiry_time": None, "future_key": {"x": 1}, "remote_num_tokens": None}
    parsed = parse(vllm)
    assert isinstance(parsed, RemotePrefill) and parsed.num_tokens == 40 and parsed.block_size is None
    assert parse(None) is None and parse({}) is None and parse({"do_remote_prefill": False}) is None
    proxy_to_prefill = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None}
    assert parse(proxy_to_prefill) == RemoteDecodeRequest()


def test_what_a_prefill_returns_parses_back() -> None:
    params = remote_prefill_params(
        engine_id="p", request_id="r", block_ids=[7, 8], host="h", port=1234, tp_size=4, num_tokens=20, block_size=16
    )
    assert params["remote_block_ids"] == [[7, 8]]  # one list per KV cache group, as NixlConnector sends
    assert parse(params, prompt_len=20) == RemotePrefill(
        engine_id="p", request_id="r", block_ids=(7, 8), host="h", port=1234, tp_size=4, num_tokens=20, block_size=16
    )


MALFORMED = {
    # missing keys
    "no engine id": (without("remote_engine_id"), "remote_engine_id", "missing"),
    "no request id": (without("remote_request_id"), "remote_request_id", "missing"),
    "no block ids": (without("remote_block_ids"), "remote_block_ids", "missing"),
    "no host": (without("remote_host"), "remote_host", "missing"),
    "no port": (without("remote_port"), "remote_port", "missing"),
    "no tp size": (without("tp_size"), "tp_size", "missing"),
    "null engine id": ({**GOOD, "remote_engine_id": None}, "remote_engine_id", "null"),
    # wrong types
    "zzz block ids": ({**GOOD, "remote_block_ids": "zzz"}, "remote_block_ids", "got str 'zzz'"),
    "dict block ids": ({**GOOD, "remote_block_ids": {"0": 1}}, "remote_block_ids", "got dict"),
    "string block id": ({**GOOD, "remote_block_ids": [3, "4", 5]}, "remote_block_ids", "entry 1 is str"),
    "bool block id": ({**GOOD, "remote_block_ids": [3, True, 5]}, "remote_block_ids", "entry 1 is bool"),
    "float block id": ({**GOOD, "remote_block_ids": [3, 4.0, 5]}, "remote_block_ids", "entry 1 is float"),
    "mixed groups": ({**GOOD, "remote_block_ids": [[3, 4], 5]}, "remote_block_ids", "entry 0 is list"),
    "string port": ({**GOOD, "remote_port": "5600"}, "remote_port", "expected an integer, got str"),
    "bool port": ({**GOOD, "remote_port": True}, "remote_port", "expected an integer, got bool"),
    "float port": ({**GOOD, "remote_port": 5600.0}, "remote_port", "got float"),
    "bool tp size": ({**GOOD, "tp_size": True}, "tp_size", "got bool"),
    "int engine id": ({**GOOD, "remote_engine_id": 7}, "remote_engine_id", "expected a string, got int"),
    "int host": ({**GOOD, "remote_host": 42}, "remote_host", "expected a string"),
    "string flag": ({**GOOD, "do_remote_prefill": "true"}, "do_remote_prefill", "expected true or false"),
    "string tokens": ({**GOOD, "remote_num_tokens": "40"}, "remote_num_tokens", "got str"),
    # values out of range
    "negative block id": ({**GOOD, "remote_block_ids": [3, -4, 5]}, "remote_block_ids", "entry 1 is negative"),
    "huge block id": ({**GOOD, "remote_block_ids": [3, 2**40, 5]}, "remote_block_ids", "beyond any cache"),
    "no blocks": ({**GOOD, "remote_block_ids": []}, "remote_block_ids", "no block ids"),
    "repeated block id": (
        {**GOOD, "remote_block_ids": [[3, 4, 3]]},
        "remote_block_ids",
        "block 3 repeats (entries 0 and 2)",
    ),
    "empty group": ({**GOOD, "remote_block_ids": [[]]}, "remote_block_ids", "no block ids"),
    "two groups": ({**GOOD, "remote_block_ids": [[3, 4, 5], [6, 7, 8]]}, "remote_block_ids", "2 KV cache groups"),
    "too many blocks": ({**GOOD, "remote_block_ids": [3, 4, 5, 6]}, "remote_block_ids", "too many blocks"),
    "too few blocks": ({**GOOD, "remote_block_ids": [3, 4]}, "remote_block_ids", "too few blocks: 40 tokens"),
    "more blocks than tokens": (
        {**without("remote_block_size"), "remote_block_ids": list(range(41))},
        "remote_block_ids",
        "41 blocks for 40 tokens",
    ),
    "port zero": ({**GOOD, "remote_port": 0}, "remote_port", "in 1..65535, got 0"),
    "port too big": ({**GOOD, "remote_port": 70000}, "remote_port", "in 1..65535, got 70000"),
    "tp size zero": ({**GOOD, "tp_size": 0}, "tp_size", "at least 1"),
    "empty host": ({**GOOD, "remote_host": ""}, "remote_host", "must not be empty"),
    "blank host": ({**GOOD, "remote_host": "  "}, "remote_host", "must not be empty"),
    "host with spaces": ({**GOOD, "remote_host": "a b"}, "remote_host", "whitespace"),
    "empty engine id": ({**GOOD, "remote_engine_id": ""}, "remote_engine_id", "must not be empty"),
    "more tokens than the prompt": ({**GOOD, "remote_num_tokens": 41}, "remote_num_tokens", "more than this request's"),
    "zero tokens": ({**GOOD, "remote_num_tokens": 0}, "remote_num_tokens", "at least 1"),
    "block sizes do not nest": ({**GOOD, "remote_block_size": 24}, "remote_block_size", "do not nest"),
    "pipeline parallel": ({**GOOD, "pp_size": 2}, "pp_size", "not supported"),
    "push mode": ({**GOOD, "transfer_mode": "push"}, "transfer_mode", "only 'pull'"),
    "both directions": ({**GOOD, "do_remote_decode": True}, "do_remote_prefill", "both true"),
    # not a dict at all
    "a string": ("zzz", None, "expected a JSON object, got str"),
    "a list": ([GOOD], None, "got list"),
    "a number": (5, None, "got int"),
    "non-string key": ({**GOOD, 3: "x"}, None, "key 3 is not a string"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_params_are_refused_naming_the_key(case: str) -> None:
    params, key, fragment = MALFORMED[case]
    with pytest.raises(InvalidTransferParams) as caught:
        parse(params)
    assert isinstance(caught.value, ValueError)
    assert caught.value.key == key, str(caught.value)
    assert fragment in str(caught.value)
    if key is not None:
        assert str(caught.value).startswith(f"kv_transfer_params: {key}: ")


_KEYS = [*GOOD, "pp_size", "dcp_size", "transfer_mode", "remote_blocks_expiry_time"]
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**64), 2**64) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=400, deadline=None)
@given(
    base=st.sampled_from([GOOD, without("remote_block_size"), {"do_remote_prefill": True}]),
    changes=st.dictionaries(st.sampled_from(_KEYS), _JSON, max_size=4),
    prompt_len=st.integers(0, 200),
)
def test_any_json_gives_a_struct_or_invalid_params_never_another_error(
    base: dict, changes: dict, prompt_len: int
) -> None:
    try:
        parse({**base, **changes}, prompt_len=prompt_len)
    except InvalidTransferParams:
        pass


# ---------------------------------------------------------------------- the scheduler side, no network
def scheduler(clock: object = time.monotonic, **overrides: object) -> SchedulerSide:
    config = ConnectorConfig.from_dict({"side_channel_host": "127.0.0.1", **overrides}, env={}, settings=DEFAULTS)
    return SchedulerSide(config, engine_id="dec", block_size=16, clock=clock)  # type: ignore[arg-type]


def test_invalid_params_are_computed_locally_and_logged_once_naming_the_request(
    caplog: pytest.LogCaptureFixture,
) -> None:
    side = scheduler()
    bad = {**GOOD, "remote_block_ids": "zzz"}
    side.on_new_request("req-zzz", bad, prompt_len=40)
    for _ in range(3):
        assert side.get_num_new_matched_tokens("req-zzz", 40, 0, bad) == (0, False)
    side.update_state_after_alloc("req-zzz", [1, 2, 3], 0)
    assert side.request_finished("req-zzz", [1, 2, 3], "stop", bad) == (False, None)
    assert side.build_step_metadata().empty
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "req-zzz" in errors[0].getMessage() and "remote_block_ids" in errors[0].getMessage()
    assert side.invalid_params == 1


def test_repeated_block_ids_are_refused_and_the_prefill_is_released_once() -> None:
    side = scheduler()
    bad = {**GOOD, "remote_block_ids": [[5, 4, 5]]}
    with pytest.raises(RepeatedBlockIds) as caught:
        parse(bad)
    assert (caught.value.block_id, caught.value.first, caught.value.again) == (5, 0, 2)
    side.on_new_request("req-dup", bad, prompt_len=40)
    assert side.get_num_new_matched_tokens("req-dup", 40, 0, bad) == (0, False)  # computed locally
    side.update_state_after_alloc("req-dup", [1, 2, 3], 0)
    metadata = side.build_step_metadata()
    assert not metadata.reqs_to_recv
    assert metadata.reqs_to_release == {
        "req-dup": RemoteRef(
            remote_engine_id="prefill-0",
            remote_host="10.0.0.2",
            remote_port=5600,
            remote_request_id="cmpl-1-0-abcd",
            remote_tp_size=2,
        )
    }  # the prefill holds it and nobody will read it: freed now, not at the end of its lease
    assert side.request_finished("req-dup", [1, 2, 3], "stop", bad) == (False, None)
    assert side.build_step_metadata().empty  # released once
    assert side.invalid_params == 1 and side.releases == 1


def test_full_prompt_load_and_the_request_is_not_loaded_twice() -> None:
    side = scheduler()
    assert side.get_num_new_matched_tokens("r", 40, 0, GOOD) == (40, True)  # the whole prompt: vLLM recomputes
    assert side.get_num_new_matched_tokens("r", 40, 0, GOOD) == (40, True)  # asked again: same answer
    side.update_state_after_alloc("r", [10, 11, 12, 13], 40)  # one block more than needed: ignored
    (spec,) = side.build_step_metadata().reqs_to_recv.values()
    assert (spec.remote_request_id, spec.remote_block_ids, spec.local_block_ids) == (
        "cmpl-1-0-abcd",
        (3, 4, 5),
        (10, 11, 12),
    )
    assert (spec.num_tokens, spec.remote_tp_size, spec.remote_port) == (40, 2, 5600)
    assert side.get_num_new_matched_tokens("r", 40, 40, GOOD) == (0, False)  # loading/loaded
    side.update_state_after_alloc("r", [14], 0)  # called again for new blocks: nothing happens
    side.update_connector_output(finished_recving=["r"])
    assert side.request_finished("r", [10, 11, 12], "stop", GOOD) == (False, None)
    assert side.build_step_metadata().empty


def test_local_prefix_hits() -> None:
    side = scheduler()
    # aligned with the remote blocks: load the rest, from the matching remote block on
    assert side.get_num_new_matched_tokens("aligned", 40, 16, GOOD) == (24, True)
    side.update_state_after_alloc("aligned", [20, 21], 24)
    # not aligned with the remote blocks: nothing loadable, and the prefill is released
    unknown_block = without("remote_block_size")
    assert side.get_num_new_matched_tokens("unaligned", 40, 16, unknown_block) == (0, False)
    side.update_state_after_alloc("unaligned", [30, 31], 0)
    # everything already local: released too
    assert side.get_num_new_matched_tokens("all-local", 40, 48, GOOD) == (0, False)
    side.update_state_after_alloc("all-local", [], 0)
    metadata = side.build_step_metadata()
    spec = metadata.reqs_to_recv["aligned"]
    assert (spec.remote_block_ids, spec.local_block_ids, spec.num_tokens) == ((4, 5), (20, 21), 24)
    assert set(metadata.reqs_to_release) == {"unaligned", "all-local"}


def test_heartbeats_while_queued_only() -> None:
    now = [100.0]
    side = scheduler(clock=lambda: now[0], lease_seconds=9.0)
    side.on_new_request("q", GOOD, prompt_len=40)
    assert not side.build_step_metadata().reqs_to_heartbeat
    now[0] += 3.0
    assert set(side.build_step_metadata().reqs_to_heartbeat) == {"q"}  # every lease / 3
    assert not side.build_step_metadata().reqs_to_heartbeat
    side.get_num_new_matched_tokens("q", 40, 0, GOOD)
    side.update_state_after_alloc("q", [1, 2, 3], 40)
    now[0] += 30.0
    metadata = side.build_step_metadata()
    assert "q" in metadata.reqs_to_recv and not metadata.reqs_to_heartbeat


def test_prefill_side_holds_only_finished_remote_decode_requests() -> None:
    side = scheduler()
    # no side channel yet: a decode could not reach us, so nothing is held
    assert side.request_finished("p", [1], "length", {"do_remote_decode": True}) == (False, None)
    assert side.request_finished("p2", [1], "abort", {"do_remote_decode": True}) == (False, None)
    assert side.request_finished("p3", [1], "length", None) == (False, None)
    assert side.build_step_metadata().empty


def test_prefill_side_advertises_the_computed_blocks_and_holds_them_all() -> None:
    side = scheduler(side_channel_port=0)
    rank = RankMetadata(
        tp_rank=0, agent_name="a", agent_metadata=b"", layout=layouts(FINGERPRINT, 1)[0], regions=[]
    )  # the side channel only publishes it here: no NIXL needed
    port = side.start_side_channel([rank])
    try:
        remote_decode = {"do_remote_decode": True, "do_remote_prefill": False, "remote_block_ids": None}
        # a fourth block was allocated for the generated token: held, but not worth reading
        delay, params = side.request_finished("p", [1, 2, 3, 4], "length", remote_decode, num_computed_tokens=40)
        assert delay is True and params is not None
        assert params["remote_block_ids"] == [[1, 2, 3]] and params["remote_num_tokens"] == 40
        assert (params["remote_host"], params["remote_port"], params["remote_engine_id"]) == ("127.0.0.1", port, "dec")
        assert side.request_finished("q", [5], "stop", remote_decode, num_computed_tokens=40) == (False, None)
        side.abort_held("p")
        metadata = side.build_step_metadata()
        assert metadata.reqs_to_hold == {"p": (1, 2, 3, 4)} and metadata.reqs_to_abort == {"p"}
        assert side.holding == 1
        side.update_connector_output(finished_sending=["p"])
        assert side.holding == 0
    finally:
        side.close()


def test_config_is_checked_naming_the_setting() -> None:
    with pytest.raises(ConfigError, match=r"unknown connector setting.*kv_lease"):
        ConnectorConfig.from_dict({"kv_lease": 3}, env={}, settings=DEFAULTS)
    with pytest.raises(ConfigError, match=r"lease_seconds"):
        ConnectorConfig.from_dict({"lease_seconds": True}, env={}, settings=DEFAULTS)
    with pytest.raises(ConfigError, match=r"failure_policy"):
        ConnectorConfig.from_dict({"failure_policy": "retry"}, env={}, settings=DEFAULTS)
    with pytest.raises(SettingError, match="VLLM_NIXL_SIDE_CHANNEL_PORT"):  # the process's settings, at its edge
        Settings.from_environ({"VLLM_NIXL_SIDE_CHANNEL_PORT": "port"})
    with pytest.raises(ConfigError, match=r"engine_spin_s: must be within 0..10 s, got -1"):
        ConnectorConfig.from_dict({"engine_spin_s": -1}, env={}, settings=DEFAULTS)
    assert (
        ConnectorConfig.from_dict({"engine_spin_s": None}, env={}, settings=DEFAULTS).engine_spin_s is None
    )  # vLLM's own
    assert ConnectorConfig.from_dict({}, env={}, settings=DEFAULTS).engine_spin_s == 0.001
    settings = Settings.from_environ({"VLLM_NIXL_SIDE_CHANNEL_HOST": "10.1.2.3", "VLLM_NIXL_SIDE_CHANNEL_PORT": "5601"})
    assert ConnectorConfig.from_dict({}, settings=settings).side_channel_port == 5601
    config = ConnectorConfig.from_dict({"side_channel_port": 7000}, settings=settings)
    assert (config.side_channel_host, config.side_channel_port) == ("10.1.2.3", 7000)  # the dict wins
    assert config.failure_policy == "recompute" and config.lease_seconds == 30.0
    assert config.heartbeat_interval_s == 10.0


# ---------------------------------------------------------------------- what only the pull can tell
def test_unknown_engine_id_fails_at_the_pull_with_a_clear_error(
    prefills: LocalPrefillEngines, decode: DecodeEngine
) -> None:
    params = {
        **GOOD,
        "remote_engine_id": "no-such-engine",
        "remote_request_id": "ghost",
        "remote_host": prefills.host,
        "remote_port": prefills.ports["p1"],
        "tp_size": 1,
        "remote_block_ids": [[0, 1, 2]],
    }
    got = decode.receive("dec-wrong-engine", 40, params)
    assert got.finished and set(got.local_block_ids) <= got.load_errors  # recompute
    error = decode.workers[0].outcomes[-1].error
    assert "WrongEngine" in error and "'no-such-engine' is unknown" in error and "serves engine 'p1'" in error


def test_out_of_range_block_ids_fail_before_any_read_and_release_the_prefill(
    prefills: LocalPrefillEngines, decode: DecodeEngine
) -> None:
    out = prefills.prefill("p1", "range-1", prompt_len=40)
    params = {**out["params"], "remote_block_ids": [[250, 251, 99_999]]}  # the engine has 256 blocks
    got = decode.receive("dec-range-1", 40, params)
    assert got.finished and set(got.local_block_ids) <= got.load_errors
    assert "out of range for a cache of 256 blocks" in decode.workers[0].outcomes[-1].error
    sent = prefills.wait_sending("p1", ["range-1"], timeout_s=10)  # released by the decode, not the lease
    assert sent["finished_sending"] == ["range-1"] and sent["status"]["range-1"] == ["read"]
    assert sent["held_blocks"] == [0]


def test_a_host_that_does_not_answer_fails_bounded_under_the_policy(agent_factory: AgentFactory) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # nobody listens here once closed
    config = decode_config(handshake_timeout_s=0.3, failure_policy="fail")
    with DecodeEngine(
        "d-dead-host", layouts(FINGERPRINT, 1), 16, config, agent_factory=agent_factory, settings=DEFAULTS
    ) as decode:
        params = {**GOOD, "remote_host": "127.0.0.1", "remote_port": port, "tp_size": 1}
        started = time.monotonic()
        got = decode.receive("dec-dead-host", 40, params, timeout_s=10)
        assert got.finished and got.failed  # fail: the request is reported failed, the engine goes on
        assert time.monotonic() - started < 5  # three attempts of 0.3 s
        assert "HandshakeTimeout" in decode.workers[0].outcomes[-1].error
