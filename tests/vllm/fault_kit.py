"""Tools of the fault tests on real vLLM servers: kill, pause and restart a server's whole process group (on the
same ports, with a new or a pinned engine id), the proxy's view of a request, and hostile side-channel frames.

Servers come from ``tests/vllm/vllm_servers.py`` (the one launcher of the tests); every wait here is bounded.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
from vllm_servers import start_all

from pd_transfer.cluster.http_client import RequestFailed, busy_ports, completion, metric_value
from pd_transfer.cluster.processes import ManagedProcess
from pd_transfer.handshake import GetMetadata, Hello, encode
from pd_transfer.handshake.auth import new_nonce
from pd_transfer.handshake.messages import MAX_REQUEST_BYTES
from pd_transfer.spec import ModelFingerprint

KV_CONFIG_FLAG = "--kv-transfer-config"
GONE_TIMEOUT_S = 30.0


def quiet_ports(count: int, low: int = 20000, high: int = 32767) -> list[int]:
    """``count`` distinct ports free now, below Linux's ephemeral range (32768-60999 by default): a server that binds
    minutes later (vLLM starts slowly) or again after a restart does not find one taken by an outgoing connection."""
    rng = random.Random()
    ports: list[int] = []
    while len(ports) < count:
        port = rng.randrange(low, high)
        if port not in ports and not busy_ports([port]):
            ports.append(port)
    return ports


def kill_group(server: ManagedProcess, timeout_s: float = GONE_TIMEOUT_S) -> None:
    """SIGKILL every process of ``server``'s group and wait (at most ``timeout_s``) until none is left."""
    server.signal_group(signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while server.members() and time.monotonic() < deadline:
        server.reap()
        time.sleep(0.05)  # polling the group's exit, bounded by the deadline
    assert not server.members(), f"{server.name}'s processes outlived SIGKILL for {timeout_s:.0f} s"


def pause_group(server: ManagedProcess) -> None:
    """SIGSTOP every process of ``server``'s group: it keeps its sockets and memory but answers nothing."""
    server.signal_group(signal.SIGSTOP)


def resume_group(server: ManagedProcess) -> None:
    server.signal_group(signal.SIGCONT)


def kv_config(server: ManagedProcess) -> dict[str, Any]:
    """The ``--kv-transfer-config`` of ``server``'s command."""
    return dict(json.loads(server.command[server.command.index(KV_CONFIG_FLAG) + 1]))


def incarnation(server: ManagedProcess, name: str, engine_id: str | None) -> ManagedProcess:
    """A copy of ``server`` (same command, ports, environment; its log ``NAME.log`` beside the first) whose
    ``--kv-transfer-config`` pins ``engine_id``, or leaves it to vLLM (a new random id per start) when None."""
    config = kv_config(server)
    config.pop("engine_id", None)
    if engine_id is not None:
        config["engine_id"] = engine_id
    command = list(server.command)
    command[command.index(KV_CONFIG_FLAG) + 1] = json.dumps(config, separators=(",", ":"))
    log_path = server.log_path.with_name(f"{name}.log")
    return dataclasses.replace(
        server, name=name, command=command, log_path=log_path, process=None, ready_after_s=None, started_at=0.0
    )


def restart(server: ManagedProcess, name: str, engine_id: str | None) -> ManagedProcess:
    """Kill what is left of ``server`` and start :func:`incarnation` of it where it was; returns it once healthy."""
    kill_group(server)
    again = incarnation(server, name, engine_id)
    start_all([again])
    return again


def fingerprint_of(model: str) -> ModelFingerprint:
    """The fingerprint our vLLM connector announces for the float32 ``model`` folder (K and V of a head: one row
    of 2 x head_dim)."""
    config = json.loads((Path(model) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return ModelFingerprint(
        model=model,
        dtype="float32",
        num_layers=config["num_hidden_layers"],
        total_num_kv_heads=config["num_key_value_heads"],
        head_size=2 * head_dim,
    )


class Background:
    """``function()`` in a thread: :meth:`result` waits for it (bounded) and returns its value or raises its error."""

    def __init__(self, function: Callable[[], Any]) -> None:
        self._value: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(function,), daemon=True)
        self.started = time.monotonic()
        self.finished: float | None = None
        self._thread.start()

    def _run(self, function: Callable[[], Any]) -> None:
        try:
            self._value = function()
        except BaseException as error:
            self._error = error
        self.finished = time.monotonic()

    def result(self, timeout_s: float) -> Any:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), f"still running after {timeout_s:.0f} s"
        if self._error is not None:
            raise self._error
        return self._value

    def outcome(self, timeout_s: float) -> tuple[Any, RequestFailed | None]:
        """(value, None), or (None, the ``RequestFailed`` it raised)."""
        try:
            return self.result(timeout_s), None
        except RequestFailed as error:
            return None, error


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.05) -> float:
    """Poll ``condition`` until true; its seconds. Fails the test after ``timeout_s`` naming ``what``."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout_s, f"not within {timeout_s:.0f} s: {what}"
        time.sleep(poll_s)
    return time.monotonic() - started


class HeldAnswers:
    """A TCP relay on 127.0.0.1 in front of the server at ``target_url``, on the caller's event loop: requests pass at
    once; while :meth:`hold` is on, the server's answers wait in the relay until :meth:`release`. ``answered`` is set
    when a held answer's first bytes arrive: the server has answered, and the client behind the relay has not seen
    it. A client that closes its connection meanwhile closes the relay's to the server."""

    def __init__(self, target_url: str) -> None:
        authority = target_url.split("://", 1)[1].rstrip("/")
        self._host, port = authority.rsplit(":", 1)
        self._port = int(port)
        self.url = ""
        self.answered = asyncio.Event()
        self._open = asyncio.Event()
        self._open.set()
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def hold(self) -> None:
        self._open.clear()
        self.answered.clear()

    def release(self) -> None:
        self._open.set()

    async def _relay(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            server_reader, server_writer = await asyncio.open_connection(self._host, self._port)
        except OSError:
            client_writer.close()
            return
        requests = asyncio.create_task(_pipe(client_reader, server_writer))
        try:
            while data := await server_reader.read(65536):
                if not self._open.is_set():
                    self.answered.set()
                    await self._open.wait()
                client_writer.write(data)
                await client_writer.drain()
        except OSError:
            pass  # the client has gone: what the server sent goes nowhere
        finally:
            requests.cancel()
            client_writer.close()
            server_writer.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """``reader``'s bytes to ``writer`` until its end, then closes ``writer``."""
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except OSError:
        pass
    finally:
        writer.close()


def prefill_hops(proxy_url: str) -> float:
    """Prefill hops the proxy has completed (its hop latency histogram's count)."""
    return metric_value(proxy_url, "pd_proxy_hop_latency_seconds_count", hop="prefill")


def proxy_completion(proxy_url: str, model: str, prompt: list[int], max_tokens: int, tag: str) -> dict[str, Any]:
    return completion(proxy_url, model, prompt, max_tokens, request_id=tag, timeout_s=60.0)


# ---- hostile side-channel frames ---------------------------------------------------------------------------------

#: Oversized frames: over the server's request limit (ZMQ drops them and the connection) by up to this many bytes.
OVERSIZED_MAX_BYTES = 4 * 2**20
FRAME_KINDS = ("random", "truncated", "bit_flipped", "wrong_types", "unknown_tag", "oversized")


def _valid_frames(fingerprint: ModelFingerprint) -> list[bytes]:
    return [
        encode(Hello(client_nonce=new_nonce())),
        encode(GetMetadata(1, fingerprint, [0], new_nonce(), new_nonce(), mac=b"m" * 32)),
        encode(GetMetadata(1, fingerprint, None, new_nonce(), new_nonce())),
    ]


def _junk_value(rng: random.Random, depth: int = 0) -> Any:
    choice = rng.randrange(7 if depth < 3 else 5)
    leaves: list[Callable[[], Any]] = [
        lambda: None,
        lambda: rng.random() < 0.5,
        lambda: rng.randrange(-(2**63), 2**64),
        lambda: "".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(rng.randrange(40))),
        lambda: rng.randbytes(rng.randrange(64)),
    ]
    if choice < 5:
        return leaves[choice]()
    if choice == 5:
        return [_junk_value(rng, depth + 1) for _ in range(rng.randrange(5))]
    return {str(_junk_value(rng, depth + 1))[:12]: _junk_value(rng, depth + 1) for _ in range(rng.randrange(5))}


def hostile_frame(kind: str, rng: random.Random, valid: list[bytes]) -> bytes:
    """One frame of ``kind`` (one of ``FRAME_KINDS``)."""
    if kind == "random":
        return rng.randbytes(rng.randrange(1, 2048))
    if kind == "truncated":
        frame = rng.choice(valid)
        return frame[: rng.randrange(len(frame))]
    if kind == "bit_flipped":
        frame = bytearray(rng.choice(valid))
        for _ in range(rng.randrange(1, 4)):
            frame[rng.randrange(len(frame))] ^= 1 << rng.randrange(8)
        return bytes(frame)
    if kind == "wrong_types":
        tag = rng.choice(("hello", "challenge", "get_metadata", "metadata", "error"))
        fields = ("protocol_version", "client_nonce", "server_nonce", "fingerprint", "tp_ranks", "mac", "engine")
        body = {field: _junk_value(rng) for field in rng.sample(fields, rng.randrange(1, len(fields)))}
        return msgspec.msgpack.encode({"type": tag, **body})
    if kind == "unknown_tag":
        tag = "".join(chr(rng.randrange(97, 123)) for _ in range(rng.randrange(1, 20)))
        return msgspec.msgpack.encode({"type": tag, "client_nonce": rng.randbytes(32)})
    if kind == "oversized":
        return rng.randbytes(MAX_REQUEST_BYTES + rng.randrange(1, OVERSIZED_MAX_BYTES))
    raise ValueError(f"unknown frame kind {kind!r}")


def hostile_frames(count: int, fingerprint: ModelFingerprint, seed: int) -> Iterator[tuple[str, bytes]]:
    """``count`` frames, kinds in turn (one oversized frame in 100: they are large), reproducible from ``seed``."""
    rng = random.Random(seed)
    valid = _valid_frames(fingerprint)
    small = [kind for kind in FRAME_KINDS if kind != "oversized"]
    for index in range(count):
        kind = "oversized" if index % 100 == 99 else small[index % len(small)]
        yield kind, hostile_frame(kind, rng, valid)


def listening_pid(server: ManagedProcess, port: int) -> int:
    """The process of ``server``'s group that listens on TCP ``port`` (vLLM's engine core serves our side channel,
    its worker the KV cache): found from ``/proc/net/tcp`` and the group's open sockets."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":  # 0A: LISTEN
                inodes.add(f"socket:[{fields[9]}]")
    for pid in server.members():
        try:
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") in inodes for fd in os.listdir(f"/proc/{pid}/fd")):
                return pid
        except OSError:
            continue
    raise AssertionError(f"no process of {server.name} listens on port {port}")
