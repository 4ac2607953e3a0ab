"""The device copier's pipeline (issue 34 item 5), what CI can check on CPU tensors: a job's blocks go to host rows and
come back element by element equal, whatever the chunks (staging buffers much smaller than the job, taken in turn
and reused across jobs), the host rows (consecutive or not) and the cache tensors (several page widths, rows further
apart than their length); two ways of gathering and scattering a chunk agree: the row mover's Triton kernel, run
under Triton's interpreter on the very addresses it gets on a GPU, and torch's gathers and scatters per tensor. The
addresses of a chunk cover its staging rows exactly once, and a chunk is one kernel launch per page width. The
streams and events (the overlap itself) need a GPU: tests/gpu/test_gpu_offload.py."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pd_transfer.offload import OffloadInputError
from pd_transfer.offload.device_copy import BlockCopier, Chunk
from pd_transfer.rows.by_torch import FEW_RUNS

WIDTHS = (96, 160, 64, 160, 36)  # four distinct page widths, two tensors of one; 36: rows aligned to 4 bytes only
BLOCKS = 40
HOST_ROWS = 48
SENTINEL = 0xA5


def cache(seed: int, widths: Sequence[int] = WIDTHS, gap: int = 24) -> list[torch.Tensor]:
    """Random pages, each tensor's rows ``gap`` bytes further apart than their length (a view into a wider one)."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for width in widths:
        wide = torch.randint(0, 256, (BLOCKS, width + gap), dtype=torch.uint8, generator=generator)
        out.append(wide[:, :width])
    return out


def whole_rows(page: torch.Tensor) -> torch.Tensor:
    """A cache tensor's rows with the bytes after each page up to the next row (the gap :func:`cache` leaves)."""
    return page.as_strided((page.shape[0], page.stride(0)), (page.stride(0), 1))


def block(caches: Sequence[torch.Tensor], block_id: int) -> torch.Tensor:
    """A block's pages back to back: what its host row holds."""
    return torch.cat([t[block_id] for t in caches])


def host_rows() -> torch.Tensor:
    return torch.full((HOST_ROWS, sum(WIDTHS)), SENTINEL, dtype=torch.uint8)


def round_trip(
    sources: list[int],
    rows: list[int],
    targets: list[int],
    *,
    staging_blocks: int,
    buffers: int,
    one_kernel: bool,
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor], BlockCopier]:
    """Store ``sources`` into ``rows`` of a fresh host buffer, load the rows into ``targets`` of a second cache;
    returns the host buffer, the source and target caches and the loading copier."""
    source, target, host = cache(1), cache(2), host_rows()
    block_bytes = sum(WIDTHS)
    storing = BlockCopier(source, staging_bytes=staging_blocks * block_bytes, buffers=buffers, one_kernel=one_kernel)
    loading = BlockCopier(target, staging_bytes=staging_blocks * block_bytes, buffers=buffers, one_kernel=one_kernel)
    assert storing.to_host(sources, rows, host) is None  # on the CPU: done on return
    assert loading.from_host(rows, targets, host) is None
    return host, source, target, loading


@pytest.mark.parametrize("one_kernel", [True, False], ids=["kernel", "torch"])
@pytest.mark.parametrize(
    "rows",
    [list(range(5, 5 + 17)), [40, 3, 4, 5, 6, 22, 23, 0, 47, 46, 12, 13, 14, 15, 16, 17, 30]],
    ids=["consecutive-rows", "scattered-rows"],
)
@pytest.mark.parametrize(("staging_blocks", "buffers"), [(2, 2), (6, 2), (9, 3), (64, 2)])
def test_blocks_come_back_element_by_element(
    one_kernel: bool, rows: list[int], staging_blocks: int, buffers: int
) -> None:
    sources = [5, 39, 3, 4, 17, 30, 31, 0, 12, 11, 10, 2, 8, 9, 33, 34, 21]
    targets = [1, 2, 38, 9, 10, 11, 20, 6, 7, 0, 25, 26, 27, 13, 14, 3, 4]
    host, source, target, copier = round_trip(
        sources, rows, targets, staging_blocks=staging_blocks, buffers=buffers, one_kernel=one_kernel
    )
    untouched_target = cache(2)
    for position, (s, r, t) in enumerate(zip(sources, rows, targets, strict=True)):
        assert torch.equal(host[r], block(source, s)), f"host row {r} (position {position})"
        assert all(torch.equal(a[t], b[s]) for a, b in zip(target, source, strict=True)), f"block {t}"
    assert bool((host[[r for r in range(HOST_ROWS) if r not in rows]] == SENTINEL).all())
    others = [b for b in range(BLOCKS) if b not in targets]
    assert all(torch.equal(a[others], b[others]) for a, b in zip(target, untouched_target, strict=True))
    chunks = len(copier.chunks(rows))
    assert chunks == -(-len(rows) // copier.chunk_rows)
    if one_kernel:  # one launch per page width
        assert copier.gather_calls == chunks * len(set(WIDTHS))
    else:  # per tensor, a gather (scatter), or a slice copy per run where a chunk's blocks make few runs
        assert chunks * len(WIDTHS) <= copier.gather_calls <= chunks * len(WIDTHS) * FEW_RUNS


def test_the_kernel_addresses_and_torch_agree_byte_for_byte() -> None:
    """The same job two ways (kernel addresses through the host reference, torch), the same bytes everywhere, rows
    padding and all."""
    rng = np.random.default_rng(3)
    sources = [int(b) for b in rng.permutation(BLOCKS)[:30]]
    targets = [int(b) for b in rng.permutation(BLOCKS)[:30]]
    rows = [int(r) for r in rng.permutation(HOST_ROWS)[:30]]
    by_kernel = round_trip(sources, rows, targets, staging_blocks=7, buffers=2, one_kernel=True)
    by_torch = round_trip(sources, rows, targets, staging_blocks=7, buffers=2, one_kernel=False)
    assert torch.equal(by_kernel[0], by_torch[0])
    for a, b in zip(by_kernel[2], by_torch[2], strict=True):
        assert torch.equal(whole_rows(a), whole_rows(b))  # the bytes between the pages too


def test_a_chunks_addresses_cover_its_staging_rows_once_and_read_the_right_pages() -> None:
    source = cache(4)
    copier = BlockCopier(source, staging_bytes=5 * sum(WIDTHS), buffers=1, one_kernel=True)
    block_ids = [7, 3, 30, 31, 2, 9, 1]
    (first, second) = copier.chunks(list(range(len(block_ids))))
    assert (first.start, first.count, second.start, second.count) == (0, 5, 5, 2)
    for to_staging in (True, False):
        per_width = copier.row_addresses(block_ids, second, to_staging=to_staging)
        assert sorted(rows.row_bytes for rows in per_width) == sorted(set(WIDTHS))
        covered = np.zeros(second.count * copier.block_bytes, dtype=np.int64)
        staging = min(int((r.targets if to_staging else r.sources).min()) for r in per_width)  # row 0, column 0
        for rows in per_width:
            in_staging, in_cache = (rows.targets, rows.sources) if to_staging else (rows.sources, rows.targets)
            for address in in_staging.tolist():
                offset = address - staging
                covered[offset : offset + rows.row_bytes] += 1
            pages = {t.data_ptr() + b * t.stride(0) for t in source if t.shape[1] == rows.row_bytes for b in (9, 1)}
            assert set(in_cache.tolist()) == pages  # chunk two holds blocks 9 and 1
        assert bool((covered == 1).all())


def test_chunks_take_the_buffers_in_turn_and_copy_runs_of_rows() -> None:
    copier = BlockCopier(cache(5), staging_bytes=2 * 3 * sum(WIDTHS), buffers=2)
    assert copier.chunk_rows == 3 and copier.buffers == 2
    assert copier.chunks([4, 5, 6, 7, 9, 10, 0]) == [
        Chunk(0, 3, 0, ((0, 4, 3),)),
        Chunk(3, 3, 1, ((0, 7, 1), (1, 9, 2))),
        Chunk(6, 1, 0, ((0, 0, 1),)),
    ]
    assert copier.chunks([]) == []
    with pytest.raises(OffloadInputError, match="3 engine blocks for 2 host rows"):
        copier.to_host([1, 2, 3], [0, 1], host_rows())
    with pytest.raises(OffloadInputError, match="at least one staging buffer"):
        BlockCopier(cache(5), buffers=0)


def test_buffers_are_reused_across_jobs_and_directions() -> None:
    """One copier, one-row chunks: stores and loads in turn through the same two buffers."""
    source = cache(6)
    copier = BlockCopier(source, staging_bytes=1, one_kernel=True)
    assert copier.chunk_rows == 1
    host = host_rows()
    copier.to_host([1, 2, 3], [10, 11, 12], host)
    copier.to_host([4, 5], [20, 30], host)
    copier.from_host([30, 20, 10], [1, 2, 3], host)  # over the very blocks stored first
    copier.to_host([1, 2, 3], [0, 1, 2], host)
    assert [torch.equal(host[row], block(cache(6), b)) for row, b in [(0, 5), (1, 4), (2, 1), (12, 3)]] == [True] * 4


@settings(max_examples=50, deadline=None)
@given(data=st.data())
def test_any_job_round_trips(data: st.DataObject) -> None:
    count = data.draw(st.integers(0, 20))
    consecutive = data.draw(st.booleans())
    first = data.draw(st.integers(0, HOST_ROWS - count))
    rows = list(range(first, first + count)) if consecutive else data.draw(st.permutations(range(HOST_ROWS)))[:count]
    sources = data.draw(st.permutations(range(BLOCKS)))[:count]
    targets = data.draw(st.permutations(range(BLOCKS)))[:count]
    staging_blocks, buffers = data.draw(st.integers(1, 25)), data.draw(st.integers(1, 4))
    one_kernel = data.draw(st.sampled_from([True, False, False, False, False]))  # interpreted kernel: ~1 ms a row
    host, source, target, _ = round_trip(
        sources, rows, targets, staging_blocks=staging_blocks, buffers=buffers, one_kernel=one_kernel
    )
    for s, r, t in zip(sources, rows, targets, strict=True):
        assert torch.equal(host[r], block(source, s)) and torch.equal(block(target, t), block(source, s))
    others = [b for b in range(BLOCKS) if b not in targets]
    assert all(torch.equal(a[others], b[others]) for a, b in zip(target, cache(2), strict=True))
