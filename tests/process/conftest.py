"""Shared engines for the connector lifecycle tests: prefill engines in one child process (spawned once per
session: a spawn costs seconds here), decode engines in the test process; real NIXL agents on both sides
(``agent_factory``: what a test hands the engines it makes itself; tests/unit/conftest.py's makes fakes)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from engine_specs import FINGERPRINT, decode_config, layouts, prefill_specs

from pd_transfer.settings import DEFAULTS
from pd_transfer.sim.engines import DecodeEngine, PrefillEngines
from pd_transfer.transfer.agent import NIXL_AGENTS
from pd_transfer.transfer.agent_protocol import AgentFactory


@pytest.fixture(scope="session")
def agent_factory() -> AgentFactory:
    """What makes the agents of the engines a test makes itself: NIXL agents."""
    return NIXL_AGENTS


@pytest.fixture(scope="session")
def prefills() -> Iterator[PrefillEngines]:
    """The engines of :func:`engine_specs.prefill_specs`, in a child process."""
    with PrefillEngines(prefill_specs()) as engines:
        yield engines


@pytest.fixture(scope="session")
def decode() -> Iterator[DecodeEngine]:
    """A TP 1 decode engine, failure policy ``recompute``."""
    with DecodeEngine(
        "d-recompute", layouts(FINGERPRINT, 1), 512, decode_config(failure_policy="recompute"), settings=DEFAULTS
    ) as engine:
        yield engine


@pytest.fixture(scope="session")
def decode_fail() -> Iterator[DecodeEngine]:
    """A TP 1 decode engine, failure policy ``fail``."""
    with DecodeEngine(
        "d-fail", layouts(FINGERPRINT, 1), 256, decode_config(failure_policy="fail"), settings=DEFAULTS
    ) as engine:
        yield engine
