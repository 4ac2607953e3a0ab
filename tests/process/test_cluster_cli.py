"""The cluster commands as a user types them, without vLLM: ``pd-transfer serve --print`` shows the command and its
environment, ``serve``'s and ``up``'s argument errors are clear (exit 2, each named), and ``up`` without vLLM says so.
The commands themselves: tests/unit/test_cluster_commands.py; ``up`` on real vLLM: tests/vllm/test_cluster_up.py."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from test_cluster_commands import MODEL_DIR, flag_value
from vllm_servers import vllm_missing


# ---------------------------------------------------------------------------------------------- command lines
def pd_transfer_cli(
    *args: str, env: dict[str, str] | None = None, timeout_s: float = 60.0
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pd_transfer.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**os.environ, **(env or {})},
        check=False,
    )


SERVE = ["serve", "--role", "decode", "--model", MODEL_DIR, "--port", "8101", "--side-channel-port", "8201"]


def test_serve_print_shows_the_command_and_its_environment() -> None:
    result = pd_transfer_cli(
        *SERVE, "--cpu-bind", "1", "--secret-env", "PD_SECRET", "--print", "--", "--dtype", "float32", "--x", "a b"
    )
    assert result.returncode == 0, result.stderr
    words = shlex.split(result.stdout)
    assignments = dict(w.split("=", 1) for w in words[: words.index(sys.executable)])
    assert assignments["VLLM_CPU_OMP_THREADS_BIND"] == "1" and assignments["VLLM_CPU_KVCACHE_SPACE"] == "1"
    command = words[words.index(sys.executable) :]
    assert command[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert command[-4:] == ["--dtype", "float32", "--x", "a b"]
    extra = json.loads(flag_value(command, "--kv-transfer-config"))["kv_connector_extra_config"]
    assert extra == {"side_channel_host": "127.0.0.1", "side_channel_port": 8201, "secret_env": "PD_SECRET"}
    # The same through python -m pd_transfer.cluster, and the secret's value is never printed.
    again = subprocess.run(
        [sys.executable, "-m", "pd_transfer.cluster", *SERVE, "--secret-env", "PD_SECRET", "--print"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PD_SECRET": "do-not-print-me"},
        check=False,
    )
    assert again.returncode == 0, again.stderr
    assert "--kv-transfer-config" in again.stdout and "do-not-print-me" not in again.stdout


def test_serve_errors_are_clear() -> None:
    result = pd_transfer_cli(*SERVE[:-1], "8101", "--print")
    assert result.returncode == 2 and "port and side_channel_port are both 8101" in result.stderr
    missing = pd_transfer_cli("serve", "--role", "prefill", "--model", MODEL_DIR, "--port", "8100")
    assert missing.returncode == 2 and "--side-channel-port" in missing.stderr
    secret = pd_transfer_cli(*SERVE, "--secret-env", "PD_NOT_SET_ANYWHERE")
    assert secret.returncode == 2 and "PD_NOT_SET_ANYWHERE is not set" in secret.stderr


def test_up_argument_errors_are_clear(tmp_path: Path) -> None:
    result = pd_transfer_cli(
        "up",
        "--prefill",
        "0",
        "--decode-tp",
        "0",
        "--keep",
        "--proxy-port",
        "8100",
        "--model",
        str(tmp_path / "nothing"),
        "--startup-timeout",
        "0",
    )
    assert result.returncode == 2, result.stdout + result.stderr
    for message in (
        "--prefill must be between 1 and 64, not 0",
        "--decode-tp must be at least 1, not 0",
        "--keep goes with --demo",
        "--proxy-port 8100 is one of the servers' ports (--base-port 8100)",
        f"--model {tmp_path / 'nothing'}: no model folder there (no config.json)",
        "--startup-timeout must be positive",
    ):
        assert f"pd-transfer up: {message}" in result.stderr, result.stderr
    assert pd_transfer_cli("up", "--routing", "random").returncode == 2


@pytest.mark.skipif(vllm_missing() is None, reason="vLLM is installed here")
def test_up_without_vllm_says_so() -> None:
    result = pd_transfer_cli("up")
    assert result.returncode == 2 and "vLLM is not installed for" in result.stderr, result.stderr
