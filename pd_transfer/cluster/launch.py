"""The command line and environment of one vLLM OpenAI server running PdTransferConnector.

Every server is ``kv_both`` (it can serve KV to a decode and pull KV from a prefill); ``role`` only names it.
A shared side-channel secret never goes on the command line: ``secret_env`` names an environment variable
that the connector reads (``kv_connector_extra_config.secret_env``). This module does not import vLLM.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pd_transfer.cluster.processes import ManagedProcess
from pd_transfer.connector.config import transport_names
from pd_transfer.settings import child_environment
from pd_transfer.transfer.digests import VERIFY_MODES

__all__ = [
    "CONNECTOR_CLASS",
    "CONNECTOR_MODULE",
    "DRAIN_MIDDLEWARE",
    "OFFLOAD_CONNECTOR_CLASS",
    "ROLES",
    "TINY_MODEL_DIR",
    "VLLM_ENTRYPOINT",
    "ServerSpec",
    "add_verify_argument",
    "cpu_binds",
    "kv_transfer_config",
    "server_process",
    "transport_setting",
    "vllm_command",
    "vllm_env",
]


def transport_setting(text: str) -> str:
    """A command line's connector ``transport`` setting, checked (an argparse type: what is wrong named)."""
    try:
        transport_names(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def add_verify_argument(parser: argparse.ArgumentParser) -> None:
    """``--verify`` (``serve``, ``up``): the connector's ``verify`` setting; None when not given (its default)."""
    parser.add_argument(
        "--verify",
        choices=VERIFY_MODES,
        default=None,
        help="what a decode checks of the KV it moved, against the prefill's digests: all, sample (the connector's"
        " default: a share of each request, all of it over time) or off",
    )


Role = Literal["prefill", "decode", "both"]
ROLES: tuple[Role, ...] = ("prefill", "decode", "both")
VLLM_ENTRYPOINT = "vllm.entrypoints.openai.api_server"
CONNECTOR_CLASS = "PdTransferConnector"
CONNECTOR_MODULE = "pd_transfer.integrations.vllm"
OFFLOAD_CONNECTOR_CLASS = "PdOffloadConnector"
#: vLLM's ``--middleware`` that makes a draining server answer 503 (``pd_transfer.integrations.vllm.drain``)
DRAIN_MIDDLEWARE = "pd_transfer.integrations.vllm.drain.DrainMiddleware"
GIB = 1 << 30
#: Where ``pd-transfer make-model`` puts the tiny model by default, relative to the working directory (the repo).
TINY_MODEL_DIR = Path(".models/tiny-llama-f32")


@dataclass(frozen=True)
class ServerSpec:
    """One vLLM server with our connector. ``cpu_bind`` is vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` (e.g. ``"0"``,
    ``"0-3"``, ``"0|1"`` for two TP ranks); ``kvcache_gib`` is the KV cache size of the CPU backend."""

    role: Role
    model: str
    port: int
    side_channel_port: int
    host: str = "127.0.0.1"
    side_channel_host: str = "127.0.0.1"
    block_size: int | None = None
    tp_size: int = 1
    lease_seconds: float | None = None
    failure_policy: str | None = None
    #: the connector's transport setting: auto, nixl, ipc or names (:mod:`pd_transfer.connector.transports.registry`);
    #: None: auto
    transport: str | None = None
    #: the connector's ``read_timeout_s`` (a decode's wait for one request's KV, a streamed one's prefill included);
    #: None: its default
    read_timeout_s: float | None = None
    #: the connector's ``verify`` (a decode's checks of what it moved: all, sample or off); None: its default
    verify: str | None = None
    secret_env: str | None = None
    cpu_bind: str | None = None
    kvcache_gib: float = 1.0
    extra_args: tuple[str, ...] = ()
    dtype: str | None = None  # vLLM's --dtype; None: vLLM's default ("auto" casts float32 weights down on CPU)
    max_model_len: int | None = None
    seed: int | None = None
    #: a (shared) offload directory: the server also runs PdOffloadConnector (vLLM's MultiConnector, ours first)
    offload_dir: str | None = None
    offload_dir_bytes: int = 10 * GIB
    offload_host_bytes: int = 0  # the host tier (0: none); needs offload_dir
    #: SIGTERM drains for at most this many seconds (vLLM's ``--shutdown-timeout``, whole seconds, rounded up;
    #: ``DRAIN_MIDDLEWARE`` answers 503 meanwhile); None: vLLM's default, SIGTERM aborts what runs and exits
    drain_seconds: float | None = None
    #: vLLM's ``--enforce-eager``: no torch.compile at startup (on a CPU server of the tiny model that compile is
    #: most of its start: 11-65 s of "init engine" here, against 0.2 s without it)
    eager: bool = False
    #: vLLM's KV events (``--kv-events-config``): the ZMQ PUB endpoint and the replay endpoint (None: no events)
    kv_events: tuple[str, str] | None = None
    #: vLLM's ``--prefix-caching-hash-algo`` (None: vLLM's default, sha256)
    hash_algo: str | None = None

    def __post_init__(self) -> None:
        problems = []
        if self.role not in ROLES:
            problems.append(f"role must be one of {', '.join(ROLES)}, not {self.role!r}")
        for name in ("port", "side_channel_port"):
            value = getattr(self, name)
            if not 1 <= value <= 65535:
                problems.append(f"{name} {value} is outside 1..65535")
        if self.port == self.side_channel_port:
            problems.append(f"port and side_channel_port are both {self.port}")
        if self.block_size is not None and self.block_size < 1:
            problems.append(f"block_size must be positive, not {self.block_size}")
        if self.max_model_len is not None and self.max_model_len < 1:
            problems.append(f"max_model_len must be positive, not {self.max_model_len}")
        if self.tp_size < 1:
            problems.append(f"tp_size must be at least 1, not {self.tp_size}")
        if self.lease_seconds is not None and not self.lease_seconds > 0:
            problems.append(f"lease_seconds must be positive, not {self.lease_seconds}")
        if self.verify is not None and self.verify not in VERIFY_MODES:
            problems.append(f"verify must be one of {', '.join(VERIFY_MODES)}, not {self.verify!r}")
        if self.failure_policy is not None and self.failure_policy not in ("recompute", "fail"):
            problems.append(f"failure_policy must be recompute or fail, not {self.failure_policy!r}")
        if self.transport is not None:
            try:
                transport_names(self.transport)
            except ValueError as error:
                problems.append(f"transport: {error}")
        if self.secret_env is not None and not self.secret_env:
            problems.append("secret_env must name an environment variable")
        if self.offload_dir is not None and (not self.offload_dir or self.offload_dir_bytes < 1):
            problems.append("offload_dir must be a path and offload_dir_bytes positive")
        if self.offload_host_bytes < 0 or (self.offload_host_bytes and self.offload_dir is None):
            problems.append("offload_host_bytes must be non-negative and goes with offload_dir")
        if self.drain_seconds is not None and not (self.drain_seconds > 0 and math.isfinite(self.drain_seconds)):
            problems.append(f"drain_seconds must be positive, not {self.drain_seconds}")
        if not (self.kvcache_gib > 0 and math.isfinite(self.kvcache_gib)):
            problems.append(f"kvcache_gib must be positive, not {self.kvcache_gib}")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


def kv_transfer_config(spec: ServerSpec) -> dict[str, object]:
    """vLLM's ``--kv-transfer-config`` for ``spec``. With ``offload_dir``: vLLM's ``MultiConnector`` over
    PdTransferConnector (first: a decode pulls from its prefill) and PdOffloadConnector (second: loads what the
    tiers hold when there is no pull, or when the pull failed and vLLM asks again), ``kv_load_failure_policy``
    set at the top (vLLM reads it there, not from the children)."""
    pd = _pd_transfer_config(spec)
    if spec.offload_dir is None:
        return pd
    offload_extra: dict[str, object] = {"offload_dir": spec.offload_dir, "offload_dir_bytes": spec.offload_dir_bytes}
    if spec.offload_host_bytes:
        offload_extra["offload_host_bytes"] = spec.offload_host_bytes
    offload = {
        "kv_connector": OFFLOAD_CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_connector_extra_config": offload_extra,
    }
    return {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_buffer_device": "cpu",
        "kv_load_failure_policy": spec.failure_policy or "recompute",
        "kv_connector_extra_config": {"connectors": [pd, offload]},
    }


def _pd_transfer_config(spec: ServerSpec) -> dict[str, object]:
    extra: dict[str, object] = {
        "side_channel_host": spec.side_channel_host,
        "side_channel_port": spec.side_channel_port,
    }
    if spec.lease_seconds is not None:
        extra["lease_seconds"] = spec.lease_seconds
    if spec.failure_policy is not None:
        extra["failure_policy"] = spec.failure_policy
    if spec.transport is not None:
        extra["transport"] = spec.transport
    if spec.read_timeout_s is not None:
        extra["read_timeout_s"] = spec.read_timeout_s
    if spec.verify is not None:
        extra["verify"] = spec.verify
    if spec.secret_env is not None:
        extra["secret_env"] = spec.secret_env
    return {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_buffer_device": "cpu",
        "kv_connector_extra_config": extra,
    }


def _whole_gib(spec: ServerSpec) -> int | None:
    return int(spec.kvcache_gib) if float(spec.kvcache_gib).is_integer() else None


def vllm_command(spec: ServerSpec, python: str = sys.executable, *, connector: bool = True) -> list[str]:
    """``python -m vllm.entrypoints.openai.api_server ...`` serving ``spec`` (run it with ``vllm_env``).
    ``connector=False`` leaves out ``--kv-transfer-config``: a plain server, e.g. as a reference."""
    command = [python, "-m", VLLM_ENTRYPOINT, "--model", spec.model, "--host", spec.host, "--port", str(spec.port)]
    for flag, value in (
        ("--dtype", spec.dtype),
        ("--max-model-len", spec.max_model_len),
        ("--seed", spec.seed),
        ("--block-size", spec.block_size),
    ):
        if value is not None:
            command += [flag, str(value)]
    if spec.tp_size != 1:
        command += ["--tensor-parallel-size", str(spec.tp_size)]
    if spec.eager:
        command.append("--enforce-eager")
    if _whole_gib(spec) is None:  # VLLM_CPU_KVCACHE_SPACE takes whole GiB only
        command += ["--kv-cache-memory-bytes", str(int(spec.kvcache_gib * GIB))]
    if connector:
        command += ["--kv-transfer-config", json.dumps(kv_transfer_config(spec), separators=(",", ":"))]
    if spec.kv_events is not None:
        endpoint, replay = spec.kv_events
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "replay_endpoint": replay}
        command += ["--kv-events-config", json.dumps(events, separators=(",", ":"))]
    if spec.hash_algo is not None:
        command += ["--prefix-caching-hash-algo", spec.hash_algo]
    if spec.drain_seconds is not None:
        command += ["--shutdown-timeout", str(math.ceil(spec.drain_seconds)), "--middleware", DRAIN_MIDDLEWARE]
    return [*command, *spec.extra_args]


#: vLLM-CPU 0.32 (torch 2.13) saves an AOT-compiled model at every start and never loads it ("'function' object has
#: no attribute 'finalize_loading'": its CPU backend's compiled function is a plain one), so a compiled server
#: compiles again at every start. Without AOT, vLLM's own compile cache loads: 4.6 s of "init engine" from a warm
#: cache against 13.0 s, healthy after 32 s against 40 (tiny model, 2 cores); a cold start is the same either way.
AOT_COMPILE_OFF = ("VLLM_USE_AOT_COMPILE", "0")


def vllm_env(spec: ServerSpec, base_env: Mapping[str, str], *, require_secret: bool = True) -> dict[str, str]:
    """``base_env`` plus what the server needs: KV cache size, CPU binding, UCX on loopback unless told
    otherwise, offline model hub for a local model folder, vLLM's AOT compile cache off unless told otherwise
    (``AOT_COMPILE_OFF``), unbuffered output. Raises ``ValueError`` when ``secret_env`` names a variable that
    ``base_env`` lacks (unless ``require_secret`` is false)."""
    env = dict(base_env)
    gib = _whole_gib(spec)
    if gib is None:
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override --kv-cache-memory-bytes
    else:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(gib)
    if spec.cpu_bind is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = spec.cpu_bind
    if spec.side_channel_host in ("127.0.0.1", "localhost", "::1"):
        env.setdefault("UCX_NET_DEVICES", "lo")
    if Path(spec.model).expanduser().is_dir():
        env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault(*AOT_COMPILE_OFF)
    env["PYTHONUNBUFFERED"] = "1"
    if require_secret and spec.secret_env is not None and not env.get(spec.secret_env):
        raise ValueError(f"secret_env: the environment variable {spec.secret_env} is not set or empty")
    return env


def server_process(
    name: str,
    spec: ServerSpec,
    log_path: Path,
    *,
    python: str = sys.executable,
    connector: bool = True,
    base_env: Mapping[str, str] | None = None,
    info: Mapping[str, object] | None = None,
) -> ManagedProcess:
    """The (not yet started) process of a vLLM server serving ``spec``: :func:`vllm_command` run with
    :func:`vllm_env` of ``base_env`` (default: this process's environment), output to ``log_path``.
    ``connector=False``: a plain server. Raises ``ValueError`` as ``vllm_env`` does."""
    env = vllm_env(spec, child_environment() if base_env is None else base_env)
    command = vllm_command(spec, python, connector=connector)
    return ManagedProcess(name, command, env, log_path, spec.url, info=dict(info or {}))


def cpu_binds(rank_counts: Sequence[int], cpus: Sequence[int]) -> list[str]:
    """``VLLM_CPU_OMP_THREADS_BIND`` of each server (its ranks separated by ``|``): every rank gets an equal,
    separate share of ``cpus`` when there are enough, else the ranks take the cores in turn."""
    total = sum(rank_counts)
    if len(cpus) >= total:
        per = len(cpus) // total
        shares = [list(cpus[i * per : (i + 1) * per]) for i in range(total)]
    else:
        shares = [[cpus[i % len(cpus)]] for i in range(total)]
    binds, at = [], 0
    for ranks in rank_counts:
        binds.append("|".join(_cpu_list(shares[at + r]) for r in range(ranks)))
        at += ranks
    return binds


def _cpu_list(cpus: Sequence[int]) -> str:
    if len(cpus) > 1 and list(cpus) == list(range(cpus[0], cpus[-1] + 1)):
        return f"{cpus[0]}-{cpus[-1]}"
    return ",".join(str(c) for c in cpus)
