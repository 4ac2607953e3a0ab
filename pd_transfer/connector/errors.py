"""Errors of the connector layer (the request lifecycle on top of handshake, topology and transfer)."""

from __future__ import annotations

from pd_transfer.transfer.errors import TransferError


class LeaseNotConfirmed(TransferError):
    """A read completed, but a prefill rank did not confirm (refused, or stayed silent) that the request's
    blocks were still held when our ``ReadDone`` reached it: what was read may be stale and must not be used."""

    def __init__(self, request_id: str, reason: str) -> None:
        self.request_id = request_id
        self.reason = reason
        super().__init__(f"request {request_id}: read not confirmed by the prefill: {reason}")


class WrongEngine(ValueError):
    """The side channel at the address in a request's parameters serves another engine than they name."""

    def __init__(self, expected: str, found: str, host: str, port: int) -> None:
        self.expected = expected
        self.found = found
        super().__init__(
            f"remote_engine_id {expected!r} is unknown at {host}:{port}, which serves engine {found!r}"
            " (stale or wrong kv_transfer_params?)"
        )
