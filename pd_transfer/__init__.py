"""pd-transfer: moves an LLM's KV cache from prefill workers to decode workers over NIXL."""

__version__ = "0.1.0"
