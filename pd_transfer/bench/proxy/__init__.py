"""``bench proxy``: the latency the proxy adds, against calling the backends directly and against vLLM's router."""
