"""Transports by name, and which ones a connector's ``transport`` setting picks, in its order of preference.

Built in: ``nixl`` (:mod:`.nixl`), ``cuda_ipc``, ``host_ipc`` and ``host_cma`` (:mod:`.ipc`), ``tcp`` (:mod:`.tcp`). Two
names stand for several: ``auto`` = ``cuda_ipc, host_ipc, host_cma, nixl`` (same-host IPC where an engine offers it,
else NIXL) and ``ipc`` = ``cuda_ipc, host_ipc, host_cma`` (same-host IPC or the engine is refused). A transport of your
own is named in the setting by ``module:attribute`` (the attribute a :class:`~.seam.Transport`), imported when a rank is
made and registered under its ``name`` from then on, as :func:`register` does in code; both ends of a P/D pair name it
(the prefill to offer it, the decode to open engines with it). Nothing else in the package changes for it:
docs/architecture.md, "Adding a transport".
"""

from __future__ import annotations

import importlib
import re
import threading

from pd_transfer.connector.config import BUILT_IN_TRANSPORTS, transport_names

from .ipc.transport import CUDA_IPC, HOST_CMA, HOST_IPC
from .nixl.transport import NIXL
from .seam import Transport
from .tcp.transport import TCP

#: The transports every process has (named as :data:`~pd_transfer.connector.config.BUILT_IN_TRANSPORTS` says).
BUILT_IN: tuple[Transport, ...] = (NIXL, CUDA_IPC, HOST_IPC, HOST_CMA, TCP)
assert tuple(transport.name for transport in BUILT_IN) == BUILT_IN_TRANSPORTS
#: Names that stand for several transports, in order of preference.
ALIASES: dict[str, tuple[str, ...]] = {
    "auto": ("cuda_ipc", "host_ipc", "host_cma", "nixl"),
    "ipc": ("cuda_ipc", "host_ipc", "host_cma"),
}
_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}")

_lock = threading.Lock()
_registered: dict[str, Transport] = {transport.name: transport for transport in BUILT_IN}


class UnknownTransport(ValueError):
    """A ``transport`` setting names a transport that is not registered, or a ``module:attribute`` that is none."""


def register(transport: Transport) -> None:
    """Make ``transport`` selectable by its name. ``ValueError`` for a name that is not lowercase letters, digits and
    ``_``, an alias, or taken by another transport."""
    name = transport.name
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name in ALIASES:
        raise ValueError(f"a transport's name must be lowercase letters, digits and _, not an alias: {name!r}")
    with _lock:
        known = _registered.get(name)
        if known is not None and known is not transport:
            raise ValueError(f"a transport named {name!r} is registered already")
        _registered[name] = transport


def registered() -> tuple[str, ...]:
    """The names that may be selected, built-in first."""
    with _lock:
        return tuple(_registered)


def select(setting: str) -> tuple[Transport, ...]:
    """The transports ``setting`` names (``"auto"``, ``"toy, nixl"``, ``"my_pkg.toy:TRANSPORT"``), in order, each
    once. ``UnknownTransport`` naming what is wrong (and what is known); ``ValueError`` for a setting that is no list
    of names."""
    chosen: dict[str, Transport] = {}
    for name in transport_names(setting):
        for each in ALIASES.get(name, (name,)):
            transport = _load(each) if ":" in each else _known(each)
            chosen.setdefault(transport.name, transport)
    return tuple(chosen.values())


def _known(name: str) -> Transport:
    with _lock:
        transport = _registered.get(name)
    if transport is None:
        known = ", ".join((*ALIASES, *registered()))
        raise UnknownTransport(f"no transport is named {name!r}; known: {known}, or a module:attribute of your own")
    return transport


def _load(path: str) -> Transport:
    """The transport at ``path`` (``module:attribute``), imported and registered."""
    module_name, _, attribute = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise UnknownTransport(f"transport {path!r}: module {module_name!r} does not import: {error}") from None
    transport = getattr(module, attribute, None)
    missing = [
        member for member in ("name", "same_host", "prefill_end", "decode_end") if not hasattr(transport, member)
    ]
    if missing:
        raise UnknownTransport(f"transport {path!r} is no transport: it has no {', '.join(missing)}")
    assert transport is not None
    register(transport)
    return transport
