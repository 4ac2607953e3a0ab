"""The kv_aware index and one engine's event stream: tiers, removals, bounds, gaps healed or not, restarts, silence,
hashes the proxy cannot reproduce; and the index's memory under 1,000,000 distinct blocks (printed, not asserted
against a time). The stream against vLLM's own publisher: tests/vllm/test_kv_events_vllm.py."""

from __future__ import annotations

import asyncio
import itertools
import sys
from collections.abc import Sequence

import msgspec
import pytest
import xxhash

from pd_transfer.proxy.kv.block_hash import BlockHasher, HashConfigError, block_key
from pd_transfer.proxy.kv.events import BadBatch, EventSource, EventStream, decode_batch
from pd_transfer.proxy.kv.index import KvIndex
from pd_transfer.proxy.routing.prefix_tree import PrefixTree

BLOCK = 4
HASHER = BlockHasher("sha256", None, BLOCK)
ENGINE = "http://p0"


def stored(tokens: Sequence[int], medium: str | None = "GPU", parent: bytes | None = None) -> dict[str, object]:
    hashes: list[bytes] = []
    for i in range(len(tokens) // BLOCK):
        parent = HASHER.block_hash(parent, tokens[i * BLOCK : (i + 1) * BLOCK])
        hashes.append(parent)
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": None,
        "token_ids": list(tokens),
        "block_size": BLOCK,
        "lora_id": None,
        "medium": medium,
        "lora_name": None,
    }


def removed(hashes: Sequence[bytes | int], medium: str | None = "GPU") -> dict[str, object]:
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": medium}


def batch(*events: dict[str, object]) -> bytes:
    """A batch as vLLM's publisher encodes it (msgpack: [ts, events, data_parallel_rank])."""
    return msgspec.msgpack.encode([1.0, list(events), 0])


class Publisher:
    """What a publisher's replay endpoint would answer: its buffered (seq, payload)."""

    def __init__(self) -> None:
        self.buffer: list[tuple[int, bytes]] = []
        self.answering = True
        self.asked: list[int] = []

    def add(self, payload: bytes) -> tuple[int, bytes]:
        seq = len(self.buffer)
        self.buffer.append((seq, payload))
        return seq, payload

    async def replay(self, start: int) -> list[tuple[int, bytes]] | None:
        self.asked.append(start)
        return [b for b in self.buffer if b[0] >= start] if self.answering else None


def matched(index: KvIndex, tokens: Sequence[int], engine: str = ENGINE) -> dict[str, int]:
    return index.match(HASHER.keys(tokens), [engine])[engine].by_tier


def test_index_tracks_tiers_and_removals() -> None:
    index = KvIndex(1000)
    tokens = list(range(16))
    hashes = HASHER.hashes(tokens)
    index.stored(ENGINE, hashes, "GPU")
    index.stored(ENGINE, hashes[:2], "CPU")
    assert matched(index, tokens) == {"engine": 4}
    index.removed(ENGINE, hashes[1:], "GPU")  # block 1 still in the host tier
    assert matched(index, tokens) == {"engine": 1, "host": 1}
    index.cleared(ENGINE)
    assert matched(index, tokens) == {"host": 2} and len(index) == 2
    # int hashes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES: the last 8 bytes) name the same blocks
    index.removed(ENGINE, [int.from_bytes(h[-8:], "big") for h in hashes[:2]], "CPU")
    assert matched(index, tokens) == {} and len(index) == 0


def test_local_disk_credits_only_its_engine() -> None:
    index = KvIndex(1000, shared_disk=False)
    tokens = list(range(8))
    index.stored(ENGINE, HASHER.hashes(tokens), "DISK")
    assert matched(index, tokens) == {"disk": 2} and matched(index, tokens, "http://p1") == {}


def test_index_is_bounded_dropping_the_oldest_stored() -> None:
    index = KvIndex(max_blocks=800)
    for i in range(1000):
        index.stored(ENGINE, [i.to_bytes(32, "big")], "GPU")
        assert len(index) <= 800
    assert index.trimmed >= 200
    assert index.match([block_key((999).to_bytes(32, "big"))], [ENGINE])[ENGINE].blocks == 1
    assert index.match([block_key((0).to_bytes(32, "big"))], [ENGINE])[ENGINE].blocks == 0


def test_drop_forgets_an_engine_including_its_directory_reports() -> None:
    index = KvIndex(1000)
    tokens = list(range(8))
    index.stored(ENGINE, HASHER.hashes(tokens), "GPU")
    index.stored(ENGINE, HASHER.hashes(tokens), "DISK")
    index.stored("http://p1", HASHER.hashes(tokens)[:1], "DISK")
    index.drop(ENGINE)
    assert matched(index, tokens, "http://p1") == {"shared": 1}  # p1's report of block 0 stands
    assert matched(index, tokens, "http://p2") == {}  # an engine that never stored there does not mount it
    assert len(index) == 1


def run(coro: object) -> None:
    asyncio.run(coro)  # type: ignore[arg-type]


def test_stream_applies_in_order_and_heals_a_gap_from_replay() -> None:
    index, publisher = KvIndex(1000), Publisher()
    stream = EventStream(ENGINE, index, HASHER)
    one, two, three = list(range(8)), list(range(100, 108)), list(range(200, 208))

    async def go() -> None:
        await stream.receive(*publisher.add(batch(stored(one))), publisher.replay)
        publisher.add(batch(stored(two)))  # lost on the way
        publisher.add(batch(removed(HASHER.hashes(one)[1:])))  # lost too
        await stream.receive(*publisher.add(batch(stored(three))), publisher.replay)
        # the lost batches' live copies arriving late are duplicates, not a restart
        await stream.receive(*publisher.buffer[2], publisher.replay)

    run(go())
    assert publisher.asked == [1]
    assert (matched(index, one), matched(index, two), matched(index, three)) == (
        {"engine": 1},
        {"engine": 2},
        {"engine": 2},
    )
    assert stream.stats.faults == {"gap_healed": 1} and stream.expected == 4


def test_stream_joining_late_reads_the_publishers_buffer() -> None:
    index, publisher = KvIndex(1000), Publisher()
    stream = EventStream(ENGINE, index, HASHER)
    publisher.add(batch(stored(list(range(8)))))
    run(stream.receive(*publisher.add(batch(stored(list(range(50, 58))))), publisher.replay))
    assert publisher.asked == [0] and len(index) == 4 and stream.stats.faults is None


def test_stream_drops_the_engine_on_an_unhealable_gap_and_on_a_restart() -> None:
    index, publisher = KvIndex(1000), Publisher()
    stream = EventStream(ENGINE, index, HASHER)
    one, two = list(range(8)), list(range(100, 108))

    async def go() -> None:
        await stream.receive(*publisher.add(batch(stored(one))), publisher.replay)
        publisher.add(batch(removed(HASHER.hashes(one))))  # lost, and gone from the buffer
        publisher.buffer[1] = (-5, b"")
        await stream.receive(*publisher.add(batch(stored(two))), publisher.replay)
        assert stream.stats.faults == {"gap_lost": 1}
        assert (matched(index, one), matched(index, two)) == ({}, {"engine": 2})
        # the engine restarts: its publisher counts from 0 again
        restarted = Publisher()
        await stream.receive(*restarted.add(batch(stored(one))), restarted.replay)

    run(go())
    assert stream.stats.faults == {"gap_lost": 1, "restart": 1}
    assert (matched(index, one), matched(index, two)) == ({"engine": 2}, {})


def test_a_silent_stream_is_probed_and_dropped_when_nobody_answers() -> None:
    index, publisher = KvIndex(1000), Publisher()
    stream = EventStream(ENGINE, index, HASHER)

    async def go() -> None:
        await stream.receive(*publisher.add(batch(stored(list(range(8))))), publisher.replay)
        await stream.idle(publisher.replay)  # alive, nothing new
        assert len(index) == 2
        publisher.add(batch(stored(list(range(20, 28)))))  # the live copy was lost; the probe brings it
        await stream.idle(publisher.replay)
        assert len(index) == 4 and stream.expected == 2
        publisher.answering = False
        await stream.idle(publisher.replay)

    run(go())
    assert len(index) == 0 and stream.expected is None
    assert stream.stats.faults == {"gap_healed": 1, "silent": 1}  # the probe healed the loss, then found no one


def test_hashes_the_proxy_cannot_reproduce_are_refused_with_the_reason() -> None:
    index = KvIndex(1000)
    stream = EventStream(ENGINE, index, BlockHasher("sha256", "another-seed", BLOCK))
    run(stream.receive(0, batch(stored(list(range(8)))), Publisher().replay))
    assert stream.refused is not None and "--kv-hash-seed" in stream.refused and len(index) == 0
    sized = EventStream(ENGINE, index, BlockHasher("sha256", None, 16))
    run(sized.receive(0, batch(stored(list(range(8)))), Publisher().replay))
    assert sized.refused is not None and "--kv-block-size" in sized.refused
    with pytest.raises(HashConfigError, match="PYTHONHASHSEED"):
        BlockHasher("xxhash")
    with pytest.raises(HashConfigError, match="unknown"):
        BlockHasher("md5")


def test_bad_input_is_refused_clearly() -> None:
    with pytest.raises(BadBatch, match="not a vLLM KV event batch"):
        decode_batch(b"\x93\x01")
    stream = EventStream(ENGINE, KvIndex(1000), HASHER)
    run(stream.receive(0, b"garbage", Publisher().replay))
    assert stream.stats.faults == {"bad_batch": 1}
    assert EventSource.parse("http://h:8100/=tcp://h:5557,tcp://h:5558") == EventSource(
        "http://h:8100", "tcp://h:5557", "tcp://h:5558"
    )
    with pytest.raises(ValueError, match="URL=tcp"):
        EventSource.parse("http://h:8100=http://h:5557")


def footprint(table: dict[int, int]) -> int:
    """Bytes a dict of int keys holds: its table and its keys (the values are small ints, which CPython keeps once)."""
    assert all(-5 <= v <= 256 for v in itertools.islice(table.values(), 1000))
    return sys.getsizeof(table) + sum(map(sys.getsizeof, table))


def test_memory_of_the_index_and_the_tree_under_a_million_blocks() -> None:
    """Prints the bytes the KV index and the prefix tree hold for 1,000,000 distinct blocks (and that the bounds
    hold past them): the figures docs/proxy.md gives."""
    million = 1_000_000
    index = KvIndex(max_blocks=4 * million)
    for start in range(0, million, 10_000):  # events of 10,000 blocks of 32-byte hashes, 2 engines
        hashes = [i.to_bytes(32, "big") for i in range(start, start + 10_000)]
        index.stored("http://p0" if start % 20_000 else "http://p1", hashes, "GPU")
    assert len(index) == million
    index_bytes = sum(footprint(t) for t in index._engines.values())  # noqa: SLF001
    tree = PrefixTree(million)
    for start in range(0, million, 1000):
        tree.insert([xxhash.xxh3_64_intdigest(i.to_bytes(8, "big")) for i in range(start, start + 1000)], start % 4)
    assert len(tree) == million
    tree_bytes = footprint(tree._nodes)  # noqa: SLF001
    print(f"\nKV index, 1,000,000 blocks: {index_bytes / million:.0f} B/block, {index_bytes / 2**20:.1f} MiB")
    print(f"prefix tree, 1,000,000 nodes: {tree_bytes / million:.0f} B/node, {tree_bytes / 2**20:.1f} MiB")
    assert index_bytes < 200 * million and tree_bytes < 200 * million
    bounded = KvIndex(max_blocks=20_000)
    for start in range(0, 200_000, 10_000):
        bounded.stored(ENGINE, [i.to_bytes(32, "big") for i in range(start, start + 10_000)], "GPU")
    assert len(bounded) <= 20_000
