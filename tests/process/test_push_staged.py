"""Push through host staging over real NIXL on loopback TCP: a prefill rank gathers a held request's rows chunk by
chunk into its staging pool and writes each chunk into a decode rank's landing area, which lands them in its cache
(both forced on host caches, as a GPU cache on either side would go; issue 34 item 4)."""

from __future__ import annotations

import time

import pytest
from test_push import tcp_settings  # noqa: F401 - the fixture: UCX on TCP, every request pushed

from pd_transfer.connector.cache import KVCache
from pd_transfer.connector.decode.rank import DecodeRank
from pd_transfer.connector.options import DecodeOptions, PrefillOptions
from pd_transfer.connector.prefill.rank import PrefillRank, serve_engine
from pd_transfer.settings import Settings
from pd_transfer.sim.peer import fill_pattern
from pd_transfer.sim.verify import received_correctly
from pd_transfer.spec import KVCacheLayout, ModelFingerprint

pytestmark = pytest.mark.timeout(240)

FINGERPRINT = ModelFingerprint(model="test-llama", dtype="bfloat16", num_layers=3, total_num_kv_heads=4, head_size=16)
LAYOUT = KVCacheLayout(fingerprint=FINGERPRINT, tp_size=1, tp_rank=0, block_size=16)
NUM_BLOCKS = 40
UNIT_BYTES = 4 * 16 * 16 * 2  # one plane block: the plan's row here


def test_a_staged_push_into_a_landing_area_is_exact_and_counts_as_read(tcp_settings: Settings) -> None:  # noqa: F811
    cache = KVCache.allocate(LAYOUT, NUM_BLOCKS)
    fill_pattern(cache, 21)
    prefill = PrefillRank(
        "test-push-staged",
        cache,
        PrefillOptions(settings=tcp_settings, push_staging=True, push_chunk_bytes=7 * UNIT_BYTES),
    )
    server = serve_engine("test-push-staged", [prefill.rank_metadata])
    decode = DecodeRank(
        f"test-push-landing-{time.monotonic_ns()}",
        KVCache.allocate(LAYOUT, NUM_BLOCKS),
        DecodeOptions(settings=tcp_settings, transport="nixl", push_staging=True, push_landing_bytes=2**20),
    )
    try:
        assert decode.ends["nixl"].pushes is not None and decode.ends["nixl"].pushes.landing is not None
        assert decode.push_ready(server.host, server.port, timeout_s=30)
        remote_ids, local_ids, tokens = [17, 3, 29, 8, 30, 12, 39, 0], [5, 33, 0, 21, 22, 9, 39, 14], 16 * 7 + 9
        prefill.hold("req-staged", remote_ids)
        stats = decode.pull_confirmed("req-staged", server.host, server.port, remote_ids, local_ids, tokens)
        assert stats.pushed_peers == (prefill.agent.name,) and stats.pushed_bytes == stats.bytes
        rows = len(remote_ids) * 3 * 2  # one row per block and plane (3 layers, K and V)
        assert stats.bytes == rows * UNIT_BYTES
        expected = KVCache.allocate(LAYOUT, NUM_BLOCKS)
        fill_pattern(expected, 21)
        assert received_correctly(decode.cache, local_ids, [expected], remote_ids, tokens)  # element by element
        untouched = sorted(set(range(NUM_BLOCKS)) - set(local_ids))
        assert all(bool((tensor[untouched] == 0).all()) for tensor in decode.cache.tensors)
        stager = prefill.ends["nixl"].writer.staging
        assert stager is not None and stager.chunks == -(-rows // 7)  # 7 rows a chunk, each its own WRITE
        assert decode.ends["nixl"].pushes.landing.landed_rows == rows
        assert prefill.wait_released("req-staged", timeout_s=10) is not None  # the write counted as the report
        assert [(f.request_id, f.reason) for f in prefill.take_freed()] == [("req-staged", "read")]
        assert prefill.ledger.held_requests == 0  # unpinned and freed
        assert decode.confirmations.received == 0  # no LeaseConfirm: the write proved the lease
    finally:
        decode.close()
        server.stop()
        prefill.close()
