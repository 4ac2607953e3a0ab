"""A staged pull over real NIXL that fails in the middle: the read lanes up, a prefill of TP 2 killed mid-request.

Prefill ranks live in a child process, the decode rank (TP 1, two read lanes) here, one plane block per chunk, so
both prefill ranks' reads land in every staged block (NHD -> HND). The failed pull raises a typed error and leaves
every block outside the request untouched; the same decode rank, staging area and lanes then pull the request from
another engine exactly (every element checked against the prefill caches) and each of its ranks hears ``ReadDone``
once. (The staged paths without a failure are checked over NIXL in tests/process/test_topology_nixl.py,
lanes up.)
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import numpy as np
import pytest

from pd_transfer.connector.cache import KVCache
from pd_transfer.connector.decode.rank import DecodeRank
from pd_transfer.connector.options import DecodeOptions
from pd_transfer.settings import DEFAULTS
from pd_transfer.sim.peer import PrefillProcess, PrefillSpec
from pd_transfer.sim.verify import received_correctly
from pd_transfer.spec import KVCacheLayout, ModelFingerprint
from pd_transfer.transfer.errors import TransferError
from pd_transfer.transfer.lanes import LaneRead

MODEL = ModelFingerprint(model="staged-llama", dtype="bfloat16", num_layers=2, total_num_kv_heads=4, head_size=16)
TOKENS = 150  # several 16-token blocks, the last one partly filled
BLOCKS = 24  # each side


def _prefill(seed: int) -> PrefillSpec:
    layouts = [KVCacheLayout(MODEL, 2, rank, 16, "NHD") for rank in range(2)]
    return PrefillSpec(f"prefill-tp2-nhd-{seed}", layouts, BLOCKS, seed=seed)


def _untouched(decode: DecodeRank, request_blocks: Sequence[int]) -> bool:
    others = sorted(set(range(BLOCKS)) - set(request_blocks))
    return all(bool((tensor[others] == 0).all()) for tensor in decode.cache.tensors)


def _killing_after(reads: int, prefill: PrefillProcess, run_on_lanes: Callable) -> Callable:
    """``run_on_lanes`` whose lanes' reads kill ``prefill`` (SIGKILL, waited for) once ``reads`` of them returned:
    every read after those (the lanes run at once) waits for the kill before it is posted, so it finds the peer
    really gone, however the lanes' threads are scheduled. Only the moment of the fault is chosen here; the reads,
    their failure and what the pull makes of it are the real ones."""
    count = threading.Lock()
    posted = returned = 0
    killed = threading.Event()

    def run(jobs: Sequence[Callable[[LaneRead], object]], timeout_s: float, **kwargs: object) -> list[object]:
        def on_lane(job: Callable[[LaneRead], object]) -> Callable[[LaneRead], object]:
            def with_read(read: LaneRead) -> object:
                def killing_read(*args: object) -> object:
                    nonlocal posted, returned
                    with count:
                        posted += 1
                        after_the_fault = posted > reads
                    if after_the_fault:
                        assert killed.wait(30), "the first reads never returned"
                    stats = read(*args)  # type: ignore[arg-type]
                    with count:
                        returned += 1
                        last_before_the_fault = returned == reads and not after_the_fault
                    if last_before_the_fault:
                        prefill.kill()
                        killed.set()
                    return stats

                return job(killing_read)  # type: ignore[arg-type]

            return with_read

        return run_on_lanes([on_lane(job) for job in jobs], timeout_s, **kwargs)

    return run


def test_prefill_killed_mid_request_fails_the_pull_and_writes_nothing_else() -> None:
    rng = np.random.default_rng(9)
    remote_ids = rng.choice(BLOCKS, -(-TOKENS // 16), replace=False).tolist()
    local_ids = rng.choice(BLOCKS, -(-TOKENS // 16), replace=False).tolist()
    cache = KVCache.allocate(KVCacheLayout(MODEL, 1, 0, 16, "HND"), BLOCKS)
    decode = DecodeRank(
        "decode-staged", cache, DecodeOptions(settings=DEFAULTS, read_lanes=2, staging_bytes=1, transport="nixl")
    )
    try:
        assert decode.agent.lanes_ready.wait(60) and decode.agent.lane_count == 2
        with PrefillProcess(_prefill(3)) as doomed:
            assert decode.remote_plan(doomed.host, doomed.port).postprocess is not None
            decode.agent.run_on_lanes = _killing_after(6, doomed, decode.agent.run_on_lanes)  # type: ignore[method-assign]
            with pytest.raises(TransferError):
                decode.pull("doomed", doomed.host, doomed.port, remote_ids, local_ids, TOKENS, timeout_s=20)
            del decode.agent.run_on_lanes  # the agent's own again
        assert _untouched(decode, local_ids)
        for tensor in decode.cache.tensors:
            tensor.zero_()
        spec = _prefill(4)  # the staging area and the lanes serve the next engine
        with PrefillProcess(spec) as prefill:
            stats = decode.pull("after", prefill.host, prefill.port, remote_ids, local_ids, TOKENS)
            assert stats.postprocess_seconds > 0
            assert received_correctly(decode.cache, local_ids, spec.caches(), remote_ids, TOKENS)
            assert _untouched(decode, local_ids)
            assert prefill.wait_released("after", timeout_s=10) == [1, 1]
    finally:
        decode.close()
