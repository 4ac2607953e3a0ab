"""The examples run as a user would run them, so none of them rots."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import queue
import re
import shlex
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from pd_transfer.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
ROLES = ("prefill", "decode")


def test_library_transfer_example() -> None:
    env = {**os.environ, "UCX_NET_DEVICES": "lo"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "library_transfer.py")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "match" in result.stdout
    assert "prefill: request-1 released" in result.stdout


# ------------------------------------------------------------------ examples/launch_pd.sh, examples/xpyd.sh
@dataclass
class Launched:
    """One ``pd-transfer`` command a launch script prints (``+ ...``), parsed, and the vLLM command it runs."""

    argv: list[str]
    args: argparse.Namespace
    vllm: list[str] = field(default_factory=list)
    vllm_env: dict[str, str] = field(default_factory=dict)


def pd_transfer_executable() -> str:
    """The ``pd-transfer`` script of the environment running the tests."""
    path = Path(sys.executable).parent / "pd-transfer"
    assert path.exists(), f"{path} missing: install the package (scripts/setup)"
    return str(path)


def dry_run(script: str, **settings: str) -> list[Launched]:
    """``DRY_RUN=1 examples/SCRIPT`` with ``settings`` in its environment; its commands, parsed by the real CLI."""
    inherited = {key: value for key, value in os.environ.items() if key not in ("UCX_NET_DEVICES", "HF_HUB_OFFLINE")}
    env = {**inherited, "DRY_RUN": "1", "PD_TRANSFER": pd_transfer_executable(), **settings}
    result = subprocess.run(
        ["bash", str(ROOT / "examples" / script)], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT
    )
    assert result.returncode == 0, result.stdout + result.stderr
    launched: list[Launched] = []
    for line in result.stdout.splitlines():
        if line.startswith("+ "):
            argv = shlex.split(line[2:])
            assert argv[0] == env["PD_TRANSFER"], argv
            errors = io.StringIO()
            try:
                with contextlib.redirect_stderr(errors):
                    args = build_parser().parse_args(argv[1:])
            except SystemExit:
                pytest.fail(f"{script} runs `{line[2:]}`, which pd-transfer refuses: {errors.getvalue()}")
            launched.append(Launched(argv, args))
        elif line.strip():
            assert launched and launched[-1].args.command == "serve" and not launched[-1].vllm, line
            words = shlex.split(line)
            if words[0] == "env":  # `env -u NAME ... KEY=VALUE ... command`
                words = words[1:]
                while words[0] == "-u":
                    words = words[2:]
            while "=" in words[0] and not words[0].startswith("-"):
                key, _, value = words.pop(0).partition("=")
                launched[-1].vllm_env[key] = value
            launched[-1].vllm = words
    assert launched, result.stdout
    return launched


def flag(argv: list[str], name: str) -> str:
    assert argv.count(name) == 1, f"{name} in {argv}"
    return argv[argv.index(name) + 1]


def check_launch(launched: list[Launched], host: str, prefills: int) -> None:
    """The servers the proxy routes to are the ones the script starts, on their own ports, and each vLLM command
    serves what its ``pd-transfer serve`` line says."""
    servers = [item for item in launched if item.args.command == "serve"]
    proxies = [item for item in launched if item.args.command == "proxy"]
    assert len(proxies) == 1 and launched[-1] is proxies[0], "the proxy comes last, once"
    proxy = proxies[0].args
    roles = [server.args.role for server in servers]
    assert roles == ["prefill"] * prefills + ["decode"], roles
    for server in servers:
        args, vllm = server.args, server.vllm
        assert vllm[1:3] == ["-m", "vllm.entrypoints.openai.api_server"], vllm
        if importlib.util.find_spec("vllm") is not None:
            assert importlib.util.find_spec(vllm[2]) is not None
        assert (flag(vllm, "--host"), int(flag(vllm, "--port"))) == (host, args.port)
        assert flag(vllm, "--dtype") == "float32"
        settings = json.loads(flag(vllm, "--kv-transfer-config"))
        assert settings["kv_connector"] == "PdTransferConnector", settings
        assert importlib.util.find_spec(settings["kv_connector_module_path"]) is not None
        extra = settings["kv_connector_extra_config"]
        assert (extra["side_channel_host"], extra["side_channel_port"]) == (host, args.side_channel_port), extra
        assert server.vllm_env.get("VLLM_CPU_OMP_THREADS_BIND") == args.cpu_bind, server.vllm_env
        assert server.vllm_env.get("UCX_NET_DEVICES") == "lo", "one host: UCX on loopback"
    urls = {role: [f"http://{host}:{s.args.port}" for s in servers if s.args.role == role] for role in ROLES}
    assert proxy.prefill == urls["prefill"] and proxy.decode == urls["decode"], (proxy, urls)
    ports = [proxy.port] + [p for s in servers for p in (s.args.port, s.args.side_channel_port)]
    assert len(ports) == len(set(ports)), f"a port used twice: {ports}"


def test_launch_pd_dry_run_prints_commands_the_cli_accepts() -> None:
    check_launch(dry_run("launch_pd.sh"), "127.0.0.1", prefills=1)
    moved = dry_run(
        "launch_pd.sh",
        HOST="10.1.2.3",
        PREFILL_PORT="18100",
        DECODE_PORT="18200",
        PROXY_PORT="18000",
        PREFILL_SIDE_CHANNEL_PORT="15600",
        DECODE_SIDE_CHANNEL_PORT="15601",
        PREFILL_CPU_BIND="1",
        DECODE_CPU_BIND="0",
    )
    # not loopback any more: the UCX check above would fail, so check the rest by hand
    assert [m.args.port for m in moved] == [18100, 18200, 18000]
    assert [m.args.side_channel_port for m in moved[:2]] == [15600, 15601]
    assert moved[2].args.prefill == ["http://10.1.2.3:18100"] and moved[2].args.decode == ["http://10.1.2.3:18200"]
    assert [m.vllm_env["VLLM_CPU_OMP_THREADS_BIND"] for m in moved[:2]] == ["1", "0"]
    assert all(flag(m.vllm, "--port") == str(m.args.port) for m in moved[:2])


def test_xpyd_dry_run_routes_over_every_prefill() -> None:
    check_launch(dry_run("xpyd.sh"), "127.0.0.1", prefills=2)
    launched = dry_run("xpyd.sh", PREFILLS="p0 p1 p2", PREFILL_PORT="18100", PREFILL_SIDE_CHANNEL_PORT="15600")
    check_launch(launched, "127.0.0.1", prefills=3)
    assert launched[-1].args.prefill == [f"http://127.0.0.1:{18100 + i}" for i in range(3)]


# ------------------------------------------------------------------------------------- examples/client.py
class Process:
    """A child process whose stdout lines are read by a thread, so every wait for a line is bounded."""

    def __init__(self, argv: list[str]) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "UCX_NET_DEVICES": "lo"}
        self.popen = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def wait_for(self, pattern: str, timeout_s: float = 30.0) -> re.Match[str]:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"no line matching {pattern!r} in {timeout_s} s; got {self.seen}") from None
            if line is None:
                raise RuntimeError(f"exited with {self.popen.wait()} before {pattern!r}; printed {self.seen}")
            self.seen.append(line)
            if match := re.search(pattern, line):
                return match

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)


@contextlib.contextmanager
def proxy_in_front_of(prefill: list[str], decode: list[str]) -> Iterator[str]:
    """The real proxy (``python -m pd_transfer.proxy``) on a free port; yields its URL."""
    proxy = Process(
        [sys.executable, "-m", "pd_transfer.proxy", "--prefill", *prefill, "--decode", *decode, "--port", "0"]
    )
    try:
        yield proxy.wait_for(r"listening on (http://\S+)")[1]
    finally:
        proxy.stop()


def run_client(*args: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / "client.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=ROOT,
    )


def get_json(url: str) -> dict[str, object]:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def test_client_through_the_proxy_and_stand_in_backends() -> None:
    pytest.importorskip("aiohttp", reason="the proxy needs the 'proxy' extra (aiohttp)")
    standins = Process([sys.executable, "-m", "pd_transfer.sim.http_standin", "prefill", "decode"])
    try:
        prefill = standins.wait_for(r"^prefill (http://\S+)")[1]
        decode = standins.wait_for(r"^decode (http://\S+)")[1]
        with proxy_in_front_of([prefill], [decode]) as proxy:
            result = run_client("--proxy", proxy, "--decode-metrics", decode, "--max-tokens", "6")
            out = result.stdout
            assert result.returncode == 0, out + result.stderr
            # the stand-in decode answers the prompt's first words: the answer came from it, through the proxy
            assert re.search(r"completion \(request \w+, \d+ ms, 6 tokens\):\n  ' The prefill server reads this", out)
            assert "  streamed: The prefill server reads this whole\n" in out, out
            assert re.search(r"\(request \w+, 6 chunks, first after \d+ ms", out), out
            # figures read from the proxy's /metrics: both requests went prefill -> decode
            assert f"proxy {proxy}: requests +2 HTTP 200; routes disaggregated +2" in out, out
            assert re.search(r"prefill hop: 2 x, mean [\d.]+ ms", out) and re.search(r"decode hop: 2 x", out), out
            # a stand-in has no /metrics: reported, not fatal
            assert f"decode {decode}: no metrics (HTTP 404)" in out, out
            # and the backends saw it: one prefill hop and one decode hop per request
            assert get_json(prefill + "/control/stats")["requests"] == 2
            assert get_json(decode + "/control/stats")["requests"] == 2
            # backends gone: the client names each failed request and exits 1
            standins.stop()
            failed = run_client("--proxy", proxy, "--model", "standin-model")
            assert failed.returncode == 1, failed.stdout + failed.stderr
            assert re.search(r"completion failed: HTTP 5\d\d: .*prefill", failed.stdout), failed.stdout
            assert re.search(r"chat failed: HTTP 5\d\d", failed.stdout), failed.stdout
    finally:
        standins.stop()
