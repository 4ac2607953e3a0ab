"""The proxy's settings (``pd-transfer proxy`` flags map onto them one to one)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ProxyConfig:
    prefill: list[str]
    decode: list[str]
    policy: str = "round_robin"
    prefill_policy: str | None = None  # None: ``policy``
    decode_policy: str | None = None  # None: ``policy``
    # cache_aware and kv_aware (pd_transfer.proxy.routing.cache_aware, .kv_aware)
    cache_threshold: float = 0.5  # cache_aware: the share of a prompt's chunks that must match to follow the match
    balance_abs_threshold: int = 32  # out of balance: the busiest has more than this many requests over the idlest
    balance_rel_threshold: float = 1.5  # ... and more than this times the idlest's count
    max_tree_size: int = 1 << 20  # cache_aware: prefix tree nodes per pool (LRU past it)
    # session affinity: a request's session (the header, else the body's "user") sticks to its backend while used
    # within session_ttl_s (0: off)
    session_ttl_s: float = 0.0
    session_header: str = "X-Session-Id"
    max_sessions: int = 100_000
    # kv_aware: the engines' KV event streams, "URL=tcp://HOST:PORT[,tcp://HOST:REPLAY_PORT]" (URL: a backend's)
    kv_event_sources: list[str] = field(default_factory=list)
    kv_block_size: int = 16  # the engines' --block-size
    kv_hash_algo: str = "sha256"  # the engines' --prefix-caching-hash-algo
    kv_hash_seed: str | None = None  # the engines' PYTHONHASHSEED (None: unset there)
    kv_penalty_host: float = 0.8  # credit of a block in an engine's host tier (its own cache: 1.0)
    kv_penalty_shared: float = 0.6  # ... in the shared directory tier (medium DISK), to every engine mounting it
    kv_penalty_disk: float = 0.3  # ... on a disk only its engine reads (with kv_shared_directory False)
    kv_shared_directory: bool = True  # the engines' DISK medium is a directory they all mount
    kv_max_blocks: int = 4_000_000  # (engine, block) entries the index holds at most
    kv_routed_ttl_s: float = 10.0  # a block just routed to an engine counts as its own this long (events lag)
    kv_silence_s: float = 30.0  # a stream silent this long is probed on its replay endpoint (no answer: dropped)
    # kv_aware: text and chat prompts tokenized by a backend's POST /tokenize (pd_transfer.proxy.tokenize), for the
    # pools whose policy needs token ids (kv_aware); False: such prompts go to the least busy
    tokenize: bool = True
    tokenize_timeout_s: float = 1.0  # one /tokenize call, connection to answer; past it the prompt goes without ids

    def policy_of(self, role: str) -> str:
        chosen = self.prefill_policy if role == "prefill" else self.decode_policy
        return chosen or self.policy

    short_prompt_tokens: int = 0  # prompts with fewer (estimated) tokens skip the prefill hop; 0: never skip
    # conditional disaggregation (pd_transfer.proxy.routing.local_prefill): a prompt a decode holds all but at most
    # this many tokens of is prefilled by that decode, no prefill hop; needs a decode policy reading the engines' KV
    # events (kv_aware); 0: off
    max_local_prefill_tokens: int = 0
    # ... unless that decode has this many requests in flight or more and a prefill fewer (0: load not weighed)
    local_prefill_max_busy: int = 0
    # streamed P/D (issue 41): both legs at once, the decode streaming the KV layer by layer from the prefill as it
    # computes it (engines with the tcp transport); a prefill's first request goes the sequential way (its answer
    # names its engine)
    stream_kv: bool = False
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
