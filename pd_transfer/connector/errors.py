"""Errors of the connector layer (the request lifecycle on top of handshake, topology and transfer)."""

from __future__ import annotations

from pd_transfer.handshake.errors import HandshakeError
from pd_transfer.topology.mapping import TopologyError
from pd_transfer.transfer.errors import PeerDisconnected, TransferError, TransferTimeout


class LeaseNotConfirmed(TransferError):
    """A read completed, but a prefill rank did not confirm (refused, or stayed silent) that the request's
    blocks were still held when our ``ReadDone`` reached it: what was read may be stale and must not be used."""

    def __init__(self, request_id: str, reason: str) -> None:
        self.request_id = request_id
        self.reason = reason
        super().__init__(f"request {request_id}: read not confirmed by the prefill: {reason}")


class StreamUnsupported(TransferError):
    """The prefill engine's transport does not stream a request while it is computed: wait for its params and pull."""


class WrongEngine(ValueError):
    """The side channel at the address in a request's parameters serves another engine than they name."""

    def __init__(self, expected: str, found: str, host: str, port: int) -> None:
        self.expected = expected
        self.found = found
        super().__init__(
            f"remote_engine_id {expected!r} is unknown at {host}:{port}, which serves engine {found!r}"
            " (stale or wrong kv_transfer_params?)"
        )


class DuplicateBlockIds(ValueError):
    """A request's block ids name one block twice: each block holds one range of the request's tokens, so the
    ids are corrupt. Raised before anything is read."""

    def __init__(self, request_id: str, name: str, block_id: int, first: int, again: int) -> None:
        self.request_id = request_id
        self.name = name
        self.block_id = block_id
        self.first = first  # index of its first entry
        self.again = again  # index of the entry repeating it
        super().__init__(
            f"request {request_id}: {name}: block {block_id} repeats (entries {first} and {again});"
            " refused before any read"
        )


def failure_kind(error: BaseException) -> str:
    """The ``kind`` label of a failed pull (``pd_transfer_pull_failures_total``)."""
    if isinstance(error, WrongEngine):
        return "wrong_engine"
    if isinstance(error, HandshakeError):
        return "handshake"
    if isinstance(error, LeaseNotConfirmed):
        return "unconfirmed"
    if isinstance(error, TransferTimeout):
        return "timeout"
    if isinstance(error, PeerDisconnected):
        return "disconnected"
    if isinstance(error, TransferError):
        return "transfer"
    if isinstance(error, TopologyError):
        return "incompatible"
    if isinstance(error, ValueError):
        return "invalid"
    return "other"
