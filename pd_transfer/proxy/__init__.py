"""The P/D proxy: an OpenAI-compatible HTTP server in front of prefill and decode servers (the only HTTP stack in
the package, on aiohttp; the ``proxy`` extra).

Flow, per ``/v1/completions`` or ``/v1/chat/completions`` request (streamed or not):

1. to a prefill server: the request with ``kv_transfer_params`` ``{"do_remote_decode": true, "do_remote_prefill":
   false, "remote_*": null}``, ``max_tokens`` 1 (chat: ``max_completion_tokens`` 1 too), ``stream`` false and no
   ``stream_options``;
2. from its JSON answer, ``kv_transfer_params`` (``remote_engine_id``, ``remote_block_ids``, host, port, ...);
3. to a decode server: the client's request plus those params; its answer, or its SSE stream chunk by chunk, goes
   back to the client. The client's ``X-Request-Id`` (or a new one) goes to both hops and back in the answer.

Routing, per role (:mod:`.routing`, one registry of policies): ``round_robin``, ``least_outstanding`` (fewest
requests this proxy has in flight on the backend, ties round robin), ``power_of_two``, ``cache_aware`` (a bounded
prefix tree of what was routed where) or ``kv_aware`` (the engines' KV events, :mod:`.kv`), with optional session
affinity. Every
``--health-interval`` seconds each backend's ``GET /health`` is checked; a failed
check or a connection error takes it out, a passing check puts it back. ``GET /health`` of the proxy is 200 while at
least one prefill and one decode are in, 503 otherwise, with every backend's state.

Conditional disaggregation: a prompt of fewer than ``--short-prompt-tokens`` tokens (0: off) goes straight to a
decode server, without ``kv_transfer_params``; so do batched completions (several prompts, which one set of params
cannot describe). Tokens are counted without a tokenizer (:mod:`.prompt`): token-id prompts exactly; text as
``ceil(max(1.3 x whitespace words, characters / 4))`` (words x 1.3 tracks English under BPE, characters / 4 catches
text with few spaces); chat messages add 4 tokens each for the template.

Errors, OpenAI style ``{"error": {"message", "type", "code", ...}}``: invalid JSON, a non-object body, a missing
``model`` / ``prompt`` / ``messages``, or a client-sent ``kv_transfer_params`` (the proxy owns the flow): 400. A
prefill that fails (connection error or 5xx) is retried once on another prefill server, then 502 with ``hop`` and
``backend``; a prefill answer without ``kv_transfer_params``: 502 naming them. A decode that fails before any byte
reached the client is tried once more on another decode server, then 502 with ``hop: "decode"``: one that refuses the
connection, answers a drain's 503, or answers 200 with no output and ``finish_reason: "abort"`` (its engine is
stopping) is also taken out; one that answers a 5xx stays in for its health checks to judge (:mod:`.decode_hop`).
A decode hop that timed out is not tried again. A backend's 4xx is handed back as it is. A client that goes away
cancels its handler, which closes the upstream connection: the decode server sees the disconnect and aborts the
request, freeing its blocks.

``GET /metrics`` (Prometheus, the proxy's own registry): ``pd_proxy_requests_total{endpoint,status}``,
``pd_proxy_routes_total{path}``, ``pd_proxy_errors_total{hop,kind}``, ``pd_proxy_retries_total{hop,reason}``,
``pd_proxy_hop_latency_seconds{hop}``, ``pd_proxy_request_latency_seconds{endpoint}``,
``pd_proxy_time_to_first_token_seconds{endpoint}`` (streams), ``pd_proxy_backend_in_flight{role,backend}``,
``pd_proxy_backend_healthy{role,backend}``.

Modules, by job: ``server`` (``Proxy``: the app, the backends' health checks, a request's way through the hops),
``intake`` (a body taken in), ``flow`` (checks and the hops' bodies, no HTTP), ``prompt`` (the prompt read once),
``prefill_hop`` and ``decode_hop`` (sharing ``hops``), ``upstream`` (the hops' HTTP/1.1 client), ``aborts``,
``release``, ``responses``, ``tokenize``, ``metrics``, ``config``, ``cli`` (``pd-transfer proxy`` / ``python -m
pd_transfer.proxy``); ``routing/`` (the registry of policies, a module per policy, the pools, the routing built from
the config) over ``kv/`` (the engines' KV events and the index of what each holds).
Stand-in backends live in :mod:`pd_transfer.sim`, the proxy's benchmark in :mod:`pd_transfer.bench.proxy.latency`.
"""
