"""A local P/D cluster: vLLM servers with PdTransferConnector plus the proxy (``pd-transfer serve`` / ``up``), and the
toolkit that ``up``, its demo, ``pd-transfer bench vllm`` and the tests share:

- ``launch``: a server's command line, environment and ``--kv-transfer-config``, CPU binding, its process;
- ``processes``: process groups with a log each, waiting (bounded) until healthy, log excerpts, stopping;
- ``http_client``: health, POST JSON and streamed (SSE), ``RequestFailed``, greedy completions and what their
  answers hold, Prometheus ``/metrics``, free ports (standard library only).

Nothing here imports vLLM: servers are launched as ``python -m vllm.entrypoints.openai.api_server`` subprocesses.
"""

from pd_transfer.cluster.launch import ServerSpec, kv_transfer_config, vllm_command, vllm_env

__all__ = ["ServerSpec", "kv_transfer_config", "vllm_command", "vllm_env"]
