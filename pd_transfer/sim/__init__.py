"""Stand-ins for what pd-transfer talks to: engines, peers and HTTP backends, for tests, benchmarks and demos.

Nothing in a production package imports this one (checked in ``scripts/test``); only ``bench``, ``cli`` and the
tests do. Modules that run as their own process: ``python -m pd_transfer.sim.http_standin`` (model-less
OpenAI-compatible backends), ``python -m pd_transfer.sim.kv_standin`` (backends that move real KV),
``python -m pd_transfer.sim.handshake_server`` (a side channel serving a fake engine).
"""
