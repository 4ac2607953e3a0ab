"""The prefill's lease ledger alone, on a fake clock: exactly-once frees, reader tallies, heartbeats, aborts,
and the confirmations that make a decode's read trustworthy."""

from __future__ import annotations

import threading

import msgspec
import pytest

from pd_transfer.connector.leases import LeaseLedger
from pd_transfer.connector.messages import ReadDone, ReadFailed, ReleaseUnread


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def ledger(clock: FakeClock) -> LeaseLedger:
    return LeaseLedger(lease_seconds=30.0, clock=clock)


def done(request: str, rank: int = 0, expected: int = 1, engine: str = "dec") -> ReadDone:
    return ReadDone(request_id=request, reader_engine_id=engine, reader_rank=rank, expected_readers=expected)


def failed(request: str, rank: int = 0, expected: int = 1) -> ReadFailed:
    return ReadFailed(
        request_id=request, reader_engine_id="dec", reader_rank=rank, expected_readers=expected, reason="x"
    )


def test_freed_once_when_every_distinct_reader_reported(ledger: LeaseLedger) -> None:
    assert ledger.hold("r", [4, 5, 6]) is None
    assert ledger.blocks_held == 3
    assert ledger.report(done("r", rank=0, expected=2)).freed is None
    assert ledger.report(done("r", rank=0, expected=2)).freed is None  # the same reader twice counts once
    outcome = ledger.report(done("r", rank=1, expected=2))
    assert outcome.readers_complete and outcome.freed is not None
    assert outcome.freed.block_ids == (4, 5, 6) and outcome.freed.reason == "read"
    assert len(outcome.freed.reports) == 2
    assert ledger.blocks_held == 0 and ledger.status("r") == "read"
    # nothing frees it again: late reports, expiry, abort
    assert ledger.report(done("r", rank=2, expected=2)).freed is None
    assert ledger.abort("r") is None
    assert ledger.expire() == []
    assert ledger.reports_after_free == 1


def test_a_gone_request_keeps_its_reports_without_the_readers_connection_metadata(ledger: LeaseLedger) -> None:
    """Tombstones (up to 65,536 of them) keep each reader's report but not its ``reply_to`` (a kilobyte or more of
    UCX addresses a report carries while its confirmation is awaited): the freed request's reports as they came, its
    tombstone's without it."""
    metadata = b"u" * 2048
    ledger.hold("r", [1])
    outcome = ledger.report(msgspec.structs.replace(done("r"), reply_to=metadata), reply_to="reader")
    assert outcome.freed is not None and outcome.freed.reports[0].reply_to == metadata  # type: ignore[union-attr]
    assert ledger.readers_complete("r") == (done("r"),)  # the same report, reply_to left out


def test_a_failed_reader_counts_towards_freeing(ledger: LeaseLedger) -> None:
    ledger.hold("r", [1])
    assert ledger.report(failed("r")).freed is not None


def test_lease_expiry_frees_exactly_once_and_heartbeat_extends_it(ledger: LeaseLedger, clock: FakeClock) -> None:
    ledger.hold("a", [1, 2])
    ledger.hold("b", [3])
    clock.advance(20)
    assert ledger.heartbeat("b")  # b's lease now ends at t+50
    clock.advance(10)  # t+30: a's lease is over
    freed = ledger.expire()
    assert [(f.request_id, f.block_ids, f.reason) for f in freed] == [("a", (1, 2), "expired")]
    assert ledger.expire() == []
    clock.advance(19.9)
    assert ledger.expire() == []
    clock.advance(0.1)
    assert [f.request_id for f in ledger.expire()] == ["b"]
    assert not ledger.heartbeat("b")  # too late: freed
    assert ledger.blocks_held == 0 and ledger.held_requests == 0


def test_abort_after_the_hold_window_frees_now_and_later_readers_are_refused(
    ledger: LeaseLedger, clock: FakeClock
) -> None:
    ledger.hold("r", [7, 8])
    clock.advance(ledger.window_seconds)
    freed = ledger.abort("r")
    assert freed is not None and freed.reason == "aborted" and freed.block_ids == (7, 8)
    assert ledger.abort("r") is None
    ledger.report(done("r"), reply_to="decoder")
    (reply,) = ledger.take_replies()
    assert reply.to == "decoder" and not reply.confirm.ok and "aborted" in reply.confirm.reason


def test_confirm_ok_only_while_held(ledger: LeaseLedger, clock: FakeClock) -> None:
    ledger.hold("live", [1])
    ledger.hold("stale", [2])
    ledger.report(done("live"), reply_to="d0")
    (reply,) = ledger.take_replies()
    assert reply.confirm.ok and reply.confirm.request_id == "live"
    clock.advance(31)
    ledger.expire()
    ledger.report(done("stale"), reply_to="d0")
    (reply,) = ledger.take_replies()
    assert not reply.confirm.ok and "expired" in reply.confirm.reason
    assert ledger.take_replies() == []


def test_report_before_hold_waits_for_the_hold(ledger: LeaseLedger) -> None:
    outcome = ledger.report(done("early"), reply_to="d0")
    assert outcome.readers_complete and outcome.freed is None
    assert ledger.status("early") == "pending" and ledger.take_replies() == []
    freed = ledger.hold("early", [9])  # every reader already reported: freed at once, confirmed
    assert freed is not None and freed.reason == "read" and freed.block_ids == (9,)
    (reply,) = ledger.take_replies()
    assert reply.confirm.ok


def test_report_for_a_request_never_held_is_refused_after_the_pending_window(
    ledger: LeaseLedger, clock: FakeClock
) -> None:
    ledger.report(done("ghost"), reply_to="d0")
    clock.advance(30)
    assert ledger.expire() == []  # nothing to free: it was never held
    (reply,) = ledger.take_replies()
    assert not reply.confirm.ok and "unknown" in reply.confirm.reason
    assert ledger.status("ghost") == "unknown" and ledger.pending_requests == 0


def test_release_unread_frees_a_rank_nobody_reads(ledger: LeaseLedger) -> None:
    ledger.hold("r", [1, 2])
    freed = ledger.report(ReleaseUnread(request_id="r", reader_engine_id="dec")).freed
    assert freed is not None and freed.reason == "read"


def test_no_reader_count_means_wait_for_one(ledger: LeaseLedger) -> None:
    ledger.hold("r", [1])
    assert ledger.report(done("r", expected=0)).freed is not None  # an odd report still counts as one reader


def test_concurrent_reports_and_expiry_free_once(clock: FakeClock) -> None:
    ledger = LeaseLedger(lease_seconds=1.0, clock=clock)
    requests = [f"r{i}" for i in range(200)]
    for index, request in enumerate(requests):
        ledger.hold(request, [index])
    clock.advance(1.0)  # every lease is over: reports and expiry race for each request
    freed: list[str] = []
    lock = threading.Lock()

    def reporter(rank: int) -> None:
        for request in requests:
            outcome = ledger.report(done(request, rank=rank, expected=2))
            if outcome.freed is not None:
                with lock:
                    freed.append(outcome.freed.request_id)

    def expirer() -> None:
        for _ in range(50):
            items = ledger.expire()
            with lock:
                freed.extend(item.request_id for item in items)

    threads = [threading.Thread(target=reporter, args=(r,)) for r in range(2)] + [threading.Thread(target=expirer)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    freed.extend(item.request_id for item in ledger.expire())
    assert sorted(freed) == sorted(requests)  # each exactly once
    assert ledger.blocks_held == 0


def test_lease_must_be_positive() -> None:
    with pytest.raises(ValueError, match="lease_seconds"):
        LeaseLedger(lease_seconds=0)


def test_abort_inside_the_hold_window_is_deferred_to_its_end(ledger: LeaseLedger, clock: FakeClock) -> None:
    assert ledger.window_seconds == 10.0  # a third of the 30 s lease
    ledger.hold("r", [7, 8])
    ledger.hold("s", [9])
    clock.advance(4.0)
    assert ledger.abort("r") is None and ledger.abort("s") is None  # promised until 10 s after the hold
    assert ledger.status("r") == "held" and ledger.blocks_held == 3
    assert ledger.heartbeat("r") and ledger.expire() == []  # a heartbeat does not undo the abort
    # a reader inside the window is answered "held" and its report frees the request, as aborted
    outcome = ledger.report(done("r"), reply_to="decoder")
    assert outcome.freed is not None and outcome.freed.reason == "aborted"
    (reply,) = ledger.take_replies()
    assert reply.confirm.ok
    clock.advance(5.99)
    assert ledger.expire() == []
    clock.advance(0.01)  # the window's end, long before the lease's
    (freed,) = ledger.expire()
    assert freed.request_id == "s" and freed.reason == "aborted" and ledger.blocks_held == 0


def test_the_window_never_outlasts_the_lease() -> None:
    assert LeaseLedger(lease_seconds=1.5).window_seconds == 0.5
    assert LeaseLedger(lease_seconds=300.0).window_seconds == 10.0
    with pytest.raises(ValueError, match="window_seconds"):
        LeaseLedger(lease_seconds=5.0, window_seconds=6.0)


# ---------------------------------------------------------------------- pins: a push from the blocks is in flight
def test_a_pin_needs_the_request_held_and_its_own_blocks(ledger: LeaseLedger, clock: FakeClock) -> None:
    assert "unknown" in ledger.pin("never", [1])
    ledger.report(done("early"))
    assert ledger.pin("early", [1]) == "not held yet"
    ledger.hold("r", [1, 2, 3])
    assert "not this request's" in ledger.pin("r", [3, 4])
    assert ledger.pin("r", [3, 1]) == ""
    assert ledger.unpin("r") is None
    clock.advance(31)
    assert ledger.pin("r", [1]) == "the lease has run out"


def test_nothing_frees_pinned_blocks_until_the_last_unpin(ledger: LeaseLedger, clock: FakeClock) -> None:
    ledger.hold("r", [1, 2])
    assert ledger.pin("r", [1]) == "" and ledger.pin("r", [2]) == ""
    clock.advance(31)  # the lease ran out, the readers all reported, an early free was asked for
    assert ledger.expire() == []
    outcome = ledger.report(failed("r"))
    assert outcome.readers_complete and outcome.freed is None
    assert ledger.release("r", read_possible=False) is None
    assert ledger.status("r") == "held"
    assert ledger.unpin("r") is None  # one write still in flight
    freed = ledger.unpin("r")
    assert freed is not None and freed.reason == "read" and freed.block_ids == (1, 2)
    assert ledger.unpin("r") is None and ledger.expire() == []  # freed exactly once


def test_a_lease_that_ran_out_while_pinned_ends_at_the_unpin(ledger: LeaseLedger, clock: FakeClock) -> None:
    ledger.hold("r", [5])
    assert ledger.pin("r", [5]) == ""
    clock.advance(31)
    assert ledger.expire() == []
    freed = ledger.unpin("r")
    assert freed is not None and freed.reason == "expired"


def test_an_abort_inside_the_window_waits_for_the_unpin_too(ledger: LeaseLedger, clock: FakeClock) -> None:
    ledger.hold("r", [5])
    assert ledger.pin("r", [5]) == ""
    assert ledger.abort("r") is None  # deferred to the window's end
    clock.advance(ledger.window_seconds + 1)
    assert ledger.expire() == []  # the window ended, but the write is still in flight
    freed = ledger.unpin("r")
    assert freed is not None and freed.reason == "aborted"


def test_the_ledger_releases_at_once_only_when_no_decode_can_be_reading() -> None:
    """The prefill side of a ``Release``: no decode has the params: freed now; a decode may be reading: not before
    the hold window ends (nor after a reader reported: that lease ends as read); twice: nothing more."""
    now = [0.0]
    ledger = LeaseLedger(9.0, clock=lambda: now[0])  # hold window: 3 s
    for name in ("unread", "maybe-read", "reported"):
        ledger.hold(name, [1, 2])
    freed = ledger.release("unread", read_possible=False)
    assert freed is not None and freed.reason == "released"
    assert ledger.release("unread", read_possible=False) is None and ledger.status("unread") == "released"
    assert ledger.release("maybe-read", read_possible=True) is None  # deferred to the window's end
    assert ledger.status("maybe-read") == "held"
    report = ReadDone(request_id="reported", reader_engine_id="d", reader_rank=0, expected_readers=2)
    ledger.report(report)
    assert ledger.release("reported", read_possible=False) is None  # a reader reported: left to end as read
    now[0] = 3.0
    assert [(f.request_id, f.reason) for f in ledger.expire()] == [("maybe-read", "released")]
    assert ledger.status("reported") == "held"
