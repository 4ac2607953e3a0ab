"""The engine-agnostic drain of a prefill engine (``SchedulerSide.drain``): new work refused naming the engine and
why, the wait for every held request's end (and its bound), the side channel stopped after.

In this process: a scheduler side whose side channel serves a rank description (no NIXL agent behind it: nothing is
read here), driven as an engine drives it, with the drain waiting in a thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from engine_specs import FINGERPRINT, layouts

from pd_transfer.connector.config import ConnectorConfig
from pd_transfer.connector.drain import Drain, Draining, DrainOutcome
from pd_transfer.connector.scheduler import SchedulerSide
from pd_transfer.handshake.messages import RankMetadata

WAIT_S = 10.0


@pytest.fixture
def scheduler() -> Iterator[SchedulerSide]:
    config = ConnectorConfig(side_channel_host="127.0.0.1", side_channel_port=0, lease_seconds=30.0)
    side = SchedulerSide(config, engine_id="drained", block_size=16)
    rank = RankMetadata(tp_rank=0, agent_name="a0", agent_metadata=b"x", layout=layouts(FINGERPRINT, 1)[0], regions=[])
    side.start_side_channel([rank])
    try:
        yield side
    finally:
        side.close()


def _hold(scheduler: SchedulerSide, request_id: str) -> None:
    """A prefill-only request finished: its blocks are held for a decode."""
    delay, params = scheduler.request_finished(request_id, [1, 2], "length", {"do_remote_decode": True})
    assert delay and params is not None


def _drain_in_thread(scheduler: SchedulerSide, timeout_s: float | None) -> tuple[threading.Thread, list[DrainOutcome]]:
    outcomes: list[DrainOutcome] = []
    thread = threading.Thread(target=lambda: outcomes.append(scheduler.drain("told to stop", timeout_s)))
    thread.start()
    return thread, outcomes


def _wait_draining(drain: Drain) -> None:
    deadline = time.monotonic() + WAIT_S
    while not drain.draining:
        assert time.monotonic() < deadline, "the drain did not start"
        time.sleep(0.01)  # polling pace


def test_a_drain_refuses_new_work_waits_until_every_hold_ended_then_closes(scheduler: SchedulerSide) -> None:
    _hold(scheduler, "r1")
    _hold(scheduler, "r2")
    scheduler.refuse_new()  # not draining: nothing raised
    thread, outcomes = _drain_in_thread(scheduler, timeout_s=None)
    _wait_draining(scheduler.drain_state)
    with pytest.raises(Draining, match=r"engine drained is draining \(told to stop, [0-9.]+ s ago\)"):
        scheduler.refuse_new()
    scheduler.update_connector_output(finished_sending=["r1"])  # read by its decode
    thread.join(0.2)
    assert thread.is_alive() and scheduler.side_channel_port is not None  # r2 still held: still serving
    scheduler.update_connector_output(finished_sending=["r2"])  # released or expired
    thread.join(WAIT_S)
    assert not thread.is_alive()
    assert outcomes[0].held_at_start == 2 and outcomes[0].left == 0 and outcomes[0].complete
    assert scheduler.side_channel_port is None  # closed after


def test_a_drain_ends_at_its_bound_with_what_is_still_held(scheduler: SchedulerSide) -> None:
    _hold(scheduler, "stuck")
    thread, outcomes = _drain_in_thread(scheduler, timeout_s=0.3)
    thread.join(WAIT_S)
    assert not thread.is_alive()
    assert outcomes[0].held_at_start == 1 and outcomes[0].left == 1 and not outcomes[0].complete
    assert scheduler.side_channel_port is None


def test_a_drain_starts_once_and_names_what_started_it() -> None:
    clock = [100.0]
    drain = Drain("engine e", clock=lambda: clock[0])
    assert drain.refusal() is None and drain.since is None
    assert drain.start("received SIGTERM") and not drain.start("received SIGINT")
    clock[0] += 2.5
    assert drain.since == 100.0
    assert drain.refusal() == (
        "engine e is draining (received SIGTERM, 2.5 s ago): it takes no new request; send it elsewhere"
    )
