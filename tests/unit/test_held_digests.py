"""connector/held_digests.py: each held request's blocks digested at its hold, and rows checked against them later."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from pd_transfer.connector.cache import KVCache
from pd_transfer.connector.held_digests import HeldDigests
from pd_transfer.connector.streams import StreamBoard
from pd_transfer.spec import KVCacheLayout, ModelFingerprint, Plane, planes_of
from pd_transfer.transfer.cma import IOVEC

MODEL = ModelFingerprint(model="held-digests", dtype="float16", num_layers=2, total_num_kv_heads=2, head_size=16)
LAYOUT = KVCacheLayout(fingerprint=MODEL, tp_size=1, tp_rank=0, block_size=16)


@pytest.fixture(params=[True, False], ids=["K and V apart", "K and V in each block"])
def cache(request: pytest.FixtureRequest) -> KVCache:
    made = KVCache.allocate(LAYOUT, 8, kv_split=request.param, huge_pages=False)
    generator = torch.Generator().manual_seed(5)
    for tensor in made.tensors:
        tensor.view(torch.uint8).copy_(torch.randint(0, 256, tensor.view(torch.uint8).shape, generator=generator))
    return made


def rows(*spans: tuple[int, int]) -> np.ndarray:
    return np.array(list(spans), dtype=IOVEC)


def block_row(plane: Plane, block: int, offset: int = 0, length: int = 0) -> tuple[int, int]:
    """A row inside ``block`` of ``plane`` (the whole block by default)."""
    return plane.base_address + block * plane.block_stride + offset, length or plane.block_len - offset


def flip(plane: Plane, block: int, offset: int) -> None:
    """Change one byte of ``block`` of ``plane`` in place."""
    byte = ctypes.c_uint8.from_address(plane.base_address + block * plane.block_stride + offset)
    byte.value ^= 0xFF


def test_rows_of_a_held_request_are_checked_against_its_hold(cache: KVCache) -> None:
    held = HeldDigests(cache)
    planes = planes_of(list(cache.regions))
    held.held("r1", (2, 5))
    assert held.blocks == 2 * len(planes)
    last = planes[-1]
    some = rows(block_row(planes[0], 2, 16, 64), block_row(last, 5))
    assert held.changed(some) == ""
    flip(last, 5, last.block_len - 1)  # the very last byte of the block: a row ending there covers it
    why = held.changed(some)
    assert f"block 5 of layer {last.layer} ({last.kind}) changed" in why and "r1" in why
    assert held.changed(rows(block_row(planes[0], 2))) == ""  # rows of other blocks: as their hold left them


def test_a_row_across_two_blocks_checks_both_and_a_block_of_no_held_request_none(cache: KVCache) -> None:
    held = HeldDigests(cache)
    plane = planes_of(list(cache.regions))[0]
    held.held("r2", (3,))
    across = rows((plane.base_address + 2 * plane.block_stride + 8, plane.block_stride))  # the end of 2, start of 3
    flip(plane, 2, 0)  # block 2: no held request's: not checked
    assert held.changed(across) == ""
    flip(plane, 3, 0)
    assert "block 3 of layer" in held.changed(across)
    outside = rows((plane.base_address - 4096, 16))  # not in the cache: nothing to check (refused elsewhere)
    assert held.changed(outside) == ""


def test_digests_follow_the_board_holds_and_ends(cache: KVCache) -> None:
    held = HeldDigests(cache)
    board = StreamBoard(MODEL.num_layers)
    board.observe(held)
    planes = len(planes_of(list(cache.regions)))
    board.held("a", [1, 2])
    board.held("b", [4])
    assert held.blocks == 3 * planes
    board.ended("a", "freed")
    assert held.blocks == planes
    board.held("b", [6, 7])  # held again elsewhere: its old blocks dropped
    assert held.blocks == 2 * planes
    board.ended("b", "expired")
    board.ended("never-held", "aborted")
    assert held.blocks == 0
