"""Errors raised by the transfer layer (NIXL's own exceptions never escape it)."""

from __future__ import annotations


class TransferError(RuntimeError):
    """A NIXL operation failed; the message names the operation and the peer."""


class TransferTimeout(TransferError):
    """A read did not finish before its deadline; the handle was released."""


class PeerDisconnected(TransferError):
    """The remote agent went away (NIXL reported a remote disconnect)."""


class UnknownPeer(TransferError):
    """No remote agent of that name was added to this agent."""


class DigestMismatch(TransferError):
    """Bytes that arrived differ from those the prefill held (their digests differ, or it sent none it was asked
    for): they must not be used; the message names the peer and the layer."""
