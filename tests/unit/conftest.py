"""The unit tests' engines: prefill and decode engines in the test process whose agents are fakes
(``tests/support/fake_agent.py``: reads and writes are memory copies, notifications a thread's hand-off), so that
the connector's logic runs end to end without a child process. Each module gets its own fabric and engines. These,
and the engines and ranks its tests make, are handed the ``agent_factory`` fixture (the fabric's ``new_agent``;
tests/process/conftest.py's makes NIXL agents) where production code gets NIXL's by default: nothing is patched."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from engine_specs import FINGERPRINT, decode_config, layouts, prefill_specs
from fake_agent import FakeFabric

from pd_transfer.settings import DEFAULTS
from pd_transfer.sim.engines import DecodeEngine, LocalPrefillEngines
from pd_transfer.transfer.agent_protocol import AgentFactory


@pytest.fixture(scope="module")
def fake_agents() -> FakeFabric:
    """This module's fabric: hand its ``new_agent`` to what makes agents, and they are fakes that reach each other."""
    return FakeFabric()


@pytest.fixture(scope="module")
def agent_factory(fake_agents: FakeFabric) -> AgentFactory:
    """What makes the agents of this module's engines and ranks: fakes on this module's fabric."""
    return fake_agents.new_agent


@pytest.fixture(scope="module")
def prefills(agent_factory: AgentFactory) -> Iterator[LocalPrefillEngines]:
    """The engines of :func:`engine_specs.prefill_specs`, in this process."""
    with LocalPrefillEngines(prefill_specs(), agent_factory=agent_factory, settings=DEFAULTS) as engines:
        yield engines


@pytest.fixture(scope="module")
def decode(agent_factory: AgentFactory) -> Iterator[DecodeEngine]:
    """A TP 1 decode engine, failure policy ``recompute``."""
    config = decode_config(failure_policy="recompute")
    with DecodeEngine(
        "d-recompute", layouts(FINGERPRINT, 1), 512, config, agent_factory=agent_factory, settings=DEFAULTS
    ) as engine:
        yield engine


@pytest.fixture(scope="module")
def decode_fail(agent_factory: AgentFactory) -> Iterator[DecodeEngine]:
    """A TP 1 decode engine, failure policy ``fail``."""
    config = decode_config(failure_policy="fail")
    with DecodeEngine(
        "d-fail", layouts(FINGERPRINT, 1), 256, config, agent_factory=agent_factory, settings=DEFAULTS
    ) as engine:
        yield engine
