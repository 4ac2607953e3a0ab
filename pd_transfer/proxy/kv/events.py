"""The engines' KV events, read from vLLM's ZMQ publisher (``--kv-events-config``), into a :class:`KvIndex`.

The wire (vLLM 0.31-0.32, ``vllm/distributed/kv_events.py``; decoded here with msgspec, without importing vLLM):

* a PUB socket sends ``(topic, seq, payload)``: ``seq`` an 8-byte big-endian counter from 0, one per batch;
  ``payload`` the msgpack of a batch, an array ``[ts, events, data_parallel_rank]``; each event a map tagged by
  ``type``: ``BlockStored`` (``block_hashes``, ``parent_block_hash``, ``token_ids``, ``block_size``, ``medium``,
  ...), ``BlockRemoved`` (``block_hashes``, ``medium``) or ``AllBlocksCleared``;
* a ROUTER socket (``replay_endpoint``) answers a request carrying a start ``seq`` (8 bytes, big-endian) with every
  batch it still buffers from that one on, as ``(topic, seq, payload)``, then ``("", -1, "")``.

:class:`EventStream` keeps one engine's sequence: the next batch is applied; a batch past a gap first asks the
replay endpoint for the missing ones (healed when it still has them all; otherwise the engine's entries are dropped,
since removals may be among the lost batches, and the stream goes on from there); a batch numbered lower than
expected (outside a replay's duplicates) is a restarted publisher: the engine's entries are dropped, then rebuilt
from the new stream. The first batch a stream sees is a gap from 0 (the publisher's buffer fills in what it still
has). :class:`EventSubscriber` runs one stream on the event loop; a stream silent for ``silence_s`` asks the replay
endpoint for anything past its last batch: an answer proves the engine alive (and heals what was missed), no answer
(or no replay endpoint) drops its entries until it speaks again.

Every event's ``block_size`` must equal the proxy's, and a first block's hash must be the one the proxy computes from
its tokens (:meth:`BlockHasher.mismatch`): an engine whose hashes the proxy cannot reproduce is refused, its events
ignored, with one error naming the settings to fix (a kv_aware score built from them would never match a request).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Union

import msgspec
import zmq
import zmq.asyncio

from pd_transfer.proxy.kv.block_hash import BlockHasher
from pd_transfer.proxy.kv.index import KvIndex

log = logging.getLogger(__name__)

#: The largest batch accepted (bytes); ZMQ drops a bigger message's connection (MAXMSGSIZE).
MAX_BATCH_BYTES = 64 * 2**20
END_SEQ = -1
FAULTS = ("gap_healed", "gap_lost", "restart", "silent", "bad_batch", "hash_mismatch")


class BlockStored(msgspec.Struct, tag=True):
    block_hashes: list[Union[bytes, int]]
    parent_block_hash: Union[bytes, int, None] = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: Union[int, None] = None
    medium: Union[str, None] = None
    lora_name: Union[str, None] = None
    extra_keys: Union[list[Any], None] = None
    group_idx: Union[int, None] = None


class BlockRemoved(msgspec.Struct, tag=True):
    block_hashes: list[Union[bytes, int]]
    medium: Union[str, None] = None
    group_idx: Union[int, None] = None


class AllBlocksCleared(msgspec.Struct, tag=True):
    pass


Event = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[Event]
    data_parallel_rank: Union[int, None] = None


_decoder = msgspec.msgpack.Decoder(Batch)


class BadBatch(ValueError):
    """A payload that is not a vLLM KV event batch."""


def decode_batch(payload: bytes) -> Batch:
    if len(payload) > MAX_BATCH_BYTES:
        raise BadBatch(f"a KV event batch of {len(payload)} bytes (limit {MAX_BATCH_BYTES})")
    try:
        return _decoder.decode(payload)
    except msgspec.DecodeError as e:
        raise BadBatch(f"not a vLLM KV event batch: {str(e)[:120]}") from None


def seq_of(raw: bytes) -> int:
    if len(raw) != 8:
        raise BadBatch(f"a sequence number of {len(raw)} bytes (expected 8)")
    return int.from_bytes(raw, "big", signed=True)


@dataclass
class StreamStats:
    batches: int = 0
    events: int = 0
    faults: dict[str, int] | None = None

    def fault(self, kind: str) -> None:
        if self.faults is None:
            self.faults = {}
        self.faults[kind] = self.faults.get(kind, 0) + 1


Replay = Callable[[int], Awaitable[list[tuple[int, bytes]] | None]]


class EventStream:
    """One engine's event sequence into ``index`` (named ``engine`` there), hash-checked with ``hasher``.

    :meth:`receive` takes a live ``(seq, payload)``; the ``replay`` it is given, ``start -> list[(seq, payload)] |
    None`` (async), returns the batches the publisher still buffers from ``start`` on, or None when its replay
    endpoint did not answer (or there is none). ``on_fault(kind)`` is told of each fault (:data:`FAULTS`)."""

    def __init__(
        self,
        engine: str,
        index: KvIndex,
        hasher: BlockHasher,
        on_fault: Callable[[str], None] | None = None,
    ) -> None:
        self.engine = engine
        self.index = index
        self.hasher = hasher
        self.expected: int | None = None  # the next seq; None before the first batch (or after a drop)
        self.refused: str | None = None  # why this engine's hashes cannot be used, once found
        self.stats = StreamStats()
        self._on_fault = on_fault
        self._checked = False
        # live batches a replay already brought: (first, last) seq; cleared by the next batch applied in order
        self._duplicates: tuple[int, int] | None = None

    def fault(self, kind: str) -> None:
        self.stats.fault(kind)
        if self._on_fault is not None:
            self._on_fault(kind)

    async def receive(self, seq: int, payload: bytes, replay: Replay) -> None:
        """A live batch."""
        expected = self.expected
        if expected is not None and seq < expected:
            duplicates = self._duplicates
            if duplicates is not None and duplicates[0] <= seq <= duplicates[1]:
                return  # a replay brought it before its live copy came
            log.warning(
                "KV events of %s restarted (batch %d after %d): dropping its index entries",
                self.engine,
                seq,
                expected - 1,
            )
            self.fault("restart")
            self.index.drop(self.engine)
            self.expected = expected = None
        self._duplicates = None
        if expected is None:
            if seq > 0:  # joined late (or a restart's first batches went by): what the publisher still buffers
                await self._heal(0, seq, replay, first=True)
            else:
                self.expected = 0
        elif seq > expected:
            await self._heal(expected, seq, replay, first=False)
        if self.expected is not None and seq < self.expected:
            return  # the replay brought this one
        self._apply(seq, payload)

    async def idle(self, replay: Replay) -> None:
        """The stream was silent: asks the replay endpoint for anything past the last batch. An answer proves the
        engine alive (and brings what the live stream lost); none drops the engine's entries."""
        start = 0 if self.expected is None else self.expected
        batches = await replay(start)
        if batches is None:
            if self.expected is not None or self.index.blocks_of(self.engine):
                log.warning(
                    "KV events of %s: silent, and no answer from its replay endpoint; dropping its entries", self.engine
                )
                self.fault("silent")
                self.index.drop(self.engine)
            self.expected = None
            return
        got = sorted(b for b in batches if b[0] >= start)
        if got:
            last = got[-1][0]
            await self._heal(start, last + 1, replay, first=self.expected is None, batches=got)

    async def _heal(
        self, start: int, upto: int, replay: Replay, *, first: bool, batches: list[tuple[int, bytes]] | None = None
    ) -> None:
        """Batches ``start..upto-1`` were missed: applied from the replay endpoint when it still has them all; when it
        does not, the engine's entries go (removals may be among the lost batches) unless the stream is new."""
        got = batches if batches is not None else sorted(b for b in (await replay(start) or []) if b[0] >= start)
        if got and got[0][0] == start:
            if not first:
                self.fault("gap_healed")
        elif not first:
            log.warning(
                "KV events of %s: batches from %d lost and not replayable; dropping its index entries",
                self.engine,
                start,
            )
            self.fault("gap_lost")
            self.index.drop(self.engine)
        self.expected = got[0][0] if got else upto
        for seq, payload in got:
            if seq == self.expected:
                self._apply(seq, payload)
        if got:
            self._duplicates = (got[0][0], got[-1][0])

    def _apply(self, seq: int, payload: bytes) -> None:
        self.expected = seq + 1
        try:
            batch = decode_batch(payload)
        except BadBatch as e:
            log.warning("KV events of %s: batch %d skipped: %s", self.engine, seq, e)
            self.fault("bad_batch")
            return
        self.stats.batches += 1
        if self.refused is not None:
            return
        index, engine = self.index, self.engine
        for event in batch.events:
            self.stats.events += 1
            if isinstance(event, BlockStored):
                if event.group_idx not in (None, 0) or event.lora_name is not None or event.lora_id is not None:
                    continue  # another KV cache group's blocks, or a LoRA's: no plain prompt hashes to them
                if not self._checked and event.extra_keys is None and not self._check(event):
                    return
                index.stored(engine, event.block_hashes, event.medium)
            elif isinstance(event, BlockRemoved):
                if event.group_idx not in (None, 0):
                    continue
                index.removed(engine, event.block_hashes, event.medium)
            else:
                index.cleared(engine)

    def _check(self, event: BlockStored) -> bool:
        """Whether ``event`` may be indexed: False (and the engine refused, with one error) when it shows hashes the
        proxy cannot reproduce. One first block (no parent) checked is enough."""
        why = self.hasher.mismatch(event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size)
        if why is None:
            if event.parent_block_hash is None and event.block_hashes and len(event.token_ids) >= event.block_size:
                self._checked = True
            return True
        self.refused = why
        log.error("KV events of %s are ignored: %s", self.engine, why)
        self.fault("hash_mismatch")
        self.index.drop(self.engine)
        return False


@dataclass(frozen=True)
class EventSource:
    """Where an engine (``backend``: its URL in the proxy's pools) publishes: ``endpoint`` (PUB) and optionally
    ``replay`` (ROUTER)."""

    backend: str
    endpoint: str
    replay: str | None = None

    @classmethod
    def parse(cls, text: str) -> EventSource:
        """``URL=tcp://host:port[,tcp://host:replay_port]``."""
        backend, sep, where = text.rpartition("=")
        parts = where.split(",")
        if not sep or not backend or len(parts) > 2 or not all(p.startswith(("tcp://", "ipc://")) for p in parts):
            raise ValueError(f"a KV event source is URL=tcp://HOST:PORT[,tcp://HOST:REPLAY_PORT], got {text[:120]!r}")
        return cls(backend.rstrip("/"), parts[0], parts[1] if len(parts) == 2 else None)


class EventSubscriber:
    """Reads one :class:`EventSource` into ``stream`` until :meth:`close` (an asyncio task of its own)."""

    def __init__(
        self,
        source: EventSource,
        stream: EventStream,
        context: zmq.asyncio.Context,
        silence_s: float = 30.0,
        replay_timeout_s: float = 2.0,
        topic: str = "",
    ) -> None:
        self.source = source
        self.stream = stream
        self.silence_s = silence_s
        self.replay_timeout_s = replay_timeout_s
        self._context = context
        self._topic = topic.encode()
        self._sub = context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.MAXMSGSIZE, MAX_BATCH_BYTES)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        self._sub.connect(source.endpoint)
        self._replay: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self.last_heard = time.monotonic()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"pd-proxy-kv-events-{self.source.backend}")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        self._sub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
            self._replay = None

    async def _run(self) -> None:
        while True:
            try:
                await self.step(self.silence_s)
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug here must not end the stream
                log.exception("KV events of %s: reading failed", self.source.backend)

    async def step(self, timeout_s: float) -> bool:
        """Read and apply one live batch, waiting at most ``timeout_s``; on silence probe the replay endpoint.
        True when a batch came."""
        frames = await self.next_frames(timeout_s)
        if frames is None:
            await self.stream.idle(self.replay)
            return False
        await self.handle(frames)
        return True

    async def next_frames(self, timeout_s: float) -> list[bytes] | None:
        """The next live message's frames, or None after ``timeout_s`` without one."""
        if not await self._sub.poll(timeout_s * 1000):
            return None
        frames: list[bytes] = await self._sub.recv_multipart()
        self.last_heard = time.monotonic()
        return frames

    async def handle(self, frames: list[bytes]) -> None:
        """One live message: ``(topic, seq, payload)``."""
        if len(frames) != 3:
            self.stream.fault("bad_batch")
            return
        try:
            seq = seq_of(frames[1])
        except BadBatch:
            self.stream.fault("bad_batch")
            return
        await self.stream.receive(seq, frames[2], self.replay)

    async def replay(self, start: int) -> list[tuple[int, bytes]] | None:
        """The batches the publisher still buffers from ``start`` on; None when it has no replay endpoint or it did
        not answer within ``replay_timeout_s``."""
        if self.source.replay is None:
            return None
        if self._replay is None:
            self._replay = self._context.socket(zmq.DEALER)
            self._replay.setsockopt(zmq.MAXMSGSIZE, MAX_BATCH_BYTES)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.connect(self.source.replay)
        sock = self._replay
        out: list[tuple[int, bytes]] = []
        try:
            async with asyncio.timeout(self.replay_timeout_s):
                await sock.send_multipart((b"", max(0, start).to_bytes(8, "big")))
                while True:
                    frames = await sock.recv_multipart()
                    if len(frames) != 4:
                        continue
                    seq = seq_of(frames[2])
                    if seq == END_SEQ:
                        return out
                    out.append((seq, frames[3]))
        except (TimeoutError, BadBatch):
            # a late answer must not be read as the next request's: a fresh socket for the next one
            sock.close(linger=0)
            self._replay = None
            return None
