"""A request's whole life through the connector, over real processes, ZMQ and NIXL.

Prefill engines (scheduler side + one worker per TP rank) run in a child process; decode engines run here.
A prefill finishes a prompt and returns kv_transfer_params; the decode's scheduler side matches and
schedules the load; its worker pulls, waits for the prefill's confirmation that the blocks were still held,
and reports the request received; the prefill reports it finished sending once its readers reported, and
holds no blocks any more. Engines hand freed blocks back to their allocator, which scribbles over them.
"""

from __future__ import annotations

import logging
import time

import pytest
from engine_specs import FINGERPRINT, ONE_HEAD, SHORT_LEASE_S, decode_config, layouts

from pd_transfer.settings import DEFAULTS
from pd_transfer.sim.engines import DecodeEngine, PrefillEngines
from pd_transfer.sim.verify import received_correctly
from pd_transfer.transfer.agent_protocol import AgentFactory


def _assert_freed(sent: dict, request_ids: list[str], status: str, ranks: int) -> None:
    assert sent["finished_sending"] == sorted(request_ids), sent
    for request_id in request_ids:
        assert sent["status"][request_id] == [status] * ranks, sent
    assert sent["held_blocks"] == [0] * ranks, sent  # the connector holds nothing any more
    assert sent["lent_blocks"] == 0, sent  # and the engine got every block back


def test_full_request_lifecycle(prefills: PrefillEngines, decode: DecodeEngine) -> None:
    out = prefills.prefill("p1", "life-1", prompt_len=70)
    params = out["params"]
    assert out["delay_free"] is True
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_engine_id"] == "p1" and params["remote_request_id"] == "life-1"
    assert params["remote_block_ids"] == [out["block_ids"]] and len(out["block_ids"]) == 5
    assert (params["remote_host"], params["remote_port"]) == (prefills.host, prefills.ports["p1"])
    assert (params["tp_size"], params["remote_num_tokens"], params["remote_block_size"]) == (1, 70, 16)

    got = decode.receive("dec-life-1", 70, params)
    assert got.ok, got
    expected = prefills.specs["p1"].caches()
    assert received_correctly(decode.caches[0], got.local_block_ids, expected, out["block_ids"], 70)
    outcome = decode.workers[0].outcomes[-1]
    assert outcome.ok and outcome.stats is not None and outcome.stats.bytes > 0

    _assert_freed(prefills.wait_sending("p1", ["life-1"]), ["life-1"], "read", 1)

    # rescheduled after the load (as vLLM does): nothing more to load; finishing releases nothing
    assert decode.scheduler.get_num_new_matched_tokens("dec-life-1", 70, 70, params) == (0, False)
    decode.scheduler.update_state_after_alloc("dec-life-1", [], 0)
    assert decode.scheduler.request_finished("dec-life-1", got.local_block_ids, "stop", params) == (False, None)
    assert decode.scheduler.build_step_metadata().empty


def test_heterogeneous_tp_prefill_2_to_decode_1(prefills: PrefillEngines, decode: DecodeEngine) -> None:
    out = prefills.prefill("p2", "hetero-1", prompt_len=50)
    assert out["params"]["tp_size"] == 2
    got = decode.receive("dec-hetero-1", 50, out["params"])
    assert got.ok, got
    expected = prefills.specs["p2"].caches()
    assert received_correctly(decode.caches[0], got.local_block_ids, expected, out["block_ids"], 50)
    # both prefill ranks were read, confirmed, and freed by their reader
    _assert_freed(prefills.wait_sending("p2", ["hetero-1"]), ["hetero-1"], "read", 2)


def test_replicated_heads_the_unread_rank_is_released_too(
    prefills: PrefillEngines, agent_factory: AgentFactory
) -> None:
    with DecodeEngine(
        "d-one-head", layouts(ONE_HEAD, 1), 32, decode_config(), agent_factory=agent_factory, settings=DEFAULTS
    ) as decode:
        out = prefills.prefill("prep", "rep-1", prompt_len=33)
        got = decode.receive("dec-rep-1", 33, out["params"])
        assert got.ok, got
        expected = prefills.specs["prep"].caches()
        assert received_correctly(decode.caches[0], got.local_block_ids, expected, out["block_ids"], 33)
        # rank 1 holds the same head and is never read: decode rank 0 released it (lease is 30 s)
        _assert_freed(prefills.wait_sending("prep", ["rep-1"], timeout_s=10), ["rep-1"], "read", 2)


def test_decode_abort_before_reading_releases_the_prefill(prefills: PrefillEngines, decode: DecodeEngine) -> None:
    queued = prefills.prefill("p1", "abort-queued", prompt_len=40)["params"]
    never_seen = prefills.prefill("p1", "abort-unseen", prompt_len=40)["params"]
    # queued and matched, then the client went away before the blocks were allocated
    decode.scheduler.on_new_request("dec-abort-queued", queued, prompt_len=40)
    assert decode.scheduler.get_num_new_matched_tokens("dec-abort-queued", 40, 0, queued) == (40, True)
    assert decode.scheduler.request_finished("dec-abort-queued", [], "abort", queued) == (False, None)
    # a request aborted before the scheduler ever saw it (vLLM's pre-aborted copies carry the params)
    assert decode.scheduler.request_finished("dec-abort-unseen", [], "abort", never_seen) == (False, None)
    metadata = decode.scheduler.build_step_metadata()
    assert set(metadata.reqs_to_release) == {"dec-abort-queued", "dec-abort-unseen"} and not metadata.reqs_to_recv
    for worker in decode.workers:
        worker.start_load(metadata)
    # freed by the decode's word, long before the 30 s lease; never reported as received here
    sent = prefills.wait_sending("p1", ["abort-queued", "abort-unseen"], timeout_s=10)
    _assert_freed(sent, ["abort-queued", "abort-unseen"], "read", 1)
    decode.step()
    assert not {"dec-abort-queued", "dec-abort-unseen"} & decode.finished_recving


def test_stale_read_after_the_lease_is_refused_and_never_used(
    prefills: PrefillEngines, decode: DecodeEngine, decode_fail: DecodeEngine
) -> None:
    names = ["stale-recompute", "stale-fail", "never-read"]
    outs = {name: prefills.prefill("pshort", name, prompt_len=40) for name in names}
    # nobody reads in time: every lease runs out, the engine gets the blocks back (and scribbles on them)
    sent = prefills.wait_sending("pshort", names, timeout_s=SHORT_LEASE_S + 10)
    _assert_freed(sent, names, "expired", 1)

    got = decode.receive("dec-stale-recompute", 40, outs["stale-recompute"]["params"])
    assert got.finished and not got.failed
    assert set(got.local_block_ids) <= got.load_errors  # recompute: the engine recomputes these blocks
    assert "expired" in decode.workers[0].outcomes[-1].error
    # the read did happen, and brought garbage: only the refused confirmation kept it from being used
    expected = prefills.specs["pshort"].caches()
    remote = outs["stale-recompute"]["block_ids"]
    assert not received_correctly(decode.caches[0], got.local_block_ids, expected, remote, 40)

    got = decode_fail.receive("dec-stale-fail", 40, outs["stale-fail"]["params"])
    assert got.finished and got.failed  # fail: the request is reported failed
    assert not set(got.local_block_ids) & got.load_errors
    assert prefills.state("pshort")["held_blocks"] == [0]


def test_heartbeats_keep_a_queued_request_alive(prefills: PrefillEngines, agent_factory: AgentFactory) -> None:
    config = decode_config(lease_seconds=SHORT_LEASE_S, heartbeat_seconds=0.25)
    with DecodeEngine(
        "d-heartbeat", layouts(FINGERPRINT, 1), 16, config, agent_factory=agent_factory, settings=DEFAULTS
    ) as decode:
        params = prefills.prefill("pshort", "beat-1", prompt_len=40)["params"]
        decode.scheduler.on_new_request("dec-beat-1", params, prompt_len=40)
        queued_until = time.monotonic() + 2 * SHORT_LEASE_S  # queued for two leases, the engine stepping
        while time.monotonic() < queued_until:
            decode.step()
            time.sleep(0.02)
        assert prefills.state("pshort", ["beat-1"])["status"]["beat-1"] == ["held"]
        got = decode.receive("dec-beat-1", 40, params)
        assert got.ok, got
        _assert_freed(prefills.wait_sending("pshort", ["beat-1"]), ["beat-1"], "read", 1)


def test_malformed_params_never_crash_and_the_next_request_succeeds(
    prefills: PrefillEngines, decode: DecodeEngine, caplog: pytest.LogCaptureFixture
) -> None:
    good = prefills.prefill("p1", "after-bad", prompt_len=40)["params"]
    malformed = [
        {"do_remote_prefill": True, "remote_block_ids": "zzz"},  # kills a vLLM 0.32 decode engine
        {"do_remote_prefill": True},
        {**good, "remote_block_ids": "zzz"},
        {**good, "remote_block_ids": [[1, 2, 3], [4, 5, 6]]},
        {**good, "remote_block_ids": [-1, 2, 3]},
        {**good, "remote_block_ids": list(range(9))},
        {**good, "remote_port": "5600"},
        {**good, "remote_port": True},
        {**good, "remote_engine_id": None},
        {**good, "tp_size": 0},
        {**good, "remote_num_tokens": 4000},
        {**good, "do_remote_prefill": "yes"},
        "zzz",
        [1, 2, 3],
    ]
    with caplog.at_level(logging.ERROR, logger="pd_transfer.connector.scheduler"):
        for index, params in enumerate(malformed):
            request_id = f"dec-bad-{index}"
            decode.scheduler.on_new_request(request_id, params, prompt_len=40)
            assert decode.scheduler.get_num_new_matched_tokens(request_id, 40, 0, params) == (0, False)
            decode.scheduler.update_state_after_alloc(request_id, decode.allocate(40), 0)
            assert decode.scheduler.request_finished(request_id, [], "abort", params) == (False, None)
            assert decode.scheduler.build_step_metadata().empty
            decode.step()
    assert "dec-bad-0" in caplog.text and "remote_engine_id: missing" in caplog.text
    assert "dec-bad-2" in caplog.text and "remote_block_ids: expected a list of block ids, got str 'zzz'" in caplog.text
    # the prefill side refuses a malformed do_remote_decode the same way: computed, not held
    out = prefills.prefill("p1", "bad-remote-decode", prompt_len=40, params={"do_remote_decode": "yes"})
    assert out["delay_free"] is False and out["params"] is None

    got = decode.receive("dec-after-bad", 40, good)
    assert got.ok, got
    _assert_freed(prefills.wait_sending("p1", ["after-bad"]), ["after-bad"], "read", 1)
