"""Topology: which bytes of which prefill rank's KV cache a decode rank reads, and where they land.

Pure Python + numpy + torch (no NIXL, ZMQ or vLLM): the transfer layer turns the descriptor grids and row
indices produced here into NIXL reads. The cache description types it plans over live in :mod:`pd_transfer.spec`.
"""

from .mapping import HeadSource, TopologyError, check_compatible, expected_readers, head_sources, holders
from .packed import PackedBlockFormat, PackedRegroup
from .plan import (
    DEFAULT_MIN_DIRECT_RUN_BYTES,
    PeerPlan,
    Postprocess,
    SourcePlan,
    SourceStats,
    Strategy,
    plane_views,
)
from .postprocess import Restage, StagedSource, restage_blocks
from .units import BlockGeometry, UnitShape

__all__ = [
    "DEFAULT_MIN_DIRECT_RUN_BYTES",
    "BlockGeometry",
    "HeadSource",
    "PackedBlockFormat",
    "PackedRegroup",
    "PeerPlan",
    "Postprocess",
    "Restage",
    "SourcePlan",
    "SourceStats",
    "StagedSource",
    "Strategy",
    "TopologyError",
    "UnitShape",
    "check_compatible",
    "expected_readers",
    "head_sources",
    "holders",
    "plane_views",
    "restage_blocks",
]
