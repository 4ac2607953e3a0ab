"""Test helpers: a fake engine's metadata, and a handshake server running in its own OS process.

``python -m pd_transfer.sim.handshake_server [--secret S] [--ranks N] [--head-size H]`` serves a fake
engine, prints ``{"port": N}`` on stdout, and stops when its stdin closes (so it never outlives its parent).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import selectors
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

import zmq

from pd_transfer.handshake.endpoints import tcp_endpoint
from pd_transfer.handshake.messages import EngineMetadata, Message, RankMetadata, decode
from pd_transfer.handshake.server import HandshakeServer
from pd_transfer.settings import child_environment
from pd_transfer.spec import KVCacheLayout, KVRegion, ModelFingerprint


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

    ``close()`` (or leaving the ``with`` block) closes the child's stdin, which stops it; it is killed
    if it does not exit within ``timeout_s``.
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
    ) -> None:
        self.timeout_s = timeout_s
        args = [sys.executable, "-m", __name__, "--engine-id", engine_id, "--ranks", str(num_ranks)]
        args += ["--head-size", str(head_size), "--port", str(port)]
        if secret is not None:
            args += ["--secret", secret]
        env = child_environment()
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        self._stderr = tempfile.TemporaryFile()
        self.process = subprocess.Popen(
            args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, env=env
        )
        try:
            self.port = self._read_port(time.monotonic() + timeout_s)
        except BaseException:
            self.close()
            raise

    def _read_port(self, deadline: float) -> int:
        assert self.process.stdout is not None
        fd = self.process.stdout.fileno()
        buffer = b""
        with selectors.DefaultSelector() as selector:
            selector.register(fd, selectors.EVENT_READ)
            while b"\n" not in buffer:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"handshake server process did not report its port: {self.stderr()}")
                if selector.select(remaining):
                    chunk = os.read(fd, 4096)
                    if not chunk:
                        raise RuntimeError(f"handshake server process exited early: {self.stderr()}")
                    buffer += chunk
        return int(json.loads(buffer.split(b"\n", 1)[0])["port"])

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


def main(argv: list[str] | None = None) -> int:
    """Serve a fake engine until stdin closes."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--engine-id", default="prefill-0")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--secret", default=None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    engine = fake_engine(args.engine_id, args.ranks, fake_fingerprint(head_size=args.head_size))
    with HandshakeServer(engine, host=args.host, port=args.port, secret=args.secret) as server:
        print(json.dumps({"port": server.port}), flush=True)
        sys.stdin.buffer.read()  # returns at EOF: the parent closed our stdin or died
    return 0


if __name__ == "__main__":
    sys.exit(main())
