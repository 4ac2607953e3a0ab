"""The benchmarks' one-unit read probe (:mod:`pd_transfer.bench.transfer.unit_reads`) against a prefill in a child
process, by each transport a decode on its host reads with: NIXL reads, copies out of shareable host memory opened
through IPC, ``process_vm_readv`` calls of memory read in place. Each gives one positive time a sample, and the
decode's cache is left as it was (the probe moves into scratch memory)."""

from __future__ import annotations

import sys

import pytest
import torch
from engine_specs import kv_layout

from pd_transfer.bench.transfer.unit_reads import one_unit_read_latencies
from pd_transfer.connector.cache import KVCache
from pd_transfer.connector.decode.rank import DecodeRank
from pd_transfer.connector.options import DecodeOptions
from pd_transfer.settings import DEFAULTS
from pd_transfer.sim.peer import PrefillProcess, PrefillSpec
from pd_transfer.spec import ModelFingerprint

pytestmark = pytest.mark.timeout(180)

FINGERPRINT = ModelFingerprint(model="probe-llama", dtype="bfloat16", num_layers=2, total_num_kv_heads=4, head_size=64)
LAYOUT = kv_layout(FINGERPRINT, 16)
BLOCKS = 8
SECRET = "unit-reads-secret"
SAMPLES = 5


@pytest.mark.parametrize(
    ("transport", "shareable"),
    [
        ("nixl", False),
        ("host_ipc", True),
        pytest.param(
            "host_cma",
            False,
            marks=pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process_vm_readv is Linux's"),
        ),
    ],
)
def test_the_probe_times_one_unit_by_the_engines_transport(transport: str, shareable: bool) -> None:
    spec = PrefillSpec(f"probe-{transport}", [LAYOUT], BLOCKS, secret=SECRET, shareable=shareable)
    with PrefillProcess(spec) as prefill:
        cache = KVCache.allocate(LAYOUT, BLOCKS)
        before = [tensor.clone() for tensor in cache.tensors]
        decode = DecodeRank(
            "probe-decode",
            cache,
            DecodeOptions(settings=DEFAULTS, secret=SECRET, transport="nixl" if transport == "nixl" else "auto"),
        )
        try:
            latencies = one_unit_read_latencies(decode, prefill.host, prefill.port, samples=SAMPLES)
            chosen = decode.remotes.connect(prefill.host, prefill.port).transport
        finally:
            decode.close()
    assert chosen == transport
    assert len(latencies) == SAMPLES
    assert all(seconds > 0 for seconds in latencies)
    assert all(torch.equal(now, was) for now, was in zip(cache.tensors, before, strict=True))
