"""KV cache offloading, engine-agnostic: block keys, a scheduler-side manager per tier, the host-memory and
directory tiers, and a background worker that moves blocks between an engine's cache and a tier.

No engine and no transport is imported here; an engine adapter calls :class:`OffloadManager` from its
scheduler and :class:`TransferWorker` from its workers. See docs/offload.md.
"""

from __future__ import annotations

from .errors import OffloadError, OffloadInputError, OffloadStateError, WorkerClosedError, brief
from .file_format import file_keys
from .files import DEFAULT_GROUP_BLOCKS, DirectoryTier, ReadOutcome
from .host import HostPool
from .keys import KEY_BYTES, BlockKey, chain_block_keys, fingerprint_digest
from .manager import OffloadManager, StorePlan
from .metrics import OffloadMetrics
from .specs import (
    BlocksEvicted,
    BlocksStored,
    OffloadEvent,
    PageFormat,
    TierBlocks,
    TransferJob,
    TransferResult,
)
from .worker import TransferWorker, canonical_views

__all__ = [
    "DEFAULT_GROUP_BLOCKS",
    "KEY_BYTES",
    "BlockKey",
    "BlocksEvicted",
    "BlocksStored",
    "DirectoryTier",
    "HostPool",
    "OffloadError",
    "OffloadEvent",
    "OffloadInputError",
    "OffloadManager",
    "OffloadMetrics",
    "OffloadStateError",
    "PageFormat",
    "ReadOutcome",
    "StorePlan",
    "TierBlocks",
    "TransferJob",
    "TransferResult",
    "TransferWorker",
    "WorkerClosedError",
    "brief",
    "canonical_views",
    "chain_block_keys",
    "file_keys",
    "fingerprint_digest",
]
