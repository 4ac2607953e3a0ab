"""The scheduler side of streamed requests (issue 41), driven as an engine drives it, in this process.

Prefill side: a ``do_remote_decode`` request with a ``stream_id`` is announced to the workers in the step that computes
it (``StepMetadata.reqs_computing``), its hold is released by its stream id as by its request id, and the stream id is
forgotten once its blocks are free (or it was never held). The side channel serves a rank description only (no agent
behind it: nothing is read here). Decode side: a decode leg naming a stream and no block ids loads the prompt
asynchronously into a ``RecvSpec`` marked ``stream`` (the prefill's blocks learnt later), leaving out the prefill's
first blocks on a local prefix hit."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from engine_specs import FINGERPRINT, layouts

from pd_transfer.connector.config import ConnectorConfig
from pd_transfer.connector.metadata import RemoteRef, StreamStart
from pd_transfer.connector.scheduler import SchedulerSide
from pd_transfer.handshake.messages import RankMetadata
from pd_transfer.settings import DEFAULTS

BLOCK = 16
STREAMED = {"do_remote_decode": True, "do_remote_prefill": False, "stream_id": "stream-A"}
SEQUENTIAL = {"do_remote_decode": True, "do_remote_prefill": False}


def config(**overrides: object) -> ConnectorConfig:
    return ConnectorConfig.from_dict(
        {"side_channel_host": "127.0.0.1", "side_channel_port": 0, **overrides}, env={}, settings=DEFAULTS
    )


@pytest.fixture
def prefill() -> Iterator[SchedulerSide]:
    """A prefill engine's scheduler side with its side channel (so that finished requests are held)."""
    side = SchedulerSide(config(), engine_id="stream-prefill", block_size=BLOCK)
    rank = RankMetadata(tp_rank=0, agent_name="a0", agent_metadata=b"x", layout=layouts(FINGERPRINT, 1)[0], regions=[])
    side.start_side_channel([rank])
    try:
        yield side
    finally:
        side.close()


@pytest.fixture
def decode() -> SchedulerSide:
    return SchedulerSide(config(), engine_id="stream-decode", block_size=BLOCK)


# ------------------------------------------------------------------------------------------------------- prefill side
def test_a_streamed_request_is_announced_in_the_step_computing_it(prefill: SchedulerSide) -> None:
    prefill.on_new_request("r-stream", STREAMED, prompt_len=40)
    prefill.on_new_request("r-plain", SEQUENTIAL, prompt_len=40)
    prefill.on_new_request("r-none", None, prompt_len=40)
    assert not prefill.build_step_metadata().reqs_computing  # not computed yet
    prefill.computing("r-stream", [7, 3, 9])
    prefill.computing("r-plain", [1, 2, 4])
    prefill.computing("r-none", [5, 6, 8])
    metadata = prefill.build_step_metadata()
    assert metadata.reqs_computing == {"r-stream": StreamStart(stream_id="stream-A", block_ids=(7, 3, 9))}
    assert not metadata.empty
    assert not prefill.build_step_metadata().reqs_computing  # the step reset it
    assert prefill.build_step_metadata().empty


def test_computed_again_after_a_preemption_is_announced_again_in_its_new_blocks(prefill: SchedulerSide) -> None:
    prefill.on_new_request("r", STREAMED, prompt_len=40)
    prefill.computing("r", [1, 2, 3])
    assert prefill.build_step_metadata().reqs_computing["r"].block_ids == (1, 2, 3)
    prefill.computing("r", [10, 11, 12])
    assert prefill.build_step_metadata().reqs_computing == {
        "r": StreamStart(stream_id="stream-A", block_ids=(10, 11, 12))
    }


def test_a_request_finished_unheld_ends_its_stream_and_forgets_it(prefill: SchedulerSide) -> None:
    prefill.on_new_request("r", STREAMED, prompt_len=40)
    prefill.computing("r", [1, 2, 3])
    assert set(prefill.build_step_metadata().reqs_computing) == {"r"}
    assert prefill.request_finished("r", [1, 2, 3], "abort", STREAMED) == (False, None)
    metadata = prefill.build_step_metadata()
    assert metadata.reqs_to_abort == {"r"}  # the workers offered it as computing: its stream ends there
    assert not metadata.reqs_to_hold and prefill.holding == 0
    assert prefill.release_held("stream-A") is False  # nothing held under it
    prefill.computing("r", [4, 5, 6])  # the id again: no longer streamed
    assert not prefill.build_step_metadata().reqs_computing
    # the stream id may name another request now
    prefill.on_new_request("r2", STREAMED, prompt_len=40)
    prefill.computing("r2", [8])
    assert prefill.build_step_metadata().reqs_computing == {"r2": StreamStart(stream_id="stream-A", block_ids=(8,))}


def test_an_unheld_request_without_a_stream_is_not_aborted(prefill: SchedulerSide) -> None:
    prefill.on_new_request("plain", SEQUENTIAL, prompt_len=40)
    assert prefill.request_finished("plain", [1, 2], "abort", SEQUENTIAL) == (False, None)
    assert prefill.request_finished("local", [3], "stop", None) == (False, None)
    assert prefill.build_step_metadata().empty


def hold(side: SchedulerSide, request_id: str, blocks: list[int], params: dict[str, Any]) -> dict[str, object]:
    """``request_id`` computed in ``blocks`` and finished: held for its decode; the params for the decode."""
    side.on_new_request(request_id, params, prompt_len=len(blocks) * BLOCK)
    side.computing(request_id, blocks)
    delay, answer = side.request_finished(request_id, blocks, "length", params, num_computed_tokens=len(blocks) * BLOCK)
    assert delay is True and answer is not None
    return answer


@pytest.mark.parametrize("by", ["stream id", "request id"])
def test_a_held_streamed_request_is_released_by_its_stream_id_as_by_its_request_id(
    prefill: SchedulerSide, by: str
) -> None:
    answer = hold(prefill, "r", [1, 2, 3], STREAMED)
    assert answer["remote_request_id"] == "r" and answer["remote_block_ids"] == [[1, 2, 3]]
    metadata = prefill.build_step_metadata()
    assert metadata.reqs_to_hold == {"r": (1, 2, 3)} and set(metadata.reqs_computing) == {"r"}
    assert prefill.holding == 1
    assert prefill.release_held("stream-A" if by == "stream id" else "r", read_possible=False) is True
    assert prefill.build_step_metadata().reqs_released == {"r": False}
    prefill.update_connector_output(finished_sending=["r"])
    assert prefill.holding == 0
    assert prefill.release_held("stream-A") is False and prefill.release_held("r") is False
    assert not prefill.build_step_metadata().reqs_released


def test_after_its_blocks_are_free_the_stream_id_is_forgotten(prefill: SchedulerSide) -> None:
    hold(prefill, "r", [1, 2], STREAMED)
    hold(prefill, "plain", [3, 4], SEQUENTIAL)
    prefill.build_step_metadata()
    assert prefill.release_held("stream-A", read_possible=True) is True
    assert prefill.release_held("stream-A", read_possible=False) is True  # once possibly read, always
    assert prefill.build_step_metadata().reqs_released == {"r": True}
    prefill.update_connector_output(finished_sending=["r"])
    assert prefill.release_held("stream-A") is False
    prefill.computing("r", [1, 2])
    assert not prefill.build_step_metadata().reqs_computing
    assert prefill.holding == 1  # the sequential request is still held, and released by its own id
    assert prefill.release_held("plain") is True
    assert prefill.build_step_metadata().reqs_released == {"plain": True}


def test_a_request_held_twice_under_one_stream_id_is_released_as_the_latest(prefill: SchedulerSide) -> None:
    hold(prefill, "r1", [1, 2], STREAMED)
    prefill.update_connector_output(finished_sending=["r1"])
    hold(prefill, "r2", [3, 4], STREAMED)  # the same stream id, given again (the first one's blocks free)
    prefill.build_step_metadata()
    assert prefill.release_held("stream-A") is True
    assert prefill.build_step_metadata().reqs_released == {"r2": True}


# -------------------------------------------------------------------------------------------------------- decode side
DECODE_LEG: dict[str, Any] = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "prefill-0",
    "remote_request_id": "stream-B",
    "remote_host": "10.0.0.2",
    "remote_port": 5600,
    "tp_size": 1,
    "remote_block_size": BLOCK,
    "stream_id": "stream-B",
}
REF = RemoteRef(
    remote_engine_id="prefill-0",
    remote_host="10.0.0.2",
    remote_port=5600,
    remote_request_id="stream-B",
    remote_tp_size=1,
)


def test_a_stream_loads_the_whole_prompt_asynchronously(decode: SchedulerSide) -> None:
    decode.on_new_request("d", DECODE_LEG, prompt_len=40)
    assert decode.get_num_new_matched_tokens("d", 40, 0, DECODE_LEG) == (40, True)
    assert decode.get_num_new_matched_tokens("d", 40, 0, DECODE_LEG) == (40, True)  # asked again: the same
    decode.update_state_after_alloc("d", [10, 11, 12, 13], 40)  # one block more than needed: ignored
    metadata = decode.build_step_metadata()
    assert set(metadata.reqs_to_recv) == {"d"} and not metadata.reqs_to_release
    spec = metadata.reqs_to_recv["d"]
    assert spec.stream is True and spec.remote_block_ids == () and spec.skip_blocks == 0
    assert (spec.local_block_ids, spec.num_tokens) == ((10, 11, 12), 40)
    assert spec.ref == REF  # read by the stream id the prefill was given
    assert decode.get_num_new_matched_tokens("d", 40, 40, DECODE_LEG) == (0, False)  # loading
    decode.update_connector_output(finished_recving=["d"])
    assert decode.request_finished("d", [10, 11, 12], "stop", DECODE_LEG) == (False, None)
    assert decode.build_step_metadata().empty


@pytest.mark.parametrize(("remote_block", "hit", "skip"), [(BLOCK, 16, 1), (BLOCK, 32, 2), (2 * BLOCK, 32, 1)])
def test_a_local_prefix_hit_on_a_block_boundary_skips_the_prefills_first_blocks(
    decode: SchedulerSide, remote_block: int, hit: int, skip: int
) -> None:
    params = {**DECODE_LEG, "remote_block_size": remote_block}
    assert decode.get_num_new_matched_tokens("d", 70, hit, params) == (70 - hit, True)
    local = [20, 21, 22, 23, 24][: -(-(70 - hit) // BLOCK)]
    decode.update_state_after_alloc("d", local, 70 - hit)
    spec = decode.build_step_metadata().reqs_to_recv["d"]
    assert spec.stream is True and spec.remote_block_ids == ()
    assert (spec.skip_blocks, spec.local_block_ids, spec.num_tokens) == (skip, tuple(local), 70 - hit)


def test_an_ordinary_pull_with_a_prefix_hit_slices_its_block_ids_and_skips_nothing(decode: SchedulerSide) -> None:
    params = {**DECODE_LEG, "remote_block_ids": [[3, 4, 5]], "remote_num_tokens": 40}
    assert decode.get_num_new_matched_tokens("d", 40, 16, params) == (24, True)
    decode.update_state_after_alloc("d", [20, 21], 24)
    spec = decode.build_step_metadata().reqs_to_recv["d"]
    assert spec.stream is False and spec.skip_blocks == 0 and spec.remote_block_ids == (4, 5)


@pytest.mark.parametrize(
    ("params", "hit"),
    [
        ({**DECODE_LEG, "remote_block_size": BLOCK}, 8),  # off a block boundary
        ({k: v for k, v in DECODE_LEG.items() if k != "remote_block_size"}, 16),  # the prefill's blocks unknown
        (DECODE_LEG, 48),  # the whole prompt held here
    ],
)
def test_a_stream_the_decode_cannot_use_is_computed_here_and_released_by_its_stream_id(
    decode: SchedulerSide, params: dict[str, Any], hit: int
) -> None:
    assert decode.get_num_new_matched_tokens("d", 40, hit, params) == (0, False)
    decode.update_state_after_alloc("d", [], 0)
    metadata = decode.build_step_metadata()
    assert not metadata.reqs_to_recv
    assert metadata.reqs_to_release == {"d": REF}


def test_a_queued_stream_heartbeats_by_its_stream_id() -> None:
    now = [100.0]
    side = SchedulerSide(config(lease_seconds=9.0), engine_id="stream-decode", block_size=BLOCK, clock=lambda: now[0])
    side.on_new_request("d", DECODE_LEG, prompt_len=40)
    assert not side.build_step_metadata().reqs_to_heartbeat
    now[0] += 3.0
    assert side.build_step_metadata().reqs_to_heartbeat == {"d": REF}
