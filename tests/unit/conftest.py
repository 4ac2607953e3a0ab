"""The unit tests' engines: prefill and decode engines in the test process whose NIXL agents are fakes
(:mod:`pd_transfer.sim.fake_agent`: reads and writes are memory copies, notifications a thread's hand-off), so that
the connector's logic runs end to end without a child process. Each module gets its own engines, and the fake is in
place of ``TransferAgent`` only while that module runs (the same pytest session may run tests/process after it)."""

from __future__ import annotations

import functools
from collections.abc import Iterator

import pytest
from engine_specs import FINGERPRINT, decode_config, layouts, prefill_specs

from pd_transfer.sim.engines import DecodeEngine, LocalPrefillEngines
from pd_transfer.sim.fake_agent import AGENT_CONSTRUCTORS, FakeAgent, FakeFabric


@pytest.fixture(scope="module")
def fake_agents() -> Iterator[FakeFabric]:
    """Every agent the connector makes while this module runs is a :class:`FakeAgent` of this fabric."""
    fabric = FakeFabric()
    with pytest.MonkeyPatch.context() as patch:
        for name in AGENT_CONSTRUCTORS:
            patch.setattr(name, functools.partial(FakeAgent, fabric=fabric))
        yield fabric


@pytest.fixture(scope="module")
def prefills(fake_agents: FakeFabric) -> Iterator[LocalPrefillEngines]:
    """The engines of :func:`engine_specs.prefill_specs`, in this process."""
    with LocalPrefillEngines(prefill_specs()) as engines:
        yield engines


@pytest.fixture(scope="module")
def decode(fake_agents: FakeFabric) -> Iterator[DecodeEngine]:
    """A TP 1 decode engine, failure policy ``recompute``."""
    with DecodeEngine("d-recompute", layouts(FINGERPRINT, 1), 512, decode_config(failure_policy="recompute")) as engine:
        yield engine


@pytest.fixture(scope="module")
def decode_fail(fake_agents: FakeFabric) -> Iterator[DecodeEngine]:
    """A TP 1 decode engine, failure policy ``fail``."""
    with DecodeEngine("d-fail", layouts(FINGERPRINT, 1), 256, decode_config(failure_policy="fail")) as engine:
        yield engine
