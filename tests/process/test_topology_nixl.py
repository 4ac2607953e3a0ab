"""Heterogeneous transfers over real NIXL: prefill ranks in a child process, decode ranks here.

Each case checks every element of every decode rank's received tokens against the prefill caches
(through each side's own layout, not the plan), that blocks outside the request are untouched, and that
every prefill rank is released by exactly the decode readers it should expect.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from pd_transfer.connector.cache import KVCache
from pd_transfer.connector.decode.rank import DecodeRank
from pd_transfer.connector.options import DecodeOptions
from pd_transfer.settings import DEFAULTS
from pd_transfer.sim.peer import PrefillProcess, PrefillSpec
from pd_transfer.sim.verify import received_correctly
from pd_transfer.spec import KVCacheLayout, ModelFingerprint
from pd_transfer.topology import TopologyError


@dataclass(frozen=True)
class Side:
    tp: int
    block_size: int
    layout: str = "HND"
    kv_split: bool = True


def _fingerprint(heads: int, mla: bool = False) -> ModelFingerprint:
    return ModelFingerprint(
        model="topo-llama", dtype="bfloat16", num_layers=2, total_num_kv_heads=heads, head_size=16, use_mla=mla
    )


def _layouts(side: Side, fingerprint: ModelFingerprint) -> list[KVCacheLayout]:
    return [
        KVCacheLayout(
            fingerprint=fingerprint, tp_size=side.tp, tp_rank=r, block_size=side.block_size, layout=side.layout
        )  # type: ignore[arg-type]
        for r in range(side.tp)
    ]


CASES = {
    "tp_2_to_1": (Side(2, 16), Side(1, 16), 4, False),
    "tp_1_to_2": (Side(1, 16), Side(2, 16), 4, False),
    "replicated_tp_4_two_heads": (Side(4, 16), Side(2, 16), 2, False),
    "replicated_to_tp_4": (Side(1, 16), Side(4, 16), 2, False),
    "block_16_to_64": (Side(1, 16), Side(1, 64), 4, False),
    "block_64_to_16": (Side(1, 64), Side(1, 16), 4, False),
    "hnd_to_nhd": (Side(1, 16, "HND"), Side(1, 16, "NHD"), 4, False),
    "nhd_kv_together_tp2_to_hnd_tp1_block_32": (Side(2, 8, "NHD", kv_split=False), Side(1, 32, "HND"), 4, False),
    "mla_tp_2_to_4": (Side(2, 16), Side(4, 16), 1, True),
}


DECODE_BLOCKS = 24
FIX_UP_CASES = ["block_16_to_64", "hnd_to_nhd", "nhd_kv_together_tp2_to_hnd_tp1_block_32"]


@pytest.mark.parametrize("case", sorted(set(CASES) - set(FIX_UP_CASES)))
def test_heterogeneous_pull_over_nixl(case: str) -> None:
    _pull_and_check(case, [{}])


@pytest.mark.parametrize("case", FIX_UP_CASES)
def test_fix_up_paths(case: str) -> None:
    """Plans that fix layouts up, from one prefill: with the default staging area, with a one-block staging area
    (a chunk per plane block, through every lane's slot groups), and without one (in place, plane group by plane
    group)."""
    _pull_and_check(case, [{}, {"staging_bytes": 1}, {"staging_bytes": 0}])


@dataclass(frozen=True)
class Request:
    """One request of a case: its ids on each side, its tokens, and what the prefill holds."""

    remote_ids: list[int]
    local_ids: list[int]
    tokens: int
    expected: list[KVCache]


def _pull_and_check(case: str, variants: list[dict[str, Any]]) -> None:
    """Pull the case's request into fresh decode ranks made with each of ``variants`` (decode options) in turn, from
    one prefill process, and check each."""
    prefill_side, decode_side, heads, mla = CASES[case]
    fingerprint = _fingerprint(heads, mla)
    tokens = 150  # several blocks of every size, the last one partly filled
    rng = np.random.default_rng(abs(hash(case)) % 2**32)
    prefill_blocks = 24
    spec = PrefillSpec(
        f"prefill-{case}", _layouts(prefill_side, fingerprint), prefill_blocks, kv_split=prefill_side.kv_split, seed=3
    )
    remote_ids = rng.choice(prefill_blocks, -(-tokens // prefill_side.block_size), replace=False).tolist()
    local_ids = rng.choice(DECODE_BLOCKS, -(-tokens // decode_side.block_size), replace=False).tolist()
    with PrefillProcess(spec) as prefill:
        request = Request(remote_ids, local_ids, tokens, spec.caches())
        for variant, options in enumerate(variants):
            layouts = _layouts(decode_side, fingerprint)
            decodes = [
                DecodeRank(
                    f"decode-{case}-{variant}",
                    KVCache.allocate(layout, DECODE_BLOCKS, kv_split=decode_side.kv_split),
                    DecodeOptions(settings=DEFAULTS, **options),
                )
                for layout in layouts
            ]
            try:
                _pull_and_check_into(prefill, f"{case}-{variant}", decodes, request)
            finally:
                for decode in decodes:
                    decode.close()


def _pull_and_check_into(prefill: PrefillProcess, request_id: str, decodes: list[DecodeRank], request: Request) -> None:
    """Pull ``request`` into every decode rank (its read lanes up: the pull uses them) and check what landed, what
    did not change, and which prefill ranks were released by how many readers."""
    remote_ids, local_ids, tokens = request.remote_ids, request.local_ids, request.tokens
    for decode in decodes:
        assert decode.agent.lanes_ready.wait(60)
        stats = decode.pull(request_id, prefill.host, prefill.port, remote_ids, local_ids, tokens)
        assert stats.bytes > 0
    for decode in decodes:
        assert received_correctly(decode.cache, local_ids, request.expected, remote_ids, tokens), decode.agent.name
        untouched = sorted(set(range(DECODE_BLOCKS)) - set(local_ids))
        for tensor in decode.cache.tensors:
            assert bool((tensor[untouched] == 0).all())
    released = prefill.wait_released(request_id, timeout_s=10)
    # every prefill rank some decode rank read from was released; the others never held readers
    sources = {s.remote_rank for d in decodes for s in d.remote_plan(prefill.host, prefill.port).sources}
    for rank, readers in enumerate(released):
        if rank in sources:
            assert readers is not None and readers >= 1, (rank, released)
        else:
            assert readers is None, (rank, released)
    assert sum(r or 0 for r in released) == sum(len(d.remote_plan(prefill.host, prefill.port).sources) for d in decodes)


def test_impossible_tp_is_refused_at_handshake_naming_the_numbers() -> None:
    fingerprint = _fingerprint(4)
    spec = PrefillSpec("prefill-tp-3", _layouts(Side(1, 16), fingerprint), 8, seed=3)
    with PrefillProcess(spec) as prefill:
        layout = KVCacheLayout(fingerprint=fingerprint, tp_size=3, tp_rank=0, block_size=16)
        decode = DecodeRank("decode-tp-3", KVCache.allocate(layout, 8), DecodeOptions(settings=DEFAULTS))
        try:
            with pytest.raises(TopologyError, match="3"):
                decode.connect(prefill.host, prefill.port)
        finally:
            decode.close()
