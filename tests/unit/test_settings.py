"""pd_transfer.settings: every environment variable declared once, parsed and bounded with errors naming it, the UCX
defaults applied once at an edge, push decided by one rule; and the check that nothing else in the package touches
the process environment (ruff's TID251, shown failing on a read planted in a copy of the package)."""

from __future__ import annotations

import ast
import math
import os
import re
import shutil
import subprocess
import sys
from dataclasses import fields, replace
from pathlib import Path

import pytest

from pd_transfer.settings import (
    CUDA_IPC_GET_ZCOPY_ENV,
    DEFAULTS,
    TCP_SEGMENT_ENV,
    SettingError,
    Settings,
    apply_process_defaults,
    child_environment,
    cpu_set,
    process_environment,
)
from pd_transfer.transfer.tcp import push_mode, push_to, tcp_ucx_env

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "pd_transfer"


def declared() -> dict[str, str]:
    """Environment variable -> the field of Settings it fills."""
    return {f.metadata["variable"].name: f.name for f in fields(Settings)}


def test_an_empty_environment_gives_the_declared_defaults() -> None:
    assert Settings.from_environ({}) == Settings() == DEFAULTS
    assert (DEFAULTS.push, DEFAULTS.push_min_bytes, DEFAULTS.native_progress_ms) == ("auto", 4 * 2**20, 20)
    assert (DEFAULTS.huge_pages, DEFAULTS.tcp_segments, DEFAULTS.thread_cpus, DEFAULTS.log_level) == (
        "own",
        True,
        "all",
        "INFO",
    )


def test_every_kind_of_value_is_parsed() -> None:
    settings = Settings.from_environ(
        {
            "PD_TRANSFER_PUSH": " ON ",
            "PD_TRANSFER_PUSH_MIN_BYTES": "0",
            "PD_TRANSFER_READ_LANES": "3",
            "PD_TRANSFER_HUGE_PAGES": "off",
            "PD_TRANSFER_NATIVE_PROGRESS_MS": "2.5",
            "PD_TRANSFER_BUSY_POLL_US": "0",
            "PD_TRANSFER_READ_WAIT_US": "500",
            "PD_TRANSFER_TCP_SEGMENTS": "0",
            "PD_TRANSFER_THREAD_CPUS": "0-2,5",
            "PD_TRANSFER_LOG_LEVEL": "debug",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": "5601",
            "UCX_TLS": "tcp,self",
            "NOT_OURS": "ignored",
        }
    )
    assert (settings.push, settings.push_min_bytes, settings.read_lanes, settings.huge_pages) == ("on", 0, 3, "0")
    assert settings.native_progress_ms == 3  # rounded up: NIXL waits whole milliseconds
    assert (settings.busy_poll_s, settings.read_wait_s) == (math.inf, 500e-6)
    assert (settings.tcp_segments, settings.log_level) == (False, "DEBUG")
    assert settings.thread_cpu_set == {0, 1, 2, 5}
    assert (settings.side_channel_port, settings.ucx_tls) == (5601, "tcp,self")
    assert not settings.own_huge_pages and not settings.registered_huge_pages


def test_a_blank_variable_counts_as_unset() -> None:
    assert Settings.from_environ({"PD_TRANSFER_NATIVE_PROGRESS_MS": " ", "UCX_TLS": ""}) == DEFAULTS


@pytest.mark.parametrize(
    ("name", "bad"),
    [
        ("PD_TRANSFER_PUSH", "sometimes"),
        ("PD_TRANSFER_PUSH_MIN_BYTES", "-1"),
        ("PD_TRANSFER_PUSH_MIN_BYTES", "1.5"),
        ("PD_TRANSFER_READ_LANES", "0"),
        ("PD_TRANSFER_HUGE_PAGES", "sometimes"),
        ("PD_TRANSFER_NATIVE_PROGRESS_MS", "-1"),
        ("PD_TRANSFER_NATIVE_PROGRESS_MS", "soon"),
        ("PD_TRANSFER_NATIVE_PROGRESS_MS", "nan"),
        ("PD_TRANSFER_NATIVE_PROGRESS_MS", "1e12"),
        ("PD_TRANSFER_BUSY_POLL_US", "inf"),
        ("PD_TRANSFER_TCP_SEGMENTS", "maybe"),
        ("PD_TRANSFER_THREAD_CPUS", "most"),
        ("PD_TRANSFER_THREAD_CPUS", "3-1"),
        ("PD_TRANSFER_LOG_LEVEL", "loud"),
        ("VLLM_NIXL_SIDE_CHANNEL_PORT", "port"),
        ("VLLM_NIXL_SIDE_CHANNEL_PORT", "70000"),
    ],
)
def test_a_bad_value_is_refused_naming_the_variable(name: str, bad: str) -> None:
    with pytest.raises(SettingError, match=rf"^{name} must .*, not {re.escape(repr(bad))}$"):
        Settings.from_environ({name: bad})


def test_an_error_shows_at_most_40_characters_of_the_value_and_names_every_bad_variable() -> None:
    with pytest.raises(SettingError) as caught:
        Settings.from_environ({"PD_TRANSFER_HUGE_PAGES": "x" * 1000, "PD_TRANSFER_READ_LANES": "many"})
    message = str(caught.value)
    assert "PD_TRANSFER_HUGE_PAGES" in message and "PD_TRANSFER_READ_LANES" in message
    assert "x" * 40 in message and "x" * 41 not in message


def test_values_given_in_code_are_checked_too() -> None:
    with pytest.raises(SettingError, match="PD_TRANSFER_READ_LANES"):
        Settings(read_lanes=0)
    with pytest.raises(SettingError, match="PD_TRANSFER_PUSH"):
        replace(DEFAULTS, push="sometimes")  # type: ignore[arg-type]
    assert replace(DEFAULTS, thread_cpus="inherit").thread_cpu_set is None


def test_cpu_sets() -> None:
    assert cpu_set("inherit") is None
    assert cpu_set("all") == set(range(os.cpu_count() or 1))
    assert cpu_set("0-2,5") == {0, 1, 2, 5}
    with pytest.raises(ValueError, match="CPU list"):
        cpu_set("most")


def test_the_default_read_lanes_are_one_per_cpu_up_to_two() -> None:
    assert DEFAULTS.read_lane_count == min(2, os.cpu_count() or 1)
    assert Settings(read_lanes=5).read_lane_count == 5


def test_push_is_decided_by_one_rule_the_configured_mode_else_the_settings() -> None:
    off = Settings(push="off")
    assert push_mode(None, off) == "off" and push_mode(None, DEFAULTS) == "auto"
    assert push_mode(" ON ", off) == "on"  # a connector's push wins, on the prefill and on the decode alike
    with pytest.raises(ValueError, match="push must be one of auto, on, off"):
        push_mode("sometimes", DEFAULTS)


def test_push_in_auto_mode_follows_the_settings_ucx_transports() -> None:
    assert push_to("127.0.0.1", "auto", "tcp,self") and not push_to("127.0.0.1", "auto", "tcp,cma,self")
    assert push_to("127.0.0.1", "on", None) and not push_to("10.1.2.3", "off", "tcp")


def test_tcp_ucx_env_keeps_what_the_user_set() -> None:
    assert tcp_ucx_env(DEFAULTS) == {"UCX_TLS": "tcp,self", **TCP_SEGMENT_ENV}
    theirs = Settings(ucx_tls="tcp", ucx_tcp_rx_seg_size="128k")
    assert tcp_ucx_env(theirs) == {"UCX_TLS": "tcp", **TCP_SEGMENT_ENV, "UCX_TCP_RX_SEG_SIZE": "128k"}


def test_process_defaults_are_set_where_unset_and_leave_the_users(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UCX_TCP_TX_SEG_SIZE", "")  # blank counts as unset (monkeypatch restores all of these)
    monkeypatch.setenv("UCX_TCP_RX_SEG_SIZE", "128k")
    monkeypatch.setenv("UCX_LOG_LEVEL", "warn")
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    in_force = apply_process_defaults(DEFAULTS, net_devices="lo")
    assert os.environ["UCX_TCP_TX_SEG_SIZE"] == TCP_SEGMENT_ENV["UCX_TCP_TX_SEG_SIZE"]
    assert (os.environ["UCX_TCP_RX_SEG_SIZE"], os.environ["UCX_LOG_LEVEL"], os.environ["UCX_NET_DEVICES"]) == (
        "128k",
        "warn",
        "lo",
    )
    assert (in_force.ucx_tcp_tx_seg_size, in_force.ucx_tcp_rx_seg_size, in_force.ucx_net_devices) == (
        TCP_SEGMENT_ENV["UCX_TCP_TX_SEG_SIZE"],
        "128k",
        "lo",
    )


def test_segment_sizes_are_left_alone_when_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("UCX_TCP_TX_SEG_SIZE", raising=False)
    monkeypatch.delenv("UCX_LOG_LEVEL", raising=False)
    in_force = apply_process_defaults(Settings(tcp_segments=False))
    assert "UCX_TCP_TX_SEG_SIZE" not in os.environ and in_force.ucx_tcp_tx_seg_size is None
    assert os.environ["UCX_LOG_LEVEL"] == "error"


def test_cuda_ipc_gets_are_switched_on_only_for_gpu_memory_and_never_over_the_users(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    (name, value) = next(iter(CUDA_IPC_GET_ZCOPY_ENV.items()))
    assert (name, value) == ("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "y")
    monkeypatch.delenv(name, raising=False)
    host = apply_process_defaults(DEFAULTS)  # a host cache: left to UCX (nothing reads it where UCX has no CUDA)
    assert name not in os.environ and host.ucx_cuda_ipc_enable_get_zcopy is None
    gpu = apply_process_defaults(host, vram=True)  # the same edge, once it knows its cache is on a GPU
    assert os.environ[name] == "y" and gpu.ucx_cuda_ipc_enable_get_zcopy == "y"
    monkeypatch.setenv(name, "auto")  # the user's, even UCX's own default, wins
    assert apply_process_defaults(DEFAULTS, vram=True).ucx_cuda_ipc_enable_get_zcopy == "auto"
    assert os.environ[name] == "auto"
    monkeypatch.setenv(name, " ")  # blank counts as unset
    assert apply_process_defaults(DEFAULTS, vram=True).ucx_cuda_ipc_enable_get_zcopy == "y"
    assert Settings.from_environ({name: "off"}).ucx_cuda_ipc_enable_get_zcopy == "off"


def test_a_process_environment_is_put_back_after_the_block(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UCX_TLS", "rc")
    monkeypatch.delenv("PD_TRANSFER_TEST_UNSET", raising=False)
    with process_environment({"UCX_TLS": "tcp,self", "PD_TRANSFER_TEST_UNSET": "1"}):
        assert child_environment({"EXTRA": "x"})["UCX_TLS"] == "tcp,self"
        assert child_environment({"EXTRA": "x"})["EXTRA"] == "x"
    assert os.environ["UCX_TLS"] == "rc" and "PD_TRANSFER_TEST_UNSET" not in os.environ


def test_every_variable_the_package_names_is_declared() -> None:
    """A ``PD_TRANSFER_*`` name anywhere in the package (a doc, a message, a child's environment) is one of ours."""
    named = {
        name
        for source in PACKAGE.rglob("*.py")
        for name in re.findall(r"PD_TRANSFER_[A-Z0-9_]*[A-Z0-9]", source.read_text())
    }
    assert len(declared()) == len(fields(Settings))
    assert sorted(named - set(declared())) == []


# ---------------------------------------------------------------------- the contract: no other module touches it
def _ruff() -> str:
    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    if not Path(ruff).is_file():
        pytest.skip("ruff is not installed beside this interpreter")
    return ruff


def _ruff_check(tree: Path) -> subprocess.CompletedProcess[str]:
    """ruff over ``tree``'s package with ``tree``'s copy of the project's configuration (no cache)."""
    return subprocess.run(
        [_ruff(), "check", "--no-cache", "--output-format", "concise", "pd_transfer"],
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.fixture
def package_copy(tmp_path: Path) -> Path:
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    shutil.copytree(PACKAGE, tmp_path / "pd_transfer", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


PLANTED = {  # a function added at the end of a module, so that the read is the copy's only problem
    "def planted() -> object:\n    import os\n\n    return os.environ.get('X')\n": "os.environ",
    "def planted() -> object:\n    from os import getenv\n\n    return getenv('X')\n": "os.getenv",
    "def planted() -> None:\n    import os\n\n    os.putenv('X', '1')\n": "os.putenv",
}


def test_the_package_as_it_is_passes_the_check(package_copy: Path) -> None:
    done = _ruff_check(package_copy)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("planted", list(PLANTED), ids=list(PLANTED.values()))
def test_a_read_planted_outside_settings_fails_the_check(package_copy: Path, planted: str) -> None:
    target = package_copy / "pd_transfer" / "connector" / "leases.py"
    target.write_text(target.read_text() + "\n\n" + planted)
    done = _ruff_check(package_copy)
    print(done.stdout)  # the failure, as ruff reports it (pytest -s shows it)
    assert done.returncode == 1
    hits = [line for line in done.stdout.splitlines() if "TID251" in line]
    assert hits == done.stdout.splitlines()[:1], done.stdout  # the read, and nothing else
    assert "pd_transfer/connector/leases.py" in hits[0], hits
    assert f"`{PLANTED[planted]}` is banned" in hits[0], hits


# ---------------------------------------------------------------------- pd-transfer settings
def test_the_settings_command_prints_them_resolved_and_refuses_a_bad_one(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from pd_transfer.cli import main

    monkeypatch.setenv("PD_TRANSFER_PUSH", "ON")
    monkeypatch.delenv("PD_TRANSFER_READ_LANES", raising=False)
    assert main(["settings"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "PD_TRANSFER_PUSH=on" in lines and "PD_TRANSFER_READ_LANES=" in lines
    assert len(lines) == len(fields(Settings))
    assert main(["settings", "--table"]) == 0
    assert capsys.readouterr().out == Settings.markdown_table()
    monkeypatch.setenv("PD_TRANSFER_READ_LANES", "many")
    assert main(["settings"]) == 2
    assert "PD_TRANSFER_READ_LANES must be a number, not 'many'" in capsys.readouterr().err


#: Where a process's settings may be given a default: the command (``cli.py``, the CLI's edge) and ``settings.py``
#: itself; every other module, the stand-ins (``sim/``) and benchmarks (``bench/``) included, gets them handed down.
EDGES = ("cli.py", "settings.py")
#: Settings fields whose default is no default: ``None`` there means that the child process the spec starts reads its
#: own settings at its edge (its environment, inherited from the parent).
CHILD_READS_ITS_OWN = {"sim/peer.py PrefillSpec.settings"}


def _is_settings(annotation: ast.expr | None) -> bool:
    return annotation is not None and "Settings" in ast.unparse(annotation)


def _a_default(value: ast.expr | None) -> bool:
    """Whether a class field's value gives it a default (``field(kw_only=True)`` alone does not)."""
    if value is None:
        return False
    if isinstance(value, ast.Call) and ast.unparse(value.func).endswith("field"):
        return any(keyword.arg in ("default", "default_factory") for keyword in value.keywords)
    return True


def settings_defaults(package: Path) -> list[str]:
    """``path:line name`` of every parameter and every class field (a dataclass's or a ``Struct``'s: a parameter of
    the class) annotated ``Settings`` (or ``Settings | None``) that has a default, below the CLI: a caller that
    forgot to hand the process's settings down would silently run on defaults there."""
    found = []
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(package).as_posix()
        if relative.startswith(EDGES):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                for statement in node.body:
                    if (
                        isinstance(statement, ast.AnnAssign)
                        and _a_default(statement.value)
                        and isinstance(statement.target, ast.Name)
                        and _is_settings(statement.annotation)
                        and f"{relative} {node.name}.{statement.target.id}" not in CHILD_READS_ITS_OWN
                    ):
                        found.append(f"{relative}:{statement.lineno} {node.name}.{statement.target.id}")
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            arguments = node.args
            positional = arguments.posonlyargs + arguments.args
            pairs = list(zip(positional[len(positional) - len(arguments.defaults) :], arguments.defaults, strict=True))
            pairs += [(a, d) for a, d in zip(arguments.kwonlyargs, arguments.kw_defaults, strict=True) if d is not None]
            for argument, _ in pairs:
                if _is_settings(argument.annotation):
                    found.append(f"{relative}:{node.lineno} {node.name}({argument.arg})")
    return found


def test_no_signature_below_the_cli_defaults_the_settings() -> None:
    """Settings are read once at a process's edge and handed down: below the CLI a ``settings`` parameter or field
    has no default (``settings: Settings = DEFAULTS`` would turn a missing hand-down into a process running on
    defaults), the stand-ins' and benchmarks' included."""
    assert settings_defaults(PACKAGE) == []


def test_a_settings_default_planted_below_the_edge_is_found(package_copy: Path) -> None:
    target = package_copy / "pd_transfer" / "connector" / "cache.py"
    target.write_text(target.read_text() + "\n\ndef planted(settings: Settings = DEFAULTS) -> None:\n    pass\n")
    field = package_copy / "pd_transfer" / "sim" / "kv_model.py"
    field.write_text(field.read_text() + "\n\nclass Planted:\n    settings: Settings = DEFAULTS\n")
    found = settings_defaults(package_copy / "pd_transfer")
    assert [hit.split(":")[0] for hit in found] == ["connector/cache.py", "sim/kv_model.py"], found
    assert found[1].endswith(" Planted.settings"), found


#: Where the product is not: the benchmarks, the stand-ins and the command that runs them.
BESIDE_THE_PRODUCT = ("bench/", "sim/", "cli.py")


def settings_only_beside_the_product(names: list[str], package: Path) -> list[str]:
    """Of the :class:`Settings` fields ``names``, those that no product module reads (as ``.name``: an attribute of
    the settings): fields that exist for a benchmark, a stand-in or a test. A variable another program reads
    (``UCX_*``, declared to be documented and put in force) counts as read."""
    product = [
        path.read_text()
        for path in sorted(package.rglob("*.py"))
        if not path.relative_to(package).as_posix().startswith(BESIDE_THE_PRODUCT)
    ]
    variables = {f.name: f.metadata["variable"].name for f in fields(Settings)}
    return [
        name
        for name in names
        if not variables.get(name, "").startswith("UCX_")
        and not any(re.search(rf"\.{name}\b", text) for text in product)
    ]


def test_every_setting_is_the_products() -> None:
    """No field of :class:`Settings` exists for a benchmark's, a stand-in's or a test's sake: each is read by the
    product (a benchmark takes its own values as arguments). ``vllm_router``, once a field only ``bench proxy``
    read, is found as one."""
    assert settings_only_beside_the_product([f.name for f in fields(Settings)], PACKAGE) == []
    assert settings_only_beside_the_product(["vllm_router"], PACKAGE) == ["vllm_router"]
