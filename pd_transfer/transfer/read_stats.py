"""What one read moved and how long it took: the result of every read, by the agent or split over its lanes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReadStats:
    """What one read moved and how long it took."""

    bytes: int
    descriptors: int  # rows handed to NIXL (before NIXL merges adjacent ones)
    post_seconds: float  # building and posting the transfer
    seconds: float  # post to DONE
