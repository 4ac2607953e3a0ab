"""The connector's settings: typed, validated, read from a dict (vLLM's ``kv_connector_extra_config``).

Unknown keys and wrong types are refused with a message naming the key. The side channel's address falls
back to the process's settings (:class:`~pd_transfer.settings.Settings`, from the environment variables vLLM's
NixlConnector uses: ``VLLM_NIXL_SIDE_CHANNEL_HOST`` / ``VLLM_NIXL_SIDE_CHANNEL_PORT``), then to their defaults
(``localhost:5600``). The shared secret is given either as ``secret`` or, to keep it off command lines, as
``secret_env``: the name of an environment variable holding it (looked up by ``from_dict`` in the environment its
caller, the process's edge, passes).

**Failure policy** (``failure_policy``): what a decode worker reports when a request's KV could not be
loaded, or was loaded but not confirmed (see :mod:`.leases`):

* ``"recompute"`` (default): the request's local block ids are reported as load errors; the engine
  recomputes the prompt (from the first bad block) and the client never sees the failure. The commonest
  failure, a lease that ran out under load, costs one local prefill instead of an error.
* ``"fail"``: the request is reported failed (and finished); the engine ends it with an error.

Either way no stale or partial KV is ever used, and nothing raises into the engine.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import Literal

import msgspec

from pd_transfer.settings import PushMode, Settings
from pd_transfer.transfer.digests import Verify

FailurePolicy = Literal["fail", "recompute"]
_NO_ENVIRONMENT: Mapping[str, str] = MappingProxyType({})


#: The built-in transports, by name (:mod:`pd_transfer.connector.transports.registry` registers one under each).
BUILT_IN_TRANSPORTS = ("nixl", "cuda_ipc", "host_ipc", "host_cma", "tcp")
#: A transport's name (``nixl``, ``cuda_ipc``, a name of your own) or the ``module:attribute`` of one.
_TRANSPORT_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}|[A-Za-z_][A-Za-z0-9_.]{0,199}:[A-Za-z_][A-Za-z0-9_]{0,99}")


def transport_names(setting: str) -> tuple[str, ...]:
    """The names in a ``transport`` setting, in order (``"toy, nixl"`` -> ``("toy", "nixl")``); ``ValueError`` for an
    empty setting, a repeated name or one that is neither a transport's name nor a ``module:attribute``."""
    names = tuple(name.strip() for name in setting.split(","))
    for name in names:
        if not _TRANSPORT_NAME.fullmatch(name):
            raise ValueError(f"{name[:80]!r} is no transport name (lowercase letters, digits, _) nor module:attribute")
    if len(set(names)) != len(names):
        raise ValueError(f"a transport is named twice in {setting[:200]!r}")
    return names


class ConfigError(ValueError):
    """A setting is unknown, of the wrong type or out of range; the message names it."""


class ConnectorConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    side_channel_host: str = "localhost"  # where this engine's side channel listens (and decodes connect)
    side_channel_port: int = 5600  # 0: any free port (tests)
    lease_seconds: float = 30.0  # how long a prefill holds a finished request's blocks for its readers
    heartbeat_seconds: float | None = None  # decode: how often a queued request extends its lease; None: lease / 3
    failure_policy: FailurePolicy = "recompute"
    secret: str | None = None  # shared HMAC secret of the side channel; None: unauthenticated
    secret_env: str | None = None  # name of an environment variable holding ``secret`` (resolved by from_dict)
    read_timeout_s: float = 30.0  # one request's reads
    confirm_timeout_s: float = 5.0  # waiting for the prefill's LeaseConfirm after a read
    handshake_timeout_s: float = 5.0  # one side-channel attempt (three attempts in all)
    # decode: after a prefill's side channel was refused or unanswered, fetches from it fail at once for this
    # long (doubling while it stays down, up to 3x); 0: off
    handshake_failure_backoff_s: float = 10.0
    load_threads: int = 4  # decode: background threads for pulls, releases and heartbeats
    # an engine step that schedules nothing while blocks are held for readers or loads are in flight waits this
    # long (engines such as vLLM step back to back until then, spinning a core); 0: off
    idle_step_sleep_s: float = 0.005
    # vLLM: how long an engine process's shared-memory queue readers spin after a read before they block. vLLM
    # spins 1 s (sched_yield in a loop, taking the GIL back after each call), which starves our threads in the same
    # process for seconds when the cores are busy; None: leave vLLM's own
    engine_spin_s: float | None = 0.001
    # decode: ask prefill ranks to write the KV instead of reading it ("auto": where reads would go over TCP; "on";
    # "off", which on a prefill also refuses such requests); None: the process's PD_TRANSFER_PUSH, else "auto"
    # (pd_transfer.transfer.tcp.push_mode: the one rule, the same for the prefill and the decode)
    push: PushMode | None = None
    # the transports a decode opens prefill engines with, in order of preference, and a prefill offers: "auto"
    # (same-host IPC where the prefill offers its memory and it can be read, CUDA IPC for GPU caches; else NIXL),
    # "nixl" (never IPC; a prefill then offers none either), "ipc" (IPC or the engine is refused), or names separated
    # by commas: built-in ones (nixl, cuda_ipc, host_ipc, host_cma) or "module:attribute" of a transport of your own
    # (pd_transfer.connector.transports.registry; docs/architecture.md, "Adding a transport")
    transport: str = "auto"
    # decode: what of a request's rows it checks against the digests the prefill computed of its cache ("all",
    # "sample": over tcp an eighth of its layers or rows, over NIXL reads and pushes a 32nd of its rows, the next run
    # for the next request, same-host reads in place under "all" only; "off"; pd_transfer.transfer.digests,
    # pd_transfer.connector.decode.read_checks): what differs fails the read, and the request is recomputed as for a
    # dead prefill
    verify: Verify = "sample"

    def __post_init__(self) -> None:
        problems = []
        if not self.side_channel_host.strip():
            problems.append("side_channel_host: must not be empty")
        if not 0 <= self.side_channel_port <= 65535:
            problems.append(f"side_channel_port: {self.side_channel_port} is outside 0..65535")
        for name in ("lease_seconds", "read_timeout_s", "confirm_timeout_s", "handshake_timeout_s"):
            value = getattr(self, name)
            if not value > 0:
                problems.append(f"{name}: must be positive, got {value!r}")
        if self.heartbeat_seconds is not None and not 0 < self.heartbeat_seconds < self.lease_seconds:
            problems.append(
                f"heartbeat_seconds: must be positive and shorter than lease_seconds ({self.lease_seconds:g}),"
                f" got {self.heartbeat_seconds!r}"
            )
        if not self.handshake_failure_backoff_s >= 0:
            problems.append(f"handshake_failure_backoff_s: must be >= 0, got {self.handshake_failure_backoff_s!r}")
        if not 0 <= self.idle_step_sleep_s <= 1:
            problems.append(f"idle_step_sleep_s: must be within 0..1 s, got {self.idle_step_sleep_s!r}")
        if self.engine_spin_s is not None and not 0 <= self.engine_spin_s <= 10:
            problems.append(f"engine_spin_s: must be within 0..10 s, got {self.engine_spin_s!r}")
        if self.load_threads < 1:
            problems.append(f"load_threads: must be at least 1, got {self.load_threads}")
        if self.secret is not None and not self.secret:
            problems.append("secret: must not be empty (leave it out for no authentication)")
        try:
            transport_names(self.transport)
        except ValueError as error:
            problems.append(f"transport: {error}")
        if problems:
            raise ConfigError("; ".join(problems))

    @property
    def heartbeat_interval_s(self) -> float:
        return self.lease_seconds / 3 if self.heartbeat_seconds is None else self.heartbeat_seconds

    @classmethod
    def from_dict(
        cls,
        extra: Mapping[str, object] | None = None,
        *,
        settings: Settings,
        env: Mapping[str, str] = _NO_ENVIRONMENT,
    ) -> ConnectorConfig:
        """Settings from ``extra`` (e.g. ``kv_connector_extra_config``), then ``settings`` (the process's, read at its
        edge) for the side channel's address, then defaults; ``secret_env`` is looked up in ``env`` (the process's
        environment, passed by its edge). Raises ``ConfigError``."""
        if extra is None:
            extra = {}
        if not isinstance(extra, Mapping):
            raise ConfigError(f"connector settings must be a mapping, got {type(extra).__name__}")
        known = cls.__struct_fields__
        unknown = sorted(str(key) for key in extra if key not in known)
        if unknown:
            raise ConfigError(f"unknown connector setting(s) {', '.join(unknown)}; known: {', '.join(known)}")
        data = dict(extra)
        if "side_channel_host" not in data and settings.side_channel_host is not None:
            data["side_channel_host"] = settings.side_channel_host
        if "side_channel_port" not in data and settings.side_channel_port is not None:
            data["side_channel_port"] = settings.side_channel_port
        secret_env = data.get("secret_env")
        if secret_env is not None:
            if "secret" in data:
                raise ConfigError("secret, secret_env: give one of them, not both")
            if not isinstance(secret_env, str) or not secret_env:
                raise ConfigError(f"secret_env: must be the name of an environment variable, got {secret_env!r}")
            secret = env.get(secret_env)
            if not secret:
                raise ConfigError(f"secret_env: the environment variable {secret_env} is not set or empty")
            data["secret"] = secret
        try:
            return msgspec.convert(data, cls, strict=True)
        except msgspec.ValidationError as error:
            raise ConfigError(f"connector settings: {error}") from None
