"""On a GPU: GPU memory registered with NIXL as VRAM (rows carrying the device index) and read between two agents;
a hold that waits for the event recorded after the kernels that wrote the KV; the decode's copy stream, whose event
the pull waits for before the blocks are reported loaded. Skipped without CUDA."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pd_transfer.connector.cache import KVCache
from pd_transfer.connector.config import ConnectorConfig
from pd_transfer.connector.metadata import StepMetadata
from pd_transfer.connector.transports.ipc.ipc_reads import CopyStream
from pd_transfer.connector.worker import WorkerSide
from pd_transfer.settings import DEFAULTS
from pd_transfer.spec import KVCacheLayout, MemoryPlace, ModelFingerprint
from pd_transfer.transfer.agent import TransferAgent

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(120),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

LAYOUT = KVCacheLayout(
    fingerprint=ModelFingerprint(model="m", dtype="bfloat16", num_layers=2, total_num_kv_heads=8, head_size=128),
    tp_size=1,
    tp_rank=0,
    block_size=16,
)
SLEEP_CYCLES = 200_000_000  # a kernel that spins this many GPU clock cycles (about 0.1 s)


def test_gpu_memory_is_registered_as_vram_and_read_between_agents() -> None:
    device = torch.cuda.current_device()
    place = MemoryPlace("cuda", device)
    source = torch.arange(1 << 20, dtype=torch.int32, device="cuda")
    target = torch.zeros_like(source)
    row = 4096 * 4  # bytes
    with (
        TransferAgent("vram-source", serves_reads=True, settings=DEFAULTS) as owner,
        TransferAgent("vram-reader", settings=DEFAULTS) as reader,
    ):
        owner.register_spans([(source.data_ptr(), source.data_ptr() + source.numel() * 4)], place=place)
        reader.register_spans([(target.data_ptr(), target.data_ptr() + target.numel() * 4)], place=place)
        peer = reader.add_peer(owner.metadata)
        rows = 8
        remote = np.array([[source.data_ptr() + i * row, row, 0] for i in range(rows)], dtype=np.uint64)
        local = np.array([[target.data_ptr() + i * row, row, 0] for i in range(rows)], dtype=np.uint64)
        theirs = reader.prepare_remote(peer, remote, place)
        mine = reader.prepare_local(local, place)
        assert mine.place == theirs.place == place and int(mine.rows[0, 2]) == device  # the device column
        order = np.array([3, 0, 7], dtype=np.int32)
        reader.read(mine, order, theirs, order, timeout_s=60.0)
    words = row // 4
    for index in order.tolist():
        assert torch.equal(target[index * words : (index + 1) * words], source[index * words : (index + 1) * words])
    assert int(target[words : 2 * words].abs().sum()) == 0  # row 1 was not read


def test_a_hold_waits_for_the_event_after_the_kernels_that_wrote_the_kv() -> None:
    config = ConnectorConfig(side_channel_host="127.0.0.1", side_channel_port=0)
    worker = WorkerSide("gpu-ready", KVCache.allocate(LAYOUT, 16, device="cuda"), config, settings=DEFAULTS)
    try:
        writer = torch.cuda.Stream()
        with torch.cuda.stream(writer):
            torch.cuda._sleep(SLEEP_CYCLES)  # the step's attention kernels, still running
            written = torch.cuda.Event()
            written.record(writer)
        worker.step_computed(written)
        worker.start_load(StepMetadata(reqs_to_hold={"r": (1, 2)}))
        assert written.query(), "the hold began before the KV was written"
        assert worker.prefill.ledger.held_requests == 1
    finally:
        worker.close()


def test_the_copy_stream_s_work_is_complete_when_its_block_ends() -> None:
    stream = CopyStream(MemoryPlace("cuda", torch.cuda.current_device()))
    target = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    with stream.running():
        queued_on = torch.cuda.current_stream()
        assert queued_on != torch.cuda.default_stream()  # the copies go on a stream of their own
        torch.cuda._sleep(SLEEP_CYCLES)
        target.fill_(7)
        indices = stream.upload(np.arange(4, dtype=np.int64))
    assert queued_on.query(), "the block ended before its work completed"
    assert bool((target == 7).all()) and indices.device.type == "cuda" and indices.tolist() == [0, 1, 2, 3]
