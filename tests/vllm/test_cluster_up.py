"""The local cluster on real vLLM: ``pd-transfer up`` (prefill and decode servers plus the proxy) refusing busy
ports and stopping everything after a failed startup, and end to end with the tiny model: it runs ``pd-transfer up
--demo`` as a subprocess next to a plain vLLM server (no connector), sends streamed and non-streamed completions and
chats through the proxy, checks every greedy answer against the plain server and the decode's ``external_kv_transfer``
prompt tokens, then interrupts ``up`` and checks that every process it started is gone.

The commands and environments ``serve`` and ``up`` build: tests/unit/test_cluster_commands.py; their command lines
without vLLM: tests/process/test_cluster_cli.py.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_cluster_cli import pd_transfer_cli
from vllm_servers import (
    DEFAULT_MODEL,
    KV_CACHE_BYTES,
    free_base_port,
    live_in_group,
    metric_value,
    reference_server,
)

from pd_transfer.cluster.http_client import (
    answer_tokens,
    post_json,
    post_stream,
    prompt_tokens,
)
from pd_transfer.cluster.processes import ManagedProcess, wait_ready


# ---------------------------------------------------------------------------------------------- refusals of up
def test_up_refuses_busy_ports(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = pd_transfer_cli(
            "up", "--proxy-port", str(port), "--model", str(tmp_path), "--log-dir", str(tmp_path / "logs")
        )
        if result.returncode == 2 and "no model folder" in result.stderr:
            (tmp_path / "config.json").write_text("{}")
            result = pd_transfer_cli("up", "--proxy-port", str(port), "--model", str(tmp_path))
    assert result.returncode == 2 and f"port(s) in use: {port}" in result.stdout + result.stderr


def test_failed_startup_stops_everything_and_shows_the_log(tiny_model: str, tmp_path: Path) -> None:
    """Servers not healthy within --startup-timeout: up names them, prints their log tails, stops them all."""
    base = free_base_port()
    logs = tmp_path / "logs"
    started = time.monotonic()
    result = pd_transfer_cli(
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
def cluster(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, ManagedProcess]]:
    work = tmp_path_factory.mktemp("up")
    base = free_base_port()
    reference = reference_server(DEFAULT_MODEL, work, eager=False)  # compiled, as `up` below: what users run
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
    demo = [line for line in text.splitlines() if "prompt tokens loaded " in line]
    assert len(demo) == 4, text
    # the servers share this host and pid namespace: the decode reads the prefill's cache in place
    assert all("prompt tokens loaded in place (host_cma)" in line for line in demo), text
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
