"""The NIXL binding's names this package relies on: its exception classes, quiet native logging, and how an agent
is made.

NIXL raises one class per status (``nixlBackendError``, ``nixlNotFoundError``, ``nixlRemoteDisconnectError``, ...)
from its compiled binding module; the transfer layer matches them by class. NIXL's Python logger is quieted when the
first agent is made, never at import (UCX's own log level is put in force by the process's edge:
:func:`pd_transfer.settings.apply_process_defaults`).

NIXL's UCX progress thread waits in ``poll()`` on UCX's event descriptor, with the agent's ``pthrDelay`` as the
timeout (rounded up to whole milliseconds); it wakes when data or a request arrives, progresses the worker until
it is idle, re-arms and waits again. The Python wrapper (``nixl_agent``) fixes that delay at 0, which turns the
wait into a spin of one full core per agent. :func:`make_nixl_agent` makes the same agent with a delay of its own.
"""

from __future__ import annotations

import logging

from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t, nixlBind

from pd_transfer.affinity import CpuSet, threads_started_unpinned

NixlBackendError: type[Exception] = nixlBind.nixlBackendError
NixlNotFoundError: type[Exception] = nixlBind.nixlNotFoundError
NixlRemoteDisconnectError: type[Exception] = nixlBind.nixlRemoteDisconnectError
NixlRegDList = nixlBind.nixlRegDList

_QUIETED = False


def quiet_nixl_logger() -> None:
    """Lower NIXL's Python logger to WARNING (it logs every agent and backend at INFO). NIXL configures that logger
    when ``nixl`` is imported, so its level is set here directly, once; a user who set ``NIXL_LOG_LEVEL`` keeps it
    (the caller does not call this)."""
    global _QUIETED
    if not _QUIETED:
        logging.getLogger("nixl").setLevel(logging.WARNING)
        _QUIETED = True


def make_nixl_agent(
    name: str, *, progress_thread_wait_ms: int = 0, thread_cpus: CpuSet = None, quiet_logs: bool = True
) -> nixl_agent:
    """A NIXL agent named ``name`` with the UCX backend and no listener thread.

    ``progress_thread_wait_ms`` > 0 runs NIXL's progress thread, woken by UCX's events and at the latest after
    that many milliseconds (its idle cost: about 0.3 % of a core at 20 ms, 2 % at 1 ms, measured); 0 runs none
    (the owner must progress the agent). With ``quiet_logs`` (the user did not set ``NIXL_LOG_LEVEL``) NIXL's
    Python logger is quieted first (:func:`quiet_nixl_logger`). With the thread, the wrapper is made without
    backends, its native agent replaced by one configured like the wrapper's own but for the thread's delay, and the
    UCX backend (which starts the thread) added to that one with the thread's CPU affinity ``thread_cpus`` as for
    our own threads (:mod:`pd_transfer.affinity`): started in a vLLM worker pinned to a core its engine spins on, it
    stalled a decode's first read for 51 s.
    """
    if quiet_logs:
        quiet_nixl_logger()
    threadless = {"enable_prog_thread": False, "enable_listen_thread": False}
    if progress_thread_wait_ms <= 0:
        return nixl_agent(name, nixl_agent_config(**threadless, backends=["UCX"]))
    agent = nixl_agent(name, nixl_agent_config(**threadless, backends=[]))
    config = nixlBind.nixlAgentConfig()
    config.useProgThread = True
    config.useListenThread = False
    config.syncMode = nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE.value  # the wrapper's choice without a listener
    config.pthrDelay = progress_thread_wait_ms * 1000  # microseconds
    config.lthrDelay = 100_000
    config.captureTelemetry = False
    agent.agent = nixlBind.nixlAgent(name, config)
    with threads_started_unpinned(thread_cpus):  # in a worker pinned to a spinning core, a pinned thread starves
        agent.create_backend("UCX", {})
    return agent
