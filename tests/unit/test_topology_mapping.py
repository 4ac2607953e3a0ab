"""Head mapping between prefill and decode TP ranks: head_sources, expected_readers, check_compatible."""

from __future__ import annotations

import itertools

import msgspec
import pytest
from topology_sim import fingerprint

from pd_transfer.spec import KVCacheLayout
from pd_transfer.topology import (
    HeadSource,
    TopologyError,
    check_compatible,
    expected_readers,
    head_sources,
    holders,
)


def layout(heads: int, tp: int, rank: int, block: int = 16, mla: bool = False, **changes) -> KVCacheLayout:
    model = msgspec.structs.replace(fingerprint(heads, mla=mla), **changes)
    return KVCacheLayout(model, tp, rank, block)


def sources(heads: int, local_tp: int, rank: int, remote_tp: int, mla: bool = False) -> list[HeadSource]:
    return head_sources(layout(heads, local_tp, rank, mla=mla), remote_tp)


class TestHeadSources:
    def test_same_tp_reads_own_rank(self) -> None:
        assert sources(8, 2, 1, 2) == [HeadSource(1, 4, 4)]

    def test_decode_tp1_reads_both_halves_of_prefill_tp2(self) -> None:
        assert sources(8, 1, 0, 2) == [HeadSource(0, 0, 4), HeadSource(1, 4, 4)]

    def test_decode_tp2_reads_its_half_of_prefill_tp1(self) -> None:
        assert sources(8, 2, 0, 1) == [HeadSource(0, 0, 4)]
        assert sources(8, 2, 1, 1) == [HeadSource(0, 4, 4)]

    def test_replicated_prefill_heads_spread_by_decode_rank(self) -> None:
        # Prefill TP 8 with 2 KV heads: head 0 on ranks 0-3, head 1 on ranks 4-7. Decode rank d reads head h
        # from candidates[d % 4]: decode TP 2 reads ranks 0 and 5.
        assert holders(fingerprint(2), 8, 0) == range(0, 4)
        assert holders(fingerprint(2), 8, 1) == range(4, 8)
        assert sources(2, 2, 0, 8) == [HeadSource(0, 0, 1)]
        assert sources(2, 2, 1, 8) == [HeadSource(5, 1, 1)]
        assert sources(2, 1, 0, 8) == [HeadSource(0, 0, 1), HeadSource(4, 1, 1)]
        assert [sources(2, 4, d, 8) for d in range(4)] == [
            [HeadSource(0, 0, 1)],
            [HeadSource(1, 0, 1)],
            [HeadSource(6, 1, 1)],
            [HeadSource(7, 1, 1)],
        ]

    def test_replicated_on_both_sides_pairs_ranks(self) -> None:
        assert [sources(2, 8, d, 8) for d in range(8)] == [[HeadSource(d, d // 4, 1)] for d in range(8)]

    def test_replicated_decode_heads_read_one_prefill_rank(self) -> None:
        # Decode TP 4 with 2 heads: ranks 0, 1 hold head 0; ranks 2, 3 hold head 1. Prefill TP 1 holds both.
        assert [sources(2, 4, d, 1) for d in range(4)] == [[HeadSource(0, d // 2, 1)] for d in range(4)]

    def test_tp_sizes_that_do_not_divide_each_other(self) -> None:
        # 12 heads: decode TP 4 holds 3 heads per rank, prefill TP 6 holds 2.
        assert sources(12, 4, 0, 6) == [HeadSource(0, 0, 2), HeadSource(1, 2, 1)]
        assert sources(12, 4, 1, 6) == [HeadSource(1, 3, 1), HeadSource(2, 4, 2)]
        assert sources(12, 6, 1, 4) == [HeadSource(0, 2, 1), HeadSource(1, 3, 1)]

    def test_mla_reads_rank_d_mod_prefill_tp(self) -> None:
        assert [sources(1, 4, d, 2, mla=True) for d in range(4)] == [[HeadSource(d % 2, 0, 1)] for d in range(4)]
        assert [sources(1, 2, d, 4, mla=True) for d in range(2)] == [[HeadSource(d, 0, 1)] for d in range(2)]

    @pytest.mark.parametrize("heads", [1, 2, 3, 4, 6, 8, 12])
    @pytest.mark.parametrize("local_tp", [1, 2, 3, 4, 6, 8, 12, 24])
    @pytest.mark.parametrize("remote_tp", [1, 2, 3, 4, 6, 8, 12, 24])
    def test_sources_partition_the_local_heads(self, heads: int, local_tp: int, remote_tp: int) -> None:
        if any(heads % tp and tp % heads for tp in (local_tp, remote_tp)):
            with pytest.raises(TopologyError):
                sources(heads, local_tp, 0, remote_tp)
            return
        for rank in range(local_tp):
            local = layout(heads, local_tp, rank)
            found = sources(heads, local_tp, rank, remote_tp)
            read = [h for s in found for h in range(s.first_global_head, s.first_global_head + s.num_heads)]
            first = local.first_global_head
            assert read == list(range(first, first + local.num_local_heads))
            for source in found:
                remote = layout(heads, remote_tp, source.remote_rank)
                assert remote.first_global_head <= source.first_global_head
                assert source.first_global_head + source.num_heads <= remote.first_global_head + remote.num_local_heads
            # consecutive sources never share a rank (they would have been merged)
            assert all(a.remote_rank != b.remote_rank for a, b in itertools.pairwise(found))

    def test_refuses_impossible_tp(self) -> None:
        with pytest.raises(TopologyError, match="prefill TP size 3 does not divide 8 KV heads"):
            sources(8, 2, 0, 3)
        with pytest.raises(TopologyError, match="decode TP size 3 does not divide 8 KV heads"):
            sources(8, 3, 0, 2)


class TestExpectedReaders:
    @staticmethod
    def readers(heads: int, remote_tp: int, local_tp: int, mla: bool = False) -> list[int]:
        remote = layout(heads, remote_tp, 0, mla=mla)
        return [expected_readers(rank, remote, local_tp) for rank in range(remote_tp)]

    def test_counts(self) -> None:
        assert self.readers(8, 1, 1) == [1]
        assert self.readers(8, 2, 1) == [1, 1]
        assert self.readers(8, 1, 4) == [4]
        assert self.readers(8, 2, 4) == [2, 2]
        assert self.readers(2, 8, 2) == [1, 0, 0, 0, 0, 1, 0, 0]
        assert self.readers(2, 8, 4) == [1, 1, 0, 0, 0, 0, 1, 1]
        assert self.readers(2, 8, 8) == [1] * 8
        assert self.readers(2, 4, 8) == [2, 2, 2, 2]
        assert self.readers(12, 6, 4) == [1, 2, 1, 1, 2, 1]
        assert self.readers(1, 4, 2, mla=True) == [1, 1, 0, 0]
        assert self.readers(1, 2, 4, mla=True) == [2, 2]

    @pytest.mark.parametrize("heads", [1, 2, 4, 8])
    @pytest.mark.parametrize("local_tp", [1, 2, 4, 8, 16])
    @pytest.mark.parametrize("remote_tp", [1, 2, 4, 8, 16])
    def test_sum_matches_sources(self, heads: int, local_tp: int, remote_tp: int) -> None:
        per_decode = [{s.remote_rank for s in sources(heads, local_tp, rank, remote_tp)} for rank in range(local_tp)]
        readers = self.readers(heads, remote_tp, local_tp)
        assert sum(readers) == sum(len(ranks) for ranks in per_decode)
        for rank in range(remote_tp):
            assert readers[rank] == sum(rank in ranks for ranks in per_decode)
        if remote_tp <= heads or local_tp >= remote_tp:
            assert min(readers) >= 1  # nobody is left unread unless replicas outnumber decode ranks

    def test_ignores_the_layouts_own_rank(self) -> None:
        assert expected_readers(1, layout(8, 2, 0), 1) == expected_readers(1, layout(8, 2, 1), 1) == 1

    def test_refuses_bad_arguments(self) -> None:
        with pytest.raises(TopologyError, match="prefill rank 2 is outside prefill TP size 2"):
            expected_readers(2, layout(8, 2, 0), 1)
        with pytest.raises(TopologyError, match="decode TP size 3 does not divide 8 KV heads"):
            expected_readers(0, layout(8, 2, 0), 3)


class TestCheckCompatible:
    @pytest.mark.parametrize(
        ("local", "remote"),
        [
            (layout(8, 1, 0), layout(8, 8, 3)),
            (layout(8, 16, 15), layout(8, 2, 1)),
            (layout(2, 8, 7, block=64), layout(2, 4, 0, block=16)),
            (layout(12, 4, 0, block=16), layout(12, 6, 5, block=128)),
            (layout(1, 8, 0, mla=True), layout(1, 3, 2, mla=True)),
        ],
    )
    def test_accepts(self, local: KVCacheLayout, remote: KVCacheLayout) -> None:
        check_compatible(local, remote)

    def test_model_name_is_not_a_geometry_fact(self) -> None:
        check_compatible(layout(8, 1, 0), layout(8, 1, 0, model="another/path"))

    @pytest.mark.parametrize(
        ("local", "remote", "message"),
        [
            (layout(8, 3, 0), layout(8, 1, 0), "decode TP size 3 does not divide 8 KV heads"),
            (layout(8, 2, 0), layout(8, 5, 0), "prefill TP size 5 does not divide 8 KV heads"),
            (layout(8, 12, 0), layout(8, 1, 0), "decode TP size 12 does not divide 8 KV heads"),
            (layout(8, 1, 0), layout(8, 1, 0, dtype="float16"), "dtype differs: decode 'float32' != prefill 'float16'"),
            (layout(8, 1, 0), layout(8, 1, 0, head_size=16), "head_size differs: decode 8 != prefill 16"),
            (layout(8, 1, 0), layout(8, 1, 0, num_layers=3), "num_layers differs: decode 2 != prefill 3"),
            (layout(8, 1, 0), layout(4, 1, 0), "total_num_kv_heads differs: decode 8 != prefill 4"),
            (layout(1, 1, 0), layout(1, 1, 0, mla=True), "use_mla differs: decode False != prefill True"),
            (
                layout(8, 1, 0, block=16),
                layout(8, 1, 0, block=24),
                "block sizes do not nest: decode 16 tokens and prefill 24 tokens",
            ),
            (layout(8, 2, 2), layout(8, 1, 0), "decode TP rank 2 is outside TP size 2"),
            (layout(8, 1, 0, block=0), layout(8, 1, 0), "decode block size 0"),
            (layout(8, 1, 0, dtype="float64"), layout(8, 1, 0, dtype="float64"), "unsupported KV dtype 'float64'"),
        ],
    )
    def test_refuses_naming_the_numbers(self, local: KVCacheLayout, remote: KVCacheLayout, message: str) -> None:
        with pytest.raises(TopologyError, match=message.replace("(", r"\(")) as info:
            check_compatible(local, remote)
        assert isinstance(info.value, ValueError)

    def test_reports_every_problem_at_once(self) -> None:
        with pytest.raises(TopologyError) as info:
            check_compatible(layout(8, 3, 0, block=16), layout(8, 1, 0, block=24, dtype="bfloat16"))
        text = str(info.value)
        assert "decode TP size 3" in text and "dtype differs" in text and "block sizes do not nest" in text
