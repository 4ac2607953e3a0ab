"""The offload manager alone (a pure state machine) and the block keys: store, evict under the budget,
blocks in flight never evicted, events, typed errors; a hypothesis state machine checks the invariants
after every step of random operation sequences."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pd_transfer.offload import (
    BlocksEvicted,
    BlocksStored,
    OffloadInputError,
    OffloadManager,
    OffloadMetrics,
    OffloadStateError,
    chain_block_keys,
)
from pd_transfer.spec import ModelFingerprint

MODEL = ModelFingerprint(model="m", dtype="bfloat16", num_layers=2, total_num_kv_heads=2, head_size=8)
OTHER = ModelFingerprint(model="m-other", dtype="bfloat16", num_layers=2, total_num_kv_heads=2, head_size=8)
BLOCK_BYTES = 1000
KEYS = chain_block_keys(MODEL, list(range(16 * 12)), 16)


def manager(blocks: int = 4, **kwargs: object) -> OffloadManager:
    return OffloadManager("host", blocks * BLOCK_BYTES + 7, BLOCK_BYTES, **kwargs)  # type: ignore[arg-type]


def stored(m: OffloadManager, keys: list[bytes]) -> None:
    plan = m.prepare_store(keys)
    assert plan is not None
    m.complete_store(plan.blocks.keys)


# ---------------------------------------------------------------------- keys
def test_keys_chain_a_prefix_and_name_the_model() -> None:
    tokens = list(range(100, 100 + 16 * 4 + 5))
    keys = chain_block_keys(MODEL, tokens, 16)
    assert len(keys) == 4 and len(set(keys)) == 4  # the partial block has no key
    assert chain_block_keys(MODEL, tokens[:32], 16) == keys[:2]  # a shared prefix hits
    assert chain_block_keys(MODEL, tokens[32:], 16, parent=keys[1]) == keys[2:]  # a chain continues
    assert not set(chain_block_keys(OTHER, tokens, 16)) & set(keys)  # another model never does
    changed = tokens.copy()
    changed[20] += 1  # block 1 differs: it and every later block get other keys
    other = chain_block_keys(MODEL, changed, 16)
    assert other[0] == keys[0] and not set(other[1:]) & set(keys)
    assert chain_block_keys(MODEL, tokens[16:32], 16) != keys[1:2]  # same tokens, no prefix: another key


@pytest.mark.parametrize(
    ("tokens", "block_size", "parent"),
    [([1, 2], 0, None), ([-1, 2], 2, None), ([2**63, 1], 2, None), ([1, 2], 2, b"short")],
)
def test_bad_key_input_is_a_typed_error(tokens: list[int], block_size: int, parent: bytes | None) -> None:
    with pytest.raises(OffloadInputError):
        chain_block_keys(MODEL, tokens, block_size, parent=parent)


# ---------------------------------------------------------------------- manager
def test_store_then_lookup_load_and_events() -> None:
    m = manager()
    plan = m.prepare_store(KEYS[:3])
    assert plan is not None and plan.blocks.keys == tuple(KEYS[:3]) and len(set(plan.blocks.rows)) == 3
    assert m.lookup(KEYS[:3]) == 0  # being stored: not loadable yet
    m.complete_store(KEYS[:3])
    assert m.take_events() == [BlocksStored("host", tuple(KEYS[:3]))]
    assert m.lookup(KEYS[:5]) == 3 and m.lookup(KEYS[1:3]) == 2
    blocks = m.prepare_load(KEYS[:2])
    assert blocks.rows == plan.blocks.rows[:2] and m.state(KEYS[0]) == "loading"
    m.complete_load(KEYS[:2])
    assert m.state(KEYS[0]) == "ready" and m.bytes_held == 3 * BLOCK_BYTES
    again = m.prepare_store(KEYS[:4])  # held blocks are skipped
    assert again is not None and again.blocks.keys == (KEYS[3],)


def test_lru_eviction_under_the_budget() -> None:
    m = manager(blocks=3)
    stored(m, KEYS[:3])
    assert m.lookup(KEYS[:1]) == 1  # block 0 used: block 1 is now the least recently used
    plan = m.prepare_store(KEYS[3:5])
    assert plan is not None and plan.evicted == (KEYS[1], KEYS[2])
    assert m.bytes_held == 3 * BLOCK_BYTES <= m.capacity_bytes
    events = m.take_events()
    assert [e.keys for e in events if isinstance(e, BlocksEvicted)] == [(KEYS[1],), (KEYS[2],)]
    assert set(plan.blocks.rows) == {m.rows()[KEYS[1 + 2]], m.rows()[KEYS[4]]}


def test_blocks_in_flight_are_never_evicted() -> None:
    m = manager(blocks=3)
    stored(m, KEYS[:2])
    m.prepare_load(KEYS[:2])  # both pinned
    assert m.prepare_store(KEYS[2:3]) is not None  # a free row: fine
    before = m.rows()
    assert m.prepare_store(KEYS[3:4]) is None  # only pinned or storing blocks left: refused
    assert m.rows() == before and m.take_events() == [BlocksStored("host", tuple(KEYS[:2]))]
    m.complete_load(KEYS[:1])
    plan = m.prepare_store(KEYS[3:4])
    assert plan is not None and plan.evicted == (KEYS[0],)


def test_a_failed_store_frees_its_rows_without_an_event() -> None:
    m = manager(blocks=2)
    plan = m.prepare_store(KEYS[:2])
    assert plan is not None
    m.complete_store(KEYS[:2], success=False)
    assert m.blocks_held == 0 and m.take_events() == [] and m.lookup(KEYS[:1]) == 0
    assert m.prepare_store(KEYS[2:4]) is not None


def test_bad_calls_raise_typed_errors_and_change_nothing() -> None:
    m = manager()
    stored(m, KEYS[:1])
    m.prepare_store(KEYS[1:2])
    before = (m.rows(), m.state(KEYS[0]), m.state(KEYS[1]))
    with pytest.raises(OffloadStateError):
        m.prepare_load([KEYS[0], KEYS[1]])  # block 1 is still being stored
    with pytest.raises(OffloadStateError):
        m.complete_load(KEYS[:1])  # never prepared
    with pytest.raises(OffloadStateError):
        m.complete_store([KEYS[0], KEYS[1]])  # block 0 was stored already
    with pytest.raises(OffloadInputError):
        m.lookup([b"not a key"])
    with pytest.raises(OffloadInputError):
        OffloadManager("host", 10, 100)
    assert (m.rows(), m.state(KEYS[0]), m.state(KEYS[1])) == before


def test_probe_adopts_blocks_stored_elsewhere_and_invalidate_drops_them() -> None:
    elsewhere = set(KEYS[:3])
    m = OffloadManager("disk", 2 * BLOCK_BYTES, BLOCK_BYTES, probe=lambda key, _file: key in elsewhere)
    assert m.lookup(KEYS[:4]) == 3  # the third adoption evicts the first: the budget holds
    assert m.blocks_held == 2
    assert m.invalidate([KEYS[2]]) == [KEYS[2]] and m.state(KEYS[2]) == "absent"
    kinds = [type(e).__name__ for e in m.take_events()]
    assert kinds == ["BlocksStored", "BlocksStored", "BlocksEvicted", "BlocksStored", "BlocksEvicted"]


def test_hits_misses_evictions_and_held_bytes_are_counted() -> None:
    metrics = OffloadMetrics()
    m = manager(blocks=2, metrics=metrics)
    stored(m, KEYS[:2])
    m.lookup(KEYS[:4])
    m.prepare_store(KEYS[4:5])
    value = metrics.registry.get_sample_value
    assert value("pd_transfer_offload_hits_total", {"tier": "host"}) == 2
    assert value("pd_transfer_offload_misses_total", {"tier": "host"}) == 2
    assert value("pd_transfer_offload_evictions_total", {"tier": "host"}) == 1
    assert value("pd_transfer_offload_held_bytes", {"tier": "host"}) == 2 * BLOCK_BYTES


# ---------------------------------------------------------------------- invariants under random sequences
UNIVERSE = KEYS[:8]


class ManagerMachine(RuleBasedStateMachine):
    """Random operations on a 4-block manager, mirrored by a model of what was announced and pinned."""

    def __init__(self) -> None:
        super().__init__()
        self.m = manager(blocks=4)
        self.announced: set[bytes] = set()
        self.storing: list[tuple[bytes, ...]] = []
        self.pins: list[bytes] = []

    def _drain_events(self) -> None:
        for event in self.m.take_events():
            for key in event.keys:
                if isinstance(event, BlocksStored):
                    assert key not in self.announced
                    self.announced.add(key)
                else:
                    assert key in self.announced and key not in self.pins
                    self.announced.remove(key)

    @rule(keys=st.lists(st.sampled_from(UNIVERSE), max_size=5))
    def store(self, keys: list[bytes]) -> None:
        in_flight = {k for group in self.storing for k in group} | set(self.pins)
        plan = self.m.prepare_store(keys)
        if plan is None:
            return
        assert not set(plan.evicted) & in_flight
        if plan.blocks.keys:
            self.storing.append(plan.blocks.keys)

    @precondition(lambda self: self.storing)
    @rule(index=st.integers(0, 10), success=st.booleans())
    def finish_store(self, index: int, success: bool) -> None:
        self.m.complete_store(self.storing.pop(index % len(self.storing)), success=success)

    @rule(keys=st.lists(st.sampled_from(UNIVERSE), min_size=1, max_size=3))
    def load(self, keys: list[bytes]) -> None:
        if self.m.lookup(keys) < len(keys):
            return
        self.m.prepare_load(keys)
        self.pins.extend(keys)

    @precondition(lambda self: self.pins)
    @rule(index=st.integers(0, 10))
    def finish_load(self, index: int) -> None:
        self.m.complete_load([self.pins.pop(index % len(self.pins))])

    @invariant()
    def budget_rows_and_events_agree(self) -> None:
        self._drain_events()
        rows = self.m.rows()
        assert self.m.bytes_held == len(rows) * BLOCK_BYTES <= self.m.capacity_bytes
        assert len(set(rows.values())) == len(rows) and all(0 <= r < self.m.capacity_blocks for r in rows.values())
        for key in self.pins:
            assert self.m.state(key) == "loading"
        for group in self.storing:
            assert all(self.m.state(key) == "storing" for key in group)
        ready = {key for key in rows if self.m.state(key) in ("ready", "loading")}
        assert ready == self.announced


ManagerMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_manager_invariants_hold_under_random_operations = ManagerMachine.TestCase
