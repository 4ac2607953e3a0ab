"""Streamed requests through the connector's engine-agnostic halves (issue 41): a prefill engine (``SchedulerSide``
with its side channel, one ``WorkerSide``) and a decode engine (the same) in this process, both on the ``tcp``
transport (their NIXL agents are the fake fabric's: tests/unit/conftest.py), driven step by step as engines drive them
(:mod:`pd_transfer.sim.kv_prefill` wires a prefill the same way).

The decode's scheduler makes the stream ``RecvSpec`` from the decode leg's params and its worker starts the load on its
stream threads; the prefill's scheduler announces the request it computes (``reqs_computing``), its worker offers each
layer as ``layers_saved`` says it is written, then holds the request. The decode receives every layer, bit for bit, and
the prefill gets its blocks back once the decode reported. A streamed request the prefill aborts mid-stream fails the
decode's load at once (not at its read timeout). Every wait is bounded."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
import torch

from pd_transfer.connector.cache import KVCache
from pd_transfer.connector.config import ConnectorConfig
from pd_transfer.connector.metadata import StepMetadata
from pd_transfer.connector.scheduler import SchedulerSide
from pd_transfer.connector.worker import LoadOutcome, WorkerSide
from pd_transfer.metrics import TransferMetrics
from pd_transfer.proxy import flow
from pd_transfer.settings import DEFAULTS
from pd_transfer.sim.peer import fill_pattern
from pd_transfer.sim.verify import logical, received_correctly
from pd_transfer.spec import KVCacheLayout, ModelFingerprint
from pd_transfer.transfer.agent_protocol import AgentFactory

LAYERS = 4
BLOCK = 16
MODEL = ModelFingerprint(model="stream-worker", dtype="float16", num_layers=LAYERS, total_num_kv_heads=2, head_size=16)
LAYOUT = KVCacheLayout(fingerprint=MODEL, tp_size=1, tp_rank=0, block_size=BLOCK)
BLOCKS = 32
SEED = 7
REMOTE, LOCAL, TOKENS = [9, 2, 30, 17], [4, 0, 21, 13], BLOCK * 3 + 5
WAIT_S = 10.0  # the bound on every wait here (each ends far sooner)
READ_TIMEOUT_S = 30.0  # a load's own bound: longer than WAIT_S, so that a stream left waiting fails the test's wait


def config(**overrides: object) -> ConnectorConfig:
    settings: dict[str, object] = {
        "side_channel_host": "127.0.0.1",
        "side_channel_port": 0,
        "transport": "tcp",
        "handshake_timeout_s": 5.0,
        "read_timeout_s": READ_TIMEOUT_S,
        "confirm_timeout_s": 5.0,
    }
    settings.update(overrides)
    return ConnectorConfig.from_dict(settings, env={}, settings=DEFAULTS)


def until(condition: Callable[[], bool], what: str) -> None:
    """Bounded: until ``condition()`` holds, looking again every few milliseconds."""
    deadline = time.monotonic() + WAIT_S
    pause = threading.Event()  # never set: a bounded pause between looks
    while not condition():
        assert time.monotonic() < deadline, f"not in time: {what}"
        pause.wait(0.002)


@dataclass
class Engine:
    """One TP 1 engine as the connector sees it: its scheduler side and its worker, and what the worker reported."""

    engine_id: str
    scheduler: SchedulerSide
    worker: WorkerSide
    sent: set[str] = field(default_factory=set)
    received: set[str] = field(default_factory=set)
    load_errors: set[int] = field(default_factory=set)

    def step(self, before: Callable[[], None] = lambda: None) -> StepMetadata:
        """One engine step: ``before`` (what the engine's scheduler does this step), the metadata to the worker, the
        worker's results back to the scheduler."""
        before()
        metadata = self.scheduler.build_step_metadata()
        self.worker.start_load(metadata)
        self.collect()
        return metadata

    def collect(self) -> None:
        output = self.worker.step_output()
        self.sent |= output.finished_sending
        self.received |= output.finished_recving
        self.load_errors |= output.load_error_block_ids
        self.scheduler.update_connector_output(
            output.finished_sending, output.finished_recving, output.load_error_block_ids, output.failed_recving
        )

    def outcome(self, request_id: str) -> LoadOutcome:
        (outcome,) = [outcome for outcome in self.worker.outcomes if outcome.request_id == request_id]
        return outcome

    def close(self) -> None:
        self.scheduler.close()
        self.worker.close()


def engine(engine_id: str, cache: KVCache, agent_factory: AgentFactory, *, side_channel: bool) -> Engine:
    settings = config()
    worker = WorkerSide(
        engine_id, cache, settings, settings=DEFAULTS, agent_factory=agent_factory, metrics=TransferMetrics()
    )
    scheduler = SchedulerSide(settings, engine_id=engine_id, block_size=BLOCK)
    if side_channel:
        scheduler.start_side_channel([worker.rank_metadata])
    return Engine(engine_id, scheduler, worker)


def expected() -> KVCache:
    """What the prefill's cache holds (the same pattern, made again)."""
    cache = KVCache.allocate(LAYOUT, BLOCKS)
    fill_pattern(cache, SEED)
    return cache


@pytest.fixture
def prefill(agent_factory: AgentFactory) -> Iterator[Engine]:
    made = engine(f"stream-p-{time.monotonic_ns()}", expected(), agent_factory, side_channel=True)
    try:
        yield made
    finally:
        made.close()


@pytest.fixture
def decode(agent_factory: AgentFactory) -> Iterator[Engine]:
    made = engine(
        f"stream-d-{time.monotonic_ns()}", KVCache.allocate(LAYOUT, BLOCKS), agent_factory, side_channel=False
    )
    try:
        yield made
    finally:
        made.close()


def decode_leg(prefill: Engine, stream_id: str) -> dict[str, object]:
    """The decode's params for a request streamed from ``prefill`` (what the proxy sends, the engine learnt earlier)."""
    port = prefill.scheduler.side_channel_port
    assert port is not None
    target = flow.stream_target(
        {
            "remote_engine_id": prefill.engine_id,
            "remote_host": "127.0.0.1",
            "remote_port": port,
            "tp_size": 1,
            "remote_block_size": BLOCK,
        }
    )
    assert target is not None
    return flow.stream_params(target, stream_id)


def start_decode(decode: Engine, request_id: str, params: dict[str, object]) -> None:
    """The decode schedules ``request_id`` (its whole prompt to load, into LOCAL) and its worker starts the stream."""

    def schedule() -> None:
        decode.scheduler.on_new_request(request_id, params, prompt_len=TOKENS)
        assert decode.scheduler.get_num_new_matched_tokens(request_id, TOKENS, 0, params) == (TOKENS, True)
        decode.scheduler.update_state_after_alloc(request_id, LOCAL, TOKENS)

    metadata = decode.step(schedule)
    spec = metadata.reqs_to_recv[request_id]
    assert spec.stream and spec.remote_block_ids == () and spec.local_block_ids == tuple(LOCAL)


def layer_arrived(decode: Engine, layer: int) -> bool:
    """Whether the decode's cache holds every token of layer ``layer`` (K and V) as the prefill's."""
    have = logical(decode.worker.cache, LOCAL, TOKENS)
    want = logical(expected(), REMOTE, TOKENS)
    planes = len(have) // LAYERS  # planes are ordered by layer, then kind
    rows = slice(layer * planes, (layer + 1) * planes)
    return torch.equal(have[rows].view(torch.int16), want[rows].view(torch.int16))


def received(decode: Engine, request_id: str) -> bool:
    decode.collect()
    return request_id in decode.received


def sent(prefill: Engine, request_id: str) -> bool:
    prefill.collect()
    return request_id in prefill.sent


def finish_prefill(prefill: Engine, request_id: str, params: dict[str, object]) -> dict[str, object]:
    """The prefill's request finished (one token): held for its decode, the hold started by the next step."""
    delay, answer = prefill.scheduler.request_finished(request_id, REMOTE, "length", params, num_computed_tokens=TOKENS)
    assert delay is True and answer is not None
    metadata = prefill.step()
    assert metadata.reqs_to_hold == {request_id: tuple(REMOTE)}
    return answer


def test_a_request_streamed_layer_by_layer_through_both_engines(prefill: Engine, decode: Engine) -> None:
    start_decode(decode, "d-1", decode_leg(prefill, "stream-1"))  # the decode asks first: both legs sent at once
    params = {"do_remote_decode": True, "do_remote_prefill": False, "stream_id": "stream-1"}

    def compute() -> None:
        prefill.scheduler.on_new_request("p-1", params, prompt_len=TOKENS)
        prefill.scheduler.computing("p-1", REMOTE)

    metadata = prefill.step(compute)
    assert set(metadata.reqs_computing) == {"p-1"}
    for written in range(1, LAYERS + 1):
        prefill.worker.layers_saved(written)  # the layer's attention wrote its KV
        until(lambda: layer_arrived(decode, written - 1), f"layer {written - 1} arrives")  # noqa: B023
        assert not any(layer_arrived(decode, later) for later in range(written, LAYERS))  # not yet written
        assert not received(decode, "d-1")  # not held yet: the stream goes on
    answer = finish_prefill(prefill, "p-1", params)
    assert answer["remote_request_id"] == "p-1" and answer["remote_block_ids"] == [list(REMOTE)]

    until(lambda: received(decode, "d-1"), "the decode received the request")
    outcome = decode.outcome("d-1")
    assert outcome.ok, outcome.error
    assert outcome.stats is not None and outcome.stats.layers_streamed == LAYERS and outcome.stats.transport == "tcp"
    assert outcome.stats.bytes > 0 and outcome.local_block_ids == tuple(LOCAL)
    assert received_correctly(decode.worker.cache, LOCAL, [expected()], REMOTE, TOKENS)
    assert not decode.load_errors

    until(lambda: sent(prefill, "p-1"), "the prefill's blocks are free")
    assert prefill.scheduler.holding == 0 and prefill.worker.prefill.ledger.blocks_held == 0
    assert prefill.worker.prefill.ledger.status("p-1") == "read"
    assert prefill.scheduler.release_held("stream-1") is False  # forgotten with its blocks
    decode.scheduler.request_finished("d-1", LOCAL, "stop", decode_leg(prefill, "stream-1"))
    assert decode.step().empty


def test_a_request_the_prefill_finished_before_the_decode_asked_is_streamed_at_once(
    prefill: Engine, decode: Engine
) -> None:
    params = {"do_remote_decode": True, "do_remote_prefill": False, "stream_id": "stream-late"}

    def compute() -> None:
        prefill.scheduler.on_new_request("p-late", params, prompt_len=TOKENS)
        prefill.scheduler.computing("p-late", REMOTE)

    prefill.step(compute)
    prefill.worker.layers_saved(LAYERS)
    finish_prefill(prefill, "p-late", params)
    start_decode(decode, "d-late", decode_leg(prefill, "stream-late"))
    until(lambda: received(decode, "d-late"), "the decode received the request")
    outcome = decode.outcome("d-late")
    assert outcome.ok, outcome.error
    assert outcome.stats is not None and outcome.stats.layers_streamed == LAYERS
    assert received_correctly(decode.worker.cache, LOCAL, [expected()], REMOTE, TOKENS)
    until(lambda: sent(prefill, "p-late"), "the prefill's blocks are free")
    assert prefill.scheduler.holding == 0


def test_a_streamed_request_the_prefill_aborts_mid_stream_fails_the_load_at_once(
    prefill: Engine, decode: Engine
) -> None:
    start_decode(decode, "d-abort", decode_leg(prefill, "stream-abort"))
    params = {"do_remote_decode": True, "do_remote_prefill": False, "stream_id": "stream-abort"}

    def compute() -> None:
        prefill.scheduler.on_new_request("p-abort", params, prompt_len=TOKENS)
        prefill.scheduler.computing("p-abort", REMOTE)

    prefill.step(compute)
    prefill.worker.layers_saved(1)
    until(lambda: layer_arrived(decode, 0), "layer 0 arrives")
    # the client went away: the engine aborts the request, whose blocks are its own again (not held)
    assert prefill.scheduler.request_finished("p-abort", REMOTE, "abort", params) == (False, None)
    prefill.step()
    until(lambda: received(decode, "d-abort"), "the decode gave the stream up")  # well before its read timeout
    outcome = decode.outcome("d-abort")
    assert not outcome.ok and "aborted" in outcome.error, outcome.error
    assert decode.load_errors == set(LOCAL)  # policy recompute: the decode computes the prompt itself
    assert prefill.scheduler.holding == 0 and prefill.worker.prefill.ledger.blocks_held == 0


def test_a_decode_that_computes_the_prompt_itself_frees_the_held_request_by_its_stream_id(
    prefill: Engine, decode: Engine
) -> None:
    params = {"do_remote_decode": True, "do_remote_prefill": False, "stream_id": "stream-unread"}

    def compute() -> None:
        prefill.scheduler.on_new_request("p-unread", params, prompt_len=TOKENS)
        prefill.scheduler.computing("p-unread", REMOTE)

    prefill.step(compute)
    prefill.worker.layers_saved(LAYERS)
    finish_prefill(prefill, "p-unread", params)
    assert prefill.scheduler.holding == 1
    leg = decode_leg(prefill, "stream-unread")

    def local_hit() -> None:  # the decode holds the whole prompt already
        assert decode.scheduler.get_num_new_matched_tokens("d-unread", TOKENS, TOKENS, leg) == (0, False)
        decode.scheduler.update_state_after_alloc("d-unread", [], 0)

    metadata = decode.step(local_hit)
    assert not metadata.reqs_to_recv and metadata.reqs_to_release["d-unread"].remote_request_id == "stream-unread"
    until(lambda: sent(prefill, "p-unread"), "the prefill's blocks are free")  # not at the lease's end
    assert prefill.scheduler.holding == 0 and prefill.worker.prefill.ledger.blocks_held == 0
