"""A source plan on the wire for push (:mod:`pd_transfer.connector.transports.nixl.push_plans`), and when a decode
asks for push."""

from __future__ import annotations

import zlib

import msgspec
import numpy as np
import pytest

from pd_transfer.connector import messages
from pd_transfer.connector.cache import KVCache
from pd_transfer.connector.transports.nixl.push_plans import (
    MAX_PUSH_ROWS,
    PushPlanError,
    check_rows_inside,
    pack_rows,
    plan_from_wire,
    plan_to_wire,
    unpack_rows,
)
from pd_transfer.settings import SettingError, Settings
from pd_transfer.spec import KVCacheLayout, ModelFingerprint
from pd_transfer.topology import PeerPlan
from pd_transfer.topology.plan import SourcePlan
from pd_transfer.transfer.tcp import is_local_address, push_mode, push_to, rdma_devices, reads_over_tcp

FINGERPRINT = ModelFingerprint(model="m", dtype="bfloat16", num_layers=32, total_num_kv_heads=8, head_size=16)
NUM_BLOCKS = 128


def source_plan() -> SourcePlan:
    """The plan of a decode rank reading 64 planes of 128 blocks each from one prefill rank (real caches)."""
    layout = KVCacheLayout(fingerprint=FINGERPRINT, tp_size=1, tp_rank=0, block_size=16)
    local, remote = KVCache.allocate(layout, NUM_BLOCKS), KVCache.allocate(layout, NUM_BLOCKS)
    plan = PeerPlan.build(layout, list(local.regions), {0: layout}, {0: list(remote.regions)})
    return plan.sources[0]


def test_a_plan_crosses_the_wire_unchanged_and_small() -> None:
    plan = source_plan()
    wire = plan_to_wire(plan)
    setup = messages.PushSetup(reader_engine_id="d", reader_rank=0, agent_metadata=b"x" * 2000, plan=wire)
    payload = messages.encode(setup)
    assert plan.local_grid.shape[0] == 64 * NUM_BLOCKS
    assert len(payload) < messages.MAX_NOTIFICATION_BYTES // 8  # 8,192 rows a side, in a notification
    back = plan_from_wire(msgspec.msgpack.decode(payload, type=messages.PushSetup).plan)
    assert np.array_equal(back.local_grid, plan.local_grid) and np.array_equal(back.remote_grid, plan.remote_grid)
    ids = ([5, 9, 100], [7, 8, 3], 40)
    for got, want in zip(back.indices(*ids), plan.indices(*ids), strict=True):
        assert np.array_equal(got, want)


def test_a_grid_that_does_not_unpack_to_its_size_is_refused() -> None:
    rows = np.array([[4096, 64, 0], [8192, 64, 0]], dtype=np.uint64)
    assert np.array_equal(unpack_rows(pack_rows(rows), 2), rows)
    for packed, count in (
        (pack_rows(rows), 3),  # fewer rows than said
        (pack_rows(rows), 1),  # more
        (b"not zlib", 2),
        (zlib.compress(bytes(1 << 24)), 2),  # a bomb: inflated only as far as two rows
        (pack_rows(rows), MAX_PUSH_ROWS + 1),
        (pack_rows(rows), 0),
    ):
        with pytest.raises(PushPlanError):
            unpack_rows(packed, count)


def test_inconsistent_plans_are_refused() -> None:
    wire = plan_to_wire(source_plan())
    for change in (
        {"num_planes": 0},
        {"unit_tokens": 3},  # blocks of 16 tokens are not whole units
        {"num_heads": 7},  # not whole units of heads
        {"local_num_blocks": NUM_BLOCKS - 1},  # the grid does not match the sizes
        {"unit_bytes": 1},  # rows of another length
        {"remote_rows": b""},
    ):
        with pytest.raises(PushPlanError):
            plan_from_wire(msgspec.structs.replace(wire, **change))


def test_rows_must_lie_inside_the_cache() -> None:
    spans = [(1000, 2000), (5000, 6000)]
    inside = np.array([[1000, 1000, 0], [5500, 500, 0]], dtype=np.uint64)
    check_rows_inside(inside, spans, "rows")
    for row in ([999, 10, 0], [1990, 20, 0], [3000, 1, 0], [6000, 1, 0], [2**64 - 8, 16, 0]):
        with pytest.raises(PushPlanError):
            check_rows_inside(np.array([row], dtype=np.uint64), spans, "rows")


def test_push_is_asked_for_only_where_reads_go_over_tcp() -> None:
    assert reads_over_tcp("tcp,self") and reads_over_tcp("tcp") and reads_over_tcp("TCP, self")
    for tls in ("", "tcp,cma,self", "rc,tcp", "^cma", "shm,tcp", "self", "all"):
        assert not reads_over_tcp(tls), tls
    assert push_to("127.0.0.1", "auto", "tcp,self") and not push_to("10.1.2.3", "off", "tcp,self")
    assert not push_to("10.1.2.3", "auto", "tcp,cma,self") and push_to("127.0.0.1", "on", "tcp,cma,self")
    # UCX_TLS unset: UCX chooses: CMA on one host, TCP to another unless RDMA is there
    assert not push_to("127.0.0.1", "auto", None) and not push_to("localhost", "auto", None)
    assert push_to("192.0.2.7", "auto", None) == (not rdma_devices())  # TEST-NET-1: never this host's
    assert is_local_address("127.0.0.2") and not is_local_address("192.0.2.7")
    assert push_mode(None, Settings()) == "auto" and push_mode(" ON ", Settings()) == "on"
    with pytest.raises(SettingError, match="PD_TRANSFER_PUSH"):
        Settings.from_environ({"PD_TRANSFER_PUSH": "sometimes"})
