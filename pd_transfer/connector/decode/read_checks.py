"""A decode rank's half of read checks (issue 42): the rows of a pull it checks, their digest where they landed, and
the comparison with the digest the prefill computed of the same rows in its cache.

Which pulls: those of a host cache, under ``verify`` ``all``, or ``sample``
(:func:`~pd_transfer.transfer.digests.sampled`: a run of a 32nd of each source's units, :data:`READ_SAMPLE_EVERY`,
the next run for the next request) where the rows cross a wire (a same-host transport's reads, ``process_vm_readv``
at memory speed, are checked under ``all`` only: docs/benchmarks.md), from prefill ranks that offer read checks
(:data:`~pd_transfer.connector.messages.READ_CHECKS_OFFER`), by a link whose plan lands the rows in place, with no
fix-up after (NIXL reads in place, pushes into a host cache, ``process_vm_readv``, any transport that copies the
plan's rows), and that does not check its reads itself (``tcp``: its link says ``checks_reads``). Rows that land
elsewhere first (staged or packed reads) are not checked here yet.

How: before the read, each source checked is sent a ``CheckRows`` naming the rows
(:class:`~pd_transfer.connector.messages.RowCheck`: the plan's unit shape, the request's blocks there, the run of
units); it digests them while the read runs (the request pinned meanwhile) and answers ``RowDigest``, whatever the
lease (a ``LeaseConfirm`` comes apart where asked for). Once the read returned, this rank digests the run's local rows
(:func:`~pd_transfer.transfer.digests.rows_digest`) and compares the two. A difference, a block the prefill found
changed since its hold, a check it refused or a digest that does not come within ``confirm_timeout_s`` raises
:class:`~pd_transfer.transfer.errors.DigestMismatch` naming the prefill rank and the rows: the KV is not used (the
request is computed here).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from pd_transfer.connector import messages
from pd_transfer.connector.cache import KVCache
from pd_transfer.connector.transports.requests import PullRequest
from pd_transfer.connector.transports.seam import Link, Source
from pd_transfer.handshake.messages import EngineMetadata
from pd_transfer.transfer.cma import IOVEC, merged_rows
from pd_transfer.transfer.digests import next_turn, rows_digest, sampled
from pd_transfer.transfer.dlists import merged_spans
from pd_transfer.transfer.errors import DigestMismatch

#: ``sample`` checks one unit in this many of a read (adjacent ones; the next run for the next request): a 32nd, where a
#: stream or a tcp read checks an eighth, as a read in place goes at memory speed and the digest at about a core's copy
#: speed: measured (``bench transfer --verify-cost``), an eighth cost 1.18x a 512 MiB NIXL read's time on one host.
READ_SAMPLE_EVERY = 32
#: Most block ids a ``RowCheck`` names: a ``CheckRows`` must fit a notification (64 KiB); longer requests go unchecked.
MAX_CHECK_BLOCKS = 8192


@dataclass(frozen=True)
class SourceCheck:
    """The rows of one source rank a pull checks: ``check`` as its ``CheckRows`` names them, ``landed`` where they are
    in our cache (:data:`~pd_transfer.transfer.cma.IOVEC` entries, in the plan's order)."""

    source: Source
    check: messages.RowCheck
    landed: np.ndarray


class ReadChecks:
    """Read checks of one decode rank's pulls into ``cache`` under ``verify`` (no state of its own: thread-safe)."""

    def __init__(self, cache: KVCache, verify: str) -> None:
        self.verify = verify
        self._host = cache.place.is_host
        self._block_size = cache.layout.block_size
        spans = np.array(merged_spans(cache.regions), dtype=np.uint64).reshape(-1, 2)
        self._starts, self._ends = spans[:, 0].copy(), spans[:, 1].copy()

    def plan(self, link: Link, engine: EngineMetadata, request: PullRequest, *, same_host: bool) -> list[SourceCheck]:
        """What a pull of ``request`` by ``link`` (an engine of ``engine``'s; ``same_host``: opened by a same-host
        transport) checks, source by source (empty: nothing; see the module's docstring). Block ids that do not fit
        raise ``ValueError``, as the read would."""
        if (
            self.verify == "off"
            or (same_host and self.verify != "all")
            or not self._host
            or link.plan.postprocess is not None
            or getattr(link, "checks_reads", False)
            or len(request.remote_block_ids) > MAX_CHECK_BLOCKS
        ):
            return []
        offering = {
            rank.tp_rank
            for rank in engine.ranks
            if rank.offer(messages.READ_CHECKS_OFFER) == messages.READ_CHECKS_DIGEST
        }
        turn = next_turn()
        checks = []
        for plan, source in zip(link.plan.sources, link.sources, strict=True):
            if source.remote_rank not in offering or plan.local_block_size != self._block_size:
                continue  # not offered; or read into a staging cache of other blocks first (packed reads)
            local, _ = plan.addresses(request.remote_block_ids, request.local_block_ids, request.num_tokens)
            chosen = sampled(self.verify, len(local), turn, READ_SAMPLE_EVERY)
            if chosen is None:
                continue
            landed = merged_rows(local[chosen], plan.unit_bytes)
            if not self._inside(landed):
                continue  # the plan lands them elsewhere first (a staging area)
            first, end, _ = chosen.indices(len(local))
            check = messages.RowCheck(
                first_global_head=plan.first_global_head,
                num_heads=plan.num_heads,
                unit_heads=plan.unit.heads,
                unit_tokens=plan.unit.tokens,
                head_size=plan.unit.head_size,
                block_ids=[int(block) for block in request.remote_block_ids],
                num_tokens=request.num_tokens,
                first_unit=first,
                end_unit=end,
            )
            checks.append(SourceCheck(source, check, landed))
        return checks

    @staticmethod
    def landed(checks: Sequence[SourceCheck]) -> list[int]:
        """The digest of each check's rows where they landed (once the read returned; while the prefill computes its
        own)."""
        return [rows_digest(check.landed) for check in checks]

    @staticmethod
    def compare(
        request_id: str,
        checks: Sequence[SourceCheck],
        landed: Sequence[int],
        answers: Mapping[str, messages.RowDigest],
    ) -> int:
        """Compare each check's ``landed`` digest with the one its source's answer carries; returns how many were
        equal. Raises :class:`DigestMismatch` naming the source and the rows at the first that is not (a digest that
        differs; a block the prefill found changed; a check it refused or did not answer)."""
        for check, digest in zip(checks, landed, strict=True):
            peer = check.source.peer
            answer = answers.get(peer)
            where = f"units {check.check.first_unit}..{check.check.end_unit} of request {request_id} from {peer}"
            if answer is None or (answer.digest is None and not answer.changed and not answer.refused):
                raise DigestMismatch(f"{where}: the prefill sent no digest in time")
            if answer.changed:
                raise DigestMismatch(f"{where}: {answer.changed}")
            if answer.refused:
                raise DigestMismatch(f"{where}: the prefill refused the check: {answer.refused}")
            if digest != answer.digest:
                raise DigestMismatch(f"{where}: the bytes that landed differ from the prefill's (digests differ)")
        return len(checks)

    def _inside(self, rows: np.ndarray) -> bool:
        """Whether every one of ``rows`` (IOVEC) lies inside the cache's registered memory."""
        if rows.dtype != IOVEC or not len(rows):
            return False
        starts = rows["base"]
        ends = starts + rows["length"]
        span = np.searchsorted(self._starts, starts, side="right") - 1
        return bool(((span >= 0) & (ends <= self._ends[np.maximum(span, 0)])).all())
