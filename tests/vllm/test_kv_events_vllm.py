"""The proxy's KV event subscriber against vLLM's own publisher (``ZmqEventPublisher``, in this process: no server):
batches published before the subscriber joined and a batch lost on the way are healed from the replay endpoint, a
restarted publisher empties the engine's index before refilling it, a publisher gone silent is dropped; vLLM's block
hashes (its ``hash_block_tokens``, all four algorithms) are the ones the proxy computes. Every wait is bounded."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import zmq.asyncio

from pd_transfer.proxy.kv.block_hash import BlockHasher
from pd_transfer.proxy.kv.events import EventSource, EventStream, EventSubscriber
from pd_transfer.proxy.kv.index import KvIndex

pytestmark = pytest.mark.timeout(60)

BLOCK = 16
ENGINE = "http://127.0.0.1:8100"


def vllm_hashes(tokens: Sequence[int], algorithm: str = "sha256") -> list[bytes]:
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    hash_fn = get_hash_fn_by_name(algorithm)
    kv_cache_utils.init_none_hash(hash_fn)
    out: list[bytes] = []
    parent = None
    for i in range(len(tokens) // BLOCK):
        parent = kv_cache_utils.hash_block_tokens(hash_fn, parent, tokens[i * BLOCK : (i + 1) * BLOCK])
        out.append(bytes(parent))
    return out


@pytest.mark.parametrize("algorithm", ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"])
def test_the_proxy_hashes_blocks_as_vllm_does(algorithm: str, monkeypatch: pytest.MonkeyPatch) -> None:
    seed = "4242" if algorithm.startswith("xxhash") else None
    if seed is not None:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    else:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    tokens = [*range(49_000, 49_040), 0, 1, 2**17, *range(30)]  # 73 tokens: 4 full blocks
    assert BlockHasher(algorithm, seed, BLOCK).hashes(tokens) == vllm_hashes(tokens, algorithm)


def stored(tokens: Sequence[int], medium: str = "GPU") -> Any:
    from vllm.distributed.kv_events import BlockStored

    return BlockStored(
        block_hashes=vllm_hashes(tokens),
        parent_block_hash=None,
        token_ids=list(tokens),
        block_size=BLOCK,
        lora_id=None,
        medium=medium,
        lora_name=None,
    )


class Engine:
    """A vLLM publisher on ipc endpoints under ``folder``; ``publish`` sends one batch of events."""

    def __init__(self, folder: Path) -> None:
        from vllm.distributed.kv_events import ZmqEventPublisher

        self.endpoint, self.replay = f"ipc://{folder}/pub", f"ipc://{folder}/replay"
        self.publisher = ZmqEventPublisher(0, endpoint=self.endpoint, replay_endpoint=self.replay, buffer_steps=100)

    def publish(self, *events: Any) -> None:
        from vllm.distributed.kv_events import KVEventBatch

        self.publisher.publish(KVEventBatch(ts=time.time(), events=list(events)))

    def close(self) -> None:
        self.publisher.shutdown()


def prompt(i: int, blocks: int = 2) -> list[int]:
    return [1000 * i + t for t in range(BLOCK * blocks)]


def held(index: KvIndex, tokens: Sequence[int], hasher: BlockHasher) -> int:
    return index.match(hasher.keys(tokens), [ENGINE])[ENGINE].blocks


async def until(condition: Any, subscriber: EventSubscriber, deadline_s: float = 10.0) -> None:
    """Read batches until ``condition()`` holds (bounded: each read by 0.5 s, the whole by ``deadline_s``)."""
    deadline = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < deadline, "the subscriber did not reach the expected state in time"
        await subscriber.step(0.5)


async def publish_until(engine: Engine, subscriber: EventSubscriber, heard: Any, first: int) -> int:
    """Publish ``prompt(first)``, ``prompt(first + 1)``, ... reading 0.2 s after each, until ``heard()`` (a SUB
    socket joins at some point); bounded by 200 batches. Returns how many were published."""
    n = 0
    while not heard():
        engine.publish(stored(prompt(first + n)))
        n += 1
        await subscriber.step(0.2)
        assert n < 200, "the subscriber never heard the publisher"
    return n


def test_subscriber_heals_from_replay_follows_a_restart_and_drops_a_silent_engine(tmp_path: Path) -> None:
    hasher = BlockHasher("sha256", None, BLOCK)
    index = KvIndex(10_000)
    stream = EventStream(ENGINE, index, hasher)
    engine = Engine(tmp_path)
    try:
        # published before anyone listens: only the replay buffer has them
        engine.publish(stored(prompt(0)))
        engine.publish(stored(prompt(1), "CPU"))

        async def go() -> None:
            context = zmq.asyncio.Context()
            subscriber = EventSubscriber(
                EventSource(ENGINE, engine.endpoint, engine.replay), stream, context, replay_timeout_s=2.0
            )
            try:
                # the SUB socket joins at some point: keep publishing until a batch arrives live
                sent = 2 + await publish_until(engine, subscriber, lambda: stream.expected is not None, 2)
                await until(lambda: stream.expected == sent, subscriber)
                assert all(held(index, prompt(i), hasher) == 2 for i in range(sent))
                assert index.match(hasher.keys(prompt(1)), [ENGINE])[ENGINE].by_tier == {"host": 2}
                # a batch lost on the way (read and thrown away here): the next one heals it from the replay
                from vllm.distributed.kv_events import BlockRemoved

                engine.publish(BlockRemoved(block_hashes=vllm_hashes(prompt(0)), medium="GPU"))
                assert await subscriber.next_frames(5.0) is not None  # lost
                engine.publish(stored(prompt(500)))
                await until(lambda: stream.expected == sent + 2, subscriber)
                assert held(index, prompt(0), hasher) == 0 and held(index, prompt(500), hasher) == 2
                assert stream.stats.faults == {"gap_healed": 1}

                # the engine restarts: a new publisher on the same endpoints, counting from 0
                engine.close()
                restarted = Engine(tmp_path)
                try:
                    n = await publish_until(
                        restarted, subscriber, lambda: bool((stream.stats.faults or {}).get("restart")), 1000
                    )
                    await until(lambda: stream.expected == n, subscriber)
                    assert held(index, prompt(500), hasher) == 0  # the old incarnation's blocks are gone
                    assert all(held(index, prompt(1000 + i), hasher) == 2 for i in range(n))
                finally:
                    restarted.close()
                # gone silent, its replay endpoint with it: dropped
                subscriber.replay_timeout_s = 0.5
                assert not await subscriber.step(0.2)
                assert len(index) == 0 and stream.stats.faults["silent"] == 1
            finally:
                await subscriber.close()
                context.term()

        asyncio.run(go())
    finally:
        engine.close()


def test_events_with_another_seed_are_refused_naming_the_fix(tmp_path: Path) -> None:
    index = KvIndex(1000)
    stream = EventStream(ENGINE, index, BlockHasher("sha256", "not-the-engines-seed", BLOCK))
    engine = Engine(tmp_path)

    async def go() -> None:
        context = zmq.asyncio.Context()
        subscriber = EventSubscriber(EventSource(ENGINE, engine.endpoint, engine.replay), stream, context)
        try:
            await publish_until(engine, subscriber, lambda: stream.expected is not None, 0)
        finally:
            await subscriber.close()
            context.term()

    try:
        asyncio.run(go())
    finally:
        engine.close()
    assert stream.refused is not None and "--kv-hash-seed" in stream.refused
    assert len(index) == 0 and stream.stats.faults == {"hash_mismatch": 1}
