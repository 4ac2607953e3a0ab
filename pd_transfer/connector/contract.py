"""The engine contract: what an engine adapter calls on the connector, and when.

An engine runs one scheduler-side object (:class:`SchedulerContract`, implemented by
:class:`~.scheduler.SchedulerSide`) and one worker-side object per TP rank
(:class:`WorkerContract`, implemented by :class:`~.worker.WorkerSide`); they may live in
different processes and talk only through the msgspec structs of :mod:`.metadata`.

**At start**, once: each worker is created on its rank's registered KV cache; the engine gathers every rank's
``WorkerContract.rank_metadata`` (in TP rank order) and hands them to ``SchedulerContract.start_side_channel``.

**Each engine step**, in this order:

1. scheduler: ``on_new_request`` for each request entering the waiting queue (decode: its prefill's lease is
   kept alive by heartbeats while it waits);
2. scheduler: ``get_num_new_matched_tokens`` for each waiting request the engine considers scheduling (may be
   asked again in later steps), then ``update_state_after_alloc`` once its blocks are allocated;
3. scheduler: ``request_finished`` for each request that finished, before its blocks are freed (prefill: may
   answer ``delay_free``; the blocks then stay allocated until they come back in ``finished_sending``);
   ``abort_held`` for a held request the engine wants back early;
4. scheduler: ``computing`` for each request whose prompt the step completes (prefill: a streamed one is offered
   layer by layer as the step runs), then ``build_step_metadata``, exactly once, after scheduling; the result goes to
   every worker;
5. every worker: ``start_load`` with that metadata, before or after the forward pass (it does not block); during the
   forward pass, on a host cache, ``streams_computing`` with that metadata, then ``layers_saved`` after each layer's
   attention wrote its KV (the first ``n`` layers);
6. every worker, after the forward pass: on a GPU, ``step_computed`` with an event recorded on the stream that
   wrote the step's KV (holds started later wait for it); then ``step_output`` (or ``get_finished``, then
   ``get_failed_requests`` and ``get_block_ids_with_load_errors``, in that order, in the same step);
7. scheduler: ``update_connector_output`` with the workers' results aggregated over all ranks (a request is
   finished once every rank reported it: ``OutputAggregator`` in :mod:`.worker`).

An engine with nothing else to do keeps stepping while ``waiting_on_transfers``. **At shutdown**: ``close`` on
every worker and on the scheduler.

The per-request hooks (``on_new_request``, ``get_num_new_matched_tokens``, ``update_state_after_alloc``,
``request_finished``, ``update_connector_output``) and the workers' loads never raise into the engine: a
failure is logged and the request is computed locally (or reported failed, by the failure policy).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Protocol

from pd_transfer.connector.prefill.rank import ReadyEvent
from pd_transfer.handshake.messages import RankMetadata

from .metadata import StepMetadata, TransferResults

if TYPE_CHECKING:
    from .scheduler import SchedulerSide
    from .worker import LoadOutcome, WorkerSide


class SchedulerContract(Protocol):
    """The connector's scheduler half: one per engine (decode, prefill, or both)."""

    def start_side_channel(self, ranks: list[RankMetadata]) -> int:
        """Publish every rank's ``rank_metadata`` (index = TP rank) on the side channel; returns its port.
        Once, at start, before any request."""
        ...

    @property
    def side_channel_port(self) -> int | None:
        """The side channel's port once started, else None."""
        ...

    def on_new_request(self, request_id: str, kv_transfer_params: object, *, prompt_len: int | None = None) -> None:
        """A request entered the waiting queue (``prompt_len`` tokens, if known)."""
        ...

    def get_num_new_matched_tokens(
        self, request_id: str, prompt_len: int, num_computed_tokens: int, kv_transfer_params: object
    ) -> tuple[int, bool]:
        """(tokens loadable from a remote prefill beyond the ``num_computed_tokens`` cached locally, load them
        asynchronously?). (0, False): compute the prompt locally."""
        ...

    def update_state_after_alloc(
        self, request_id: str, local_block_ids: Iterable[int], num_external_tokens: int
    ) -> None:
        """The request's blocks (token order) are allocated; ``num_external_tokens`` of them are to be loaded
        (0: the remote KV is not used, and the prefill is told to free it)."""
        ...

    def request_finished(
        self,
        request_id: str,
        block_ids: list[int],
        finished_reason: str,
        kv_transfer_params: object,
        *,
        num_computed_tokens: int | None = None,
    ) -> tuple[bool, dict[str, object] | None]:
        """A request finished (``finished_reason``: "stop", "length", "abort", ...), its blocks not yet freed.
        Returns (delay_free: the connector keeps ``block_ids`` until ``finished_sending``, the
        ``kv_transfer_params`` to give the client for the decode, or None)."""
        ...

    def abort_held(self, request_id: str) -> None:
        """Prefill: stop holding a request's blocks; they come back in ``finished_sending``."""
        ...

    def computing(self, request_id: str, block_ids: Iterable[int]) -> None:
        """Prefill: this step completes ``request_id``'s prompt in ``block_ids`` (all its blocks, in token order)."""
        ...

    def build_step_metadata(self) -> StepMetadata:
        """This step's work for every worker; once per step (it resets the step's state)."""
        ...

    def update_connector_output(
        self,
        finished_sending: Iterable[str] = (),
        finished_recving: Iterable[str] = (),
        load_error_block_ids: Iterable[int] = (),
        failed_requests: Iterable[str] = (),
    ) -> None:
        """The step's results, aggregated over every worker."""
        ...

    @property
    def holding(self) -> int:
        """Prefill: requests whose blocks the workers hold for readers."""
        ...

    @property
    def waiting_on_transfers(self) -> bool:
        """Blocks are held for readers or loads are pending: keep stepping to learn when they end."""
        ...

    def close(self) -> None:
        """Stop the side channel."""
        ...


class WorkerContract(Protocol):
    """The connector's worker half: one per TP rank, on that rank's KV cache."""

    @property
    def rank_metadata(self) -> RankMetadata:
        """This rank's entry for ``SchedulerContract.start_side_channel`` (its NIXL agent and regions)."""
        ...

    def start_load(self, metadata: StepMetadata) -> None:
        """Act on a step's metadata without blocking: holds at once, network work in the background."""
        ...

    def streams_computing(self, metadata: StepMetadata) -> None:
        """Prefill: offer the step's streamed requests as computed (idempotent per step; before the forward's first
        ``layers_saved``; ``start_load`` does it too)."""
        ...

    def layers_saved(self, layers: int) -> None:
        """Prefill, host caches: the step's first ``layers`` layers wrote their KV (streamed requests offer them)."""
        ...

    def step_computed(self, ready: ReadyEvent) -> None:
        """The step's kernels that write KV were queued; ``ready`` completes when they finished (a
        ``torch.cuda.Event`` recorded after them). Holds of later steps wait for the latest such event before
        their blocks are offered to readers. Engines whose KV is written synchronously (CPU) need not call it."""
        ...

    def get_finished(self) -> tuple[set[str], set[str]]:
        """(finished_sending, finished_recving) since the last call; stages this step's failures for the two
        calls below."""
        ...

    def get_failed_requests(self) -> set[str]:
        """Policy ``fail``: requests whose load failed (also in ``finished_recving``)."""
        ...

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Policy ``recompute``: local blocks whose KV must be recomputed."""
        ...

    def step_output(self) -> TransferResults:
        """The three calls above as one report of this rank, for ``OutputAggregator``."""
        ...

    @property
    def outcomes(self) -> Sequence[LoadOutcome]:
        """How this rank's recent loads ended, newest last (bounded; for stats and logs)."""
        ...

    def close(self) -> None:
        """Stop taking work, wait for running loads (bounded by their timeouts), release NIXL."""
        ...


def _conforms(scheduler: SchedulerSide, worker: WorkerSide) -> tuple[SchedulerContract, WorkerContract]:
    """Never called: a type checker verifies here that the implementations satisfy the contract (an error
    on either assignment names the member that does not match)."""
    scheduler_side: SchedulerContract = scheduler
    worker_side: WorkerContract = worker
    return scheduler_side, worker_side
