"""Every environment variable pd-transfer reads, declared once, read once at a process's edge into :class:`Settings`.

Each field of :class:`Settings` comes from one declaration: the variable's name, the kind of value it takes (its
choices or bounds), its default and one line of doc. A process's edge (``pd-transfer``'s commands, the vLLM
connector's processes, the stand-ins' entry points and child processes, the benchmarks) calls :func:`read_settings`
once and hands the object, or the values in it, to what it makes: agents, ranks, lanes, pollers. Library users pass
their own (``Settings()``: the defaults; ``Settings.from_environ(os.environ)``: their environment, read at their edge).
Every field is one the product reads: a benchmark or a stand-in takes its own values as command-line arguments
(``bench vllm --model``, ``bench proxy --vllm-router``, ``bench transfer --busy-prefill``), and a test reads its own
variables (tests/unit/test_settings.py checks that no field is read only beside the product).

No other module of the package reads or writes ``os.environ`` (ruff's TID251, configured in ``pyproject.toml``): a
child process's environment starts from :func:`child_environment`, and the UCX variables that UCX itself reads when
an agent is made are put in force once per process by :func:`apply_process_defaults`.

A variable set but blank counts as unset. A bad value raises :class:`SettingError` naming the variable and showing
at most 40 characters of the value. README.md's settings table is :meth:`Settings.markdown_table` (a test keeps the
two equal).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal, Protocol

PushMode = Literal["auto", "on", "off"]
HugePagesMode = Literal["own", "all", "0"]

#: UCX's TCP segment sizes applied where unset (transfer/tcp.py says why TX stays at 64 KiB while RX is raised).
TCP_SEGMENT_ENV: dict[str, str] = {"UCX_TCP_TX_SEG_SIZE": "64k", "UCX_TCP_RX_SEG_SIZE": "256k"}
#: UCX's log level applied where unset: UCX's exit-time pool warnings are noise for users.
UCX_LOG_LEVEL_DEFAULT = "error"
#: UCX's CUDA IPC GETs, applied where unset by a process that registers GPU memory (:func:`apply_process_defaults`,
#: ``vram=True``). UCX's default, ``auto``, turns them off wherever NVML sees no NVLink, and a READ of another
#: process's VRAM then falls back to active messages over TCP: 0.5 GB/s, against 1,172 GiB/s with them on (4 MiB
#: rows, one H200 node).
CUDA_IPC_GET_ZCOPY_ENV: dict[str, str] = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}
_SHOWN_CHARS = 40  # of a bad value, in an error


class SettingError(ValueError):
    """An environment variable holds a value its declaration refuses; the message names the variable."""


class Kind(Protocol):
    """How a variable's text becomes a value (``parse`` raises ``ValueError`` saying what it must be), whether a
    value given in code is one it could have produced (``accepts``), and its values as the README shows them."""

    @property
    def shown(self) -> str: ...

    def parse(self, text: str) -> Any: ...

    def accepts(self, value: object) -> bool: ...


@dataclass(frozen=True)
class Choice:
    """One of ``choices`` (case-insensitive; ``aliases`` are other spellings of a choice); ``upper``: the choices are
    upper case."""

    choices: tuple[str, ...]
    aliases: Mapping[str, str] = field(default_factory=dict)
    upper: bool = False

    @property
    def shown(self) -> str:
        spelled = [f"`{choice}`" for choice in self.choices]
        return ", ".join(spelled) + (f" (also {', '.join(f'`{a}`' for a in self.aliases)})" if self.aliases else "")

    def parse(self, text: str) -> str:
        word = text.upper() if self.upper else text.lower()
        word = self.aliases.get(word, word)
        if word not in self.choices:
            raise ValueError(f"must be one of {', '.join(self.choices)}")
        return word

    def accepts(self, value: object) -> bool:
        return value in self.choices


@dataclass(frozen=True)
class Number:
    """A number within ``low``..``high``; ``whole``: an integer; ``round_up``: any number, rounded up to an integer."""

    low: float
    high: float
    whole: bool = False
    round_up: bool = False

    @property
    def shown(self) -> str:
        return f"{self.low:g} to {self.high:g}" + (", whole" if self.whole else "")

    def parse(self, text: str) -> float | int:
        try:
            value = float(text)
        except ValueError:
            raise ValueError("must be a number") from None
        if not self.low <= value <= self.high:  # NaN too
            raise ValueError(f"must be within {self.low:g} to {self.high:g}")
        if self.round_up:
            return math.ceil(value)
        if self.whole:
            if not value.is_integer():
                raise ValueError("must be a whole number")
            return int(value)
        return value

    def accepts(self, value: object) -> bool:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        return self.low <= value <= self.high and (isinstance(value, int) or not (self.whole or self.round_up))


@dataclass(frozen=True)
class Flag:
    """On or off: ``1``, ``on``, ``yes``, ``true`` or ``0``, ``off``, ``no``, ``false``."""

    shown: str = "`1`/`on`, `0`/`off`"

    def parse(self, text: str) -> bool:
        word = text.lower()
        if word in ("1", "on", "yes", "true"):
            return True
        if word in ("0", "off", "no", "false"):
            return False
        raise ValueError("must be 1, on, yes, true, 0, off, no or false")

    def accepts(self, value: object) -> bool:
        return isinstance(value, bool)


@dataclass(frozen=True)
class Text:
    """Any text (a path, a name, another program's own setting, passed on as it is); ``shown``: what it holds."""

    shown: str = "text"

    def parse(self, text: str) -> str:
        return text

    def accepts(self, value: object) -> bool:
        return isinstance(value, str)


@dataclass(frozen=True)
class CpuList:
    """``all`` (every CPU of this machine), ``inherit`` (the creating thread's), or a list such as ``0-3,8``."""

    shown: str = "`all`, `inherit`, a list like `0-3,8`"

    def parse(self, text: str) -> str:
        word = text.lower()
        cpu_set(word)
        return word

    def accepts(self, value: object) -> bool:
        if not isinstance(value, str):
            return False
        try:
            cpu_set(value)
        except ValueError:
            return False
        return True


def cpu_set(setting: str) -> frozenset[int] | None:
    """The CPUs a :class:`CpuList` setting names; None for ``inherit``. Raises ``ValueError`` for anything else."""
    value = setting.strip().lower()
    if value == "inherit":
        return None
    if value in ("", "all"):
        return frozenset(range(os.cpu_count() or 1))
    cpus: set[int] = set()
    for part in value.split(","):
        first, _, last = part.strip().partition("-")
        try:
            low, high = int(first), int(last or first)
        except ValueError:
            raise ValueError("must be all, inherit or a CPU list like 0-3,8") from None
        if not 0 <= low <= high:
            raise ValueError("must be all, inherit or a CPU list like 0-3,8 (ranges low-high, from 0)")
        cpus.update(range(low, high + 1))
    return frozenset(cpus)


@dataclass(frozen=True)
class Variable:
    """The declaration of one environment variable: its ``name``, its ``kind``, one line of ``doc`` (markdown) and,
    where the default alone does not say it, the default as the README shows it (``shown_default``)."""

    name: str
    kind: Kind
    doc: str
    shown_default: str | None = None

    def parse(self, text: str) -> Any:
        """The value of ``text`` (stripped, not blank); raises :class:`SettingError` naming the variable."""
        try:
            return self.kind.parse(text)
        except ValueError as error:
            raise SettingError(f"{self.name} {error}, not {text[:_SHOWN_CHARS]!r}") from None


def _declare(name: str, kind: Kind, doc: str, shown_default: str | None = None) -> dict[str, Variable]:
    """The metadata of a field of :class:`Settings` read from the variable ``name``: its declaration."""
    return {"variable": Variable(name, kind, doc, shown_default)}


def _shown(default: object) -> str:
    if default is None:
        return "unset"
    if isinstance(default, bool):
        return "on" if default else "off"
    if isinstance(default, str):
        return f"`{default}`"
    return f"{default:g}" if isinstance(default, float) else str(default)


_LOG_LEVELS = Choice(("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"), upper=True)


@dataclass(frozen=True)
class Settings:
    """pd-transfer's settings, one field per environment variable (:meth:`from_environ` reads them all). Frozen:
    derive another with :func:`dataclasses.replace`. A value given in code that its variable would refuse raises
    :class:`SettingError` too."""

    push: PushMode = field(
        default="auto",
        metadata=_declare(
            "PD_TRANSFER_PUSH",
            Choice(("auto", "on", "off")),
            "decodes ask prefills to write the KV instead of reading it: `auto` where reads would go over TCP, `on`,"
            " `off` (a prefill set `off` refuses); a connector's `push` setting wins over it",
        ),
    )
    push_min_bytes: int = field(
        default=4 * 2**20,
        metadata=_declare(
            "PD_TRANSFER_PUSH_MIN_BYTES",
            Number(0, 1e12, whole=True),
            "the smallest request pushed (bytes); smaller ones are read",
            "4194304 (4 MiB)",
        ),
    )
    read_lanes: int | None = field(
        default=None,
        metadata=_declare(
            "PD_TRANSFER_READ_LANES",
            Number(1, 64, whole=True),
            "NIXL agents a decode rank reads with; a read of 4 MiB or more is split over them",
            "one per CPU, at most 2",
        ),
    )
    huge_pages: HugePagesMode = field(
        default="own",
        metadata=_declare(
            "PD_TRANSFER_HUGE_PAGES",
            Choice(("own", "all", "0"), aliases={"off": "0", "no": "0", "false": "0"}),
            "`own`: caches pd-transfer allocates start in transparent huge pages; `all`: also memory an engine"
            " registers (advised, then collapsed in the background); `0`: off",
        ),
    )
    native_progress_ms: int = field(
        default=20,
        metadata=_declare(
            "PD_TRANSFER_NATIVE_PROGRESS_MS",
            Number(0, 60_000, round_up=True),
            "a prefill agent's NIXL progress thread wakes at least every this many ms; `0`: no native thread, our"
            " poller progresses the agent",
        ),
    )
    busy_poll_us: float = field(
        default=30.0,
        metadata=_declare(
            "PD_TRANSFER_BUSY_POLL_US",
            Number(0, 1e6),
            "a poll longer than this (us) moved data, so the poller polls again at once; `0`: only notifications count",
        ),
    )
    read_wait_us: float = field(
        default=50.0,
        metadata=_declare(
            "PD_TRANSFER_READ_WAIT_US",
            Number(0, 1e6),
            "how long a read waits between state checks once it stopped spinning (us)",
        ),
    )
    drain_s: float = field(
        default=30.0,
        metadata=_declare(
            "PD_TRANSFER_DRAIN_S",
            Number(0, 3600),
            "a NIXL read or write past its timeout is waited for this much longer (s) until NIXL ends it, so that none"
            " of its bytes lands in memory given to another request (a cut TCP connection delivers them when it"
            " resumes)",
        ),
    )
    sever_stalled: bool = field(
        default=True,
        metadata=_declare(
            "PD_TRANSFER_SEVER_STALLED",
            Flag(),
            "a decode whose NIXL read or push from another host stalls past its timeout shuts down its TCP"
            " connections to that host, so that nothing of it lands later and it ends at once; `0`: only drain it",
        ),
    )
    tcp_segments: bool = field(
        default=True,
        metadata=_declare(
            "PD_TRANSFER_TCP_SEGMENTS",
            Flag(),
            "`0`: leave UCX's own TCP segment sizes instead of setting `UCX_TCP_TX_SEG_SIZE` and `UCX_TCP_RX_SEG_SIZE`"
            " where unset",
        ),
    )
    thread_cpus: str = field(
        default="all",
        metadata=_declare(
            "PD_TRANSFER_THREAD_CPUS",
            CpuList(),
            "the CPUs our threads and NIXL's progress threads run on: `all`, `inherit` (the creator's), or a list",
        ),
    )
    log_level: str = field(
        default="INFO",
        metadata=_declare(
            "PD_TRANSFER_LOG_LEVEL",
            _LOG_LEVELS,
            "the level of pd-transfer's log lines inside a vLLM server's processes",
        ),
    )
    model: str | None = field(
        default=None,
        metadata=_declare(
            "PD_TRANSFER_MODEL",
            Text("a folder"),
            "`pd-transfer up`: the model folder to serve (the tiny model is built there if it holds none)",
        ),
    )
    models_dir: str | None = field(
        default=None,
        metadata=_declare(
            "PD_TRANSFER_MODELS_DIR",
            Text("a folder"),
            "`pd-transfer up`: where the default models are built",
            "`.models`",
        ),
    )
    side_channel_host: str | None = field(
        default=None,
        metadata=_declare(
            "VLLM_NIXL_SIDE_CHANNEL_HOST",
            Text("a host"),
            "the connector's side-channel address where `kv_connector_extra_config` names none",
            "`localhost`",
        ),
    )
    side_channel_port: int | None = field(
        default=None,
        metadata=_declare(
            "VLLM_NIXL_SIDE_CHANNEL_PORT",
            Number(0, 65535, whole=True),
            "the connector's side-channel port where `kv_connector_extra_config` names none",
            "5600",
        ),
    )
    ucx_net_devices: str | None = field(
        default=None,
        metadata=_declare(
            "UCX_NET_DEVICES",
            Text("as UCX reads it"),
            "the network devices UCX may use; between hosts or containers name the NIC, never `lo`",
            "set to `lo` where unset, for the demo, the stand-ins and servers whose side channel is on loopback",
        ),
    )
    ucx_tls: str | None = field(
        default=None,
        metadata=_declare(
            "UCX_TLS",
            Text("as UCX reads it"),
            "UCX's transports; naming only TCP (`tcp`, `self`, `sockcm`, `tcp_sockcm`, `rdmacm`) makes"
            " `PD_TRANSFER_PUSH=auto` push",
        ),
    )
    ucx_tcp_tx_seg_size: str | None = field(
        default=None,
        metadata=_declare(
            "UCX_TCP_TX_SEG_SIZE",
            Text("as UCX reads it"),
            "UCX's TCP message size when sending; it must not exceed any receiver's RX size",
            f"set to `{TCP_SEGMENT_ENV['UCX_TCP_TX_SEG_SIZE']}` where unset",
        ),
    )
    ucx_tcp_rx_seg_size: str | None = field(
        default=None,
        metadata=_declare(
            "UCX_TCP_RX_SEG_SIZE",
            Text("as UCX reads it"),
            "UCX's TCP message size when receiving",
            f"set to `{TCP_SEGMENT_ENV['UCX_TCP_RX_SEG_SIZE']}` where unset",
        ),
    )
    ucx_log_level: str | None = field(
        default=None,
        metadata=_declare(
            "UCX_LOG_LEVEL",
            Text("as UCX reads it"),
            "UCX's log level",
            f"set to `{UCX_LOG_LEVEL_DEFAULT}` where unset",
        ),
    )
    ucx_cuda_ipc_enable_get_zcopy: str | None = field(
        default=None,
        metadata=_declare(
            "UCX_CUDA_IPC_ENABLE_GET_ZCOPY",
            Text("as UCX reads it"),
            "UCX's CUDA IPC GETs (`on`, `off`, `auto`); UCX's `auto` turns them off where NVML sees no NVLink, and"
            " reads of GPU memory then go over TCP (0.5 GB/s)",
            f"set to `{CUDA_IPC_GET_ZCOPY_ENV['UCX_CUDA_IPC_ENABLE_GET_ZCOPY']}` where unset, by a process that"
            " registers GPU memory",
        ),
    )
    nixl_log_level: str | None = field(
        default=None,
        metadata=_declare(
            "NIXL_LOG_LEVEL",
            Text("as NIXL reads it"),
            "NIXL's log level; set, NIXL's Python logger keeps it",
            "unset: NIXL's Python logger at WARNING",
        ),
    )

    def __post_init__(self) -> None:
        for name, variable in _variables().items():
            value = getattr(self, name)
            if value is not None and not variable.kind.accepts(value):
                raise SettingError(f"{variable.name} (Settings.{name}) cannot be {str(value)[:_SHOWN_CHARS]!r}")

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> Settings:
        """The settings ``environ`` holds (a blank or missing variable: its default). Raises :class:`SettingError`
        naming every variable with a bad value."""
        values: dict[str, Any] = {}
        problems = []
        for name, variable in _variables().items():
            text = environ.get(variable.name, "").strip()
            if not text:
                continue
            try:
                values[name] = variable.parse(text)
            except SettingError as error:
                problems.append(str(error))
        if problems:
            raise SettingError("; ".join(problems))
        return cls(**values)

    # ------------------------------------------------------------------ derived values, in the units code uses
    @property
    def busy_poll_s(self) -> float:
        """A poll longer than this (seconds) moved data; ``inf`` when ``busy_poll_us`` is 0."""
        return self.busy_poll_us * 1e-6 if self.busy_poll_us > 0 else math.inf

    @property
    def read_wait_s(self) -> float:
        return self.read_wait_us * 1e-6

    @property
    def read_lane_count(self) -> int:
        """Agents a decode rank reads with: ``read_lanes``, else one per CPU up to 2."""
        return self.read_lanes if self.read_lanes is not None else min(2, os.cpu_count() or 1)

    @property
    def thread_cpu_set(self) -> frozenset[int] | None:
        """The CPUs our threads run on (None: inherit the creator's)."""
        return cpu_set(self.thread_cpus)

    @property
    def own_huge_pages(self) -> bool:
        """Whether memory pd-transfer allocates itself is advised to use huge pages (``huge_pages`` not "0")."""
        return self.huge_pages != "0"

    @property
    def registered_huge_pages(self) -> bool:
        """Whether memory is advised and collapsed when an agent registers it (``huge_pages`` "all")."""
        return self.huge_pages == "all"

    # ------------------------------------------------------------------ documentation
    @classmethod
    def markdown_table(cls) -> str:
        """Every variable as a row of a markdown table (name, default, values, meaning): README.md's settings."""
        rows = ["| name | default | values | meaning |", "|---|---|---|---|"]
        for declared in fields(cls):
            variable: Variable = declared.metadata["variable"]
            default = variable.shown_default if variable.shown_default is not None else _shown(declared.default)
            rows.append(f"| `{variable.name}` | {default} | {variable.kind.shown} | {variable.doc} |")
        return "\n".join(rows) + "\n"

    def lines(self) -> list[str]:
        """``NAME=value`` for every variable, as resolved (``pd-transfer settings``); unset ones as ``NAME=``."""
        out = []
        for name, variable in _variables().items():
            value = getattr(self, name)
            shown = "" if value is None else ("1" if value is True else "0" if value is False else str(value))
            out.append(f"{variable.name}={shown}")
        return out


def _variables() -> dict[str, Variable]:
    """Field name -> its variable's declaration, in declaration order."""
    return {declared.name: declared.metadata["variable"] for declared in fields(Settings)}


DEFAULTS = Settings()


# ---------------------------------------------------------------------- the process environment (edges only)
def environment() -> dict[str, str]:
    """A copy of this process's environment, for an edge: to read :class:`Settings` from, or to look up a variable
    whose name is configured (a connector's ``secret_env``)."""
    return dict(os.environ)


def read_settings() -> Settings:
    """This process's settings: call once, at the process's edge, and pass the result down."""
    return Settings.from_environ(os.environ)


def child_environment(overrides: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a child process: this process's, with ``overrides`` on top."""
    return {**os.environ, **(overrides or {})}


def apply_process_defaults(settings: Settings, *, net_devices: str | None = None, vram: bool = False) -> Settings:
    """Put the UCX variables pd-transfer wants in force into this process's environment where they are unset or blank
    (UCX reads them when an agent is made; child processes inherit them): ``UCX_LOG_LEVEL=error``, the TCP segment
    sizes of :data:`TCP_SEGMENT_ENV` unless ``settings.tcp_segments`` is off, ``UCX_NET_DEVICES=net_devices`` if
    given, and with ``vram`` (this process registers GPU memory) :data:`CUDA_IPC_GET_ZCOPY_ENV`. Call at the edge,
    before the first agent; an edge that learns only later that its cache is on a GPU (vLLM's worker, at
    ``register_kv_caches``) calls it again with ``vram=True`` before the agents that register it (a second call
    changes only what is still unset). Returns ``settings`` with the UCX values now in force."""
    wanted = {"UCX_LOG_LEVEL": UCX_LOG_LEVEL_DEFAULT, **(TCP_SEGMENT_ENV if settings.tcp_segments else {})}
    if net_devices:
        wanted["UCX_NET_DEVICES"] = net_devices
    if vram:
        # Only for GPU memory, not always: the variable is harmless for host memory (only UCX's cuda_ipc transport
        # reads it, and it moves only GPU memory), but where UCX has no CUDA (these CPU machines) nothing reads it,
        # and UCX then warns "unused environment variables: UCX_CUDA_IPC_ENABLE_GET_ZCOPY" at its warn level.
        wanted.update(CUDA_IPC_GET_ZCOPY_ENV)
    for key, value in wanted.items():
        if not os.environ.get(key, "").strip():
            os.environ[key] = value
    return _with_ucx_of(settings, os.environ)


def set_process_environment(values: Mapping[str, str]) -> None:
    """Set ``values`` in this process's environment, for an edge whose own configuration decides a variable UCX
    reads (a stand-in child told its network devices)."""
    os.environ.update(values)


@contextmanager
def process_environment(values: Mapping[str, str]) -> Iterator[None]:
    """Set ``values`` in this process's environment for the block (agents made and children started meanwhile see
    them), then put back what was there: for a benchmark's edge that runs a section under other UCX settings."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _with_ucx_of(settings: Settings, environ: Mapping[str, str]) -> Settings:
    """``settings`` with its UCX fields as ``environ`` holds them."""
    ucx: dict[str, Any] = {
        name: environ.get(variable.name, "").strip() or None
        for name, variable in _variables().items()
        if variable.name.startswith("UCX_")
    }
    return replace(settings, **ucx)
