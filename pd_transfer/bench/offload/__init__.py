"""``bench offload``: the offload tiers against memcpy and plain files, and time to first token on vLLM servers."""
