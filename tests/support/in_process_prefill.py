"""A prefill rank in the test's own process, behind its side channel: for tests whose decode reads it with the
agents of ``agents`` (a fake fabric's in tests/unit)."""

from __future__ import annotations

from pd_transfer.connector.cache import KVCache
from pd_transfer.connector.options import PrefillOptions
from pd_transfer.connector.prefill.rank import PrefillRank, serve_engine
from pd_transfer.handshake.server import HandshakeServer
from pd_transfer.settings import DEFAULTS
from pd_transfer.sim.peer import fill_pattern
from pd_transfer.spec import KVCacheLayout
from pd_transfer.transfer.agent_protocol import AgentFactory


class InProcessPrefill:
    """One prefill rank (engine ``engine_id``) of ``num_blocks`` blocks of ``layout``, filled with ``fill_pattern(cache,
    seed)``, served at ``host:port``, offering the transports ``transport`` names (the connector's setting), its side
    channel and connections of its own asking for ``secret`` (None: nothing). ``close`` stops the side channel and the
    rank."""

    def __init__(
        self,
        engine_id: str,
        layout: KVCacheLayout,
        num_blocks: int,
        agents: AgentFactory,
        *,
        seed: int = 5,
        transport: str = "auto",
        secret: str | None = None,
    ) -> None:
        self.engine_id = engine_id
        self.layout, self.num_blocks, self.seed = layout, num_blocks, seed
        options = PrefillOptions(settings=DEFAULTS, transport=transport, secret=secret, listen_host="127.0.0.1")
        self.rank = PrefillRank(engine_id, self.expected()[0], options, agent_factory=agents)
        self.server: HandshakeServer = serve_engine(engine_id, [self.rank.rank_metadata], secret=secret)
        self.host, self.port = "127.0.0.1", self.server.port

    def expected(self) -> list[KVCache]:
        """A fresh cache holding what the rank's cache was filled with (the same pattern, made again)."""
        cache = KVCache.allocate(self.layout, self.num_blocks)
        fill_pattern(cache, self.seed)
        return [cache]

    def close(self) -> None:
        self.server.stop()
        self.rank.close()
