"""What each engine holds, from its own KV events: vLLM's block hashes (``block_hash``), the engines' event streams
(``events``) and the index of which engine holds which prefix block in which tier (``index``). The ``kv_aware``
routing policy and the local prefill read the index (:mod:`pd_transfer.proxy.routing`)."""
