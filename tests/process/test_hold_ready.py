"""A prefill exposes a request's blocks only after the work that wrote them finished: the engine hands the worker a
"KV written" event after each computing step (``WorkerSide.step_computed``), and a hold started later waits for it
before its lease begins. Here the event is a gate opened by the test (a GPU engine's is a ``torch.cuda.Event``:
tests/gpu); the worker and its NIXL agent are real."""

from __future__ import annotations

import threading

import pytest
from engine_specs import FINGERPRINT, decode_config, layouts

from pd_transfer.connector.cache import KVCache
from pd_transfer.connector.metadata import StepMetadata
from pd_transfer.connector.worker import WorkerSide
from pd_transfer.settings import DEFAULTS

pytestmark = pytest.mark.timeout(60)
WAIT_S = 20.0


class Gate:
    """A ready event the test completes: ``synchronize`` says it was entered, then blocks until ``open``."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self._opened = threading.Event()

    def synchronize(self) -> None:
        self.entered.set()
        assert self._opened.wait(WAIT_S), "the gate was never opened"

    def open(self) -> None:
        self._opened.set()


def test_a_hold_begins_only_once_the_step_s_kv_is_written() -> None:
    worker = WorkerSide(
        "ready-prefill", KVCache.allocate(layouts(FINGERPRINT, 1)[0], 16), decode_config(), settings=DEFAULTS
    )
    try:
        gate = Gate()
        worker.step_computed(gate)
        step = StepMetadata(reqs_to_hold={"written-later": (1, 2, 3)})
        holding = threading.Thread(target=worker.start_load, args=(step,))
        holding.start()
        assert gate.entered.wait(WAIT_S), "the hold did not wait for the step's event"
        assert worker.prefill.ledger.held_requests == 0  # not offered to readers while the kernels run
        gate.open()
        holding.join(WAIT_S)
        assert not holding.is_alive()
        assert worker.prefill.ledger.held_requests == 1 and worker.prefill.ledger.blocks_held == 3
    finally:
        worker.close()


def test_without_an_event_a_hold_begins_at_once() -> None:
    worker = WorkerSide(
        "ready-cpu-prefill", KVCache.allocate(layouts(FINGERPRINT, 1)[0], 16), decode_config(), settings=DEFAULTS
    )
    try:
        worker.start_load(StepMetadata(reqs_to_hold={"written": (4,)}))
        assert worker.prefill.ledger.held_requests == 1
    finally:
        worker.close()
