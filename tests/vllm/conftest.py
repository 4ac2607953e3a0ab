"""The real-vLLM tests' shared fixtures (the servers themselves: :mod:`vllm_servers`).

- Every test here is skipped, with the reason, in an interpreter without vLLM (run them with .venv-vllm:
  scripts/test-vllm).
- ``tiny_model``: the test model's folder (``PD_TRANSFER_VLLM_MODEL``, else ``.models/tiny-llama-f32``); a test
  using it is skipped, saying how to make it, where it is missing.
- ``serve``: starts a module's servers at once, each within its startup bound, prints how long that took, and stops
  every server it started when the module ends (a module's ``servers`` fixture says which servers; the
  servers are the module's, started once for all its tests: starting vLLM costs minutes here).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from vllm_servers import DEFAULT_MODEL, Serve, start_all, vllm_missing

from pd_transfer.cluster.processes import ManagedProcess, stop_all


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
