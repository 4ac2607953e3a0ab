"""``bench vllm``: PdTransferConnector against vLLM's NixlConnector on real vLLM servers, and its 8B-geometry run."""
