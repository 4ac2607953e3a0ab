"""The local cluster: ``pd-transfer serve`` (one vLLM server with our connector) and ``pd-transfer up`` (prefill and
decode servers plus the proxy).

Fast tests run anywhere: the vLLM command and environment, ``serve --print``, ``up``'s argument errors. The end-to-end
test needs vLLM and the tiny model: it runs ``pd-transfer up --demo`` as a subprocess next to a plain vLLM server (no
connector), sends streamed and non-streamed completions and chats through the proxy, checks every greedy answer
against the plain server and the decode's ``external_kv_transfer`` prompt tokens, then interrupts ``up`` and checks
that every process it started is gone.
"""

from __future__ import annotations

import json
import os
import random
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from pd_transfer.cluster.http_client import (
    LISTEN_PORT_RANGE,
    answer_tokens,
    free_port,
    post_json,
    post_stream,
    prompt_tokens,
)
from pd_transfer.cluster.launch import ServerSpec, cpu_binds, kv_transfer_config, vllm_command, vllm_env
from pd_transfer.cluster.processes import ManagedProcess, log_excerpt, wait_ready
from pd_transfer.connector.config import ConfigError, ConnectorConfig

MODEL_DIR = "/models/tiny"  # need not exist for the command-line tests


def _spec(**overrides: object) -> ServerSpec:
    fields: dict[str, object] = {"role": "prefill", "model": MODEL_DIR, "port": 8100, "side_channel_port": 8200}
    return ServerSpec(**(fields | overrides))  # type: ignore[arg-type]


def _flag(command: list[str], flag: str) -> str:
    assert command.count(flag) == 1, f"{flag} appears {command.count(flag)} times in {command}"
    return command[command.index(flag) + 1]


# ---------------------------------------------------------------------------------------------- command and env
def test_vllm_command_runs_the_api_server_with_our_connector() -> None:
    spec = _spec(
        role="decode",
        port=8101,
        side_channel_port=8201,
        host="0.0.0.0",
        side_channel_host="10.0.0.2",
        block_size=64,
        tp_size=2,
        lease_seconds=12.5,
        failure_policy="fail",
        secret_env="PD_SECRET",
        extra_args=("--enforce-eager",),
        dtype="float32",
        max_model_len=2048,
        seed=0,
    )
    command = vllm_command(spec, python="/opt/py/bin/python")
    assert command[:3] == ["/opt/py/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert command[-1] == "--enforce-eager"
    expected = {
        "--model": MODEL_DIR,
        "--host": "0.0.0.0",
        "--port": "8101",
        "--block-size": "64",
        "--tensor-parallel-size": "2",
        "--dtype": "float32",
        "--max-model-len": "2048",
        "--seed": "0",
    }
    assert {flag: _flag(command, flag) for flag in expected} == expected
    transfer = json.loads(_flag(command, "--kv-transfer-config"))
    assert transfer == kv_transfer_config(spec)
    assert {k: transfer[k] for k in ("kv_connector", "kv_connector_module_path", "kv_role", "kv_buffer_device")} == {
        "kv_connector": "PdTransferConnector",
        "kv_connector_module_path": "pd_transfer.integrations.vllm",
        "kv_role": "kv_both",
        "kv_buffer_device": "cpu",
    }
    extra = transfer["kv_connector_extra_config"]
    assert extra == {
        "side_channel_host": "10.0.0.2",
        "side_channel_port": 8201,
        "lease_seconds": 12.5,
        "failure_policy": "fail",
        "secret_env": "PD_SECRET",
    }
    # The connector accepts exactly this extra config, and reads the secret from the named variable.
    config = ConnectorConfig.from_dict(extra, env={"PD_SECRET": "s3cret"})
    assert (config.side_channel_host, config.side_channel_port, config.secret) == ("10.0.0.2", 8201, "s3cret")
    assert (config.lease_seconds, config.failure_policy) == (12.5, "fail")
    assert "s3cret" not in " ".join(command)


def test_minimal_command_leaves_vllm_defaults_alone() -> None:
    command = vllm_command(_spec(), python="python")
    for flag in ("--block-size", "--tensor-parallel-size", "--dtype", "--seed", "--kv-cache-memory-bytes"):
        assert flag not in command
    extra = json.loads(_flag(command, "--kv-transfer-config"))["kv_connector_extra_config"]
    assert extra == {"side_channel_host": "127.0.0.1", "side_channel_port": 8200}
    assert ConnectorConfig.from_dict(extra, env={}).failure_policy == "recompute"
    assert "--kv-transfer-config" not in vllm_command(_spec(), python="python", connector=False)


def test_log_excerpt_keeps_the_root_cause_and_the_end(tmp_path: Path) -> None:
    """vLLM's engine core logs the root cause long before the API server's own traceback ends the log."""
    lines = [f"INFO step {i}" for i in range(100)]
    lines[10] = "\x1b[1;31mERROR\x1b[0m EngineCore failed to start."
    lines[11] = "ValueError: the root cause"
    log = tmp_path / "server.log"
    log.write_text("\n".join(lines))
    excerpt = log_excerpt(log, tail_lines=5, error_lines=3).splitlines()
    assert excerpt == [
        "ERROR EngineCore failed to start.",
        "ValueError: the root cause",
        "INFO step 12",
        "[... 82 lines ...]",
        *lines[95:],
    ]
    within_tail = log_excerpt(log, tail_lines=95).splitlines()  # the error lies in the tail: shown once
    assert within_tail == [*lines[5:10], "ERROR EngineCore failed to start.", *lines[11:]]
    quiet = tmp_path / "quiet.log"
    quiet.write_text("\n".join(lines[20:]))
    assert log_excerpt(quiet, tail_lines=5).splitlines() == lines[95:]
    assert log_excerpt(tmp_path / "missing.log") == "(no log)"


def test_free_port_never_returns_a_port_twice() -> None:
    """Servers started together get their ports before any binds one: 500 picks from the 12,768 ports of the range
    would repeat about ten times by chance; none may."""
    ports = [free_port() for _ in range(500)]
    assert len(set(ports)) == len(ports)
    assert all(LISTEN_PORT_RANGE[0] <= port < LISTEN_PORT_RANGE[1] for port in ports)


def test_vllm_env(tmp_path: Path) -> None:
    base = {"PATH": "/bin", "VLLM_CPU_KVCACHE_SPACE": "7", "PD_SECRET": "s3cret"}
    env = vllm_env(_spec(model=str(tmp_path), cpu_bind="0|1", secret_env="PD_SECRET"), base)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    assert env["UCX_NET_DEVICES"] == "lo"  # loopback side channel
    assert env["HF_HUB_OFFLINE"] == "1"  # a local model folder
    assert env["PATH"] == "/bin" and env["PD_SECRET"] == "s3cret"
    assert base["VLLM_CPU_KVCACHE_SPACE"] == "7", "the base environment must not change"
    # A UCX choice of the caller stays; a non-local side channel does not force loopback; a hub id stays online.
    remote = vllm_env(_spec(side_channel_host="10.0.0.2", model="org/model"), {"PATH": "/bin"})
    assert "UCX_NET_DEVICES" not in remote and "HF_HUB_OFFLINE" not in remote
    assert vllm_env(_spec(), {"UCX_NET_DEVICES": "eth0"})["UCX_NET_DEVICES"] == "eth0"
    # Half a GiB: VLLM_CPU_KVCACHE_SPACE takes whole GiB, so the size goes on the command line.
    half = _spec(kvcache_gib=0.5)
    assert "VLLM_CPU_KVCACHE_SPACE" not in vllm_env(half, base)
    assert _flag(vllm_command(half, python="python"), "--kv-cache-memory-bytes") == str(1 << 29)
    with pytest.raises(ValueError, match="PD_MISSING is not set"):
        vllm_env(_spec(secret_env="PD_MISSING"), base)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"role": "router"}, "role must be one of prefill, decode, both"),
        ({"port": 0}, "port 0 is outside"),
        ({"side_channel_port": 8100}, "port and side_channel_port are both 8100"),
        ({"tp_size": 0}, "tp_size must be at least 1"),
        ({"failure_policy": "retry"}, "failure_policy must be recompute or fail"),
        ({"kvcache_gib": 0.0}, "kvcache_gib must be positive"),
    ],
)
def test_server_spec_refuses_bad_values(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _spec(**overrides)


def test_connector_secret_env() -> None:
    with pytest.raises(ConfigError, match="give one of them"):
        ConnectorConfig.from_dict({"secret": "a", "secret_env": "PD_SECRET"}, env={"PD_SECRET": "b"})
    with pytest.raises(ConfigError, match="PD_SECRET is not set or empty"):
        ConnectorConfig.from_dict({"secret_env": "PD_SECRET"}, env={"PD_SECRET": ""})
    assert ConnectorConfig.from_dict({"secret_env": "PD_SECRET"}, env={"PD_SECRET": "x"}).secret == "x"


def test_cpu_binds_spread_ranks_over_cores() -> None:
    assert cpu_binds([1, 1], [0, 1]) == ["0", "1"]
    assert cpu_binds([1, 1, 1], [0, 1]) == ["0", "1", "0"]  # more ranks than cores: in turn
    assert cpu_binds([2, 1], [0, 1]) == ["0|1", "0"]
    assert cpu_binds([2, 1], [0, 1, 2, 3, 4, 5]) == ["0-1|2-3", "4-5"]
    assert cpu_binds([1], [0, 2, 4]) == ["0,2,4"]


# ---------------------------------------------------------------------------------------------- command lines
def _cli(*args: str, env: dict[str, str] | None = None, timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
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
    result = _cli(
        *SERVE, "--cpu-bind", "1", "--secret-env", "PD_SECRET", "--print", "--", "--dtype", "float32", "--x", "a b"
    )
    assert result.returncode == 0, result.stderr
    words = shlex.split(result.stdout)
    assignments = dict(w.split("=", 1) for w in words[: words.index(sys.executable)])
    assert assignments["VLLM_CPU_OMP_THREADS_BIND"] == "1" and assignments["VLLM_CPU_KVCACHE_SPACE"] == "1"
    command = words[words.index(sys.executable) :]
    assert command[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert command[-4:] == ["--dtype", "float32", "--x", "a b"]
    extra = json.loads(_flag(command, "--kv-transfer-config"))["kv_connector_extra_config"]
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
    result = _cli(*SERVE[:-1], "8101", "--print")
    assert result.returncode == 2 and "port and side_channel_port are both 8101" in result.stderr
    missing = _cli("serve", "--role", "prefill", "--model", MODEL_DIR, "--port", "8100")
    assert missing.returncode == 2 and "--side-channel-port" in missing.stderr
    secret = _cli(*SERVE, "--secret-env", "PD_NOT_SET_ANYWHERE")
    assert secret.returncode == 2 and "PD_NOT_SET_ANYWHERE is not set" in secret.stderr


def test_up_argument_errors_are_clear(tmp_path: Path) -> None:
    result = _cli(
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
    assert _cli("up", "--routing", "random").returncode == 2


def test_up_offload_dir_wires_every_connector_server(tmp_path: Path) -> None:
    """``--offload-dir`` gives every prefill and decode (not the plain reference) vLLM's MultiConnector over
    PdTransferConnector then PdOffloadConnector on the same directory, failures recomputed."""
    import argparse

    from pd_transfer.cluster.up import add_arguments, plan_servers, validate

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    shared = tmp_path / "kv"
    flags = ["--demo", "--decode", "2", "--offload-dir", str(shared), "--offload-dir-bytes", "1048576"]
    args = parser.parse_args([*flags, "--offload-host-bytes", "4096"])
    assert validate(args) == []
    planned = plan_servers(args, MODEL_DIR, "tiny")
    assert [p.name for p in planned] == ["prefill-0", "decode-0", "decode-1", "reference"]
    for server in planned[:3]:
        config = json.loads(_flag(vllm_command(server.spec), "--kv-transfer-config"))
        assert config["kv_connector"] == "MultiConnector" and config["kv_load_failure_policy"] == "recompute"
        pd, offload = config["kv_connector_extra_config"]["connectors"]
        assert pd == kv_transfer_config(replace(server.spec, offload_dir=None, offload_host_bytes=0))
        assert offload == {
            "kv_connector": "PdOffloadConnector",
            "kv_connector_module_path": "pd_transfer.integrations.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "offload_dir": str(shared.resolve()),
                "offload_dir_bytes": 1048576,
                "offload_host_bytes": 4096,
            },
        }
    assert "--kv-transfer-config" not in vllm_command(planned[3].spec, connector=planned[3].connector)
    assert planned[3].spec.offload_dir is None
    bad = parser.parse_args(["--offload-host-bytes", "1", "--decode-tp", "2"])
    assert validate(bad) == ["--offload-host-bytes goes with --offload-dir"]
    bad = parser.parse_args(["--offload-dir", str(shared), "--offload-dir-bytes", "0", "--decode-tp", "2"])
    assert validate(bad) == [
        "--offload-dir-bytes must be positive, not 0",
        "--offload-dir supports TP 1 only (PdOffloadConnector)",
    ]


from vllm_servers import vllm_missing  # noqa: E402

_MISSING = vllm_missing()


@pytest.mark.skipif(_MISSING is None, reason="vLLM is installed here")
def test_up_without_vllm_says_so() -> None:
    result = _cli("up")
    assert result.returncode == 2 and "vLLM is not installed for" in result.stderr, result.stderr


@pytest.mark.skipif(_MISSING is not None, reason=_MISSING or "")
def test_up_refuses_busy_ports(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = _cli("up", "--proxy-port", str(port), "--model", str(tmp_path), "--log-dir", str(tmp_path / "logs"))
        if result.returncode == 2 and "no model folder" in result.stderr:
            (tmp_path / "config.json").write_text("{}")
            result = _cli("up", "--proxy-port", str(port), "--model", str(tmp_path))
    assert result.returncode == 2 and f"port(s) in use: {port}" in result.stdout + result.stderr


@pytest.mark.skipif(_MISSING is not None, reason=_MISSING or "")
def test_failed_startup_stops_everything_and_shows_the_log(tmp_path: Path) -> None:
    """Servers not healthy within --startup-timeout: up names them, prints their log tails, stops them all."""
    if not (Path(DEFAULT_MODEL) / "config.json").exists():
        pytest.skip(f"no model at {DEFAULT_MODEL}")
    base = free_base_port()
    logs = tmp_path / "logs"
    started = time.monotonic()
    result = _cli(
        "up",
        "--model",
        DEFAULT_MODEL,
        "--base-port",
        str(base),
        "--proxy-port",
        str(base - 1),
        "--log-dir",
        str(logs),
        "--startup-timeout",
        "5",
        timeout_s=120,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "not healthy after 5 s: prefill-0, decode-0 (--startup-timeout)" in output, output
    assert f"--- the end of {logs / 'prefill-0.log'} ---" in output, output
    assert output.splitlines()[-1].startswith("stopped ("), output
    state = json.loads((logs / "cluster.json").read_text())
    assert state["state"] == "stopped"
    left = {p["name"]: live_in_group(p["pgid"]) for p in state["processes"]}
    assert not any(left.values()), f"left behind: {left}"
    print(f"\nfailed startup reported and stopped in {time.monotonic() - started:.1f} s")


# ---------------------------------------------------------------------------------------------- end to end
from vllm_servers import (  # noqa: E402
    DEFAULT_MODEL,
    KV_CACHE_BYTES,
    free_base_port,
    live_in_group,
    metric_value,
    reference_server,
)

EXTERNAL = "external_kv_transfer"
PROMPT_METRIC = "vllm:prompt_tokens_by_source_total"
MAX_TOKENS = 12
UP_TIMEOUT_S = float(os.environ.get("PD_TRANSFER_VLLM_STARTUP_S", "900"))
RUN_SALT = time.time_ns() % 10**9
#: The first test using the cluster also waits for its startup (the three servers start at once).
E2E_TIMEOUT = pytest.mark.timeout(UP_TIMEOUT_S + 900)


def _prompt_ids(length: int, seed: int) -> list[int]:
    rng = random.Random(seed * 10**9 + RUN_SALT)
    return [rng.randrange(3, 2048) for _ in range(length)]  # 0..2 are <s>, </s>, <pad>


def _words(count: int, seed: int) -> str:
    from pd_transfer.tiny_model import synthetic_corpus

    words = " ".join(synthetic_corpus(count * 8, corpus_seed=seed + RUN_SALT)).split()
    return " ".join(words[:count])


class Cluster:
    def __init__(self, process: subprocess.Popen[bytes], output: Path, log_dir: Path, base_port: int) -> None:
        self.process = process
        self.output = output
        self.log_dir = log_dir
        self.base_port = base_port
        self.state: dict = {}

    def text(self) -> str:
        return self.output.read_text(errors="replace")

    def load_state(self) -> dict:
        try:
            self.state = json.loads((self.log_dir / "cluster.json").read_text())
        except (OSError, ValueError):
            pass
        return self.state

    def pgids(self) -> list[int]:
        return [int(p["pgid"]) for p in self.load_state().get("processes", [])]

    def logs(self) -> str:
        return "\n".join(
            f"--- {path.name} ---\n" + "\n".join(path.read_text(errors="replace").splitlines()[-30:])
            for path in sorted(self.log_dir.glob("*.log"))
        )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, ManagedProcess]]:
    if _MISSING is not None:
        pytest.skip(_MISSING)
    if not (Path(DEFAULT_MODEL) / "config.json").exists():
        pytest.skip(f"no model at {DEFAULT_MODEL} (make it with `pd-transfer make-model`)")
    work = tmp_path_factory.mktemp("up")
    base = free_base_port()
    reference = reference_server(DEFAULT_MODEL, work)
    output = work / "up.out"
    # the test brings its own reference and checks every answer itself; the cluster stays up for it
    command = [sys.executable, "-m", "pd_transfer.cluster", "up", "--demo", "--no-check", "--keep"]
    command += ["--model", DEFAULT_MODEL, "--kvcache-gib", str(KV_CACHE_BYTES / 2**30)]
    command += ["--base-port", str(base), "--proxy-port", str(base - 1), "--log-dir", str(work / "logs")]
    command += ["--startup-timeout", str(UP_TIMEOUT_S)]
    # SIGTERM to pytest (e.g. from `timeout`) must still run the teardown below: up and the reference live in their
    # own sessions and would outlive it.
    previous = signal.signal(signal.SIGTERM, signal.getsignal(signal.SIGINT))
    started = time.monotonic()
    reference.start()
    with open(output, "wb") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
    up = Cluster(process, output, work / "logs", base)
    try:
        deadline = time.monotonic() + UP_TIMEOUT_S + 300  # startup, the proxy, the demo
        while "Ctrl-C stops the cluster." not in up.text():
            assert process.poll() is None, f"up exited with {process.returncode}:\n{up.text()}\n{up.logs()}"
            assert time.monotonic() < deadline, f"up not ready in time:\n{up.text()}\n{up.logs()}"
            time.sleep(1.0)
        wait_ready([reference], UP_TIMEOUT_S)
        print(f"\nup --demo ready and the reference healthy after {time.monotonic() - started:.0f} s:\n{up.text()}")
        yield up, reference
    finally:
        pgids = up.pgids()
        if process.poll() is None:  # a failed test: stop it the way a user would, then make sure
            process.send_signal(signal.SIGINT)
            try:
                process.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(10)
        for pgid in pgids:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        reference.stop()
        signal.signal(signal.SIGTERM, previous)


@E2E_TIMEOUT
def test_up_demo_printed_transfers(cluster: tuple[Cluster, ManagedProcess]) -> None:
    up, _ = cluster
    text = up.text()
    state = up.load_state()
    assert state["state"] == "ready" and state["proxy"] == f"http://127.0.0.1:{up.base_port - 1}"
    assert [p["name"] for p in state["processes"]] == ["prefill-0", "decode-0", "proxy"]
    curl = next(line.strip() for line in text.splitlines() if line.strip().startswith("curl -s http://127.0.0.1:"))
    if shutil.which("curl"):  # the printed example works as printed
        answer = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=120, check=True)
        assert json.loads(answer.stdout)["choices"][0]["text"], answer.stdout
    demo = [line for line in text.splitlines() if "loaded over NIXL" in line]
    assert len(demo) == 4, text
    for line in demo:
        loaded = int(line.split("KV of ", 1)[1].split()[0])
        prompt = int(line.split(": ", 1)[1].split()[0])
        assert loaded == prompt > 0, line  # the decode loaded every prompt token from the prefill


CASES = [
    ("completion, 50 token ids", "/v1/completions", False, {"prompt": _prompt_ids(50, 1)}),
    ("completion, 677 token ids, streamed", "/v1/completions", True, {"prompt": _prompt_ids(5 * 128 + 37, 2)}),
    ("completion, text", "/v1/completions", True, {"prompt": _words(40, 3)}),
    ("chat, short", "/v1/chat/completions", False, {"messages": [{"role": "user", "content": _words(12, 4)}]}),
    (
        "chat, multi-block, streamed",
        "/v1/chat/completions",
        True,
        {"messages": [{"role": "user", "content": _words(400, 5)}]},
    ),
]


@E2E_TIMEOUT
@pytest.mark.parametrize(("name", "endpoint", "streamed", "body"), CASES, ids=[c[0] for c in CASES])
def test_proxy_answers_equal_a_plain_vllm_server(
    cluster: tuple[Cluster, ManagedProcess], name: str, endpoint: str, streamed: bool, body: dict
) -> None:
    up, reference = cluster
    chat = endpoint.endswith("chat/completions")
    proxy = up.state["proxy"]
    decode = next(p["url"] for p in up.state["processes"] if p["name"] == "decode-0")
    common = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
    common |= {"logprobs": True} if chat else {"logprobs": 1}
    expected = answer_tokens(post_json(reference.url + endpoint, {**body, **common, "model": DEFAULT_MODEL}), chat=chat)
    before = metric_value(decode, PROMPT_METRIC, source=EXTERNAL)
    payload = {**body, **common, "model": up.state["model"]}
    started = time.perf_counter()
    if streamed:
        answer: dict | list[dict] = post_stream(proxy + endpoint, payload | {"stream_options": {"include_usage": True}})
    else:
        answer = post_json(proxy + endpoint, payload)
    seconds = time.perf_counter() - started
    got, prompted = answer_tokens(answer, chat=chat), prompt_tokens(answer)
    loaded = metric_value(decode, PROMPT_METRIC, source=EXTERNAL) - before
    print(f"\n{name}: {prompted} prompt tokens, {seconds:.2f} s, external_kv_transfer +{loaded:.0f}")
    assert len(expected) == MAX_TOKENS
    assert got == expected, f"{name}: the proxy's answer differs from a plain vLLM server's\n{got}\n{expected}"
    assert loaded == prompted > 0, f"{name}: the decode loaded {loaded} of {prompted} prompt tokens"


@E2E_TIMEOUT
def test_interrupt_stops_every_process(cluster: tuple[Cluster, ManagedProcess]) -> None:
    """Runs last in this module: SIGINT to up, then nothing it started may be left."""
    up, _ = cluster
    pgids = up.pgids()
    assert len(pgids) == 3 and all(live_in_group(pgid) for pgid in pgids), up.state
    started = time.monotonic()
    up.process.send_signal(signal.SIGINT)
    code = up.process.wait(90)
    waited = time.monotonic() - started
    left = {pgid: live_in_group(pgid) for pgid in pgids}
    print(f"\nup stopped in {waited:.1f} s (exit {code}); its last lines:\n" + "\n".join(up.text().splitlines()[-3:]))
    assert code == 0, up.text()
    assert not any(left.values()), f"processes left behind: {left}"
    assert up.text().splitlines()[-1].startswith("stopped (")
    assert up.load_state()["state"] == "stopped"
