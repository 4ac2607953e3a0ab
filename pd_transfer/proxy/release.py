"""Freeing a prefill's blocks that no decode will read: the client left between the hops, or the decode hop failed.

The prefill holds a finished request's KV blocks under a lease (30 s by default) for the decode named by the
proxy. When the proxy knows no decode will read them, it sends the prefill's side channel a ``Release``
(:mod:`pd_transfer.handshake.release`, HMAC-authenticated when a secret is set) naming the engine and request of
the ``kv_transfer_params`` the prefill answered:

* the decode hop was never sent (the client left, no decode backend, every decode refused the connection) or it
  ended with a failure: ``read_possible`` False, the prefill frees the blocks at once;
* the client left while the decode hop ran: a decode may be reading, so ``read_possible`` True: the prefill keeps
  the blocks to the end of the hold window it promised decodes, or until the reader reports.

A client leaving during the prefill hop: the proxy reads the prefill's answer on for up to a second
(:data:`pd_transfer.proxy.prefill_hop.PREFILL_LEFTOVER_S`) and releases what it names (``read_possible`` False); a
prefill that has not answered by then gets its connection closed and aborts the request (vLLM holds nothing for an
aborted request). The decode hop releases what it was given when it fails (:mod:`pd_transfer.proxy.decode_hop`).
Releases run off the event loop, each bounded by ``timeout_s``, and are counted in
``pd_proxy_releases_total{outcome}``; a failed release costs nothing but the lease. The prefill's ``ReleaseReply``
is not authenticated (the ``Release`` is): its outcome only labels that count and a log line, and nothing here acts on
it (docs/faults.md, "What the side-channel secret protects").
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from pd_transfer.handshake.errors import AuthenticationError, HandshakeError, HandshakeRefused, HandshakeTimeout
from pd_transfer.handshake.release import Releaser
from pd_transfer.proxy.metrics import ProxyMetrics

log = logging.getLogger(__name__)

_MAX_ID_CHARS = 1024
_MAX_HOST_CHARS = 255


@dataclass(frozen=True)
class Target:
    """What a release names: the prefill engine's side channel and the request whose blocks it holds."""

    engine_id: str
    request_id: str
    host: str
    port: int

    @classmethod
    def of(cls, params: dict[str, Any]) -> Target | None:
        """The target of a prefill's ``kv_transfer_params``, or None when they do not name one."""
        engine, request = params.get("remote_engine_id"), params.get("remote_request_id")
        host, port = params.get("remote_host"), params.get("remote_port")
        if not (isinstance(engine, str) and isinstance(request, str) and isinstance(host, str)):
            return None
        if not (0 < len(engine) <= _MAX_ID_CHARS and 0 < len(request) <= _MAX_ID_CHARS):
            return None
        if not 0 < len(host) <= _MAX_HOST_CHARS or isinstance(port, bool) or not isinstance(port, int):
            return None
        return cls(engine, request, host, port) if 0 < port < 65536 else None


class KVReleases:
    """The proxy's releases: one :class:`Releaser`, the background tasks, the metric.

    ``secret``: the side channel's shared secret (``None``: the prefills run without). ``timeout_s``: bound of one
    release (seconds).
    """

    def __init__(self, metrics: ProxyMetrics, secret: str | None, timeout_s: float = 1.0) -> None:
        self._metrics = metrics
        self._releaser = Releaser(secret, timeout_s)
        self._tasks: set[asyncio.Task[Any]] = set()

    def release(self, params: dict[str, Any], rid: str, *, read_possible: bool, why: str) -> None:
        """Release the blocks ``params`` (a prefill's answer) name, in the background."""
        target = Target.of(params)
        if target is None:
            self._metrics.releases.labels("invalid").inc()
            log.warning("request %s: %s, but the prefill's kv_transfer_params name nothing to release", rid, why)
            return
        self._spawn(self._release(target, rid, read_possible, why))

    async def close(self, grace_s: float = 5.0) -> None:
        """Wait up to ``grace_s`` seconds for releases in flight (each bounded by ``timeout_s``), then close the
        releaser."""
        if self._tasks:
            _done, pending = await asyncio.wait(list(self._tasks), timeout=grace_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        self._releaser.close()

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _release(self, target: Target | None, rid: str, read_possible: bool, why: str) -> None:
        if target is None:
            self._metrics.releases.labels("invalid").inc()
            return
        outcome: str
        try:
            outcome = await asyncio.to_thread(
                self._releaser.release,
                target.host,
                target.port,
                target.engine_id,
                target.request_id,
                read_possible=read_possible,
            )
        except HandshakeError as error:
            outcome = _failure(error)
            log.warning(
                "request %s: %s; releasing %s on engine %s at %s:%d failed (%s): its lease will free it: %s",
                rid, why, target.request_id, target.engine_id, target.host, target.port, outcome, error,
            )  # fmt: skip
        else:
            log.info(
                "request %s: %s; released %s on engine %s (%s, read possible: %s)",
                rid, why, target.request_id, target.engine_id, outcome, read_possible,
            )  # fmt: skip
        self._metrics.releases.labels(outcome).inc()


def _failure(error: HandshakeError) -> str:
    """The ``outcome`` label of a failed release."""
    if isinstance(error, HandshakeTimeout):
        return "unreachable"
    if isinstance(error, AuthenticationError):
        return "auth"
    if isinstance(error, HandshakeRefused):
        return "version" if error.code == "unsupported_version" else "refused"
    return "error"
