"""A side channel's log of refused frames keeps to its budget (:mod:`pd_transfer.handshake.refusal_log`): at most
``lines`` lines a window, then one line saying how many it left out."""

from __future__ import annotations

import logging

import pytest

from pd_transfer.handshake.refusal_log import RefusalLog


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_flood_logs_the_budget_then_one_count_of_the_rest(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    log = RefusalLog(logging.getLogger("refusal-log-test"), lambda: "side channel", lines=3, window_s=10.0, clock=clock)
    with caplog.at_level(logging.INFO, logger="refusal-log-test"):
        logged = [log.log(logging.INFO, "refused frame %d", number) for number in range(1000)]
        assert logged == [True] * 3 + [False] * 997
        assert [record.getMessage() for record in caplog.records] == [f"refused frame {n}" for n in range(3)]
        assert log.left_out == log.left_out_total == 997
        clock.now += 10.0  # the next window
        assert log.log(logging.WARNING, "refused frame %d", 1000)
    messages = [record.getMessage() for record in caplog.records]
    assert messages[3:] == ["side channel: 997 more not logged in the last 10 s", "refused frame 1000"]
    assert log.left_out == 0 and log.left_out_total == 997


def test_a_quiet_window_logs_every_line_and_no_count(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    log = RefusalLog(logging.getLogger("refusal-log-test"), lambda: "side channel", lines=3, window_s=10.0, clock=clock)
    with caplog.at_level(logging.INFO, logger="refusal-log-test"):
        for number in range(6):
            assert log.log(logging.INFO, "refused frame %d", number)
            clock.now += 5.0  # two a window
    assert [record.getMessage() for record in caplog.records] == [f"refused frame {n}" for n in range(6)]


def test_a_budget_of_nothing_is_refused() -> None:
    with pytest.raises(ValueError):
        RefusalLog(logging.getLogger("refusal-log-test"), lambda: "x", lines=0)
