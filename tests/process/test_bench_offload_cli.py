"""``pd-transfer bench offload --end-to-end`` against interpreters it runs: one without vLLM and one that does not
exist are refused, naming the reason; ``--help`` of the command lists the flag (the rest:
tests/unit/test_bench_offload_vllm.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pd_transfer.bench.offload import end_to_end, tiers


def test_refuses_without_vllm(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fake = tmp_path / "python"  # an interpreter without vllm: a plain one with an empty path
    fake.write_text(f'#!/bin/sh\nexec {sys.executable} -I -S "$@"\n')
    fake.chmod(0o755)
    assert end_to_end.vllm_absent(str(fake)) is not None
    output = tmp_path / "out.json"
    code = tiers.main(["--end-to-end", "--python", str(fake), "--output", str(output)])
    assert code == 2
    assert "vLLM is not installed" in capsys.readouterr().err
    assert not output.exists()


def test_missing_interpreter_is_named() -> None:
    reason = end_to_end.vllm_absent("/nonexistent/python")
    assert reason is not None and "cannot run the interpreter" in reason


def test_cli_help_lists_the_flag() -> None:
    done = subprocess.run([sys.executable, "-m", "pd_transfer.cli", "bench", "offload", "--help"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    assert "--end-to-end" in done.stdout
