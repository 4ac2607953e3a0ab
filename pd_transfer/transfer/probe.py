"""Telling a dead peer from another read failure: after a read failed, progress the agent and read one row again.

NIXL reports a dead peer as a remote disconnect only once UCX ran the endpoint's error handler, which happens on
a progress call *after* the failed copy itself; :func:`peer_gone` makes that call and probes.
"""

from __future__ import annotations

import time
from typing import Protocol

import numpy as np

from .dlists import DescriptorList
from .errors import PeerDisconnected, TransferError
from .native import NixlBackendError, NixlNotFoundError, NixlRemoteDisconnectError
from .session import NixlSession


class ProbedAgent(Protocol):
    """The agent whose read failed (:class:`~.agent.TransferAgent`): its name, its NIXL session, its peers, and how
    it is progressed (its notifications handed out)."""

    @property
    def name(self) -> str: ...

    @property
    def session(self) -> NixlSession: ...

    def poll(self) -> bool: ...

    def has_peer(self, peer: str) -> bool: ...


def peer_gone(
    agent: ProbedAgent,
    local: DescriptorList,
    remote: DescriptorList,
    local_row: int,
    remote_row: int,
    budget_s: float = 0.5,
) -> str | None:
    """After a failed read: progress NIXL, then read one row again without a notification (into a row the
    failed read was writing anyway). Returns NIXL's disconnect error if the peer is gone, ``None`` if the
    probe read worked or failed otherwise (the original error stands). Bounded by ``budget_s``."""
    deadline = time.perf_counter() + budget_s
    while True:
        agent.poll()  # runs UCX's pending endpoint error handlers (and hands out notifications)
        outcome = _probe_read(agent, local, remote, local_row, remote_row, deadline)
        if outcome != "retry" or time.perf_counter() >= deadline:
            return outcome if outcome not in ("alive", "retry", "other") else None
        time.sleep(0.001)  # let the progress engine see the failure before the next probe


def _probe_read(
    agent: ProbedAgent,
    local: DescriptorList,
    remote: DescriptorList,
    local_row: int,
    remote_row: int,
    deadline: float,
) -> str:
    """One one-row read: "alive", "retry" (another backend error), "other", or a disconnect's message."""
    rows = (np.array([local_row], np.int32), np.array([remote_row], np.int32))
    session = agent.session
    try:
        handle, state, failure = session.start_transfer("READ", local.handle, rows[0], remote.handle, rows[1])
    except Exception as error:
        if isinstance(error, NixlRemoteDisconnectError):
            return f"{type(error).__name__}: {error}"
        if isinstance(error, NixlNotFoundError) and agent.has_peer(remote.peer):
            return f"NIXL dropped the peer after a disconnect ({error})"  # we did not remove it
        return "other"
    try:
        while True:
            if failure is not None:
                if isinstance(failure, NixlRemoteDisconnectError):
                    return f"{type(failure).__name__}: {failure}"
                return "retry" if isinstance(failure, NixlBackendError) else "other"
            if state == "DONE":
                return "alive"
            if state != "PROC":
                return "retry"
            if time.perf_counter() >= deadline:
                return "other"
            try:
                state = session.state(handle)
            except Exception as error:
                failure = error
    finally:
        session.release_transfer(handle)


def wrapped_error(agent_name: str, error: Exception, what: str) -> TransferError:
    """NIXL's ``error`` while agent ``agent_name`` did ``what``, as the transfer error it stands for."""
    if isinstance(error, NixlRemoteDisconnectError):
        return PeerDisconnected(f"agent {agent_name}: {what}: peer disconnected ({error})")
    if isinstance(error, NixlNotFoundError):
        return TransferError(f"agent {agent_name}: {what}: not found (unknown peer or unregistered memory): {error}")
    return TransferError(f"agent {agent_name}: {what}: {error}")


def transfer_error(
    agent: ProbedAgent,
    error: Exception | None,
    what: str,
    local: DescriptorList,
    remote: DescriptorList,
    probe_rows: tuple[int, int],
    *,
    probe: bool = True,
) -> TransferError:
    """The error to raise for a failed transfer. NIXL reports a dead peer as a remote disconnect only once UCX
    ran the endpoint's error handler, which happens on a progress call *after* the failed copy itself: a
    transfer that hits a peer killed moments ago can fail first as ``nixlBackendError`` (UCX "Input/output
    error") or end in state ERR. With ``probe`` (reads only: the probe reads one row into ``local``), such failures
    are checked with :func:`peer_gone` before they are reported as anything but ``PeerDisconnected``."""
    if error is None:
        wrapped = TransferError(f"agent {agent.name}: {what}")
    else:
        wrapped = wrapped_error(agent.name, error, what)
    if not probe or isinstance(wrapped, PeerDisconnected):
        return wrapped
    if error is not None and not isinstance(error, NixlBackendError):
        return wrapped
    gone = peer_gone(agent, local, remote, *probe_rows)
    if gone is None:
        return wrapped
    return PeerDisconnected(f"agent {agent.name}: {what}: peer disconnected ({gone}; first reported as {wrapped})")
