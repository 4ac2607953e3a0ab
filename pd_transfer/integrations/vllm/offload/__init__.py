"""``PdOffloadConnector``'s modules: the connector vLLM loads (from ``pd_transfer.integrations.vllm``, which
re-exports it), its scheduler and worker halves, its configuration, KV events and metrics."""
