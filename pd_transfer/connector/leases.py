"""The prefill side's ledger of requests whose KV blocks are held for decode readers.

When a prefill-only request finishes, the engine hands its blocks to the connector (``hold``). The blocks
go back to the engine exactly once, for the first of:

* every expected decode reader reported (``ReadDone``, ``ReadFailed``; ``ReleaseUnread`` for a rank no
  decode rank reads): reason ``"read"``;
* the lease ran out (``expire``; ``heartbeat`` pushes the end back): reason ``"expired"``;
* the engine gave up on it (``abort``): reason ``"aborted"``, but never inside the hold window (below);
* nobody will read it (``release``, asked by the proxy when its client left or the decode hop failed): reason
  ``"released"``; at once when no decode was given the params, else like an abort (never inside the hold window);
  a request a reader reported on already is left to end as read.

**The hold window.** From ``hold`` on, a request's blocks are held at least ``window_seconds`` (see
:func:`hold_window`) unless every reader reported first: the prefill states that window in the
``kv_transfer_params`` it returns, and a decode whose read ended well inside it uses the KV without asking
for a confirmation. The lease (``lease_seconds``, longer) never ends inside the window; an early free (``abort``)
asked for inside it is deferred to the window's end (or to the readers' reports, whichever is first). The window
is counted from the hold, which comes after the params were made, so it covers what they promise.

Readers are counted per distinct ``(reader engine, reader rank)``; how many to expect comes with their
reports (``expected_readers``), so a request is never freed before one reader has said how many there are.

**Read, then confirm.** A ``ReadDone`` carrying ``reply_to`` gets a ``LeaseConfirm`` (collected with
``take_replies``): ``ok`` only if the blocks were held when the report was processed. Blocks are only ever
freed by this ledger and never before the readers' reports or the lease end, so an ``ok`` proves that the
read, which NIXL completes before delivering its notification, saw the request's live blocks.

**Pinned while written.** A prefill that pushes a request's blocks to a reader (``pin``) keeps them until the write
ended (``unpin``): whatever would free them meanwhile (the last report, an abort, a release, the lease's end) is
done at ``unpin`` instead, which returns the request then freed.

A report may arrive before ``hold`` (the engine tells its workers about finished requests on its next
step): it is kept as *pending*, and its confirmation waits for the ``hold`` (then ``ok``: the engine owned
the blocks all along) or for ``pending_seconds`` (then not ``ok``: unknown request).

Thread-safe: every method takes one lock. Time comes from ``clock`` (inject a fake one in tests).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

import msgspec

from pd_transfer.connector.messages import LeaseConfirm, ReadDone, ReaderReport, ReadFailed, ReleaseUnread

logger = logging.getLogger(__name__)

FreeReason = Literal["read", "expired", "aborted", "released"]
Status = Literal["held", "pending", "read", "expired", "aborted", "released", "unknown"]


@dataclass(frozen=True)
class Freed:
    """A request's blocks are the engine's again (reported exactly once per hold)."""

    request_id: str
    block_ids: tuple[int, ...]
    reason: FreeReason
    reports: tuple[ReaderReport, ...]


@dataclass(frozen=True)
class Reply:
    """A confirmation to send to the reader known as ``to`` (the ``reply_to`` key given with its report)."""

    to: str
    confirm: LeaseConfirm


@dataclass(frozen=True)
class ReportOutcome:
    freed: Freed | None = None  # this report freed the request
    readers_complete: bool = False  # this report was the last expected one (True once per request)


@dataclass
class _Entry:
    block_ids: tuple[int, ...] | None  # None: pending (reports arrived, no hold yet)
    deadline: float  # held: end of the lease; pending: when to stop waiting for the hold
    promised_until: float = 0.0  # held: end of the hold window (no early free before it)
    deferred: FreeReason | None = None  # an early free asked for inside the window, done at its end
    expected: int = 0
    reports: dict[tuple[str, int], ReaderReport] = field(default_factory=dict)
    parked: list[str] = field(default_factory=list)  # reply_to keys waiting for a verdict
    complete: bool = False
    pins: int = 0  # writes from the blocks in flight (held entries only)
    after_pins: FreeReason | None = None  # a free asked for while pinned, done at the last unpin


@dataclass(frozen=True)
class _Gone:
    reason: Literal["read", "expired", "aborted", "released", "unknown"]
    reports: tuple[ReaderReport, ...]
    complete: bool


_GONE_REASONS = {
    "read": "already freed: every expected reader had reported",
    "expired": "the lease had expired and the blocks were freed",
    "aborted": "the prefill aborted the request and freed its blocks",
    "released": "the proxy released it (its client left or its decode hop failed) and the blocks were freed",
    "unknown": "unknown request: never held by this prefill rank",
}


def hold_window(lease_seconds: float) -> float:
    """Seconds a held request is promised to stay held (unless its readers reported): a third of the lease,
    at most 10 s (an abort inside it waits that long at worst)."""
    return min(lease_seconds / 3.0, 10.0)


class LeaseLedger:
    """Held requests of one prefill rank: leases, reader tallies, confirmations."""

    def __init__(
        self,
        lease_seconds: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        pending_seconds: float | None = None,
        max_tombstones: int = 65536,
        window_seconds: float | None = None,
    ) -> None:
        """``window_seconds``: the hold window (default :func:`hold_window` of the lease; at most the lease)."""
        if not lease_seconds > 0:
            raise ValueError(f"lease_seconds must be positive, got {lease_seconds!r}")
        self.lease_seconds = float(lease_seconds)
        window = hold_window(self.lease_seconds) if window_seconds is None else float(window_seconds)
        if not 0 <= window <= self.lease_seconds:
            raise ValueError(f"window_seconds must be in 0..lease_seconds, got {window_seconds!r}")
        self.window_seconds = window
        self.pending_seconds = self.lease_seconds if pending_seconds is None else float(pending_seconds)
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._gone: OrderedDict[str, _Gone] = OrderedDict()
        self._max_tombstones = max_tombstones
        self._outbox: list[Reply] = []
        self.reports_after_free = 0  # reports for requests already freed (late or stale readers)

    # ------------------------------------------------------------------ events
    def hold(self, request_id: str, block_ids: Iterable[int]) -> Freed | None:
        """Start the lease of a finished request's blocks. Returns the request as freed at once when every
        expected reader has already reported (reports may overtake the hold), else None."""
        blocks = tuple(int(b) for b in block_ids)
        with self._lock:
            now = self._clock()
            entry = self._entries.get(request_id)
            if entry is not None and entry.block_ids is not None:
                logger.warning("request %s held twice: keeping the first blocks, extending the lease", request_id)
                entry.deadline = max(entry.deadline, now + self.lease_seconds)
                entry.promised_until = max(entry.promised_until, now + self.window_seconds)
                return None
            if self._gone.pop(request_id, None) is not None:
                logger.warning("request %s held again after it was freed: starting a new lease", request_id)
            if entry is None:
                entry = self._entries[request_id] = _Entry(
                    block_ids=blocks, deadline=now + self.lease_seconds, promised_until=now + self.window_seconds
                )
                return None
            # pending: readers reported before the hold; the engine owned the blocks all along
            entry.block_ids = blocks
            entry.deadline = now + self.lease_seconds
            entry.promised_until = now + self.window_seconds
            self._answer_parked(request_id, entry, ok=True, reason="held")
            if entry.complete:
                return self._free(request_id, entry, "read")
            return None

    def report(self, message: ReaderReport, *, reply_to: str | None = None) -> ReportOutcome:
        """A reader's report. With ``reply_to`` (``ReadDone`` only), a ``LeaseConfirm`` for it is queued
        now, or when the request's fate is known if the report overtook the hold."""
        request_id = message.request_id
        wants_reply = reply_to is not None and isinstance(message, ReadDone)
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is None:
                gone = self._gone.get(request_id)
                if gone is not None:
                    self.reports_after_free += 1
                    if wants_reply:
                        assert reply_to is not None
                        self._reply(reply_to, request_id, ok=False, reason=_GONE_REASONS[gone.reason])
                    return ReportOutcome()
                entry = self._entries[request_id] = _Entry(
                    block_ids=None, deadline=self._clock() + self.pending_seconds
                )
            if wants_reply:
                assert reply_to is not None
                if entry.block_ids is not None:
                    self._reply(reply_to, request_id, ok=True, reason="held")
                else:
                    entry.parked.append(reply_to)
            if isinstance(message, ReleaseUnread):
                key = (message.reader_engine_id, -1)
                entry.expected = max(entry.expected, 1)
            else:
                key = (message.reader_engine_id, message.reader_rank)
                entry.expected = max(entry.expected, message.expected_readers)
            entry.reports[key] = message
            if isinstance(message, ReadFailed):
                logger.warning(
                    "request %s: decode %s rank %d gave up: %s",
                    request_id,
                    message.reader_engine_id,
                    message.reader_rank,
                    message.reason,
                )
            if entry.complete or len(entry.reports) < max(entry.expected, 1):
                return ReportOutcome()
            entry.complete = True
            if entry.block_ids is None:
                return ReportOutcome(readers_complete=True)
            freed = self._free_unless_pinned(request_id, entry, entry.deferred or "read")
            return ReportOutcome(freed=freed, readers_complete=True)

    def heartbeat(self, request_id: str) -> bool:
        """Extend a held request's lease to a full lease from now; False if it is not held."""
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is None or entry.block_ids is None:
                return False
            if entry.deferred is not None:
                return True  # held until its deferred free: not extended
            entry.deadline = max(entry.deadline, self._clock() + self.lease_seconds)
            return True

    def abort(self, request_id: str) -> Freed | None:
        """Free a held request now (readers that come later are told it is gone); None if not held, or if its
        hold window is still running: it is then freed at the window's end (``expire``) or by its readers'
        reports, with reason ``"aborted"`` either way."""
        with self._lock:
            return self._free_early(request_id, "aborted")

    def release(self, request_id: str, *, read_possible: bool = True) -> Freed | None:
        """Free a held request nobody will read. ``read_possible`` (a decode may have its params): as ``abort``
        (deferred to the end of the hold window); else at once. None when it is not held, when it is deferred, or
        when a reader reported already (it then ends as read, or at the lease end). Idempotent."""
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is None or entry.block_ids is None or entry.reports:
                return None
            if read_possible:
                return self._free_early(request_id, "released")
            return self._free_unless_pinned(request_id, entry, "released")

    def expire(self) -> list[Freed]:
        """Free every held request whose lease ran out; drop pending reports whose hold never came."""
        freed: list[Freed] = []
        with self._lock:
            now = self._clock()
            for request_id, entry in list(self._entries.items()):
                if entry.deadline > now or entry.pins:  # a pinned one is looked at again when unpinned
                    continue
                if entry.block_ids is not None and entry.deferred is not None:
                    freed.append(self._free(request_id, entry, entry.deferred))
                elif entry.block_ids is not None:
                    logger.warning(
                        "request %s: lease of %g s expired with %d of %d reader(s) reported; freeing %d block(s)",
                        request_id,
                        self.lease_seconds,
                        len(entry.reports),
                        max(entry.expected, 1),
                        len(entry.block_ids),
                    )
                    freed.append(self._free(request_id, entry, "expired"))
                else:
                    logger.info("request %s: reported by readers but never held here; dropped", request_id)
                    self._answer_parked(request_id, entry, ok=False, reason=_GONE_REASONS["unknown"])
                    del self._entries[request_id]
                    self._tombstone(request_id, _Gone("unknown", tuple(entry.reports.values()), entry.complete))
        return freed

    def pin(self, request_id: str, block_ids: Iterable[int]) -> str:
        """Keep a held request's blocks until ``unpin`` (a write from ``block_ids`` is about to start). Returns ""
        when pinned, else why not: the request is not held (unknown, pending or freed), its lease has run out, or
        a block id is not one of its blocks."""
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is None or entry.block_ids is None:
                gone = self._gone.get(request_id)
                if gone is not None:
                    return _GONE_REASONS[gone.reason]
                return "not held yet" if entry is not None else _GONE_REASONS["unknown"]
            if entry.deadline <= self._clock():
                return "the lease has run out"
            missing = set(block_ids).difference(entry.block_ids)
            if missing:
                return f"{len(missing)} block id(s) of the order are not this request's"
            entry.pins += 1
            return ""

    def unpin(self, request_id: str) -> Freed | None:
        """End one ``pin``; returns the request if it is freed now (something asked for it meanwhile, or its lease
        ran out), else None."""
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is None or entry.block_ids is None or entry.pins == 0:
                return None
            entry.pins -= 1
            if entry.pins:
                return None
            if entry.after_pins is not None:
                return self._free(request_id, entry, entry.after_pins)
            if entry.deadline <= self._clock():
                return self._free(request_id, entry, entry.deferred or "expired")
            return None

    def take_replies(self) -> list[Reply]:
        """Confirmations queued since the last call (each returned once)."""
        with self._lock:
            replies, self._outbox = self._outbox, []
        return replies

    def forget(self, request_id: str) -> None:
        """Drop everything known of a request without freeing anything (the caller owns the blocks)."""
        with self._lock:
            self._entries.pop(request_id, None)
            self._gone.pop(request_id, None)

    # ------------------------------------------------------------------ queries
    def status(self, request_id: str) -> Status:
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is not None:
                return "held" if entry.block_ids is not None else "pending"
            gone = self._gone.get(request_id)
            return "unknown" if gone is None else gone.reason

    def readers_complete(self, request_id: str) -> tuple[ReaderReport, ...] | None:
        """The readers' reports once every expected reader has reported, else None."""
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is not None:
                return tuple(entry.reports.values()) if entry.complete else None
            gone = self._gone.get(request_id)
            return gone.reports if gone is not None and gone.complete else None

    @property
    def held_requests(self) -> int:
        with self._lock:
            return sum(1 for entry in self._entries.values() if entry.block_ids is not None)

    @property
    def pending_requests(self) -> int:
        with self._lock:
            return sum(1 for entry in self._entries.values() if entry.block_ids is None)

    @property
    def blocks_held(self) -> int:
        with self._lock:
            return sum(len(entry.block_ids) for entry in self._entries.values() if entry.block_ids is not None)

    # ------------------------------------------------------------------ internals (lock held)
    def _free_early(self, request_id: str, reason: FreeReason) -> Freed | None:
        """Free a held request before its readers reported, for ``reason``: now, or at the end of its hold
        window if that is still running (None then, and when it is not held)."""
        entry = self._entries.get(request_id)
        if entry is None or entry.block_ids is None:
            return None
        now = self._clock()
        if now >= entry.promised_until:
            return self._free_unless_pinned(request_id, entry, reason)
        if entry.deferred is None:
            logger.info(
                "request %s: %s inside its hold window: freed in %.3f s or when its readers report",
                request_id,
                reason,
                entry.promised_until - now,
            )
        entry.deferred = reason
        entry.deadline = min(entry.deadline, entry.promised_until)
        return None

    def _free_unless_pinned(self, request_id: str, entry: _Entry, reason: FreeReason) -> Freed | None:
        """Free now, or at the last ``unpin`` while a write from the blocks is in flight (None then)."""
        if entry.pins:
            entry.after_pins = entry.after_pins or reason
            return None
        return self._free(request_id, entry, reason)

    def _free(self, request_id: str, entry: _Entry, reason: FreeReason) -> Freed:
        assert entry.block_ids is not None
        del self._entries[request_id]
        reports = tuple(entry.reports.values())
        self._tombstone(request_id, _Gone(reason, reports, entry.complete))
        return Freed(request_id=request_id, block_ids=entry.block_ids, reason=reason, reports=reports)

    def _tombstone(self, request_id: str, gone: _Gone) -> None:
        """Remember a request gone (at most ``max_tombstones``), its reports kept without their ``reply_to``: a
        reader's connection metadata (a kilobyte or more: UCX's addresses) is not needed once the request is gone, and
        65,536 tombstones kept it, 80-150 MiB of a prefill's memory (measured in a soak)."""
        reports = tuple(
            msgspec.structs.replace(report, reply_to=b"")
            if isinstance(report, ReadDone) and report.reply_to
            else report
            for report in gone.reports
        )
        gone = _Gone(gone.reason, reports, gone.complete)
        self._gone[request_id] = gone
        self._gone.move_to_end(request_id)
        while len(self._gone) > self._max_tombstones:
            self._gone.popitem(last=False)

    def _reply(self, to: str, request_id: str, *, ok: bool, reason: str) -> None:
        self._outbox.append(Reply(to=to, confirm=LeaseConfirm(request_id=request_id, ok=ok, reason=reason)))

    def _answer_parked(self, request_id: str, entry: _Entry, *, ok: bool, reason: str) -> None:
        for to in entry.parked:
            self._reply(to, request_id, ok=ok, reason=reason)
        entry.parked.clear()
