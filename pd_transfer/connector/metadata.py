"""What the scheduler side tells the workers each engine step, and what the workers report back.

Plain msgspec structs (picklable, msgpack-encodable): the scheduler and the workers may live in different
processes.
"""

from __future__ import annotations

import msgspec


class RemoteRef(msgspec.Struct, frozen=True, kw_only=True):
    """A request as the prefill engine that holds its KV knows it."""

    remote_engine_id: str
    remote_host: str
    remote_port: int
    remote_request_id: str
    remote_tp_size: int


class RecvSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Load ``num_tokens`` tokens of KV from a prefill engine into ``local_block_ids`` (in token order)."""

    remote_engine_id: str
    remote_host: str
    remote_port: int
    remote_request_id: str
    remote_tp_size: int
    remote_block_ids: tuple[int, ...]
    local_block_ids: tuple[int, ...]
    num_tokens: int
    trust_until: float | None = None  # time.monotonic of this host: a read ended before it needs no confirmation
    incarnation: str | None = None  # the prefill incarnation that promised that (``remote_incarnation``)
    stream: bool = False  # streamed while the prefill computes it: ``remote_block_ids`` empty, learnt from it
    skip_blocks: int = 0  # streamed: the prefill's first blocks of it to leave out (a prefix held here)

    @property
    def ref(self) -> RemoteRef:
        return RemoteRef(
            remote_engine_id=self.remote_engine_id,
            remote_host=self.remote_host,
            remote_port=self.remote_port,
            remote_request_id=self.remote_request_id,
            remote_tp_size=self.remote_tp_size,
        )


class StreamStart(msgspec.Struct, frozen=True, kw_only=True):
    """Prefill: a request whose prompt is computed in this step, offered layer by layer to the decode that names it
    ``stream_id``, in ``block_ids`` (in token order)."""

    stream_id: str
    block_ids: tuple[int, ...]


class StepMetadata(msgspec.Struct, frozen=True, kw_only=True):
    """One engine step's work for every worker (each TP rank acts on its share)."""

    reqs_to_recv: dict[str, RecvSpec] = {}  # decode: start loading these (request id -> what and where)
    reqs_to_hold: dict[str, tuple[int, ...]] = {}  # prefill: finished requests whose blocks readers will read
    reqs_to_abort: frozenset[str] = frozenset()  # prefill: held requests to free now, streamed ones not held to end
    # prefill: held requests nobody will read (the proxy said so) -> whether a decode may be reading them now
    reqs_released: dict[str, bool] = {}
    reqs_to_release: dict[str, RemoteRef] = {}  # decode: requests we will not read: tell the prefill
    reqs_to_heartbeat: dict[str, RemoteRef] = {}  # decode: queued requests: extend the prefill's lease
    reqs_computing: dict[str, StreamStart] = {}  # prefill: streamed requests whose prompt this step computes
    hold_aliases: dict[str, str] = {}  # prefill: of reqs_to_hold, the streamed ones -> their stream id

    @property
    def empty(self) -> bool:
        return not (
            self.reqs_to_recv
            or self.reqs_to_hold
            or self.reqs_to_abort
            or self.reqs_released
            or self.reqs_to_release
            or self.reqs_to_heartbeat
            or self.reqs_computing
        )


class TransferResults(msgspec.Struct, frozen=True, kw_only=True):
    """What one worker (``rank``) finished since its last report, or, aggregated, the whole engine
    (``rank`` -1). A request in ``failed_recving`` is also in ``finished_recving``."""

    rank: int
    finished_sending: frozenset[str] = frozenset()  # prefill: blocks free again (read, expired or aborted)
    finished_recving: frozenset[str] = frozenset()  # decode: loads over, whatever their outcome
    failed_recving: frozenset[str] = frozenset()  # decode, policy "fail": loads that failed
    load_error_block_ids: frozenset[int] = frozenset()  # decode, policy "recompute": blocks to recompute
