"""``pd-transfer bench soak --kv-standins --minutes``, short: the soak under faults that the hour-long run in
docs/benchmarks.md makes longer (issue 42, item 3). A minute of steady load through the proxy on KV stand-ins moving
real KV over the ``tcp`` transport, every decode checking every row's digest, while the second prefill and the second
decode are killed and drained in turn every 12 s (on until each kind was done once: on busy cores a restart takes
20 s), every fifth request's KV changed in its prefill's cache once held, and clients leave; no answer may be wrong,
every block must be free at the end, the long-lived processes' RSS and descriptors are reported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("aiohttp", reason="the proxy needs the 'proxy' extra (aiohttp)")

pytestmark = pytest.mark.timeout(420)


def test_a_minute_of_faults_answers_nothing_wrong_and_frees_every_block(tmp_path: Path) -> None:
    output = tmp_path / "soak_faults.json"
    command = [sys.executable, "-m", "pd_transfer.cli", "bench", "soak", "--kv-standins", "--minutes", "1"]
    command += ["--fault-every", "12", "--faults", "3", "--corrupt-every", "5", "--transport", "tcp", "--verify", "all"]
    command += ["--requests", "60", "--concurrency", "8", "--leave-early", "4", "--leave-mid", "4", "--lease", "6"]
    command += ["--num-blocks", "512", "--log-dir", str(tmp_path / "logs"), "--output", str(output), "--seed", "11"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=360)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(output.read_text())
    print(f"\n{run.stdout.strip().splitlines()[-1]}\nfootprint: {result['footprint']}")
    answers, corrupted = result["answers"], result["corrupted"]
    assert answers["wrong"] == 0 and not result["wrong_samples"], result["wrong_samples"]
    assert result["blocks_held_after"] == {} and not result["fault_failure"], result
    assert len(result["faults"]) >= 3  # each kind once: prefill killed, decode killed, prefill drained
    assert {fault["fault"] for fault in result["faults"][:3]} == {"kill prefill-1", "kill decode-1", "drain prefill-1"}
    assert answers["right"] > 0 and answers["clients_left"] > 0
    assert corrupted["injected"] > 0 and corrupted["digest_mismatches"] > 0  # changed bytes were read, and caught
    lasting = result["footprint"]["end"]
    assert set(lasting) == {"prefill-0", "decode-0", "proxy"}  # alive throughout: read at the end
