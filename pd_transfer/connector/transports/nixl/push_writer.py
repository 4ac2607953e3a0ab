"""The prefill side of push, the NIXL transport's writer (the decode side: :mod:`.push_orders`): writing a held
request's blocks into a decode rank that asked for it.

Over TCP a READ is emulated by its target (the target copies into send buffers, the reader out of receive buffers:
1.5-2 times the CPU of a plain stream), while a WRITE leaves from the sender's memory. So a decode rank whose reads
would go over TCP asks each prefill rank it reads from to push instead:

1. ``PushSetup`` (once per prefill rank, on connecting): its NIXL metadata with its memory, and its plan's source
   (both descriptor grids). The prefill rank checks that its own rows lie inside its cache, adds the reader as a
   peer, prepares both grids, and answers ``PushReady``.
2. ``PushOrder`` (per request): the block ids and token count of the params. The prefill rank computes the rows
   with the reader's plan, *pins* the request's lease (:meth:`pd_transfer.connector.leases.LeaseLedger.pin`:
   refused unless every block id is the held request's own), and posts one WRITE whose notification is
   ``PushOutcome(ok=True)``: the reader gets it after the data, and it proves the blocks were held throughout. The
   write then counts as the reader's ``ReadDone``; the lease is unpinned.
3. Anything else answers ``PushOutcome(ok=False)``: with ``may_read`` (no setup, not held, the write failed) the
   reader reads as before, whose confirmation then tells the truth; without it (malformed block ids) it gives up.

The rank writes with an agent of its own, made on the first setup: without NIXL's progress thread (the rank's agent
runs one, to serve reads), which cost a 512 MiB write over loopback TCP 1.5-2 times the CPU of the writing thread
progressing the transfer itself. Its answers name the rank's agent (``prefill_agent``).

A cache on a GPU (or a host cache where ``staging`` is given, as tests do) is pushed through host memory
(:class:`~.push_staging.PushStager`): the writing agent registers the stager's pool, not the cache,
and an order's rows are gathered into it a chunk at a time, each chunk written as soon as it is there (the last write
carries the ``PushOutcome(ok)``), the next chunks gathered meanwhile. A reader whose setup names a landing area (its
cache is on a GPU) is written there, the order's rows back to back, instead of into its cache's rows.

Writes run one at a time on one thread (the notification thread only hands them over); at most
``max_queued`` orders wait, more are answered ``may_read`` at once. At most ``max_readers`` readers are kept (the
oldest set up is dropped: its next order is answered ``may_read`` and ``setup_again``, and the reader sets up anew).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from pd_transfer.affinity import unpinning
from pd_transfer.connector import messages
from pd_transfer.connector.leases import Freed, LeaseLedger
from pd_transfer.topology.plan import SourcePlan
from pd_transfer.transfer.agent import DescriptorList
from pd_transfer.transfer.agent_protocol import Agent, AgentFactory
from pd_transfer.transfer.errors import TransferError

from .push_plans import MAX_PUSH_ROWS, PushPlanError, check_rows_inside, plan_from_wire
from .push_staging import PushStager, StagedChunk

logger = logging.getLogger(__name__)

#: Longest reason sent back (characters).
MAX_REASON_CHARS = 500


@dataclass
class _Reader:
    """A decode rank set up for pushing: its plan's source for this rank, and both grids prepared."""

    engine_id: str
    rank: int
    plan: SourcePlan
    ours: DescriptorList  # the plan's remote grid: rows of our cache (staged: the pool's rows)
    theirs: DescriptorList  # the plan's local grid: rows of the reader's cache (or its landing area's rows)
    landing_rows: int = 0  # > 0: ``theirs`` is the reader's landing area, written back to back, this many rows

    def release(self) -> None:
        self.ours.release()
        self.theirs.release()


class PushWriter:
    """Push for prefill rank ``tp_rank``, whose agent is ``owner``, whose cache is ``spans`` ((start, end) byte
    ranges) and whose ``ledger`` holds the requests. ``on_written(peer, done)`` is called after each write that
    landed, with the ``ReadDone`` it stands for; ``on_freed(freed)`` for a request an unpin freed. ``staging``:
    push through its host pool (required for a cache on a GPU, which the writing agent then never registers).
    ``agent_factory``: makes the writing agent (the owner's factory)."""

    def __init__(
        self,
        owner: Agent,
        ledger: LeaseLedger,
        tp_rank: int,
        spans: list[tuple[int, int]],
        *,
        on_written: Callable[[str, messages.ReadDone], None],
        on_freed: Callable[[Freed], None],
        max_readers: int = 256,
        max_queued: int = 1024,
        accepting: bool = True,
        staging: PushStager | None = None,
        agent_factory: AgentFactory,
    ) -> None:
        self.owner = owner
        self._agent_factory = agent_factory
        self.staging = staging
        self.accepting = accepting  # False: every setup is refused (push mode "off" on the prefill)
        self._writer: Agent | None = None  # made on the first setup, on the writer thread
        self.ledger = ledger
        self.tp_rank = tp_rank
        self.spans = spans
        self._on_written = on_written
        self._on_freed = on_freed
        self.max_readers = max_readers
        self._max_queued = max_queued
        self._readers: OrderedDict[str, _Reader] = OrderedDict()  # touched only on the writer thread
        self._peers: OrderedDict[str, None] = OrderedDict()  # loaded in the writer agent, oldest first (likewise)
        self._queued = 0
        self._queued_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(
            1, thread_name_prefix="pd-transfer-push", initializer=unpinning(owner.settings.thread_cpu_set)
        )
        self.writes = 0

    # ------------------------------------------------------------------ the notification thread
    def on_message(self, peer: str, message: messages.PushSetup | messages.PushOrder) -> None:
        """Hand a reader's setup or order to the writer thread (never blocks)."""
        with self._queued_lock:
            full = self._queued >= self._max_queued
            if not full:
                self._queued += 1
        if full:
            if isinstance(message, messages.PushOrder):
                self._refuse(peer, message.request_id, f"{self._max_queued} orders queued already", may_read=True)
            return
        try:
            self._pool.submit(self._handle, peer, message, time.monotonic())
        except RuntimeError:  # closed
            with self._queued_lock:
                self._queued -= 1

    def _handle(self, peer: str, message: messages.PushSetup | messages.PushOrder, arrived: float) -> None:
        try:
            if isinstance(message, messages.PushSetup):
                self._setup(peer, message)
            else:
                self._order(peer, message, arrived)
        except Exception:
            logger.exception("prefill %s: push %s from %s failed", self.owner.name, type(message).__name__, peer)
        finally:
            with self._queued_lock:
                self._queued -= 1

    # ------------------------------------------------------------------ setup
    def _writer_agent(self) -> Agent:
        """The agent that writes (and answers), with the cache registered: made once."""
        if self._writer is None:
            writer = self._agent_factory(f"{self.owner.name}-push", settings=self.owner.settings)
            try:
                spans = self.spans if self.staging is None else [self.staging.pool_span()]
                writer.register_spans(spans, huge_pages=False)
            except Exception:
                writer.close()
                raise
            self._writer = writer
        return self._writer

    def _setup(self, peer: str, setup: messages.PushSetup) -> None:
        name = self.owner.name
        if not self.accepting:
            self._refuse_setup(peer, setup, "push is off on this prefill (its push mode is off)")
            return
        try:
            writer = self._writer_agent()
            added = writer.add_peer(setup.agent_metadata)
        except (TransferError, ValueError) as error:
            logger.warning("prefill %s: push setup of %s failed (it will read): %s", name, peer, error)
            return
        if added != peer:  # not the sender's own metadata: nobody to answer
            logger.warning("prefill %s: the push setup of %s carries agent %s's metadata; dropped", name, peer, added)
            writer.remove_peer(added)
            return
        try:
            reader = self._make_reader(peer, setup, writer)
        except (PushPlanError, TransferError, ValueError) as error:
            logger.warning("prefill %s: push setup of %s refused: %s", name, peer, error)
            self._send(peer, messages.PushReady(prefill_agent=name, ok=False, reason=str(error)[:MAX_REASON_CHARS]))
            return
        old = self._readers.pop(peer, None)
        if old is not None:
            old.release()
        self._readers[peer] = reader
        while len(self._readers) > self.max_readers:  # the oldest set up goes; its next order asks for a new setup
            _, dropped = self._readers.popitem(last=False)
            dropped.release()
        self._peers[peer] = None  # peers stay loaded longer than readers, to answer them; bounded too
        self._peers.move_to_end(peer)
        while len(self._peers) > 4 * self.max_readers:
            gone, _ = self._peers.popitem(last=False)
            if gone not in self._readers:
                writer.remove_peer(gone)
        logger.info("prefill %s: pushes to %s (engine %s, rank %d)", name, peer, reader.engine_id, reader.rank)
        self._send(peer, messages.PushReady(prefill_agent=name, ok=True, reason=""))

    def _refuse_setup(self, peer: str, setup: messages.PushSetup, reason: str) -> None:
        """Answer a setup with a refusal from the rank's own agent (no writing agent is made for it)."""
        try:
            if self.owner.add_peer(setup.agent_metadata) != peer:
                return
            refusal = messages.PushReady(prefill_agent=self.owner.name, ok=False, reason=reason)
            self.owner.notify(peer, messages.encode(refusal))
        except TransferError as error:
            logger.info("prefill %s: could not refuse the push setup of %s: %s", self.owner.name, peer, error)

    def _make_reader(self, peer: str, setup: messages.PushSetup, writer: Agent) -> _Reader:
        plan = plan_from_wire(setup.plan)
        if plan.remote_rank != self.tp_rank:
            raise PushPlanError(f"the plan is for prefill rank {plan.remote_rank}, this is rank {self.tp_rank}")
        check_rows_inside(plan.remote_grid, self.spans, "the prefill's rows")
        target = plan.local_grid
        if setup.landing_rows:
            target = landing_grid(setup.landing_address, setup.landing_rows, plan.unit_bytes)
        ours = writer.prepare_local(
            plan.remote_grid if self.staging is None else self.staging.pool_rows(plan.unit_bytes)
        )
        try:
            theirs = writer.prepare_remote(peer, target)
        except Exception:
            ours.release()
            raise
        return _Reader(setup.reader_engine_id, setup.reader_rank, plan, ours, theirs, max(0, setup.landing_rows))

    # ------------------------------------------------------------------ orders
    def _order(self, peer: str, order: messages.PushOrder, arrived: float) -> None:
        reader = self._readers.get(peer)
        if reader is None:
            self._refuse(peer, order.request_id, "no push setup from this reader", may_read=True, setup_again=True)
            return
        try:
            their_rows, our_rows = reader.plan.indices(order.remote_block_ids, order.local_block_ids, order.num_tokens)
        except ValueError as error:
            self._refuse(peer, order.request_id, f"malformed order: {error}", may_read=False)
            return
        if reader.landing_rows and len(their_rows) > reader.landing_rows:
            why = f"{len(their_rows)} rows do not fit the reader's landing area of {reader.landing_rows}"
            self._refuse(peer, order.request_id, why, may_read=True)
            return
        why = self.ledger.pin(order.request_id, order.remote_block_ids)
        if why:
            self._refuse(peer, order.request_id, why, may_read=True)
            return
        try:
            timeout_s = order.timeout_ms / 1000.0 - (time.monotonic() - arrived)
            if timeout_s <= 0:
                raise TransferError(f"the order's {order.timeout_ms} ms had passed before its turn")
            done = messages.encode(
                messages.PushOutcome(prefill_agent=self.owner.name, request_id=order.request_id, ok=True)
            )
            writer = self._writer_agent()
            if self.staging is None and not reader.landing_rows:
                writer.write(reader.ours, our_rows, reader.theirs, their_rows, notification=done, timeout_s=timeout_s)
            else:
                self._write_staged(peer, writer, reader, our_rows, their_rows, done, timeout_s)
        except (TransferError, ValueError, RuntimeError) as error:  # RuntimeError: the device's, while staging
            self._unpin(order.request_id)
            self._refuse(peer, order.request_id, f"the write failed: {error}", may_read=True)
            return
        self._unpin(order.request_id)
        self.writes += 1
        written = messages.ReadDone(
            request_id=order.request_id,
            reader_engine_id=reader.engine_id,
            reader_rank=reader.rank,
            expected_readers=order.expected_readers,
        )
        self._on_written(peer, written)

    def _write_staged(
        self,
        peer: str,
        writer: Agent,
        reader: _Reader,
        our_rows: np.ndarray,
        their_rows: np.ndarray,
        done: bytes,
        timeout_s: float,
    ) -> None:
        """Write rows ``our_rows`` of our grid to rows ``their_rows`` of the reader's (to its landing area back to
        back, if it has one) through the stager's pool, a chunk per WRITE; the last WRITE carries ``done``. Without a
        stager (a host cache written into a landing area), one WRITE from the cache. Raises ``TransferError`` (a
        write failed, or the deadline passed), ``ValueError`` or the device's ``RuntimeError``."""
        deadline = time.perf_counter() + timeout_s
        targets = np.arange(len(their_rows), dtype=np.int64) if reader.landing_rows else their_rows
        if self.staging is None:
            writer.write(reader.ours, our_rows, reader.theirs, targets, notification=done, timeout_s=timeout_s)
            return

        def send(chunk: StagedChunk) -> None:
            left = deadline - time.perf_counter()
            if left <= 0:
                raise TransferError(f"the order's time ran out after {chunk.start} of {len(targets)} rows")
            notification = done if chunk.last else b""
            theirs = targets[chunk.start : chunk.end]
            writer.write(reader.ours, chunk.pool_rows, reader.theirs, theirs, notification=notification, timeout_s=left)

        sources = reader.plan.remote_grid[np.asarray(our_rows, dtype=np.int64), 0].astype(np.int64)
        if self.staging.push(sources, reader.plan.unit_bytes, deadline, send) == 0:  # no rows: the outcome alone
            writer.notify(peer, done)

    def _unpin(self, request_id: str) -> None:
        freed = self.ledger.unpin(request_id)
        if freed is not None:
            self._on_freed(freed)

    def _refuse(self, peer: str, request_id: str, reason: str, *, may_read: bool, setup_again: bool = False) -> None:
        name = self.owner.name
        logger.info("prefill %s: request %s: not pushed to %s: %s", name, request_id, peer, reason[:200])
        reason = reason[:MAX_REASON_CHARS]
        outcome = messages.PushOutcome(
            prefill_agent=name,
            request_id=request_id,
            ok=False,
            reason=reason,
            may_read=may_read,
            setup_again=setup_again,
        )
        self._send(peer, outcome)

    def _send(self, peer: str, message: messages.PeerMessage) -> None:
        """Answer ``peer`` from the writing agent (best effort: the reader's wait is bounded)."""
        try:
            if self._writer is None or not self._writer.has_peer(peer):
                raise TransferError("no setup from it was taken")
            self._writer.notify(peer, messages.encode(message))
        except TransferError as error:
            logger.info("prefill %s: could not answer %s: %s", self.owner.name, peer, error)

    def close(self) -> None:
        """Finish the write under way, drop queued orders, release the readers' lists."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        for reader in self._readers.values():
            reader.release()
        self._readers.clear()
        if self._writer is not None:
            self._writer.close()


def landing_grid(address: int, rows: int, row_bytes: int) -> np.ndarray:
    """Descriptor rows (N x 3 uint64) of a reader's landing area: ``rows`` rows of ``row_bytes`` back to back from
    ``address``. Raises :class:`PushPlanError` for an area that is empty, too large or not addressable."""
    if not 0 < rows <= MAX_PUSH_ROWS or address <= 0 or address + rows * row_bytes >= 1 << 64:
        raise PushPlanError(f"a landing area of {rows} rows of {row_bytes} bytes at {address:#x}")
    grid = np.zeros((rows, 3), dtype=np.uint64)
    grid[:, 0] = np.uint64(address) + np.arange(rows, dtype=np.uint64) * np.uint64(row_bytes)
    grid[:, 1] = row_bytes
    return grid
