"""The image built and the compose cluster run for real: ``docker/test-cluster`` as a process.

It needs a Docker engine (or root to start one), minutes of CPU and gigabytes of disk (docs/deploy.md: a cold run
and a warm one). scripts/test runs it as its last step through scripts/test-docker (budget and skips); here the
whole run is a test only with ``PD_TRANSFER_DOCKER_TEST=1``. Always checked: the help text (the script runs on the
host's own Python with the standard library only), the on-purpose skip of scripts/test-docker, and, where a Docker
engine runs or dockerd is installed, that a budget too short for the run skips it with its reason.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "docker" / "test-cluster"
STEP = ROOT / "scripts" / "test-docker"
#: A cold run (no cache: debootstrap, the wheelhouse, the image, two cluster starts) took about 40 min here.
RUN_TIMEOUT_S = float(os.environ.get("PD_TRANSFER_DOCKER_TIMEOUT_S", "5400"))


def test_script_runs_on_the_standard_library() -> None:
    done = subprocess.run([sys.executable, "-I", str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "--keep" in done.stdout and "--no-cluster" in done.stdout


def test_step_skips_on_purpose() -> None:
    env = {**os.environ, "PD_TRANSFER_DOCKER_TEST": "0"}
    done = subprocess.run([str(STEP)], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0 and done.stderr.strip() == "docker/test-cluster skipped: PD_TRANSFER_DOCKER_TEST=0"


def test_step_does_not_run_the_cluster_twice() -> None:
    # under scripts/test, PD_TRANSFER_DOCKER_TEST=1 has its pytest run build and run the cluster already
    env = {**os.environ, "PD_TRANSFER_DOCKER_TEST": "1", "PD_TRANSFER_TEST_STARTED": "1"}
    done = subprocess.run([str(STEP)], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip().endswith("ran it in scripts/test's pytest run already")


def test_a_budget_too_short_skips_with_its_reason() -> None:
    engine = shutil.which("docker") and subprocess.run(["docker", "info"], capture_output=True).returncode == 0
    if not engine and not (shutil.which("dockerd") and os.geteuid() == 0):
        pytest.skip("no Docker engine answers and none can be started here (dockerd and root needed)")
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--budget-seconds", "60"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 3, done.stdout + done.stderr
    assert re.search(r"skipped: a (cold|warm|cached-image) run takes about \d+ s; 60 s are left", done.stderr)


@pytest.mark.timeout(RUN_TIMEOUT_S + 120)
def test_image_builds_and_the_compose_cluster_answers_like_a_plain_server() -> None:
    if os.environ.get("PD_TRANSFER_DOCKER_TEST") != "1":
        pytest.skip("set PD_TRANSFER_DOCKER_TEST=1 to build the image and run the compose cluster (tens of minutes)")
    try:
        done = subprocess.run(
            [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=RUN_TIMEOUT_S, cwd=ROOT
        )
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"docker/test-cluster ran longer than {RUN_TIMEOUT_S:.0f} s:\n{error.stdout!r}")
    print(done.stdout)
    assert done.returncode == 0, f"docker/test-cluster exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    first = re.search(r"1P1D: (\d+) requests equal .* pulled (\d+) bytes", done.stdout)
    second = re.search(
        r"2P1D: (\d+) requests equal, prefills served \[(\d+)\.0, (\d+)\.0\].* pulled (\d+) bytes", done.stdout
    )
    assert first and second, done.stdout
    assert int(first[1]) >= 5 and int(first[2]) > 0
    assert int(second[1]) >= 10 and int(second[2]) > 0 and int(second[3]) > 0 and int(second[4]) > 0
    assert re.search(r"every panel has data: \d+ panels", done.stdout), done.stdout
    assert "removed the containers and the network" in done.stdout
