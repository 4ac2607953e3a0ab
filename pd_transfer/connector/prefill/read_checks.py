"""A prefill rank's half of read checks (issue 42): the digest of the rows a decode read from it, for the decode to
compare with the same rows where they landed.

A decode about to read a request from this rank (over NIXL, by a push, with ``process_vm_readv``) names in a
``CheckRows`` the rows it checks (:class:`~pd_transfer.connector.messages.RowCheck`: its plan's unit shape and a run of
its units, no address); this rank finds them in its own cache (:class:`~pd_transfer.topology.own_rows.OwnRows`),
digests them (:func:`~pd_transfer.transfer.digests.rows_digest`, while the read runs, the request pinned), then
re-checks the blocks holding them against their digests at the hold
(:class:`~pd_transfer.connector.held_digests.HeldDigests`), and answers ``RowDigest``: the digest, or why a block
changed, or why the check is refused (a shape or block ids that do not fit this rank). Host caches only: a rank whose
cache is on a GPU offers no read checks.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from pd_transfer.connector.cache import KVCache
from pd_transfer.connector.held_digests import HeldDigests
from pd_transfer.connector.messages import RowCheck
from pd_transfer.topology.mapping import TopologyError
from pd_transfer.topology.own_rows import OwnRows
from pd_transfer.topology.units import UnitShape
from pd_transfer.transfer.cma import merged_rows
from pd_transfer.transfer.digests import rows_digest

#: Unit shapes whose rows a rank keeps ready (a decode engine's plan has one a source rank: few are ever in use).
MAX_SHAPES = 32
#: Longest reason sent back (characters).
MAX_REASON_CHARS = 300


@dataclass(frozen=True)
class Verdict:
    """What a rank answers a checked read: ``digest`` of the rows (None where ``changed`` or ``refused`` says why)."""

    digest: int | None
    changed: str = ""
    refused: str = ""


class RowDigests:
    """Digests the rows read checks name in ``cache`` (a host cache), re-checked against ``held``. Thread-safe."""

    def __init__(self, cache: KVCache, held: HeldDigests) -> None:
        self._cache = cache
        self._held = held
        self._lock = threading.Lock()
        self._shapes: OrderedDict[tuple[int, int, int, int, int], OwnRows] = OrderedDict()

    def verdict(self, check: RowCheck) -> Verdict:
        """The digest of the rows ``check`` names as the cache holds them now, unless a block holding them changed
        since its request was held, or ``check`` does not fit this rank (its shape, block ids or units)."""
        try:
            own = self._own_rows(check)
            addresses = own.addresses(check.block_ids, check.num_tokens)
        except (TopologyError, ValueError) as error:
            return Verdict(None, refused=str(error)[:MAX_REASON_CHARS])
        if not 0 <= check.first_unit < check.end_unit <= len(addresses):
            return Verdict(None, refused=f"units {check.first_unit}..{check.end_unit} of {len(addresses)}")
        rows = merged_rows(addresses[check.first_unit : check.end_unit], own.unit_bytes)
        digest = rows_digest(rows)  # first: a change after it shows here or where the rows landed
        changed = self._held.changed(rows)
        return Verdict(None, changed=changed[:MAX_REASON_CHARS]) if changed else Verdict(digest)

    def _own_rows(self, check: RowCheck) -> OwnRows:
        """The rows of ``check``'s shape in this cache (made once a shape, the least used forgotten first)."""
        key = (check.first_global_head, check.num_heads, check.unit_heads, check.unit_tokens, check.head_size)
        with self._lock:
            own = self._shapes.get(key)
            if own is not None:
                self._shapes.move_to_end(key)
                return own
        unit = UnitShape(check.unit_heads, check.unit_tokens, check.head_size)
        own = OwnRows(
            self._cache.layout,
            self._cache.regions,
            first_global_head=check.first_global_head,
            num_heads=check.num_heads,
            unit=unit,
        )
        with self._lock:
            self._shapes[key] = own
            while len(self._shapes) > MAX_SHAPES:
                self._shapes.popitem(last=False)
        return own
