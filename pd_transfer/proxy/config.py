"""The proxy's settings (``pd-transfer proxy`` flags map onto them one to one)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ProxyConfig:
    prefill: list[str]
    decode: list[str]
    policy: str = "round_robin"
    short_prompt_tokens: int = 0  # prompts with fewer (estimated) tokens skip the prefill hop; 0: never skip
    health_interval_s: float = 5.0
    health_timeout_s: float = 2.0
    connect_timeout_s: float = 5.0
    request_timeout_s: float | None = None  # whole hop; None: unbounded (long generations)
    max_body_bytes: int = 16 * 2**20  # one request's body (a 128k-token prompt is about 1 MiB of JSON)
    max_inflight_body_bytes: int = 256 * 2**20  # all bodies being read or held at once; beyond it: 503
    header_timeout_s: float = 15.0  # a connection's request headers must arrive within this of it opening or idling
    body_timeout_s: float = 30.0  # a request's body must arrive within this of its headers
    shutdown_timeout_s: float = 5.0  # on close, how long requests in flight may finish
    # the prefills' side-channel secret, for releasing blocks no decode will read (None: the prefills have none);
    # the CLI reads it from the environment variable --handshake-secret-env names, never from the command line
    handshake_secret: str | None = None
    release_timeout_s: float = 1.0  # one release of a prefill's blocks, connection to answer
