"""The lease confirmations a decode rank waits for after its reads: read, then confirm (only for reads that
cannot rely on the prefill's hold window, see :meth:`.rank.DecodeRank.pull_confirmed`); and the digests of the rows
its reads check (``RowDigest``, read checks: :mod:`.read_checks`), awaited the same way.

While a request is awaited (``awaiting``), its ``ReadDone`` notifications carry ``reply_to`` and each
prefill rank read from answers with a ``LeaseConfirm``: ok only if the request's blocks were still held when
the ``ReadDone`` arrived (see :mod:`pd_transfer.connector.leases`). ``wait`` returns once every rank
confirmed, one refused, or the time ran out. Notifications that do not decode, that are not a
``LeaseConfirm``, or that answer a request no longer awaited are dropped and logged.

Thread-safe: one condition guards the answers; the NIXL agent's progress thread delivers them
(``on_notification``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from pd_transfer.connector import messages

logger = logging.getLogger(__name__)

#: What a prefill rank answers a decode rank's reports with.
Answer = TypeVar("Answer", messages.LeaseConfirm, messages.RowDigest)


class LeaseConfirmations:
    """The ``LeaseConfirm`` answers awaited by the decode rank whose NIXL agent is called ``name``."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._cond = threading.Condition()
        self._awaiting: dict[str, dict[str, messages.LeaseConfirm]] = {}  # request -> prefill agent -> answer
        self._digests: dict[str, dict[str, messages.RowDigest]] = {}  # request -> prefill agent -> its digest
        self.received = 0  # every LeaseConfirm that arrived (a round trip each)
        self.digests_received = 0  # every RowDigest that arrived (read checks)

    def awaits(self, request_id: str) -> bool:
        """Whether ``request_id``'s confirmations are awaited (its ``ReadDone`` should carry ``reply_to``)."""
        return request_id in self._awaiting

    @contextmanager
    def awaiting(self, request_id: str, fast_polling: Callable[[bool], None]) -> Iterator[None]:
        """Await ``request_id``'s confirmations for the duration of the block. ``fast_polling(on)`` is told,
        under the lock, whether any request is awaited (the agent then polls for notifications quickly)."""
        with self._awaited(self._awaiting, request_id, fast_polling):
            yield

    @contextmanager
    def awaiting_digests(self, request_id: str, fast_polling: Callable[[bool], None]) -> Iterator[None]:
        """Await ``request_id``'s ``RowDigest`` answers (read checks) for the duration of the block; ``fast_polling``
        as for :meth:`awaiting`."""
        with self._awaited(self._digests, request_id, fast_polling):
            yield

    @contextmanager
    def _awaited(
        self, table: dict[str, dict[str, Answer]], request_id: str, fast_polling: Callable[[bool], None]
    ) -> Iterator[None]:
        with self._cond:
            table[request_id] = {}
            fast_polling(True)
        try:
            yield
        finally:
            with self._cond:
                table.pop(request_id, None)
                fast_polling(bool(self._awaiting or self._digests))

    def wait_digests(self, request_id: str, peers: list[str], timeout_s: float) -> dict[str, messages.RowDigest]:
        """The ``RowDigest`` answers to ``request_id`` from ``peers`` (prefill agent names), once every one came or
        ``timeout_s`` passed (then those that came)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                answers = self._digests.get(request_id, {})
                remaining = deadline - time.monotonic()
                if all(peer in answers for peer in peers) or remaining <= 0:
                    return dict(answers)
                self._cond.wait(remaining)

    def on_notification(self, peer: str, payload: bytes) -> None:
        """A notification from prefill agent ``peer``: a ``LeaseConfirm`` is recorded and wakes the waiters."""
        try:
            message = messages.decode(payload)
        except Exception as error:
            logger.warning("decode %s: malformed notification from %s dropped: %s", self.name, peer, error)
            return
        self.on_message(peer, message)

    def on_message(self, peer: str, message: messages.PeerMessage) -> None:
        """A decoded notification from prefill agent ``peer`` (:meth:`on_notification`)."""
        if isinstance(message, messages.RowDigest):
            with self._cond:
                self.digests_received += 1
                self._record(self._digests, "digest", peer, message)
        elif isinstance(message, messages.LeaseConfirm):
            with self._cond:
                self.received += 1
                self._record(self._awaiting, "confirmation", peer, message)
        else:
            logger.warning("decode %s: unexpected %s from %s dropped", self.name, type(message).__name__, peer)

    def _record(self, table: dict[str, dict[str, Answer]], what: str, peer: str, message: Answer) -> None:
        """Keep ``message`` (from ``peer``) while its request is awaited in ``table``, and wake the waiters (under
        the lock)."""
        answers = table.get(message.request_id)
        if answers is None:
            logger.info(
                "decode %s: %s of request %s from %s came after we stopped waiting",
                self.name,
                what,
                message.request_id,
                peer,
            )
            return
        answers[peer] = message
        self._cond.notify_all()

    def wait(self, request_id: str, peers: list[str], timeout_s: float) -> tuple[bool, str]:
        """Wait until each of ``peers`` (prefill agent names) answered for ``request_id`` (only while it is
        awaited). Returns (True, "") when all confirmed, (False, why) as soon as one refuses, or when
        ``timeout_s`` seconds pass without every answer."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                answers = self._awaiting.get(request_id, {})
                refused = [f"{peer}: {answer.reason}" for peer, answer in answers.items() if not answer.ok]
                if refused:
                    return False, "refused by " + "; ".join(refused)
                missing = [peer for peer in peers if peer not in answers]
                if not missing:
                    return True, ""
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False, f"no confirmation from {', '.join(missing)} within {timeout_s:g} s"
                self._cond.wait(remaining)
