"""The row mover (pd_transfer.rows) on CPU tensors: rows of every alignment (1, 2, 4 and 8-byte elements), lengths
(6 bytes to more than one kernel program's block) and placements (several storages, permuted, read twice) moved by
the Triton kernel under Triton's interpreter and by torch's fallback, each compared with numpy's copy of the same
rows over every byte of every storage; the oracle catching a kernel whose mask drops the tail of a row's last block;
the calls each way makes; and what it refuses."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from pd_transfer.rows import (
    BLOCK_ELEMENTS,
    RowAddresses,
    RowCopy,
    RowMemory,
    RowsOutside,
    kernel_available,
    kernel_module,
    kernel_upload,
    launch_rows,
    move_rows,
    use_kernel,
)
from pd_transfer.rows.by_torch import FEW_RUNS

SOURCE_BYTES = (40_000, 33_333, 20_002)  # three source storages, two of odd sizes
TARGET_BYTES = (50_000, 30_001)


class Rows:
    """Random rows of ``row_bytes`` at multiples of ``align`` bytes: sources anywhere in three storages (a row may
    be read twice), targets in distinct, non-overlapping places of two others, in random order; and numpy's
    expectation of every storage after the copy."""

    def __init__(self, count: int, row_bytes: int, align: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        generator = torch.Generator().manual_seed(seed)
        self.sources = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=generator) for n in SOURCE_BYTES]
        self.targets = [torch.zeros(n, dtype=torch.uint8) for n in TARGET_BYTES]
        self.row_bytes = row_bytes
        source_at, target_at = [], []
        self.expected = [t.numpy().copy() for t in self.targets]
        slot = -(-row_bytes // align) * align  # target places a row apart, at least, on the alignment
        places = [(t, p * slot) for t, n in enumerate(TARGET_BYTES) for p in range(n // slot)]
        for index in rng.permutation(len(places))[:count].tolist():
            target, offset = places[index]
            storage = int(rng.integers(len(SOURCE_BYTES)))
            start = int(rng.integers((SOURCE_BYTES[storage] - row_bytes) // align + 1)) * align
            source_at.append(self.sources[storage].data_ptr() + start)
            target_at.append(self.targets[target].data_ptr() + offset)
            row = self.sources[storage].numpy()[start : start + row_bytes]
            self.expected[target][offset : offset + row_bytes] = row
        self.before = [s.numpy().copy() for s in self.sources]
        addresses = RowAddresses(np.array(source_at, np.int64), np.array(target_at, np.int64), row_bytes)
        self.copy = RowCopy(addresses, RowMemory([*self.sources, *self.targets]))

    def check(self) -> None:
        """Every byte of every storage as numpy expects (``AssertionError`` naming the first wrong one, and how many
        bytes of the targets are)."""
        assert all(np.array_equal(s.numpy(), b) for s, b in zip(self.sources, self.before, strict=True))
        wrong = [
            np.flatnonzero(target.numpy() != want) for target, want in zip(self.targets, self.expected, strict=True)
        ]
        first = next(((index, int(at[0])) for index, at in enumerate(wrong) if at.size), None)
        assert first is None, f"target {first[0]} byte {first[1]} wrong: {sum(at.size for at in wrong)} bytes wrong"


CASES = {
    "64-permuted-4KiB-rows": (64, 4096, 4096),
    "6-byte-rows-at-2-bytes": (200, 6, 2),
    "48-byte-rows-at-1-byte": (150, 48, 1),
    "36-byte-rows-at-4-bytes": (150, 36, 4),
    "9000-byte-rows-two-blocks-each": (8, 9000, 8),
}


@pytest.mark.parametrize(("count", "row_bytes", "align"), CASES.values(), ids=CASES.keys())
@pytest.mark.parametrize("one_kernel", [True, False], ids=["kernel", "torch"])
def test_rows_land_where_numpy_puts_them(count: int, row_bytes: int, align: int, one_kernel: bool) -> None:
    rows = Rows(count, row_bytes, align, seed=row_bytes)
    assert rows.copy.addresses.element_bytes() == min(8, align)
    uploads: list[int] = []
    assert move_rows([rows.copy], counted(uploads), one_kernel=one_kernel) >= 1
    rows.check()
    assert len(uploads) <= 1  # every address or index of the call in one upload


def counted(uploads: list[int]) -> Callable[[np.ndarray], torch.Tensor]:
    """An ``upload`` to host memory that notes the size of each call."""

    def upload(values: np.ndarray) -> torch.Tensor:
        uploads.append(len(values))
        return torch.from_numpy(values)

    return upload


def test_a_kernel_whose_mask_drops_a_row_s_tail_fails_the_check() -> None:
    rows = Rows(8, 9000, 8, seed=1)  # 1,125 int64 a row: a second program of 101 elements, masked
    addresses, rows_count = torch.from_numpy(kernel_upload([rows.copy.addresses])), rows.copy.addresses.rows
    module = kernel_module()
    assert module is not None
    module.launch(addresses[:rows_count], addresses[rows_count:], rows_count, 9000 // 8 - 1, BLOCK_ELEMENTS, 8)
    with pytest.raises(AssertionError, match=": 64 bytes wrong"):  # the last int64 of each of the 8 rows
        rows.check()
    module.launch(addresses[:rows_count], addresses[rows_count:], rows_count, 9000 // 8, BLOCK_ELEMENTS, 8)
    rows.check()


def test_the_kernel_is_one_launch_per_row_size_and_torch_a_few_calls_per_pair_of_storages() -> None:
    small, large = Rows(40, 64, 64, seed=2), Rows(10, 512, 8, seed=3)
    assert move_rows([small.copy, large.copy, small.copy], torch.from_numpy, one_kernel=True) == 2
    small.check()
    large.check()
    pairs = len(SOURCE_BYTES) * len(TARGET_BYTES)
    assert 1 <= move_rows([large.copy], torch.from_numpy, one_kernel=False) <= 2 * pairs
    memory = RowMemory([large.sources[0], large.targets[0]])
    start, into = large.sources[0].data_ptr(), large.targets[0].data_ptr()
    run = RowAddresses(start + np.arange(100) * 64, into + np.arange(100) * 64, 64)  # one run on both sides
    assert move_rows([RowCopy(run, memory)], torch.from_numpy, one_kernel=False) == 1
    assert torch.equal(large.targets[0][:6400], large.sources[0][:6400])
    runs = RowAddresses(np.concatenate([run.sources[:50], run.sources[60:]]), run.targets[:90], 64)
    assert move_rows([RowCopy(runs, memory)], torch.from_numpy, one_kernel=False) == 2 <= FEW_RUNS


def test_rows_closer_than_their_length_are_moved_in_chunks() -> None:
    source = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
    target = torch.zeros(8192, dtype=torch.uint8)
    starts = np.array([0, 24, 8, 400, 16], dtype=np.int64)  # 64-byte rows read 8 bytes apart, overlapping
    into = np.array([640, 0, 1280, 64, 2048], dtype=np.int64)
    rows = RowCopy(RowAddresses(source.data_ptr() + starts, target.data_ptr() + into, 64), RowMemory([source, target]))
    for one_kernel in (False, True):
        target.zero_()
        move_rows([rows], torch.from_numpy, one_kernel=one_kernel)
        for at, to in zip(starts.tolist(), into.tolist(), strict=True):
            assert torch.equal(target[to : to + 64], source[at : at + 64])
        assert int(target.count_nonzero()) <= 5 * 64


def test_row_addresses_take_the_widest_element_their_alignment_allows() -> None:
    rows = RowAddresses(np.array([0x1000, 0x2000], dtype=np.int64), np.array([0x3000, 0x4008], dtype=np.int64), 64)
    assert rows.element_bytes() == 8 and rows.nbytes == 128
    odd = RowAddresses(np.array([0x1002], dtype=np.int64), np.array([0x3000], dtype=np.int64), 64)
    assert odd.element_bytes() == 2
    assert RowAddresses(np.array([0x1000], dtype=np.int64), np.array([0x3000], dtype=np.int64), 6).element_bytes() == 2
    with pytest.raises(ValueError, match="one address per row"):
        RowAddresses(np.zeros(2, dtype=np.int64), np.zeros(3, dtype=np.int64), 64)
    with pytest.raises(ValueError, match="rows of one size only"):
        RowAddresses.concat([rows, RowAddresses(rows.sources, rows.targets, 32)])


def test_the_kernel_runs_by_default_only_on_cuda_and_says_why_it_cannot_elsewhere() -> None:
    assert not kernel_available(torch.device("cpu"))
    assert use_kernel(torch.device("cpu"), None) is False
    assert use_kernel(torch.device("cpu"), True) is True  # under Triton's interpreter: the tests' way
    with pytest.raises(ValueError, match="no row kernel for memory on meta"):
        use_kernel(torch.device("meta"), True)
    assert launch_rows([RowAddresses(np.zeros(0, np.int64), np.zeros(0, np.int64), 8)], torch.from_numpy) == 0


def test_a_row_outside_the_memory_is_refused_before_anything_moves() -> None:
    source, target = torch.ones(100, dtype=torch.uint8), torch.zeros(100, dtype=torch.uint8)
    past_the_end = RowAddresses(np.array([source.data_ptr() + 60]), np.array([target.data_ptr()]), 48)
    with pytest.raises(RowsOutside, match=r"row 0 \(48 bytes at 0x[0-9a-f]+\) lies outside the tensors' memory"):
        move_rows([RowCopy(past_the_end, RowMemory([source, target]))], torch.from_numpy, one_kernel=False)
    assert not bool(target.any())
    with pytest.raises(ValueError, match="more than one device"):
        RowMemory([source, torch.zeros(4, device="meta")])
