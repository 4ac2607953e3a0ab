"""Test helpers: a fake engine's metadata, a handshake server running in its own OS process, and peers that send
it hostile frames.

``python -m pd_transfer.sim.handshake_server [--secret S] [--ranks N] [--head-size H] [--release] [--trace-memory]``
serves a fake engine, prints ``{"port": N}`` on stdout, and stops when its stdin closes (so it never outlives its
parent). Each line ``probe`` on its stdin is answered with one JSON line on stdout: the process's memory
(:meth:`ServerProcess.probe`); ``trim`` does the same after giving freed heap memory back (``malloc_trim(0)``).

``python -m pd_transfer.sim.handshake_server --hostile-curve N [--step S] [--seed K] [--log-level L]
[--trace-memory] [--junk-bytes B] [--weight KIND=W]`` starts such a server with a secret and sends it N frames of
:class:`HostileMix`, printing its memory every S frames (default 10,000) on stderr, then every probe as JSON on
stdout (issue 42; docs/faults.md gives the figures).
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import ctypes.util
import gc
import json
import logging
import os
import random
import selectors
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from pd_transfer.handshake.auth import new_nonce, signed_request_mac
from pd_transfer.handshake.client import HandshakeClient
from pd_transfer.handshake.endpoints import tcp_endpoint
from pd_transfer.handshake.messages import (
    MAX_REQUEST_BYTES,
    Challenge,
    EngineMetadata,
    ErrorReply,
    GetMetadata,
    Hello,
    Message,
    Metadata,
    RankMetadata,
    Release,
    ReleaseReply,
    decode,
    encode,
)
from pd_transfer.handshake.server import HandshakeServer
from pd_transfer.handshake.versions import PROTOCOL_VERSION
from pd_transfer.settings import child_environment
from pd_transfer.spec import KVCacheLayout, KVRegion, ModelFingerprint

_MODULE = "pd_transfer.sim.handshake_server"  # what the child runs (``__name__`` is ``__main__`` under ``-m``)


def fake_fingerprint(**overrides: object) -> ModelFingerprint:
    """A small model's fingerprint; keyword arguments override fields."""
    fields: dict[str, object] = {
        "model": "test/tiny-llama",
        "dtype": "bfloat16",
        "num_layers": 2,
        "total_num_kv_heads": 4,
        "head_size": 128,
    }
    fields.update(overrides)
    return ModelFingerprint(**fields)  # type: ignore[arg-type]


def fake_engine(
    engine_id: str = "prefill-0", num_ranks: int = 2, fingerprint: ModelFingerprint | None = None
) -> EngineMetadata:
    """Metadata of a ``num_ranks``-way TP engine with fake NIXL agent bytes and made-up addresses."""
    fingerprint = fingerprint or fake_fingerprint()
    ranks = []
    for tp_rank in range(num_ranks):
        layout = KVCacheLayout(fingerprint=fingerprint, tp_size=num_ranks, tp_rank=tp_rank, block_size=16)
        block_len = 2 * layout.plane_block_bytes
        regions = [
            KVRegion(
                layer=layer,
                kinds=("k", "v"),
                base_address=0x7F00_0000_0000 + (tp_rank << 32) + layer * (1 << 24),
                num_blocks=64,
                block_len=block_len,
                block_stride=block_len,
            )
            for layer in range(fingerprint.num_layers)
        ]
        agent_metadata = f"fake-nixl-agent:{engine_id}:{tp_rank}".encode() + bytes(range(256))
        ranks.append(
            RankMetadata(
                tp_rank=tp_rank,
                agent_name=f"{engine_id}-rank{tp_rank}",
                agent_metadata=agent_metadata,
                layout=layout,
                regions=regions,
            )
        )
    return EngineMetadata(engine_id=engine_id, fingerprint=fingerprint, tp_size=num_ranks, ranks=ranks)


class ServerProcess:
    """A fake engine's handshake server in a child process; ``port`` (given, or 0: any free one) is known once
    constructed.

    ``release``: the server answers ``Release`` (every request is ``not_held``: it holds none) instead of refusing
    it as unexpected. ``trace_memory``: the child traces its Python allocations (``tracemalloc``) from the start,
    for :meth:`probe` to report. ``log_level``: of the child's log (on its stderr, kept in a temporary file).
    ``close()`` (or leaving the ``with`` block) closes the child's stdin, which stops
    it; it is killed if it does not exit within ``timeout_s``.
    """

    def __init__(
        self,
        *,
        secret: str | None = None,
        engine_id: str = "prefill-0",
        num_ranks: int = 2,
        head_size: int = 128,
        port: int = 0,
        timeout_s: float = 30.0,
        release: bool = False,
        trace_memory: bool = False,
        log_level: str = "ERROR",
    ) -> None:
        self.timeout_s = timeout_s
        args = [sys.executable, "-m", _MODULE, "--engine-id", engine_id, "--ranks", str(num_ranks)]
        args += ["--head-size", str(head_size), "--port", str(port)]
        if secret is not None:
            args += ["--secret", secret]
        if release:
            args.append("--release")
        if trace_memory:
            args.append("--trace-memory")
        args += ["--log-level", log_level]
        env = child_environment()
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        self._stderr = tempfile.TemporaryFile()
        self._buffer = b""  # read from the child's stdout, not yet a whole line
        self.process = subprocess.Popen(
            args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, env=env
        )
        try:
            self.port = int(json.loads(self._read_line(time.monotonic() + timeout_s, "its port"))["port"])
        except BaseException:
            self.close()
            raise

    def _read_line(self, deadline: float, what: str) -> bytes:
        """The child's next line on stdout; ``TimeoutError`` at ``deadline`` (monotonic seconds)."""
        assert self.process.stdout is not None
        fd = self.process.stdout.fileno()
        with selectors.DefaultSelector() as selector:
            selector.register(fd, selectors.EVENT_READ)
            while b"\n" not in self._buffer:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"handshake server process did not report {what}: {self.stderr()}")
                if selector.select(remaining):
                    chunk = os.read(fd, 65536)
                    if not chunk:
                        raise RuntimeError(f"handshake server process exited early: {self.stderr()}")
                    self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line

    def probe(self, *, trim: bool = False) -> dict[str, Any]:
        """The child's memory now, from the child itself (bounded by ``timeout_s``): ``rss_bytes`` (``VmRSS``),
        ``used_nonces`` (entries of the server's used-nonce store), ``objects`` (live objects the garbage collector
        tracks) and ``object_types`` (the 12 commonest types, count each); with ``trace_memory`` also
        ``traced_bytes`` (Python allocations now) and ``top`` (the 12 source lines whose allocations grew most
        since the server started: ``[line, bytes, count]``). ``trim``: first give the allocator's free memory
        back to the system (``malloc_trim(0)``), which tells memory kept by the allocator from memory in use."""
        assert self.process.stdin is not None
        self.process.stdin.write(b"trim\n" if trim else b"probe\n")
        self.process.stdin.flush()
        answer: dict[str, Any] = json.loads(self._read_line(time.monotonic() + self.timeout_s, "a probe"))
        return answer

    def stderr(self) -> str:
        """What the child wrote on stderr so far (for failure messages)."""
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")

    def close(self) -> int | None:
        """Stop the child; returns its exit code (``None`` if it had to be killed)."""
        if self.process.stdin is not None and not self.process.stdin.closed:
            try:
                self.process.stdin.close()
            except BrokenPipeError:
                pass
        try:
            code: int | None = self.process.wait(self.timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(self.timeout_s)
            code = None
        if self.process.stdout is not None:
            self.process.stdout.close()
        self._stderr.close()
        return code

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class RawPeer:
    """A bare DEALER socket for speaking (or garbling) the protocol by hand."""

    def __init__(self, host: str, port: int) -> None:
        self._context = zmq.Context()
        self.socket = self._context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(tcp_endpoint(host, port))

    def send(self, *frames: bytes) -> None:
        """Send one message made of ``frames`` (the server sees them after the identity frame)."""
        self.socket.send_multipart(list(frames))

    def receive_frames(self, timeout_s: float = 5.0) -> list[bytes]:
        """The next reply's frames; ``TimeoutError`` after ``timeout_s`` seconds."""
        if not self.socket.poll(int(timeout_s * 1000), zmq.POLLIN):
            raise TimeoutError(f"no reply within {timeout_s} s")
        return self.socket.recv_multipart(zmq.NOBLOCK)

    def receive(self, timeout_s: float = 5.0) -> Message:
        """The next reply, which must be one decodable frame."""
        frames = self.receive_frames(timeout_s)
        if len(frames) != 1:
            raise AssertionError(f"expected a 1-frame reply, got {len(frames)} frames")
        return decode(frames[0])

    def request(self, *frames: bytes, timeout_s: float = 5.0) -> Message:
        """Send ``frames`` and return the decoded reply."""
        self.send(*frames)
        return self.receive(timeout_s)

    def close(self) -> None:
        self.socket.close(linger=0)
        self._context.term()

    def __enter__(self) -> RawPeer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


#: Frames of each kind in :class:`HostileMix`, per 100 kinds drawn (some kinds take 2 frames: a ``Hello`` first).
HOSTILE_MIX: dict[str, int] = {
    "junk": 28,  # random bytes, 1 to 512: malformed
    "mangled": 14,  # a real request truncated or bit-flipped, or msgpack with fields of the wrong types
    "oversized": 1,  # over MAX_REQUEST_BYTES, on a connection of its own: ZMQ drops it and the connection
    "no_mac": 8,  # Hello, then a GetMetadata under its nonce without a MAC: auth_required
    "bad_mac": 8,  # Hello, then a GetMetadata with a MAC under another secret: auth_failed
    "forged_nonce": 8,  # a GetMetadata under a nonce the server never issued, a random MAC: auth_failed
    "replay": 14,  # a genuine signed GetMetadata sent again: auth_failed (nonce reused, later expired)
    "new_connection": 12,  # junk on a fresh connection (a new ROUTER identity), its reply read, then closed
    "unknown_request": 2,  # Hello, then a Release signed with the secret for a request nobody holds: not_held
    "unknown_rank": 2,  # Hello, then a GetMetadata signed with the secret for a TP rank not served: unknown_rank
    "handshake": 3,  # a real handshake (HandshakeClient.fetch): Metadata
}
#: The kinds whose request a side channel remembers (its nonce, as used, for the nonce's lifetime: 30 s by default).
AUTHENTICATED_KINDS = frozenset({"unknown_request", "unknown_rank", "handshake"})
#: At most this many of them a second (on average since the first frame): a side channel remembers at most 4,096 used
#: nonces, so above 136 a second (4,096 in 30 s) it refuses authenticated requests as ``busy``, real ones too.
AUTHENTICATED_PER_S = 50.0
#: A genuine signed request is captured anew after this many replays of it (so that ``reused`` and ``expired`` both
#: come up: a capture's nonce expires 30 s after it was issued).
REPLAYS_PER_CAPTURE = 500


class HostileMix:
    """Sends a side channel with a shared ``secret`` a mix of hostile frames (:data:`HOSTILE_MIX`) beside real
    handshakes, one at a time: each reply is read (bounded by ``timeout_s``) and checked before the next frame.

    Kinds in :data:`AUTHENTICATED_KINDS` are sent at most :data:`AUTHENTICATED_PER_S` a second: when one is drawn
    ahead of that rate, another kind is drawn instead (nothing waits). Most frames go over one long-lived connection;
    ``new_connection``, ``oversized`` and the real handshakes each open their own. ``send(n)`` raises
    ``AssertionError`` when a reply is not the one that kind must get, ``TimeoutError`` when none comes.

    ``release``: the server answers ``Release`` (``ServerProcess(release=True)``); without, a ``Release`` must be
    refused as unexpected. ``junk_bytes``: the largest random frame; ``oversized_bytes``: the largest oversized one
    (bytes). ``weights``: kinds whose weight differs from :data:`HOSTILE_MIX`'s (0: never). ``fingerprint``: the
    served model's (a real engine's; default the fake engine's). Not thread-safe.
    """

    def __init__(
        self,
        host: str,
        port: int,
        secret: str,
        *,
        seed: int = 42,
        engine_id: str = "prefill-0",
        release: bool = True,
        timeout_s: float = 5.0,
        junk_bytes: int = 512,
        oversized_bytes: int = 4 * 2**20,
        weights: dict[str, int] | None = None,
        fingerprint: ModelFingerprint | None = None,
    ) -> None:
        self.host = host
        self.junk_bytes = junk_bytes
        self.oversized_bytes = oversized_bytes
        self.port = port
        self.engine_id = engine_id
        self.release = release
        self.timeout_s = timeout_s
        self.sent = 0  # frames sent so far
        self.kinds: collections.Counter[str] = collections.Counter()  # kinds sent so far
        self._secret = secret.encode()
        self._rng = random.Random(seed)
        self._fingerprint = fingerprint if fingerprint is not None else fake_fingerprint()
        mix = {**HOSTILE_MIX, **(weights or {})}
        self._names = list(mix)
        self._weights = list(mix.values())
        self._context = zmq.Context()
        self._peer = RawPeer(host, port)
        self._client = HandshakeClient(self._fingerprint, secret=secret, timeout_s=timeout_s, retries=0)
        self._captured = b""
        self._replays = 0
        self._started: float | None = None  # when the first frame was sent (monotonic seconds)
        self._authenticated = 0  # kinds of AUTHENTICATED_KINDS sent
        self._senders: dict[str, Callable[[], None]] = {
            "junk": self._junk,
            "mangled": self._mangled,
            "oversized": self._oversized,
            "no_mac": self._no_mac,
            "bad_mac": self._bad_mac,
            "forged_nonce": self._forged_nonce,
            "replay": self._replay,
            "new_connection": self._new_connection,
            "unknown_request": self._unknown_request,
            "unknown_rank": self._unknown_rank,
            "handshake": self.handshake,
        }
        if set(mix) != set(self._senders):
            raise ValueError(f"unknown kinds of hostile frame: {sorted(set(mix) - set(self._senders))}")

    def send(self, frames: int) -> None:
        """Send kinds drawn from the mix until ``frames`` more frames have gone (a kind of 2 frames may pass it
        by one)."""
        target = self.sent + frames
        if self._started is None:
            self._started = time.monotonic()
        while self.sent < target:
            kind = self._rng.choices(self._names, self._weights)[0]
            if kind in AUTHENTICATED_KINDS:
                allowed = 1 + (time.monotonic() - self._started) * AUTHENTICATED_PER_S
                if self._authenticated >= allowed:
                    continue
                self._authenticated += 1
            self._senders[kind]()
            self.kinds[kind] += 1

    # ------------------------------------------------------------------ one kind each

    def _request(self, frame: bytes) -> Message:
        """``frame`` on the long-lived connection, and its reply."""
        self.sent += 1
        return self._peer.request(frame, timeout_s=self.timeout_s)

    def _challenge(self) -> bytes:
        """A fresh server nonce: a ``Hello`` and its ``Challenge``."""
        reply = self._request(encode(Hello(client_nonce=new_nonce())))
        assert isinstance(reply, Challenge) and reply.auth_required, reply
        return reply.server_nonce

    def _get_metadata(self, server_nonce: bytes, tp_ranks: list[int] | None = None) -> GetMetadata:
        return GetMetadata(
            protocol_version=PROTOCOL_VERSION,
            fingerprint=self._fingerprint,
            tp_ranks=tp_ranks,
            client_nonce=new_nonce(),
            server_nonce=server_nonce,
        )

    def _signed(self, request: GetMetadata, secret: bytes | None = None) -> GetMetadata:
        return msgspec.structs.replace(request, mac=signed_request_mac(secret or self._secret, request))

    def _refused(self, reply: Message, code: str) -> None:
        assert isinstance(reply, ErrorReply) and reply.code == code, (code, reply)

    def _junk(self) -> None:
        self._refused(self._request(self._junk_frame()), "malformed")

    def _junk_frame(self) -> bytes:
        return self._rng.randbytes(self._rng.randrange(1, self.junk_bytes + 1))

    def _mangled(self) -> None:
        """A real request truncated or bit-flipped, msgpack of a real tag with fields of random types, or of an
        unknown tag: mostly malformed (a flip may leave a request that is refused otherwise, random fields a valid
        ``Hello``)."""
        rng = self._rng
        real = encode(self._signed(self._get_metadata(new_nonce(), [0])))
        way = rng.randrange(4)
        if way == 0:
            frame = real[: rng.randrange(1, len(real))]
        elif way == 1:
            flipped = bytearray(real)
            for _ in range(rng.randrange(1, 4)):
                flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
            frame = bytes(flipped)
        elif way == 2:
            tag = rng.choice(("hello", "challenge", "get_metadata", "metadata", "release", "error"))
            fields = ("protocol_version", "client_nonce", "server_nonce", "fingerprint", "tp_ranks", "mac", "engine")
            body = {field: _junk_value(rng) for field in rng.sample(fields, rng.randrange(1, len(fields)))}
            frame = msgspec.msgpack.encode({"type": tag, **body})
        else:
            tag = "".join(chr(rng.randrange(97, 123)) for _ in range(rng.randrange(1, 20)))
            frame = msgspec.msgpack.encode({"type": tag, "client_nonce": rng.randbytes(32)})
        reply = self._request(frame)
        assert isinstance(reply, ErrorReply | Challenge), reply

    def _oversized(self) -> None:
        """Over ``MAX_REQUEST_BYTES`` on a connection of its own: the server drops the connection at the frame's
        length header; no reply. Waits (bounded) until the connection is dropped."""
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            socket.connect(tcp_endpoint(self.host, self.port))
            socket.send(self._rng.randbytes(self._rng.randrange(MAX_REQUEST_BYTES + 1, self.oversized_bytes + 1)))
            self.sent += 1
            if not monitor.poll(int(self.timeout_s * 1000)):
                raise TimeoutError(f"an oversized frame's connection was not dropped within {self.timeout_s} s")
            assert recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
            assert not socket.poll(0), "an oversized frame was answered"
        finally:
            socket.disable_monitor()
            monitor.close(linger=0)
            socket.close(linger=0)

    def _no_mac(self) -> None:
        self._refused(self._request(encode(self._get_metadata(self._challenge()))), "auth_required")

    def _bad_mac(self) -> None:
        request = self._signed(self._get_metadata(self._challenge()), b"not the shared secret")
        self._refused(self._request(encode(request)), "auth_failed")

    def _forged_nonce(self) -> None:
        request = msgspec.structs.replace(self._get_metadata(new_nonce()), mac=self._rng.randbytes(32))
        self._refused(self._request(encode(request)), "auth_failed")

    def _replay(self) -> None:
        if not self._captured or self._replays >= REPLAYS_PER_CAPTURE:
            self._captured = encode(self._signed(self._get_metadata(self._challenge())))
            reply = self._request(self._captured)
            assert isinstance(reply, Metadata) and reply.engine.engine_id == self.engine_id, reply
            self._replays = 0
        self._replays += 1
        self._refused(self._request(self._captured), "auth_failed")

    def _new_connection(self) -> None:
        with RawPeer(self.host, self.port) as peer:
            self.sent += 1
            reply = peer.request(self._junk_frame(), timeout_s=self.timeout_s)
        self._refused(reply, "malformed")

    def _unknown_request(self) -> None:
        request = Release(
            protocol_version=PROTOCOL_VERSION,
            engine_id=self.engine_id,
            request_id=f"cmpl-{self._rng.randbytes(12).hex()}",
            server_nonce=self._challenge(),
            read_possible=self._rng.random() < 0.5,
        )
        request = msgspec.structs.replace(request, mac=signed_request_mac(self._secret, request))
        reply = self._request(encode(request))
        if self.release:
            assert isinstance(reply, ReleaseReply) and reply.outcome == "not_held", reply
        else:
            self._refused(reply, "unexpected_message")

    def _unknown_rank(self) -> None:
        request = self._signed(self._get_metadata(self._challenge(), [7]))
        self._refused(self._request(encode(request)), "unknown_rank")

    def handshake(self) -> None:
        """One real handshake (2 frames), on a connection of its own; it must succeed."""
        self.sent += 2
        engine = self._client.fetch(self.host, self.port, fresh=True)
        assert engine.engine_id == self.engine_id, engine.engine_id

    def close(self) -> None:
        """Close every connection."""
        self._client.close()
        self._peer.close()
        self._context.term()

    def __enter__(self) -> HostileMix:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _junk_value(rng: random.Random, depth: int = 0) -> Any:
    """A random msgpack value: scalars, text of any script, bytes, lists and maps nested up to 3 deep."""
    choice = rng.randrange(7 if depth < 3 else 5)
    if choice == 0:
        return None
    if choice == 1:
        return rng.random() < 0.5
    if choice == 2:
        return rng.randrange(-(2**63), 2**64)
    if choice == 3:
        return "".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(rng.randrange(40)))
    if choice == 4:
        return rng.randbytes(rng.randrange(64))
    if choice == 5:
        return [_junk_value(rng, depth + 1) for _ in range(rng.randrange(5))]
    return {str(_junk_value(rng, depth + 1))[:12]: _junk_value(rng, depth + 1) for _ in range(rng.randrange(5))}


def hostile_curve(
    frames: int,
    step: int,
    *,
    seed: int = 42,
    trace_memory: bool = False,
    log_level: str = "ERROR",
    junk_bytes: int = 512,
    weights: dict[str, int] | None = None,
    host: str = "127.0.0.1",
) -> list[dict[str, Any]]:
    """Start a side channel with a secret (:class:`ServerProcess`, answering ``Release``), make one real handshake,
    then send it ``frames`` frames of :class:`HostileMix`, probing its memory (:meth:`ServerProcess.probe`) at the
    start and every ``step`` frames; each probe also gets ``frames`` (sent so far) and ``seconds`` (since the first
    frame). ``trace_memory`` and ``log_level``: the server's (:class:`ServerProcess`); ``junk_bytes`` and
    ``weights``: the mix's. Prints one line a probe on stderr as it goes."""
    secret = "hostile-mix-secret"
    curve: list[dict[str, Any]] = []
    with ServerProcess(secret=secret, release=True, trace_memory=trace_memory, log_level=log_level) as server:
        with HostileMix(host, server.port, secret, seed=seed, junk_bytes=junk_bytes, weights=weights) as mix:
            mix.handshake()  # before the baseline: a server's first handshake imports and allocates
            mix.sent = 0
            started = time.monotonic()
            while True:
                probe = server.probe()
                probe.update(frames=mix.sent, seconds=round(time.monotonic() - started, 1))
                curve.append(probe)
                print(_shown_probe(probe), file=sys.stderr, flush=True)
                if mix.sent >= frames:
                    break
                mix.send(min(step, frames - mix.sent))
    return curve


def _shown_probe(probe: dict[str, Any]) -> str:
    """One probe on one line."""
    line = (
        f"{probe['frames']:>7} frames {probe['seconds']:>6} s: RSS {probe['rss_bytes'] / 2**20:.1f} MiB,"
        f" {probe['objects']} objects, {probe['used_nonces']} used nonces"
    )
    if "traced_bytes" in probe:
        line += f", traced {probe['traced_bytes'] / 2**20:.2f} MiB; top: {probe['top'][:3]}"
    return line


def _probe(server: HandshakeServer, baseline: tracemalloc.Snapshot | None, *, trim: bool) -> dict[str, Any]:
    """What :meth:`ServerProcess.probe` returns, measured in this (the server's) process."""
    if trim:
        libc = ctypes.util.find_library("c")
        if libc is not None:
            ctypes.CDLL(libc).malloc_trim(0)
    objects = gc.get_objects()
    types = collections.Counter(type(item).__name__ for item in objects)
    answer: dict[str, Any] = {
        "rss_bytes": _rss_bytes(),
        "used_nonces": server.used_nonces,
        "objects": len(objects),
        "object_types": types.most_common(12),
    }
    del objects
    if baseline is not None:
        snapshot = tracemalloc.take_snapshot()
        answer["traced_bytes"] = tracemalloc.get_traced_memory()[0]
        answer["top"] = [
            [str(stat.traceback), stat.size_diff, stat.count_diff]
            for stat in snapshot.compare_to(baseline, "lineno")[:12]
        ]
    return answer


def _rss_bytes() -> int:
    """This process's resident memory (bytes), ``VmRSS`` of ``/proc/self/status``."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise OSError("no VmRSS in /proc/self/status")


def main(argv: list[str] | None = None) -> int:
    """Serve a fake engine until stdin closes (answering ``probe`` and ``trim`` lines), or with ``--hostile-curve``
    measure one such server under hostile frames."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine-id", default="prefill-0")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--secret", default=None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--release", action="store_true", help="answer Release (not_held: nothing is held)")
    parser.add_argument("--trace-memory", action="store_true", help="trace Python allocations for probes")
    parser.add_argument("--log-level", default="ERROR", help="of the server's log, on stderr")
    parser.add_argument("--hostile-curve", type=int, default=0, metavar="N", help="measure a server under N frames")
    parser.add_argument("--step", type=int, default=10_000, help="frames between probes of --hostile-curve")
    parser.add_argument("--seed", type=int, default=42, help="of --hostile-curve's mix")
    parser.add_argument("--junk-bytes", type=int, default=512, help="largest random frame of --hostile-curve's mix")
    parser.add_argument("--weight", action="append", default=[], metavar="KIND=N", help="of a kind in the mix")
    args = parser.parse_args(argv)
    level = "ERROR" if args.hostile_curve else args.log_level.upper()  # --hostile-curve: the server's, not ours
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.hostile_curve:
        curve = hostile_curve(
            args.hostile_curve,
            args.step,
            seed=args.seed,
            trace_memory=args.trace_memory,
            log_level=args.log_level,
            junk_bytes=args.junk_bytes,
            weights={kind: int(n) for kind, n in (item.split("=", 1) for item in args.weight)},
        )
        print(json.dumps(curve))
        return 0
    if args.trace_memory:
        tracemalloc.start()
    engine = fake_engine(args.engine_id, args.ranks, fake_fingerprint(head_size=args.head_size))
    on_release = (lambda request_id, read_possible: False) if args.release else None
    with HandshakeServer(engine, host=args.host, port=args.port, secret=args.secret, on_release=on_release) as server:
        baseline = tracemalloc.take_snapshot() if args.trace_memory else None
        print(json.dumps({"port": server.port}), flush=True)
        for line in sys.stdin.buffer:  # ends at EOF: the parent closed our stdin or died
            command = line.strip()
            if command in (b"probe", b"trim"):
                print(json.dumps(_probe(server, baseline, trim=command == b"trim")), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
