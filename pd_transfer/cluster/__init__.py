"""A local P/D cluster: vLLM servers with PdTransferConnector plus the proxy (``pd-transfer serve`` / ``up``).

Nothing here imports vLLM: servers are launched as ``python -m vllm.entrypoints.openai.api_server`` subprocesses.
"""

from pd_transfer.cluster.launch import ServerSpec, kv_transfer_config, vllm_command, vllm_env

__all__ = ["ServerSpec", "kv_transfer_config", "vllm_command", "vllm_env"]
