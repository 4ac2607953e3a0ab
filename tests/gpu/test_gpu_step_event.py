"""The P/D worker holds blocks for readers only after the kernels that wrote them finished: a CUDA event recorded
after them is handed to ``WorkerSide.mark_step_written``, and the next holds wait for it (that event only).
tests/process/test_step_written.py checks the same order with a CPU stand-in for the kernel."""

from __future__ import annotations

import pytest
import torch

from pd_transfer.connector.cache import KVCache
from pd_transfer.connector.config import ConnectorConfig
from pd_transfer.connector.metadata import StepMetadata
from pd_transfer.connector.worker import WorkerSide
from pd_transfer.sim.peer import on_device
from pd_transfer.spec import KVCacheLayout, ModelFingerprint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: torch sees no GPU here"),
]

LAYOUT = KVCacheLayout(ModelFingerprint("gpu-step-event", "bfloat16", 2, 2, 16), 1, 0, 16)


def test_holds_wait_for_the_event_after_the_kernels_that_wrote_the_blocks() -> None:
    cache = on_device(KVCache.allocate(LAYOUT, 32), "cuda")
    config = ConnectorConfig.from_dict({"side_channel_host": "127.0.0.1", "side_channel_port": 0}, env={})
    worker = WorkerSide("gpu-step-event", cache, config)
    blocks = [3, 4, 9]
    index = torch.tensor(blocks, device="cuda")  # made now: a host copy later would wait for the kernel
    try:
        torch.cuda._sleep(2_000_000_000)  # the step's forward, still running at its end
        for tensor in cache.tensors:
            tensor.index_fill_(0, index, 7.0)
        event = torch.cuda.Event()
        event.record()
        assert not event.query()
        worker.mark_step_written(event)
        worker.start_load(StepMetadata(reqs_to_hold={"req-1": tuple(blocks)}))
        assert event.query() and worker.prefill.ledger.status("req-1") == "held"
        assert all(bool((tensor[blocks].cpu() == 7.0).all()) for tensor in cache.tensors)
    finally:
        worker.close()
