"""Digests of rows where they sit (:mod:`pd_transfer.transfer.digests`): the bytes of IOVEC rows hashed in order as
one stream, equal to XXH3-64 of their concatenation; and which groups each ``verify`` mode checks."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import xxhash

from pd_transfer.connector.transports.tcp.frames import TcpOffer, decode_offer, encode_offer
from pd_transfer.transfer.cma import entries_of
from pd_transfer.transfer.digests import SAMPLE_EVERY, groups_to_verify, rows_digest, span_digest


def rows_of(buffer: np.ndarray, starts: list[int], length: int) -> np.ndarray:
    return entries_of(np.array([buffer.ctypes.data + start for start in starts], dtype=np.uint64), length)


def test_a_digest_is_xxh3_of_the_rows_bytes_in_order() -> None:
    buffer = np.random.default_rng(42).integers(0, 256, 4096, dtype=np.uint8)
    rows = rows_of(buffer, [1024, 0, 3000], 96)
    expected = xxhash.xxh3_64_intdigest(
        buffer[1024:1120].tobytes() + buffer[:96].tobytes() + buffer[3000:3096].tobytes()
    )
    assert rows_digest(rows) == expected
    assert rows_digest(rows[[1, 0, 2]]) != expected  # the same bytes in another order
    assert rows_digest(rows[:0]) == xxhash.xxh3_64_intdigest(b"")
    buffer[3095] ^= 1  # one bit of the last row
    assert rows_digest(rows) != expected


def test_a_span_digest_is_the_digest_of_that_one_row() -> None:
    memory = np.random.default_rng(3).integers(0, 256, 5000, dtype=np.uint8)
    base = memory.ctypes.data
    for start, length in ((0, 5000), (17, 1), (4096, 904), (100, 0)):
        assert span_digest(base + start, length) == rows_digest(entries_of(np.array([base + start]), length))
        assert span_digest(base + start, length) == xxhash.xxh3_64_intdigest(memory[start : start + length].tobytes())


@pytest.mark.parametrize("groups", [1, 3, SAMPLE_EVERY, 33, 64])
def test_sampling_checks_at_least_one_group_a_request_and_every_group_over_as_many_requests(groups: int) -> None:
    turns = min(SAMPLE_EVERY, groups)
    picked = [groups_to_verify("sample", groups, turn) for turn in range(turns)]
    assert all(picked_now for picked_now in picked)
    assert sorted(index for now in picked for index in now) == list(range(groups))  # each once over the turns
    assert groups_to_verify("sample", groups, turns) == picked[0]
    assert groups_to_verify("all", groups, 5) == list(range(groups))
    assert groups_to_verify("off", groups, 5) == []


def test_a_verify_mode_that_is_none_is_refused() -> None:
    with pytest.raises(ValueError, match="none of all, sample, off"):
        groups_to_verify("some", 4, 0)


def test_an_offer_of_a_prefill_before_digests_asks_for_none() -> None:
    assert decode_offer(msgspec.msgpack.encode({"port": 5000})) == TcpOffer(port=5000, digests=False)
    assert decode_offer(encode_offer(5000)).digests
