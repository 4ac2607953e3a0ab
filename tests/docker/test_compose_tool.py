"""The compose files through the compose tool itself, where ``docker compose`` (or the older ``docker-compose``) is
installed (``scripts/ensure-compose``; no daemon needed): its ``config`` validates the files and its resolution gets
the same checks as our own reading of them (tests/unit/test_docker.py), with the defaults and every port moved."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_docker import (
    CLUSTERS,
    DOCKER,
    DOCKERFILE,
    HOST_UCX,
    MOVED,
    Dockerfile,
    check_services,
    defaults_used,
    environment_of,
    image_model_dir,
    load_compose,
)


def compose_tool() -> list[str] | None:
    """``docker compose`` (the plugin) or ``docker-compose`` (the standalone tool), whichever works."""
    candidates = [["docker", "compose"], ["docker-compose"]]
    for command in candidates:
        if shutil.which(command[0]) is None:
            continue
        try:
            probe = subprocess.run([*command, "version"], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if probe.returncode == 0:
            return command
    return None


def compose_config(tool: list[str], paths: list[Path], env: Mapping[str, str], tmp_path: Path) -> dict[str, Any]:
    """``TOOL -f ... config``, run with ``env`` as the only settings (an empty env file: a docker/.env that a
    user keeps must not change the result); returns its services."""
    empty = tmp_path / "empty.env"
    empty.touch()
    clean = {key: value for key, value in os.environ.items() if key not in defaults_used(*paths)}
    command = [*tool, "--env-file", str(empty), *(arg for path in paths for arg in ("-f", str(path))), "config"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env={**clean, **env}, cwd=DOCKER)
    assert result.returncode == 0, f"{shlex.join(command)} failed:\n{result.stdout}\n{result.stderr}"
    return yaml.safe_load(result.stdout)["services"]


def test_compose_tool_validates_and_resolves_the_same(tmp_path: Path) -> None:
    tool = compose_tool()
    if tool is None:
        pytest.skip(
            "neither `docker compose` (the compose plugin) nor `docker-compose` is installed, so the compose "
            "tool's own validation did not run (the structural checks above did); on Debian: "
            "apt-get install docker-compose, or docker/validate"
        )
    model_dir = image_model_dir(Dockerfile.read(DOCKERFILE))
    cases = [(cluster, {**HOST_UCX, **env}) for cluster in CLUSTERS for env in ({}, MOVED)]
    with ThreadPoolExecutor(len(cases)) as pool:  # each run starts the tool afresh: seconds
        results = list(pool.map(lambda case: compose_config(tool, CLUSTERS[case[0]], case[1], tmp_path), cases))
    for (cluster, env), resolved in zip(cases, results, strict=True):
        problems = check_services(resolved, cluster, env.get("MODEL", model_dir))
        assert not problems, f"{shlex.join(tool)} config of {cluster} {env}:\n" + "\n".join(problems)
        ours = load_compose(CLUSTERS[cluster], env)
        for name, service in resolved.items():
            theirs = [str(word) for word in service["command"]]
            assert theirs == ours[name]["command"], f"{name}: compose resolves {theirs}, we {ours[name]}"
            assert environment_of(service) == environment_of(ours[name]), name
