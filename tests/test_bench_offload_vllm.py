"""``pd-transfer bench offload --end-to-end`` without vLLM: its flags parse, and it refuses clearly (exit 2, a
message naming the reason) when the interpreter it is given has no vLLM or a setup name is unknown."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pd_transfer.bench import offload, offload_vllm
from pd_transfer.cli import build_parser


def test_flags_parse() -> None:
    argv = "bench offload --end-to-end --json --output out.json --repeats 3 --setups recompute,pd_host --python py"
    args = build_parser().parse_args(argv.split())
    assert args.end_to_end and args.json and args.output == Path("out.json") and args.repeats == 3
    settings = offload_vllm._settings(args)
    assert settings.setups == ("recompute", "pd_host") and settings.python == "py" and settings.repeats == 3
    assert not build_parser().parse_args(["bench", "offload"]).end_to_end


def test_refuses_without_vllm(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fake = tmp_path / "python"  # an interpreter without vllm: a plain one with an empty path
    fake.write_text(f'#!/bin/sh\nexec {sys.executable} -I -S "$@"\n')
    fake.chmod(0o755)
    assert offload_vllm.vllm_absent(str(fake)) is not None
    output = tmp_path / "out.json"
    code = offload.main(["--end-to-end", "--python", str(fake), "--output", str(output)])
    assert code == 2
    assert "vLLM is not installed" in capsys.readouterr().err
    assert not output.exists()


def test_refuses_unknown_setup(capsys: pytest.CaptureFixture[str]) -> None:
    assert offload.main(["--end-to-end", "--setups", "pd_host,nope"]) == 2
    assert "unknown setups ['nope']" in capsys.readouterr().err


def test_missing_interpreter_is_named() -> None:
    reason = offload_vllm.vllm_absent("/nonexistent/python")
    assert reason is not None and "cannot run the interpreter" in reason


def test_save_merges_into_the_end_to_end_key(tmp_path: Path) -> None:
    path = tmp_path / "offload.json"
    path.write_text(json.dumps({"host": {"x": 1}, "end_to_end": None, "end_to_end_note": "to come"}))
    offload_vllm._save(path, {"verified": True})
    assert json.loads(path.read_text()) == {"host": {"x": 1}, "end_to_end": {"verified": True}}


def test_cli_help_lists_the_flag() -> None:
    done = subprocess.run([sys.executable, "-m", "pd_transfer.cli", "bench", "offload", "--help"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    assert "--end-to-end" in done.stdout
