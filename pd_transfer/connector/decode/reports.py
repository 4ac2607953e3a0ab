"""What a decode rank, as a reader, tells the prefill ranks about a request, through each source's courier (NIXL
notifications, or a transport's own connection: :mod:`pd_transfer.connector.transports.seam`).

* ``ReadDone``: attached to the last READ from each source rank (or sent after a copy); carries ``reply_to`` (our
  connection metadata) while the request's lease confirmation is awaited, so the prefill answers with a
  ``LeaseConfirm``.
* ``CheckRows``: before a checked read, to each source rank checked (read checks: :mod:`.read_checks`).
* ``ReadFailed``: to every source rank when a read failed or will not happen (it counts as done for freeing).
* ``LeaseHeartbeat``: we still mean to read (the request is queued): extend the lease.
* ``ReleaseUnread``: from decode rank 0, to the prefill ranks no decode rank reads.

Sending is best effort: a rank that cannot be told is logged, and its lease frees the request in the end.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from pd_transfer.connector import messages
from pd_transfer.connector.transports.seam import Source
from pd_transfer.transfer.errors import TransferError

logger = logging.getLogger(__name__)

#: Longest ``ReadFailed`` reason sent (characters).
MAX_REASON_CHARS = 500


class ReaderReports:
    """Reports of decode rank ``reader_rank`` of engine ``engine_id`` (``name``: its agent's, for logs).

    ``awaits(request_id)`` says whether the request's lease confirmation is awaited; ``reply_to`` is what its
    ``ReadDone`` then carries (the agent's connection metadata), as does every ``CheckRows``.
    """

    def __init__(
        self,
        name: str,
        engine_id: str,
        reader_rank: int,
        *,
        reply_to: bytes,
        awaits: Callable[[str], bool],
    ) -> None:
        self.name = name
        self.engine_id = engine_id
        self.reader_rank = reader_rank
        self._reply_to = reply_to
        self._awaits = awaits

    def read_done(self, request_id: str, source: Source) -> bytes:
        """The encoded ``ReadDone`` for the last READ of ``request_id`` from ``source``."""
        return messages.encode(
            messages.ReadDone(
                request_id=request_id,
                reader_engine_id=self.engine_id,
                reader_rank=self.reader_rank,
                expected_readers=source.expected_readers,
                reply_to=self._reply_to if self._awaits(request_id) else b"",
            )
        )

    def check_rows(self, source: Source, request_id: str, check: messages.RowCheck) -> None:
        """Ask ``source`` for the digest of the rows ``check`` names of ``request_id`` (read checks; before the read,
        so that the prefill digests them while it runs). ``TransferError`` if it cannot be told."""
        asked = messages.CheckRows(
            request_id=request_id,
            reader_engine_id=self.engine_id,
            reader_rank=self.reader_rank,
            check=check,
            reply_to=self._reply_to,
        )
        source.tell(messages.encode(asked))

    def tell_read(self, sources: Iterable[Source], request_id: str) -> None:
        """Send each source rank its ``ReadDone`` of ``request_id`` (reads that post no NIXL transfer: copies)."""
        for source in sources:
            source.tell(self.read_done(request_id, source))

    def read_failed(self, sources: Iterable[Source], request_id: str, reason: str) -> None:
        """Tell each source rank we gave up on ``request_id`` (``reason`` cut to ``MAX_REASON_CHARS``)."""
        for source in sources:
            failed = messages.ReadFailed(
                request_id=request_id,
                reader_engine_id=self.engine_id,
                reader_rank=self.reader_rank,
                expected_readers=source.expected_readers,
                reason=reason[:MAX_REASON_CHARS],
            )
            try:
                source.tell(messages.encode(failed))
            except TransferError as error:
                logger.info(
                    "decode %s: could not tell %s about request %s: %s", self.name, source.peer, request_id, error
                )

    def heartbeat(self, request_id: str, sources: Iterable[Source]) -> int:
        """Tell each of ``sources`` we still mean to read ``request_id``; returns how many were told."""
        beat = messages.encode(
            messages.LeaseHeartbeat(
                request_id=request_id, reader_engine_id=self.engine_id, reader_rank=self.reader_rank
            )
        )
        sent = 0
        for source in sources:
            try:
                source.tell(beat)
                sent += 1
            except TransferError as error:
                logger.info("decode %s: heartbeat of %s to %s failed: %s", self.name, request_id, source.peer, error)
        return sent

    def release_unread(self, request_id: str, sources: Iterable[Source]) -> None:
        """Tell each of ``sources`` (prefill ranks no decode rank reads) to free ``request_id`` now."""
        release = messages.encode(messages.ReleaseUnread(request_id=request_id, reader_engine_id=self.engine_id))
        for source in sources:
            try:
                source.tell(release)
            except TransferError as error:
                logger.info("decode %s: releasing %s on %s failed: %s", self.name, request_id, source.peer, error)
