"""Huge pages for memory in this process, on the real kernel (no NIXL): the aligned runs of a span, a cache tensor is
in huge pages from its first write, ``PD_TRANSFER_HUGE_PAGES`` switches the advice and says whose memory is advised.
``MADV_COLLAPSE`` keeping every byte (in a fresh process), and registered memory read by another process while it
collapses: tests/process/test_huge_pages.py."""

from __future__ import annotations

import mmap

import pytest
import torch

from pd_transfer.connector.cache import KVCache, zeroed_host_tensor
from pd_transfer.settings import SettingError, Settings
from pd_transfer.spec import KVCacheLayout, ModelFingerprint
from pd_transfer.transfer.huge_pages import (
    HUGE_PAGE_BYTES,
    advise_huge_pages,
    aligned_runs,
    resident_huge_page_bytes,
    thp_mode,
)

MIB = 2**20


def span_of(tensor: torch.Tensor) -> tuple[int, int]:
    return tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size()


needs_thp = pytest.mark.skipif(thp_mode() in {"never", "unknown"}, reason="the kernel gives no transparent huge pages")


def test_aligned_runs_are_the_whole_huge_pages_inside_each_span() -> None:
    h = HUGE_PAGE_BYTES
    assert aligned_runs([(0, h)]) == [(0, h)]
    assert aligned_runs([(1, 3 * h - 1)]) == [(h, 2 * h)]
    assert aligned_runs([(h + 1, 2 * h + 5)]) == []  # no whole aligned huge page inside
    assert aligned_runs([(5 * h, 9 * h + 7), (0, 10)]) == [(5 * h, 9 * h)]


def _kernel_gives_huge_pages_now() -> bool:
    """Whether a fresh private mapping, advised and written, gets huge pages at this moment (a fragmented host can
    have none free: then no advice can give them)."""
    mapping = mmap.mmap(-1, 8 * MIB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        probe = torch.frombuffer(mapping, dtype=torch.uint8)
        advise_huge_pages([span_of(probe)])
        probe.fill_(1)
        got = resident_huge_page_bytes([span_of(probe)]) > 0
        del probe
        return got
    finally:
        mapping.close()


@needs_thp
def test_a_cache_tensor_is_in_huge_pages_from_its_first_write() -> None:
    tensor = zeroed_host_tensor((32 * MIB,), torch.uint8)
    assert int(tensor.count_nonzero()) == 0
    resident = resident_huge_page_bytes([span_of(tensor)])
    if resident == 0 and not _kernel_gives_huge_pages_now():
        pytest.skip("the kernel has no free huge pages right now (fragmented memory): no advice can give them")
    assert resident >= 28 * MIB


def test_the_switch_turns_the_advice_off() -> None:
    off = Settings.from_environ({"PD_TRANSFER_HUGE_PAGES": "0"})
    tensor = zeroed_host_tensor((32 * MIB,), torch.uint8, huge_pages=off.own_huge_pages)
    assert int(tensor.count_nonzero()) == 0
    if thp_mode() == "madvise":  # unadvised memory gets no huge pages in this mode
        assert resident_huge_page_bytes([span_of(tensor)]) == 0


def test_the_mode_says_whose_memory_is_advised() -> None:
    def mode(text: str) -> tuple[str, bool, bool]:
        settings = Settings.from_environ({"PD_TRANSFER_HUGE_PAGES": text})
        return settings.huge_pages, settings.own_huge_pages, settings.registered_huge_pages

    assert mode("") == ("own", True, False)
    assert mode("all") == ("all", True, True)
    assert mode("off") == ("0", False, False)
    with pytest.raises(SettingError, match="PD_TRANSFER_HUGE_PAGES must be one of own, all, 0"):
        mode("sometimes" * 10)


@needs_thp
def test_a_cache_allocated_with_the_switch_off_is_not_advised() -> None:
    if thp_mode() != "madvise":
        pytest.skip(
            f"transparent huge pages are {thp_mode()!r} here: only in madvise mode does unadvised memory stay small"
        )
    fingerprint = ModelFingerprint(model="m", dtype="float32", num_layers=1, total_num_kv_heads=8, head_size=128)
    layout = KVCacheLayout(fingerprint=fingerprint, tp_size=1, tp_rank=0, block_size=16)
    cache = KVCache.allocate(layout, 512, huge_pages=False)  # 32 MiB per plane
    spans = [(region.base_address, region.base_address + region.span_bytes) for region in cache.regions]
    assert resident_huge_page_bytes(spans) == 0
