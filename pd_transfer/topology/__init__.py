"""Topology: which bytes of which prefill rank's KV cache a decode rank reads, and where they land.

Pure Python + numpy + torch (no NIXL, ZMQ or vLLM): the transfer layer turns the descriptor grids and row
indices produced here into NIXL reads. ``spec`` and ``mapping`` need only msgspec; the planner's names
(numpy, torch) are imported on first use so that importing :mod:`pd_transfer.topology.spec` stays light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .mapping import HeadSource, TopologyError, check_compatible, expected_readers, head_sources, holders
from .spec import (
    DTYPE_SIZES,
    KVCacheLayout,
    KVLayout,
    KVRegion,
    ModelFingerprint,
    Plane,
    PlaneKind,
    planes_of,
    region_from_tensor,
)

if TYPE_CHECKING:
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

_LAZY = {
    "DEFAULT_MIN_DIRECT_RUN_BYTES": ".plan",
    "PeerPlan": ".plan",
    "Postprocess": ".plan",
    "SourcePlan": ".plan",
    "SourceStats": ".plan",
    "Strategy": ".plan",
    "plane_views": ".plan",
    "PackedBlockFormat": ".packed",
    "PackedRegroup": ".packed",
    "Restage": ".postprocess",
    "StagedSource": ".postprocess",
    "restage_blocks": ".postprocess",
    "BlockGeometry": ".units",
    "UnitShape": ".units",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "DEFAULT_MIN_DIRECT_RUN_BYTES",
    "DTYPE_SIZES",
    "BlockGeometry",
    "HeadSource",
    "KVCacheLayout",
    "KVLayout",
    "KVRegion",
    "ModelFingerprint",
    "PackedBlockFormat",
    "PackedRegroup",
    "PeerPlan",
    "Plane",
    "PlaneKind",
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
    "planes_of",
    "region_from_tensor",
    "restage_blocks",
]
