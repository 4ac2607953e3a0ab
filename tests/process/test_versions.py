"""Mixed protocol versions on the side channel, with real processes: a decode of version N reads a prefill of version
3 (version 4 only added an offer a version 3 peer is never sent), and a decode and a prefill whose versions do not
overlap (version 3 put the regions' memory kind on the wire, which older peers cannot read) are refused at the
handshake with a message naming both versions.

The prefill side is a handshake server in a child process built to speak another version (constructor arguments,
as an older or newer release would); the decode side is a real ``HandshakeClient`` (or the proxy's ``Releaser``)
in this process.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from pd_transfer.handshake import PROTOCOL_VERSION, HandshakeClient, HandshakeRefused
from pd_transfer.handshake.release import Releaser
from pd_transfer.sim.handshake_server import fake_fingerprint

pytestmark = pytest.mark.timeout(120)

N = PROTOCOL_VERSION
HOST = "127.0.0.1"
REPO = Path(__file__).resolve().parents[2]
#: The last commit of protocol version 1 (its handshake package is the released version 1, run as it was)
VERSION_1_COMMIT = "ef4396c"

_SERVER = """
import json, sys
from pd_transfer.handshake.server import HandshakeServer
from pd_transfer.sim.handshake_server import fake_engine
version, supported = int(sys.argv[1]), frozenset(int(v) for v in sys.argv[2].split(","))
server = HandshakeServer(
    fake_engine("prefill-v%d" % version, 1),
    host="127.0.0.1",
    protocol_version=version,
    supported_versions=supported,
    on_release=lambda request_id, read_possible: False,
)
with server:
    print(json.dumps({"port": server.port}), flush=True)
    sys.stdin.buffer.read()
"""


_OLD_SERVER = """
import json, sys
sys.path.insert(0, sys.argv[1])
import msgspec
from old_handshake.messages import EngineMetadata
from old_handshake.server import HandshakeServer
from pd_transfer.sim.handshake_server import fake_engine
data = msgspec.to_builtins(fake_engine("prefill-v1", 1))
for rank in data["ranks"]:  # what version 3 added
    rank.pop("ipc")
    for region in rank["regions"]:
        region.pop("memory"), region.pop("device_index")
engine = msgspec.convert(data, type=EngineMetadata)
with HandshakeServer(engine, host="127.0.0.1") as server:
    print(json.dumps({"port": server.port}), flush=True)
    sys.stdin.buffer.read()
"""


def version_1_package(into: Path) -> Path:
    """The handshake package of the last version 1 commit, from git, as ``old_handshake`` under ``into``."""
    git = shutil.which("git")
    if git is None or not (REPO / ".git").exists():
        pytest.skip("needs git and the repository's history (the version 1 code comes from it)")
    listing = subprocess.run(
        [git, "ls-tree", "--name-only", f"{VERSION_1_COMMIT}:pd_transfer/handshake"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
    )
    if listing.returncode != 0:
        pytest.skip(f"commit {VERSION_1_COMMIT} is not in this clone (shallow?): {listing.stderr.strip()[:200]}")
    package = into / "old_handshake"
    package.mkdir()
    for name in listing.stdout.split():
        source = subprocess.run(
            [git, "show", f"{VERSION_1_COMMIT}:pd_transfer/handshake/{name}"],
            cwd=REPO,
            capture_output=True,
            check=True,
            timeout=30,
        )
        (package / name).write_bytes(source.stdout)
    return into


@contextmanager
def prefill_speaking(version: int, supported: set[int], *, released_code: Path | None = None) -> Iterator[int]:
    """A handshake server of ``version`` (answering ``supported``) in a child process; yields its port. With
    ``released_code`` (from :func:`version_1_package`), the released version 1 server itself. It exits when its stdin
    closes."""
    if released_code is not None:
        command = [sys.executable, "-c", _OLD_SERVER, str(released_code)]
    else:
        command = [sys.executable, "-c", _SERVER, str(version), ",".join(str(v) for v in sorted(supported))]
    process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO)
    try:
        assert process.stdout is not None
        line = process.stdout.readline()  # bounded by the module's timeout
        assert line, f"the server of version {version} exited with {process.wait(timeout=10)}"
        yield int(json.loads(line)["port"])
    finally:
        assert process.stdin is not None
        process.stdin.close()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def test_a_decode_of_n_reads_a_prefill_of_3_and_refuses_one_of_2_naming_both() -> None:
    """Version 3 put each region's memory kind on the wire: a version 2 prefill's regions would read as host memory
    whatever they are, so a decode of N refuses it, naming both versions. A version 3 prefill is read."""
    with prefill_speaking(3, {3}) as port, HandshakeClient(fake_fingerprint(), retries=0) as client:
        assert client.fetch(HOST, port).engine_id == "prefill-v3"
    with prefill_speaking(2, {2}) as port, HandshakeClient(fake_fingerprint(), retries=0) as client:
        with pytest.raises(HandshakeRefused) as caught:
            client.fetch(HOST, port)
    assert caught.value.code == "unsupported_version"
    assert "speaks protocol version 2" in caught.value.message
    assert f"this client speaks {N}" in caught.value.message


def test_a_prefill_of_n_only_refuses_a_decode_of_n_minus_1_naming_both() -> None:
    """A prefill that answers version N only (as a release that dropped version N-1 would) refuses an older decode
    at its Hello, naming both."""
    client = HandshakeClient(fake_fingerprint(), retries=0, protocol_version=N - 1)
    with prefill_speaking(N, {N}) as port, client:
        with pytest.raises(HandshakeRefused) as caught:
            client.fetch(HOST, port)
    assert caught.value.code == "unsupported_version"
    message = caught.value.message
    assert f"protocol version {N - 1}" in message and f"speaks {N}" in message and f"client speaks {N - 1}" in message


def test_a_release_to_a_prefill_without_release_is_refused_naming_both_versions() -> None:
    releaser = Releaser(timeout_s=5.0)
    try:
        with prefill_speaking(1, {1}) as port:
            with pytest.raises(HandshakeRefused) as caught:
                releaser.release(HOST, port, "prefill-v1", "some-request", read_possible=False)
        assert caught.value.code == "unsupported_version"
        assert "speaks protocol version 1" in caught.value.message and f"speaks {N}" in caught.value.message
        with prefill_speaking(N, {1, N}) as port:
            assert releaser.release(HOST, port, f"prefill-v{N}", "some-request", read_possible=False) == "not_held"
    finally:
        releaser.close()


def test_the_released_version_1_prefill_refuses_a_decode_of_n_naming_both(tmp_path: Path) -> None:
    """The version 1 server refuses a newer Hello outright; a decode of N, which speaks no older version, is refused
    with both versions named."""
    code = version_1_package(tmp_path)
    with prefill_speaking(1, {1}, released_code=code) as port:
        with HandshakeClient(fake_fingerprint(), retries=0) as client:
            with pytest.raises(HandshakeRefused) as caught:
                client.fetch(HOST, port)
    message = caught.value.message
    assert caught.value.code == "unsupported_version"
    assert "speaks 1" in message and f"client speaks {N}" in message
