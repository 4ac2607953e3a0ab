"""``bench soak``: many requests through the proxy on a vLLM pair or on KV stand-ins, and what is left after them."""
