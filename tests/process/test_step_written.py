"""A worker exposes blocks (holds them for readers) only after the step that wrote them finished writing: the engine
hands ``WorkerSide.mark_step_written`` an event recorded after its kernels, and the next holds wait for it.

A real ``WorkerSide`` (its NIXL agent included) on a host cache. The engine's asynchronous kernel is a thread that
writes the request's blocks once released, and its event releases it and waits for it when synchronized (what a CUDA
event's ``synchronize`` waits for); tests/gpu/test_gpu_step_event.py does the same with a CUDA kernel and event.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

from pd_transfer.connector.cache import KVCache
from pd_transfer.connector.config import ConnectorConfig
from pd_transfer.connector.metadata import StepMetadata
from pd_transfer.connector.worker import WorkerSide
from pd_transfer.spec import KVCacheLayout, ModelFingerprint

LAYOUT = KVCacheLayout(ModelFingerprint("step-written", "float32", 2, 2, 8), 1, 0, 16)
WRITTEN = 7.0


class KernelEvent:
    """A step's kernel (a thread writing ``blocks`` of every tensor, held back until released) and its event."""

    def __init__(self, cache: KVCache, blocks: list[int], worker: WorkerSide, request_id: str) -> None:
        self.release = threading.Event()
        self.seen_at_synchronize: list[str] = []  # the request's lease status whenever the event was waited for
        self._worker, self._request_id = worker, request_id
        self._thread = threading.Thread(target=self._kernel, args=(cache, blocks), daemon=True)
        self._thread.start()

    def _kernel(self, cache: KVCache, blocks: list[int]) -> None:
        if self.release.wait(30.0):
            for tensor in cache.tensors:
                tensor[blocks] = WRITTEN

    def synchronize(self) -> None:
        self.seen_at_synchronize.append(self._worker.prefill.ledger.status(self._request_id))
        self.release.set()
        self._thread.join(30.0)
        assert not self._thread.is_alive(), "the kernel did not finish"


@pytest.fixture
def worker() -> Iterator[WorkerSide]:
    config = ConnectorConfig.from_dict({"side_channel_host": "127.0.0.1", "side_channel_port": 0}, env={})
    side = WorkerSide("step-written", KVCache.allocate(LAYOUT, 32), config)
    yield side
    side.close()


def blocks_written(cache: KVCache, blocks: list[int]) -> bool:
    return all(bool((tensor[blocks] == WRITTEN).all()) for tensor in cache.tensors)


def test_holds_wait_for_the_step_that_wrote_the_blocks(worker: WorkerSide) -> None:
    blocks = [3, 4, 9]
    event = KernelEvent(worker.cache, blocks, worker, "req-1")
    worker.mark_step_written(event)
    assert not blocks_written(worker.cache, blocks)  # the "kernel" is still queued
    worker.start_load(StepMetadata(reqs_to_hold={"req-1": tuple(blocks)}))
    assert event.seen_at_synchronize == ["unknown"]  # waited for before the hold existed
    assert worker.prefill.ledger.status("req-1") == "held"
    assert blocks_written(worker.cache, blocks)


def test_a_step_without_holds_leaves_the_event_for_the_next_holds(worker: WorkerSide) -> None:
    event = KernelEvent(worker.cache, [1], worker, "req-2")
    worker.mark_step_written(event)
    worker.start_load(StepMetadata(reqs_to_abort=frozenset({"someone-else"})))
    assert event.seen_at_synchronize == [] and not event.release.is_set()
    worker.start_load(StepMetadata(reqs_to_hold={"req-2": (1,)}))
    worker.start_load(StepMetadata(reqs_to_hold={"req-3": (2,)}))  # the event was waited for once
    assert event.seen_at_synchronize == ["unknown"] and blocks_written(worker.cache, [1])


def test_a_cpu_engine_marks_nothing_and_holds_at_once(worker: WorkerSide) -> None:
    worker.mark_step_written(None)
    worker.start_load(StepMetadata(reqs_to_hold={"req-4": (5,)}))
    assert worker.prefill.ledger.status("req-4") == "held"
    assert torch.equal(worker.cache.tensors[0][5], torch.zeros_like(worker.cache.tensors[0][5]))
