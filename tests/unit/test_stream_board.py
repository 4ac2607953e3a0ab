"""The stream board alone (:mod:`pd_transfer.connector.streams`, issue 41): what a request has written (computing,
layers written, held, ended), its generations, bounded waits woken by the engine's side from another thread, and the
bound on the ended requests it remembers."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from pd_transfer.connector import streams
from pd_transfer.connector.streams import Progress, StreamBoard

LAYERS = 4
WAIT_S = 5.0  # the most any wait here takes when something wakes it (it returns far sooner)


def test_computing_then_each_layer_then_held_is_complete_in_its_generation() -> None:
    board = StreamBoard(LAYERS)
    started = board.computing("r", [3, 1, 7])
    assert started == Progress((3, 1, 7), 0, LAYERS, started.generation)
    assert board.computing_requests == 1
    for layers in range(1, LAYERS + 1):
        board.written("r", layers)
        progress = board.progress("r")
        assert progress is not None and progress.layers == layers and not progress.held
        assert progress.generation == started.generation
        assert not board.complete("r", started.generation)  # every layer written, but no lease yet
    board.held("r", [3, 1, 7])
    progress = board.progress("r")
    assert progress is not None and progress.held and progress.complete and progress.ended is None
    assert progress.generation == started.generation
    assert board.complete("r", started.generation)
    assert not board.complete("r", started.generation + 1)
    assert board.computing_requests == 0  # held: no longer computing


def test_written_is_ignored_for_fewer_layers_an_unknown_request_or_one_held() -> None:
    board = StreamBoard(LAYERS)
    board.written("unknown", 2)
    assert board.progress("unknown") is None
    board.computing("r", [0, 1])
    board.written("r", 3)
    board.written("r", 2)  # fewer than said already
    board.written("r", 3)  # the same
    progress = board.progress("r")
    assert progress is not None and progress.layers == 3
    board.written("r", LAYERS + 10)  # no more than the cache has
    progress = board.progress("r")
    assert progress is not None and progress.layers == LAYERS
    board.held("r", [0, 1])
    board.written("r", 1)  # a held request has every layer
    progress = board.progress("r")
    assert progress is not None and progress.layers == LAYERS and progress.held


def test_computing_again_starts_a_new_generation_that_voids_the_old_one() -> None:
    board = StreamBoard(LAYERS)
    first = board.computing("r", [1, 2])
    board.written("r", 2)
    second = board.computing("r", [1, 2])  # preempted and computed again, even into the same blocks
    assert second.generation > first.generation
    progress = board.progress("r")
    assert progress is not None and progress.layers == 0  # nothing of the new computation written yet
    board.written("r", LAYERS)
    board.held("r", [1, 2])
    assert board.complete("r", second.generation)
    assert not board.complete("r", first.generation)


def test_held_in_other_blocks_than_computed_starts_a_new_generation() -> None:
    board = StreamBoard(LAYERS)
    computed = board.computing("r", [1, 2])
    board.written("r", LAYERS)
    board.held("r", [5, 6])
    progress = board.progress("r")
    assert progress is not None and progress.block_ids == (5, 6) and progress.held
    assert progress.generation != computed.generation
    assert not board.complete("r", computed.generation)
    assert board.complete("r", progress.generation)


def test_held_without_computing_is_complete_at_once_in_a_generation_of_its_own() -> None:
    board = StreamBoard(LAYERS)
    other = board.computing("other", [0])
    board.held("r", [4, 9])
    progress = board.progress("r")
    assert progress is not None and progress.complete and progress.layers == LAYERS
    assert progress.generation not in (0, other.generation)
    assert board.complete("r", progress.generation)


def test_an_ended_request_answers_a_wait_at_once_and_never_completes() -> None:
    board = StreamBoard(LAYERS)
    started = board.computing("r", [2, 3])
    board.written("r", 1)
    board.ended("r", "aborted")
    began = time.monotonic()
    progress = board.wait("r", lambda _: False, WAIT_S)  # never satisfied: only the end answers
    assert time.monotonic() - began < WAIT_S / 2
    assert progress is not None and progress.ended == "aborted" and progress.layers == 1
    assert not progress.complete
    assert not board.complete("r", started.generation)
    assert board.computing_requests == 0
    board.ended("unknown", "aborted")  # nothing known of it: nothing kept
    assert board.progress("unknown") is None


def test_a_held_request_that_ends_is_complete_no_more() -> None:
    board = StreamBoard(LAYERS)
    board.held("r", [1])
    progress = board.progress("r")
    assert progress is not None and board.complete("r", progress.generation)
    board.ended("r", "read")
    ended = board.progress("r")
    assert ended is not None and ended.ended == "read" and not ended.complete
    assert not board.complete("r", progress.generation)


def test_computed_again_after_it_ended_it_is_going_again() -> None:
    board = StreamBoard(LAYERS)
    first = board.computing("r", [1])
    board.ended("r", "aborted")
    again = board.computing("r", [1])
    progress = board.progress("r")
    assert progress is not None and progress.ended is None and again.generation > first.generation
    board.ended("r", "aborted")
    board.held("r", [1])  # held again after it ended: a new generation, not the ended one
    progress = board.progress("r")
    assert progress is not None and progress.ended is None and progress.complete
    assert progress.generation not in (first.generation, again.generation)


def test_a_wait_that_nothing_answers_returns_none_once_its_time_is_up() -> None:
    board = StreamBoard(LAYERS)
    board.computing("r", [1])
    for request_id in ("r", "unknown"):
        began = time.monotonic()
        assert board.wait(request_id, lambda progress: progress.layers >= 2, 0.05) is None
        assert 0.05 <= time.monotonic() - began < WAIT_S
    assert board.wait("r", lambda _: True, 0.0) is not None  # satisfied already: no time needed


def test_the_ended_requests_kept_are_bounded_the_oldest_forgotten(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(streams, "ENDED_KEPT", 3)
    board = StreamBoard(LAYERS)
    for index in range(5):
        board.computing(f"r{index}", [index])
        board.ended(f"r{index}", f"why {index}")
    assert board.progress("r0") is None and board.progress("r1") is None
    for index in (2, 3, 4):
        progress = board.progress(f"r{index}")
        assert progress is not None and progress.ended == f"why {index}"
    board.computing("r2", [7])  # going again: no longer among the ended
    board.computing("r5", [8])
    board.ended("r5", "aborted")
    for index in (3, 4, 5):
        progress = board.progress(f"r{index}")
        assert progress is not None and progress.ended is not None
    progress = board.progress("r2")
    assert progress is not None and progress.ended is None


def test_a_board_of_no_layers_is_refused() -> None:
    with pytest.raises(ValueError, match="0 layers"):
        StreamBoard(0)


class Waiter:
    """A thread waiting on ``board`` for ``request_id`` until ``until``; :attr:`checked` is set once it looked (under
    the board's lock, so whatever the engine's side does after that wakes it from its wait)."""

    def __init__(self, board: StreamBoard, request_id: str, until: Callable[[Progress], bool]) -> None:
        self.checked = threading.Event()
        self.result: Progress | None = None
        self.waited_s = -1.0

        def probe(progress: Progress) -> bool:
            self.checked.set()
            return until(progress)

        def run() -> None:
            began = time.monotonic()
            self.result = board.wait(request_id, probe, WAIT_S)
            self.waited_s = time.monotonic() - began

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def finished(self) -> Progress | None:
        self.thread.join(timeout=WAIT_S * 2)
        assert not self.thread.is_alive()
        assert 0 <= self.waited_s < WAIT_S  # woken, not timed out
        return self.result


def test_waits_are_woken_by_the_engine_side_from_another_thread() -> None:
    board = StreamBoard(LAYERS)
    board.computing("r", [1, 2])
    waiters = [Waiter(board, "r", lambda progress: progress.layers > 1) for _ in range(3)]
    held = Waiter(board, "r", lambda progress: progress.held)
    for waiter in [*waiters, held]:
        assert waiter.checked.wait(WAIT_S)  # each looked, found too little, and waits
    board.written("r", 1)  # wakes them, not enough yet: they wait on
    board.written("r", 2)
    for waiter in waiters:
        progress = waiter.finished()
        assert progress is not None and progress.layers == 2 and not progress.held
    assert held.thread.is_alive()
    board.held("r", [1, 2])
    progress = held.finished()
    assert progress is not None and progress.held


def test_a_wait_for_a_request_not_yet_known_is_woken_when_it_is_computed_or_ends() -> None:
    board = StreamBoard(LAYERS)
    computed = Waiter(board, "later", lambda progress: progress.layers >= 1)
    ended = Waiter(board, "doomed", lambda progress: progress.layers >= LAYERS)
    board.computing("later", [3])  # known now, nothing written: it waits on
    assert computed.checked.wait(WAIT_S)
    board.written("later", 1)
    progress = computed.finished()
    assert progress is not None and progress.block_ids == (3,) and progress.layers == 1
    board.computing("doomed", [4])
    assert ended.checked.wait(WAIT_S)
    board.ended("doomed", "freed")
    progress = ended.finished()
    assert progress is not None and progress.ended == "freed"


def test_a_request_may_be_asked_for_by_its_alias() -> None:
    board = StreamBoard(LAYERS)
    assert board.resolve("stream-1") == "stream-1"  # no alias known: the name itself
    waiter = Waiter(board, "stream-1", lambda progress: progress.layers >= 1)
    started = board.computing("r", [5, 6], alias="stream-1")
    assert board.resolve("stream-1") == "r" and board.resolve("r") == "r"
    assert waiter.checked.wait(WAIT_S)
    board.written("r", 1)
    progress = waiter.finished()
    assert progress is not None and progress.generation == started.generation and progress.block_ids == (5, 6)
    assert board.progress("stream-1") == board.progress("r")
    board.ended("r", "aborted")
    progress = board.progress("stream-1")
    assert progress is not None and progress.ended == "aborted"  # a late reader by alias hears why
    board.computing("same", [1], alias="same")  # an alias that is its own name is none
    assert board.resolve("same") == "same"


def test_the_aliases_kept_are_bounded_the_oldest_forgotten(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(streams, "ENDED_KEPT", 2)
    board = StreamBoard(LAYERS)
    for index in range(6):
        board.computing(f"r{index}", [index], alias=f"a{index}")
        board.ended(f"r{index}", "freed")
    assert [board.resolve(f"a{index}") for index in range(6)] == ["a0", "a1", "a2", "r3", "r4", "r5"]
