"""The real-vLLM tests' shared fixtures (the servers themselves: :mod:`vllm_servers`).

- Every test here is skipped, with the reason, in an interpreter without vLLM (run them with .venv-vllm:
  scripts/test-vllm).
- ``tiny_model``: the test model's folder (``PD_TRANSFER_VLLM_MODEL``, else ``.models/tiny-llama-f32``); a test
  using it is skipped, saying how to make it, where it is missing.
- ``serve``: starts a module's servers at once, each within its startup bound, prints how long that took, and stops
  every server it started when the module ends (a module's ``servers`` fixture says which servers; the
  servers are the module's, started once for all its tests: starting vLLM costs minutes here).
- ``shared_reference``: the plain vLLM server (no connector, eager: :func:`vllm_servers.reference_server`) whose
  greedy tokens the P/D, offload, drain, fault and router tests compare their answers with. Nothing in it is
  anyone's to change (no test kills, drains or reconfigures it), so one serves the whole session instead of one per
  module (each start is 30-40 s of CPU on 2 cores). Started, not waited for, by the first module that needs it, so
  that it starts beside that module's own servers; each user waits for it (``vllm_servers.ready``, bounded).
  Stopped after the last test that uses it, not at the session's end.
- The modules run in ``MODULE_ORDER``: those that use the shared reference one after another, so that it lives
  only as long as they run.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from vllm_servers import DEFAULT_MODEL, Serve, logs_dir, reference_server, start_all, vllm_missing

from pd_transfer.cluster.processes import ManagedProcess, stop_all

#: The order the modules of tests/vllm run in (a module not named runs after these, in pytest's order). First the
#: modules without servers of their own; then those that use ``shared_reference``, one after another (it is stopped
#: after the last of them); then the rest.
MODULE_ORDER = (
    "test_vllm_version_refusal",
    "test_install_into_vllm",
    "test_real_model",
    "test_examples_vllm",
    "test_vllm_offload",
    "test_vllm_pd_offload",
    "test_vllm_pd",
    "test_vllm_stream",
    "test_drain",
    "test_vllm_faults",
    "test_vllm_router",
    "test_cluster_up",
    "test_dashboard",
    "test_decode_abort_vllm",
    "test_vllm_offload_tp",
    "test_vllm_tp",
)
SHARED_REFERENCE = "shared_reference"
_HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="session", autouse=True)
def _vllm_importable() -> None:
    if (reason := vllm_missing()) is not None:
        pytest.skip(reason)


@pytest.fixture(scope="session")
def tiny_model() -> str:
    if not (Path(DEFAULT_MODEL) / "config.json").exists():
        pytest.skip(f"no model at {DEFAULT_MODEL} (make it with `pd-transfer make-model`)")
    return DEFAULT_MODEL


@pytest.fixture(scope="module")
def serve() -> Iterator[Serve]:
    started: list[ManagedProcess] = []

    def start(servers: Sequence[ManagedProcess]) -> list[ManagedProcess]:
        began = time.monotonic()
        start_all(servers)  # on a failure it stops them all and raises, naming the server
        started.extend(servers)
        print(
            f"\n{len(servers)} server(s) healthy after {time.monotonic() - began:.0f} s: "
            + ", ".join(s.url for s in servers)
        )
        return list(servers)

    try:
        yield start
    finally:
        stop_all(started)


class SharedReference:
    """The session's plain reference server: started by the fixture, waited for by each user (:meth:`ready`)."""

    def __init__(self) -> None:
        self.server: ManagedProcess | None = None

    def start(self, model: str) -> ManagedProcess:
        self.server = reference_server(model, logs_dir("pd-transfer-vllm-reference"))
        self.server.start()
        return self.server

    def stop(self) -> None:
        if self.server is not None:
            stop_all([self.server])
            self.server = None


_shared = SharedReference()


@pytest.fixture(scope="session")
def shared_reference(tiny_model: str) -> Iterator[ManagedProcess]:
    """The plain reference server, started (not yet healthy: :func:`vllm_servers.ready` waits for it)."""
    try:
        yield _shared.start(tiny_model)
    finally:
        _shared.stop()


def _module_rank(item: pytest.Item) -> int:
    name = item.path.stem
    return MODULE_ORDER.index(name) if name in MODULE_ORDER else len(MODULE_ORDER)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tests of this folder in ``MODULE_ORDER`` (each module's own order kept), in the places they held among
    the collected tests: the other folders' tests keep their order and places."""
    places = [i for i, item in enumerate(items) if item.path.resolve().parent == _HERE]
    ordered = sorted((items[i] for i in places), key=_module_rank)  # stable: a module's tests keep their order
    for place, item in zip(places, ordered, strict=True):
        items[place] = item


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Stop the shared reference once no test left to run uses it (an idle vLLM server still holds gigabytes, and
    a few percent of a CPU). "Uses" is what pytest knows before the test runs: the fixtures it names, directly or
    through other fixtures. A fixture that gets ``shared_reference`` by ``request.getfixturevalue`` must name it
    instead, or it may find the server stopped."""
    if _shared.server is None:
        return
    session_items = item.session.items
    rest = session_items[session_items.index(nextitem) :] if nextitem in session_items else []
    if not any(SHARED_REFERENCE in getattr(later, "fixturenames", ()) for later in rest):
        _shared.stop()
