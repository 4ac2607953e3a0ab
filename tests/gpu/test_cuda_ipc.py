"""On a GPU: library pulls between CUDA caches in two processes, through CUDA IPC (what a one-node decode chooses) and
through NIXL with the memory registered as VRAM, at TP 1<->2, block 16<->64 both ways and HND<->NHD, every byte
verified; the handles' lifetimes (forgotten, a prefill that exits and restarts); memory from CUDA's virtual memory API
refused with its reason. Skipped without CUDA."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch
from engine_specs import kv_layout as kv_layout_of

from pd_transfer.connector.cache import KVCache
from pd_transfer.connector.decode.rank import DecodeRank
from pd_transfer.connector.options import DecodeOptions
from pd_transfer.handshake.messages import CudaSegment
from pd_transfer.settings import DEFAULTS
from pd_transfer.sim.peer import PrefillProcess, PrefillSpec
from pd_transfer.sim.verify import received_correctly
from pd_transfer.spec import KVCacheLayout, ModelFingerprint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

FINGERPRINT = ModelFingerprint(model="gpu-llama", dtype="bfloat16", num_layers=4, total_num_kv_heads=8, head_size=128)
BLOCKS = 64
TOKENS = 300  # not a multiple of either block size


def layout(block_size: int = 16, tp: int = 1, rank: int = 0, kv_layout: str = "HND") -> KVCacheLayout:
    return kv_layout_of(FINGERPRINT, block_size, tp, rank, kv_layout)


PREFILLS = {
    "tp1-b16-HND": [layout(16)],
    "tp2-b16-HND": [layout(16, 2, 0), layout(16, 2, 1)],
    "tp1-b64-NHD": [layout(64, kv_layout="NHD")],
}
CASES = [
    ("tp1-b16-HND", [layout(16)]),
    ("tp1-b16-HND", [layout(16, 2, 0), layout(16, 2, 1)]),  # TP 1 -> 2
    ("tp2-b16-HND", [layout(16)]),  # TP 2 -> 1
    ("tp1-b16-HND", [layout(64)]),  # block 16 -> 64
    ("tp1-b64-NHD", [layout(16)]),  # block 64 -> 16, NHD -> HND
    ("tp1-b16-HND", [layout(16, kv_layout="NHD")]),  # HND -> NHD
]
CASE_IDS = ["same", "tp1-to-tp2", "tp2-to-tp1", "block16-to-64", "block64-NHD-to-16-HND", "HND-to-NHD"]


@pytest.fixture(scope="module")
def prefills() -> Iterator[dict[str, PrefillProcess]]:
    started: dict[str, PrefillProcess] = {}
    try:
        for name, layouts in PREFILLS.items():
            started[name] = PrefillProcess(PrefillSpec(f"gpu-{name}", layouts, BLOCKS, seed=9, device="cuda"))
        yield started
    finally:
        for process in started.values():
            process.close()


def pull_verified(decode: DecodeRank, prefill: PrefillProcess, request_id: str) -> str:
    """Hold a request on ``prefill``, pull it with confirmation, verify every byte; returns the transport."""
    remote_size = prefill.spec.layouts[0].block_size
    remote_ids = list(range(40, 40 - -(-TOKENS // remote_size), -1))
    local_ids = list(range(3, 3 + -(-TOKENS // decode.cache.layout.block_size)))
    prefill.request("hold", request_id, remote_ids)
    stats = decode.pull_confirmed(request_id, prefill.host, prefill.port, remote_ids, local_ids, TOKENS)
    expected = prefill.spec.caches()
    assert received_correctly(decode.cache, local_ids, expected, remote_ids, TOKENS), request_id
    return stats.transport


@pytest.mark.parametrize("transport", ["auto", "nixl"])
@pytest.mark.parametrize(("prefill_name", "decode_layouts"), CASES, ids=CASE_IDS)
def test_library_pulls_between_cuda_caches_are_verified(
    prefills: dict[str, PrefillProcess],
    prefill_name: str,
    decode_layouts: list[KVCacheLayout],
    transport: str,
) -> None:
    prefill = prefills[prefill_name]
    for decode_layout in decode_layouts:
        cache = KVCache.allocate(decode_layout, BLOCKS, device="cuda")
        decode = DecodeRank(
            f"gpu-decode-{transport}", cache, DecodeOptions(settings=DEFAULTS, transport=transport, read_timeout_s=60.0)
        )
        try:
            shape = f"{decode_layout.tp_size}-{decode_layout.tp_rank}-{decode_layout.block_size}-{decode_layout.layout}"
            got = pull_verified(decode, prefill, f"{prefill_name}-{transport}-{shape}")
        finally:
            decode.close()
        assert got == ("cuda_ipc" if transport == "auto" else "nixl")


def test_forgotten_and_restarted_prefills_close_their_handles(prefills: dict[str, PrefillProcess]) -> None:
    shared = prefills["tp1-b16-HND"]
    decode = DecodeRank(
        "gpu-decode-lifetimes", KVCache.allocate(layout(16), BLOCKS, device="cuda"), DecodeOptions(settings=DEFAULTS)
    )
    try:
        assert pull_verified(decode, shared, "lifetime-1") == "cuda_ipc"
        first = decode.remotes.get(shared.host, shared.port)
        assert first is not None and first.link.opened is not None
        decode.forget(shared.host, shared.port)
        assert first.link.opened.closed
        gc.collect()
        assert pull_verified(decode, shared, "lifetime-2") == "cuda_ipc"  # opened afresh
        with PrefillProcess(PrefillSpec("gpu-restart", [layout(16)], BLOCKS, seed=10, device="cuda")) as old:
            port = old.port
            assert pull_verified(decode, old, "before-restart") == "cuda_ipc"
            stale = decode.remotes.get(old.host, port)
        assert stale is not None and stale.link.opened is not None and stale.link.opened.owner_exited()
        spec = PrefillSpec("gpu-restart", [layout(16)], BLOCKS, seed=11, device="cuda", port=port)
        with PrefillProcess(spec) as new:
            assert pull_verified(decode, new, "after-restart") == "cuda_ipc"
        assert stale.link.opened.closed
    finally:
        decode.close()


def test_the_offer_names_the_gpu_and_the_legacy_handles() -> None:
    from pd_transfer.same_host.common import device_uuid
    from pd_transfer.same_host.exporting import export_cache

    cache = KVCache.allocate(layout(16), BLOCKS, device="cuda")
    offer, why_not = export_cache(cache.tensors, cache.regions, "cuda")
    assert offer is not None, why_not
    assert offer.pid == os.getpid() and len(offer.segments) == 1  # one allocation holds the whole cache
    (segment,) = offer.segments
    assert isinstance(segment, CudaSegment) and segment.device_uuid == device_uuid(torch.cuda.current_device())
    assert segment.base_address == cache.tensors[0].untyped_storage().data_ptr()


_EXPANDABLE = """
import json, torch
from pd_transfer.connector.cache import KVCache
from pd_transfer.same_host.exporting import export_cache
from pd_transfer.spec import KVCacheLayout, ModelFingerprint
fingerprint = ModelFingerprint(model="m", dtype="bfloat16", num_layers=2, total_num_kv_heads=8, head_size=128)
cache = KVCache.allocate(KVCacheLayout(fingerprint=fingerprint, tp_size=1, tp_rank=0, block_size=16), 64, device="cuda")
offer, why_not = export_cache(cache.tensors, cache.regions, "cuda")
print(json.dumps({"offered": offer is not None, "why_not": why_not}))
"""


def test_memory_from_the_virtual_memory_api_is_refused_saying_why() -> None:
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    done = subprocess.run(
        [sys.executable, "-c", _EXPANDABLE], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["offered"] is False
    assert "virtual memory API" in result["why_not"] and "NIXL moves it" in result["why_not"]
