"""Test helpers for the row mover on a pull's rows: one request of a fused case (a block-size regroup, a TP head slice,
a layout change) planned with a direct plan (every row to its final place, nothing fixed up after), located through
the IPC engine in the prefill's memory and ours, and checked against the planner's oracle (:mod:`topology_sim`:
every request token's code where the decode's own layout puts it, every other byte, padding between blocks included,
untouched).

Also the deliberately broken moves the oracle must catch: a row's source address shifted by one element, and the
kernel launched with the bound of its mask off by one element (the tail of each row dropped, or a row's end run
past).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
from topology_sim import (
    LOCAL_SENTINEL,
    REMOTE_SENTINEL,
    RankCache,
    Scenario,
    build_cache,
    check_received,
    fill_request,
    fingerprint,
)

from pd_transfer.rows import BLOCK_ELEMENTS, RowAddresses, RowCopy, by_row_size, kernel_module, kernel_upload
from pd_transfer.same_host.ipc_engine import IpcSource, storages
from pd_transfer.spec import KVCacheLayout
from pd_transfer.topology import PeerPlan

#: K and V apart in the prefill's regions and together in the decode's, 8 elements of padding after every block (a
#: write past a row's end lands where the oracle looks), a direct plan.
BASE = Scenario(heads=4, head_size=8, plan="direct", local_together=True, pad=8, extra_blocks=3)

#: Every kind of row a direct plan fuses into the copy: whole blocks, a head's slice of a block (regroups both ways),
#: a TP rank's heads (2 -> 1 and 1 -> 2), a token's head (layout changes both ways), and two at once.
FUSED = {
    "same": BASE,
    "block-16-to-64": replace(BASE, local_block=64),
    "block-64-to-16": replace(BASE, remote_block=64, num_tokens=70),
    "tp-2-to-1": replace(BASE, remote_tp=2),
    "tp-1-to-2": replace(BASE, local_tp=2),
    "HND-to-NHD": replace(BASE, local_layout="NHD", num_tokens=20),
    "NHD-to-HND": replace(BASE, remote_layout="NHD", num_tokens=20),
    "tp-2-to-1-block-8-to-32-NHD": replace(
        BASE, remote_tp=2, remote_block=8, local_block=32, local_layout="NHD", num_tokens=20
    ),
}


@dataclass
class Pull:
    """One decode rank's request: its cache, the request's block ids, and the row mover's copies that carry it."""

    local: RankCache
    local_ids: list[int]
    tokens: int
    copies: list[RowCopy]

    def check(self) -> None:
        """The planner's oracle: ``AssertionError`` naming the first wrong element, if any."""
        check_received(self.local, self.local_ids, self.tokens)


def pulls(case: Scenario) -> list[Pull]:
    """The request of ``case``, one :class:`Pull` per decode rank (nothing moved yet): prefill caches filled with the
    oracle's codes, decode caches with its sentinel, the case's plan (which must fix nothing up), its rows located
    through the IPC engine."""
    rng = np.random.default_rng(case.seed)
    model = fingerprint(case.heads, case.head_size, dtype=case.dtype)
    size = KVCacheLayout(model, 1, 0, 1).element_size
    remote_needed = -(-case.num_tokens // case.remote_block)
    remote_blocks = remote_needed + case.extra_blocks
    remote_ids = [int(i) for i in rng.permutation(remote_blocks)[:remote_needed]]
    prefills: dict[int, RankCache] = {}
    for rank in range(case.remote_tp):
        layout = KVCacheLayout(model, case.remote_tp, rank, case.remote_block, case.remote_layout)  # type: ignore[arg-type]
        prefills[rank] = build_cache(layout, remote_blocks, case.remote_together, case.pad, REMOTE_SENTINEL[size])
        fill_request(prefills[rank], remote_ids, case.num_tokens)
    local_needed = -(-case.num_tokens // case.local_block)
    out = []
    for rank in range(case.local_tp):
        layout = KVCacheLayout(model, case.local_tp, rank, case.local_block, case.local_layout)  # type: ignore[arg-type]
        local_blocks = local_needed + case.extra_blocks
        local = build_cache(layout, local_blocks, case.local_together, case.pad, LOCAL_SENTINEL[size])
        local_ids = [int(i) for i in rng.permutation(local_blocks)[:local_needed]]
        plan = PeerPlan.build(
            layout,
            local.regions,
            {r: cache.layout for r, cache in prefills.items()},
            {r: cache.regions for r, cache in prefills.items()},
            strategy=case.plan,  # type: ignore[arg-type]
        )
        assert plan.postprocess is None  # every row lands in place: the copy is the whole pull
        copies = []
        for source in plan.sources:
            segments = storages(prefills[source.remote_rank].tensors)
            opened = IpcSource.open(segments, [s.data_ptr() for s in segments], source, storages(local.tensors))
            copies += opened.copies(*source.indices(remote_ids, local_ids, case.num_tokens))
        out.append(Pull(local, local_ids, case.num_tokens, copies))
    return out


def storage_pairs(copies: list[RowCopy]) -> int:
    """How many (source storage, target storage) pairs the rows of ``copies`` touch."""
    pairs: set[tuple[int, int]] = set()
    for copy in copies:
        rows = copy.addresses
        starts = np.array([storage.data_ptr() for storage in copy.memory.storages], dtype=np.int64)
        sources, _ = copy.memory.locate(rows.sources, rows.row_bytes)
        targets, _ = copy.memory.locate(rows.targets, rows.row_bytes)
        pairs |= set(zip(starts[sources].tolist(), starts[targets].tolist(), strict=True))
    return len(pairs)


def shifted(copies: list[RowCopy], row: int, by_elements: int) -> list[RowCopy]:
    """``copies`` with row ``row`` (of the first copy) read ``by_elements`` elements (of the rows' widest element)
    further on: an address broken on purpose (it stays inside the prefill's buffer: blocks are padded)."""
    first = copies[0].addresses
    sources = first.sources.copy()
    sources[row] += by_elements * first.element_bytes()
    return [RowCopy(RowAddresses(sources, first.targets, first.row_bytes), copies[0].memory), *copies[1:]]


def launch_with_mask_off_by(copies: list[RowCopy], elements: int) -> None:
    """The real kernel on ``copies``' rows (CPU tensors: under Triton's interpreter), launched with its mask's bound,
    the row's length in elements, off by ``elements``: a mask broken on purpose."""
    (rows,) = by_row_size(copy.addresses for copy in copies)
    module = kernel_module()
    assert module is not None, "needs Triton"
    addresses = torch.from_numpy(kernel_upload([rows]))
    element = rows.element_bytes()
    row_elems = rows.row_bytes // element + elements
    module.launch(addresses[: rows.rows], addresses[rows.rows :], rows.rows, row_elems, BLOCK_ELEMENTS, element)
