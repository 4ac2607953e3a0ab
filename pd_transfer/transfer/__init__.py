"""NIXL transfers: the only package of pd-transfer that imports ``nixl``."""

from .agent import DescriptorList, ReadStats, TransferAgent
from .errors import PeerDisconnected, TransferError, TransferTimeout, UnknownPeer

__all__ = [
    "DescriptorList",
    "PeerDisconnected",
    "ReadStats",
    "TransferAgent",
    "TransferError",
    "TransferTimeout",
    "UnknownPeer",
]
