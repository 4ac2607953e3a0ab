"""A transport added through the recipe of docs/architecture.md ("Adding a transport") and nothing else: a toy reader
(the prefill lives in this process, so its rows are copied with ``memmove``, address to address) implementing
``Reader``, a claim that picks the engines it reads, both handed to a decode rank with ``add_reader``. The pull then
goes by the toy: verified bytes, its name on the pull's stats and metrics, the lease confirmed and the blocks freed, the
reader closed with the rank. No connector module is edited or patched for it."""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable, Iterable, Iterator

import pytest
from in_process_prefill import InProcessPrefill

from pd_transfer.connector.cache import KVCache
from pd_transfer.connector.decode.options import DecodeOptions
from pd_transfer.connector.decode.rank import DecodeRank
from pd_transfer.connector.decode.reads import ReadTotals
from pd_transfer.connector.decode.remote_engines import RemoteEngine, SourceRank
from pd_transfer.connector.decode.request import PullRequest
from pd_transfer.handshake.messages import EngineMetadata
from pd_transfer.metrics import TransferMetrics
from pd_transfer.settings import DEFAULTS
from pd_transfer.sim.verify import received_correctly
from pd_transfer.spec import KVCacheLayout, ModelFingerprint
from pd_transfer.transfer.agent_protocol import AgentFactory

MODEL = ModelFingerprint(model="toy-reader", dtype="float16", num_layers=2, total_num_kv_heads=2, head_size=16)
LAYOUT = KVCacheLayout(fingerprint=MODEL, tp_size=1, tp_rank=0, block_size=16)
BLOCKS = 32
TOY = "toy_memmove"


class MemmoveReader:
    """A toy transport for a prefill in this process: each row of the plan copied with ``memmove``, then the
    prefill ranks told (``ReadDone``, through ``tell_read``)."""

    def __init__(self, tell_read: Callable[[Iterable[SourceRank], str], None]) -> None:
        self._tell_read = tell_read
        self.requests: list[str] = []
        self.closed = False

    def read(self, remote: RemoteEngine, request: PullRequest, deadline: float, *, pushed: bool) -> ReadTotals:
        if remote.plan.postprocess is not None:
            raise ValueError("the toy reader moves rows straight into place only")
        started = time.perf_counter()
        rows = [
            plan.addresses(request.remote_block_ids, request.local_block_ids, request.num_tokens)
            for plan in remote.plan.sources
        ]  # all of them first: block ids that do not fit the plan raise before anything moves
        moved = 0
        for plan, (local, theirs) in zip(remote.plan.sources, rows, strict=True):
            for to, source in zip(local.tolist(), theirs.tolist(), strict=True):
                ctypes.memmove(to, source, plan.unit_bytes)
            moved += len(local) * plan.unit_bytes
        self._tell_read(remote.sources, request.request_id)
        self.requests.append(request.request_id)
        return ReadTotals(
            bytes=moved,
            descriptors=sum(len(local) for local, _ in rows),
            read_seconds=time.perf_counter() - started,
            postprocess_seconds=0.0,
            postprocess_exposed_seconds=0.0,
        )

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def prefill(agent_factory: AgentFactory) -> Iterator[InProcessPrefill]:
    made = InProcessPrefill(f"toy-prefill-{time.monotonic_ns()}", LAYOUT, BLOCKS, agent_factory, seed=11)
    try:
        yield made
    finally:
        made.close()


@pytest.fixture
def decode(agent_factory: AgentFactory) -> Iterator[DecodeRank]:
    rank = DecodeRank(
        f"toy-decode-{time.monotonic_ns()}",
        KVCache.allocate(LAYOUT, BLOCKS),
        DecodeOptions(settings=DEFAULTS),
        metrics=TransferMetrics(),
        agent_factory=agent_factory,
    )
    try:
        yield rank
    finally:
        rank.close()


def claims(engine_id: str) -> Callable[[EngineMetadata], bool]:
    return lambda engine: engine.engine_id == engine_id


def test_a_toy_reader_added_by_the_recipe_moves_the_pull(prefill: InProcessPrefill, decode: DecodeRank) -> None:
    toy = MemmoveReader(decode.reports.tell_read)
    decode.add_reader(TOY, toy, claims(prefill.engine_id))
    remote_ids, local_ids, tokens = [9, 2, 30, 17], [4, 0, 21, 13], 16 * 3 + 5
    prefill.rank.hold("toy-1", remote_ids)
    stats = decode.pull_confirmed("toy-1", prefill.host, prefill.port, remote_ids, local_ids, tokens)
    assert toy.requests == ["toy-1"]
    assert stats.transport == TOY and stats.bytes > 0
    assert received_correctly(decode.cache, local_ids, prefill.expected(), remote_ids, tokens)
    assert decode.metrics.registry.get_sample_value("pd_transfer_pulls_total", {"outcome": "ok", "transport": TOY}) == 1
    assert prefill.rank.ledger.readers_complete("toy-1") is not None  # every reader reported (confirmed)
    assert prefill.rank.ledger.blocks_held == 0  # so the blocks are free


def test_block_ids_outside_the_plan_are_refused_before_the_toy_moves_anything(
    prefill: InProcessPrefill, decode: DecodeRank
) -> None:
    toy = MemmoveReader(decode.reports.tell_read)
    decode.add_reader(TOY, toy, claims(prefill.engine_id))
    before = [tensor.clone() for tensor in decode.cache.tensors]
    prefill.rank.hold("toy-bad", [1, 2])
    with pytest.raises(ValueError):
        decode.pull("toy-bad", prefill.host, prefill.port, [1, BLOCKS + 5], [3, 4], 20)
    assert toy.requests == [] and all(a.equal(b) for a, b in zip(before, decode.cache.tensors, strict=True))


def test_an_engine_the_claim_does_not_take_goes_by_the_built_in_choice(
    prefill: InProcessPrefill, decode: DecodeRank
) -> None:
    toy = MemmoveReader(decode.reports.tell_read)
    decode.add_reader(TOY, toy, claims("another-engine"))
    prefill.rank.hold("not-toy", [5])
    stats = decode.pull_confirmed("not-toy", prefill.host, prefill.port, [5], [6], 16)
    assert stats.transport != TOY and toy.requests == []


def test_a_reader_name_is_taken_once_and_the_rank_closes_its_readers(agent_factory: AgentFactory) -> None:
    rank = DecodeRank(
        "toy-close", KVCache.allocate(LAYOUT, BLOCKS), DecodeOptions(settings=DEFAULTS), agent_factory=agent_factory
    )
    toy = MemmoveReader(rank.reports.tell_read)
    rank.add_reader(TOY, toy, claims("e"))
    with pytest.raises(ValueError, match="already"):
        rank.add_reader(TOY, MemmoveReader(rank.reports.tell_read), claims("e"))
    with pytest.raises(ValueError, match="already"):
        rank.add_reader("nixl", MemmoveReader(rank.reports.tell_read), claims("e"))
    rank.close()
    assert toy.closed
