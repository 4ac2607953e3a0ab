"""Push through host staging (issue 34 item 4) on host tensors: rows gathered and scattered by address (the row
mover's Triton kernel under Triton's interpreter, and torch), a prefill's chunked staging pool, a decode's landing
area, and a request pushed end to end through both with fake agents, checked element by element against the
prefill's cache."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from pd_transfer.connector import messages
from pd_transfer.connector.cache import KVCache
from pd_transfer.connector.decode.rank import DecodeRank
from pd_transfer.connector.options import DecodeOptions, PrefillOptions
from pd_transfer.connector.prefill.rank import PrefillRank, serve_engine
from pd_transfer.connector.transports.nixl.push_staging import LandingArea, PushStager, StagedChunk
from pd_transfer.handshake import HandshakeServer
from pd_transfer.rows import AddressedRows
from pd_transfer.settings import DEFAULTS, Settings
from pd_transfer.sim.peer import fill_pattern
from pd_transfer.sim.verify import received_correctly
from pd_transfer.spec import KVCacheLayout, ModelFingerprint
from pd_transfer.transfer.agent_protocol import AgentFactory

pytestmark = pytest.mark.timeout(60)

FINGERPRINT = ModelFingerprint(model="test-llama", dtype="bfloat16", num_layers=3, total_num_kv_heads=4, head_size=16)
LAYOUT = KVCacheLayout(fingerprint=FINGERPRINT, tp_size=1, tp_rank=0, block_size=16)
NUM_BLOCKS = 32
UNIT_BYTES = 4 * 16 * 16 * 2  # a plane block of this layout: 4 heads x 16 tokens x 16 x bf16


def _tensors() -> list[torch.Tensor]:
    """Three storages: rows of 48 bytes live in them at scattered, 16-byte-aligned and odd offsets."""
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator) for size in (4096, 1000, 777)]


def _read_rows(tensors: list[torch.Tensor], addresses: np.ndarray, row_bytes: int) -> list[bytes]:
    """The bytes now at each of ``addresses`` (each inside one of ``tensors``), read with numpy."""
    out = []
    for address in addresses.tolist():
        (tensor,) = [t for t in tensors if 0 <= address - t.data_ptr() < t.numel()]
        offset = address - tensor.data_ptr()
        out.append(tensor.numpy()[offset : offset + row_bytes].tobytes())
    return out


def _rows(tensors: list[torch.Tensor], row_bytes: int) -> tuple[np.ndarray, list[bytes]]:
    """Addresses of rows in every tensor, interleaved across them, and each row's bytes (read with numpy)."""
    picks = [(0, 0), (2, 3), (1, 16), (0, 1024), (2, 500), (0, 64), (1, 900), (0, 4096 - row_bytes), (1, 700)]
    addresses = np.array([tensors[t].data_ptr() + offset for t, offset in picks], dtype=np.int64)
    expected = [tensors[t].numpy()[offset : offset + row_bytes].tobytes() for t, offset in picks]
    return addresses, expected


@pytest.mark.parametrize("one_kernel", [True, False], ids=["kernel", "torch"])
def test_rows_by_address_gather_and_scatter_back(one_kernel: bool) -> None:
    tensors = _tensors()
    rows = AddressedRows(tensors, one_kernel=one_kernel)
    row_bytes = 48
    addresses, expected = _rows(tensors, row_bytes)
    packed = torch.zeros(len(addresses) * row_bytes + 5, dtype=torch.uint8)
    rows.gather(addresses, row_bytes, packed)
    assert packed.numpy()[: len(expected) * row_bytes].tobytes() == b"".join(expected)
    assert packed.numpy()[-5:].tolist() == [0] * 5
    # scattered back, reversed: each row lands at its address, nothing else changes
    before = [tensor.clone() for tensor in tensors]
    flipped = torch.from_numpy(packed.numpy()[: len(expected) * row_bytes].reshape(-1, row_bytes)[::-1].copy())
    rows.scatter(addresses, row_bytes, flipped.reshape(-1))
    assert _read_rows(tensors, addresses, row_bytes) == expected[::-1]
    untouched = np.ones(sum(t.numel() for t in tensors), dtype=bool)
    starts = np.cumsum([0] + [t.numel() for t in tensors])
    for address in addresses.tolist():
        for index, tensor in enumerate(tensors):
            offset = address - tensor.data_ptr()
            if 0 <= offset < tensor.numel():
                untouched[starts[index] + offset : starts[index] + offset + row_bytes] = False
    now = np.concatenate([t.numpy() for t in tensors])
    was = np.concatenate([t.numpy() for t in before])
    assert np.array_equal(now[untouched], was[untouched])


def test_rows_outside_the_tensors_are_refused() -> None:
    tensors = _tensors()
    rows = AddressedRows(tensors, one_kernel=False)
    outside = np.array([tensors[1].data_ptr() + 1000 - 8], dtype=np.int64)  # runs past the storage's end
    with pytest.raises(ValueError, match="outside"):
        rows.gather(outside, 48, torch.zeros(48, dtype=torch.uint8))
    with pytest.raises(ValueError, match="bytes for"):
        rows.gather(np.array([tensors[0].data_ptr()], dtype=np.int64), 48, torch.zeros(47, dtype=torch.uint8))


@pytest.mark.parametrize("one_kernel", [True, False], ids=["kernel", "torch"])
def test_the_stager_sends_every_chunk_staged_in_order_through_its_slots(one_kernel: bool) -> None:
    tensors = _tensors()
    row_bytes = 48
    addresses, expected = _rows(tensors, row_bytes)
    addresses, expected = np.tile(addresses, 3), expected * 3  # 27 rows: 7 chunks of 4 through 3 slots
    stager = PushStager(tensors, chunk_bytes=4 * row_bytes + 10, slots=3, one_kernel=one_kernel)
    grid = stager.pool_rows(row_bytes)
    assert len(grid) == 3 * 4 and set(grid[:, 1].tolist()) == {row_bytes}
    got: list[bytes] = []
    seen: list[StagedChunk] = []

    def send(chunk: StagedChunk) -> None:
        seen.append(chunk)
        for row in chunk.pool_rows.tolist():
            address = int(grid[row, 0])
            start = address - stager.pool_span()[0]
            got.append(bytes(memoryview(stager.pool.numpy())[start : start + row_bytes]))

    assert stager.push(addresses, row_bytes, time.perf_counter() + 10, send) == 7
    assert got == expected
    assert [(c.start, c.end) for c in seen] == [(s, min(s + 4, 27)) for s in range(0, 27, 4)]
    assert [c.last for c in seen] == [False] * 6 + [True]
    assert [int(c.pool_rows[0]) // 4 for c in seen] == [0, 1, 2, 0, 1, 2, 0]  # slots in turn


def test_a_failed_send_stops_the_push() -> None:
    tensors = _tensors()
    addresses, _ = _rows(tensors, 48)
    stager = PushStager(tensors, chunk_bytes=96, slots=2, one_kernel=False)
    sent: list[int] = []

    def send(chunk: StagedChunk) -> None:
        sent.append(chunk.start)
        if len(sent) == 2:
            raise RuntimeError("the write failed")

    with pytest.raises(RuntimeError, match="the write failed"):
        stager.push(addresses, 48, time.perf_counter() + 10, send)
    assert sent == [0, 2]


@pytest.mark.parametrize("one_kernel", [True, False], ids=["kernel", "torch"])
def test_the_landing_area_lands_rows_at_their_addresses(one_kernel: bool) -> None:
    tensors = _tensors()
    row_bytes = 48
    addresses, _ = _rows(tensors, row_bytes)
    area = LandingArea(tensors, landing_bytes=4096, chunk_bytes=100, one_kernel=one_kernel)
    at, capacity = area.part(1, 2, row_bytes)
    assert capacity == 2048 // row_bytes and at == area.span[0] + 2048
    payload = np.random.default_rng(1).integers(0, 256, len(addresses) * row_bytes, dtype=np.uint8)
    area.area.numpy()[2048 : 2048 + payload.size] = payload
    area.land(at, addresses, row_bytes, time.perf_counter() + 10)
    assert b"".join(_read_rows(tensors, addresses, row_bytes)) == payload.tobytes()
    assert area.landed_rows == len(addresses)
    with pytest.raises(ValueError, match="not inside the landing area"):
        area.land(area.span[1] - row_bytes, addresses[:2], row_bytes, time.perf_counter() + 10)


def test_a_setup_with_a_landing_area_leaves_older_setups_unchanged() -> None:
    # a setup without landing fields encodes as before (an older prefill decodes it); one with them carries them
    plan = messages.PushPlan(0, 0, 4, 4, 16, 16, UNIT_BYTES, 6, 16, 16, 32, 32, b"", b"")
    plain = messages.PushSetup(reader_engine_id="d", reader_rank=0, agent_metadata=b"m", plan=plan)
    assert b"landing" not in messages.encode(plain)
    landing = messages.PushSetup(
        reader_engine_id="d", reader_rank=0, agent_metadata=b"m", plan=plan, landing_address=4096, landing_rows=9
    )
    back = messages.decode(messages.encode(landing))
    assert isinstance(back, messages.PushSetup) and (back.landing_address, back.landing_rows) == (4096, 9)


# ---------------------------------------------------------------------------------------------- end to end
class StagedPrefill:
    """A prefill rank in this process pushing through its staging pool (forced on its host cache), small chunks."""

    def __init__(self, engine_id: str, agents: AgentFactory, *, staging: bool = True) -> None:
        cache = KVCache.allocate(LAYOUT, NUM_BLOCKS)
        fill_pattern(cache, 7)
        self.rank = PrefillRank(
            engine_id,
            cache,
            PrefillOptions(settings=DEFAULTS, push_staging=staging, push_chunk_bytes=5 * UNIT_BYTES),
            agent_factory=agents,
        )
        self.server: HandshakeServer = serve_engine(engine_id, [self.rank.rank_metadata])
        self.host, self.port = "127.0.0.1", self.server.port

    def expected(self) -> list[KVCache]:
        cache = KVCache.allocate(LAYOUT, NUM_BLOCKS)
        fill_pattern(cache, 7)
        return [cache]

    def close(self) -> None:
        self.server.stop()
        self.rank.close()


@pytest.fixture
def staged_prefill(agent_factory: AgentFactory) -> Iterator[StagedPrefill]:
    made = StagedPrefill(f"staged-prefill-{time.monotonic_ns()}", agent_factory)
    try:
        yield made
    finally:
        made.close()


def _decode(name: str, agents: AgentFactory, *, landing: bool, landing_bytes: int = 2**20) -> DecodeRank:
    return DecodeRank(
        f"{name}-{time.monotonic_ns()}",
        KVCache.allocate(LAYOUT, NUM_BLOCKS),
        DecodeOptions(
            push="on",
            settings=Settings(push_min_bytes=0),
            transport="nixl",
            push_staging=landing,
            push_landing_bytes=landing_bytes,
        ),
        agent_factory=agents,
    )


@pytest.mark.parametrize("landing", [True, False], ids=["into-landing", "into-cache"])
def test_a_staged_push_lands_every_element_and_counts_as_read(
    agent_factory: AgentFactory, staged_prefill: StagedPrefill, landing: bool
) -> None:
    decode = _decode("staged-decode", agent_factory, landing=landing)
    try:
        assert decode.push_ready(staged_prefill.host, staged_prefill.port, timeout_s=10)
        remote_ids, local_ids, tokens = [17, 3, 29, 8, 30, 12], [5, 31, 0, 21, 22, 9], 16 * 5 + 7
        staged_prefill.rank.hold("staged", remote_ids)
        stats = decode.pull_confirmed("staged", staged_prefill.host, staged_prefill.port, remote_ids, local_ids, tokens)
        assert stats.pushed_peers == (staged_prefill.rank.agent.name,) and stats.pushed_bytes == stats.bytes > 0
        assert received_correctly(decode.cache, local_ids, staged_prefill.expected(), remote_ids, tokens)
        untouched = sorted(set(range(NUM_BLOCKS)) - set(local_ids))
        assert all(bool((tensor[untouched] == 0).all()) for tensor in decode.cache.tensors)
        stager = staged_prefill.rank.ends["nixl"].writer.staging
        rows = 6 * 3 * 2  # blocks x layers x (K, V): one unit per plane block
        assert stager is not None and stager.chunks == -(-rows // 5)  # 5 rows a chunk
        assert decode.ends["nixl"].pushes is not None
        assert (
            decode.ends["nixl"].pushes.landing.landed_rows if decode.ends["nixl"].pushes.landing is not None else rows
        ) == rows
        assert staged_prefill.rank.wait_released("staged", timeout_s=10) is not None
        freed = staged_prefill.rank.take_freed()
        assert [(f.request_id, f.reason) for f in freed] == [("staged", "read")]  # unpinned, lease ended as read
        assert staged_prefill.rank.ledger.held_requests == 0
        assert decode.confirmations.received == 0  # the write proved the lease
    finally:
        decode.close()


def test_a_request_larger_than_the_landing_part_is_read(agent_factory: AgentFactory) -> None:
    # an unstaged prefill (host cache) writes straight from its cache into the landing area; what does not fit is read
    prefill = StagedPrefill(f"plain-prefill-{time.monotonic_ns()}", agent_factory, staging=False)
    decode = _decode("small-landing", agent_factory, landing=True, landing_bytes=6 * UNIT_BYTES + 256)  # 6 rows
    try:
        assert decode.push_ready(prefill.host, prefill.port, timeout_s=10)
        prefill.rank.hold("too-large", [4, 5])  # 12 rows
        stats = decode.pull_confirmed("too-large", prefill.host, prefill.port, [4, 5], [6, 7], 32)
        assert stats.pushed_peers == ()
        assert received_correctly(decode.cache, [6, 7], prefill.expected(), [4, 5], 32)
        prefill.rank.hold("fits", [9])  # 6 rows: one block of 3 layers' K and V
        stats = decode.pull_confirmed("fits", prefill.host, prefill.port, [9], [1], 16)
        assert stats.pushed_peers == (prefill.rank.agent.name,)
        assert received_correctly(decode.cache, [1], prefill.expected(), [9], 16)
        assert decode.ends["nixl"].pushes is not None and decode.ends["nixl"].pushes.landing is not None
        assert decode.ends["nixl"].pushes.landing.landed_rows == 6
    finally:
        decode.close()
        prefill.close()
