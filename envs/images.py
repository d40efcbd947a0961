"""OCI images for the ``container`` sandbox: the engine, task images cached by content hash, the
verifier layer, and offline stand-ins for the base images tasks name in ``FROM``.

**Engine** (:func:`resolve_engine`): ``podman`` (driven as ``podman --runtime runc
--cgroup-manager cgroupfs``, see :class:`~t1async.config.ContainerConfig`) or ``docker``; both
are called with the same sub-commands (``build``, ``run``, ``exec``, ``image exists``/``image
inspect``, ``tag``, ``import``, ``rm``).

**Task images** (:func:`ensure_task_image`): the task's own Dockerfile and build context, tagged
``localhost/t1async-task/<name>:<hash>`` where the hash (sha256, 16 hex digits) covers the
Dockerfile, every file of the context (path, executable bit, bytes; ``.git`` skipped), the
image IDs its ``FROM`` names resolve to and the build options, so an unchanged task is built once
and a changed one, or one whose base image changed (a new bootstrap, a pulled real image), is
rebuilt. Before the
build: ``COPY``/``RUN`` heredocs are rewritten (:func:`expand_heredocs`: podman 4.3's buildah
lacks them), each ``FROM`` image missing locally is replaced by its bootstrapped stand-in
(:func:`ensure_base`), and the host CA bundle is mounted (podman ``build -v``; TLS to package
indexes is intercepted on some hosts) with pip and uv pointed at it. Builds run with the same
explicit ulimits as containers. A build lock (``fcntl`` on a file in the cache folder) makes
concurrent episodes of one task build it once.

**Verifier layer** (:func:`ensure_verifier_image`): ``FROM`` the task image, the Debian packages
and Python requirements the task's test script would install at test time, installed at build
time into ``/opt/t1async-verifier`` (a venv with ``--system-site-packages``, so the tests see
the image's own packages as the test script's environment would, plus pytest). Cached by hash
too. Network is then needed only at build time.

**Stand-ins** (:data:`STAND_INS`, :func:`bootstrap`): with no registry reachable, ``t1async
images bootstrap`` builds Debian root filesystems with ``mmdebstrap --variant=minbase`` (plus
python3, pip, venv, ca-certificates, procps, netbase; documentation dropped; pip allowed to
install system-wide: the ``EXTERNALLY-MANAGED`` marker is removed, as the official python
images have none; ``python``, ``pip`` and ``/usr/local/bin/python3`` provided) and
``import``s them under the names tasks use. Every substitution is reported
(:attr:`StandIn.differences`). Measured here: about 40-120 s per suite (two CPU cores shared),
about 190 MB per image.

Sources: the Dockerfile reference (https://docs.docker.com/reference/dockerfile/: heredocs,
FROM, build args HTTP_PROXY...), podman-build(1), podman-import(1), mmdebstrap(1).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Iterator

from loguru import logger

from t1async.config import ContainerConfig

from .protocol import SandboxError, SandboxUnavailable

ENGINE_CWD = tempfile.gettempdir()
"""Working directory of every engine process (podman/docker and the conmon it starts): on an
out-of-memory kill conmon writes a file ``oom`` into it (measured: tests run from a checkout left
an empty ``oom`` in the checkout), so never the caller's folder."""
from .task import heredoc_terminators

CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "t1async" / "images"
"""Build locks and bootstrap scratch space."""

TASK_REPO = "localhost/t1async-task"
"""Repository of task images (``<TASK_REPO>/<name>:<hash>``)."""

VERIFIER_DIR = "/opt/t1async-verifier"
"""Venv of the verifier layer inside a container (its ``bin/python`` runs the tests)."""

DEBIAN_MIRROR = "http://deb.debian.org/debian"
HOST_CA_FILES = ("/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt")
PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy")
BASE_REPO = "localhost/t1async-base"
"""Repository of the bootstrapped root filesystems (``<BASE_REPO>/<suite>:<ROOTFS_VERSION>``)."""

ROOTFS_VERSION = 2
"""Bumped whenever :func:`build_rootfs` makes a different root filesystem (2: pip ``RECORD`` files
for Debian's Python packages), so that ``t1async images bootstrap`` builds and re-tags anew."""

BOOTSTRAP_PACKAGES = ("python3", "python3-pip", "python3-venv", "python-is-python3", "ca-certificates",
                      "procps", "netbase")
"""Packages every stand-in root filesystem gets on top of ``minbase``."""


PIP_RECORDS_SCRIPT = r"""
import os, re, sys
root = sys.argv[1]
info = os.path.join(root, "var/lib/dpkg/info")
meta = re.compile(r"(/usr/lib/python3[^/]*/dist-packages)/([^/]+\.(dist-info|egg-info))")
for name in sorted(os.listdir(info)):
    if not name.endswith(".list"):
        continue
    with open(os.path.join(info, name)) as handle:
        owned = [line.rstrip("\n") for line in handle if line.strip()]
    for entry in owned:
        match = meta.fullmatch(entry)
        if not match or not os.path.isdir(root + entry):
            continue
        site, kind = match.group(1), match.group(3)
        files = [q for q in owned if q.startswith(site + "/") and os.path.isfile(root + q)]
        if kind == "dist-info" and not os.path.exists(root + entry + "/RECORD"):
            lines = [os.path.relpath(q, site) + ",," for q in files] + [os.path.relpath(entry, site) + "/RECORD,,"]
            with open(root + entry + "/RECORD", "w") as out:
                out.write("\n".join(lines) + "\n")
        elif kind == "egg-info" and not os.path.exists(root + entry + "/installed-files.txt"):
            with open(root + entry + "/installed-files.txt", "w") as out:
                out.write("\n".join(os.path.relpath(q, entry) for q in files) + "\n")
"""
"""Customize hook (host Python, the root filesystem as argv[1]): give every Python distribution a
Debian package installed (pip, wheel, packaging; setuptools on bookworm) the file list pip needs
to uninstall it (``RECORD`` / ``installed-files.txt``, from dpkg's own list of the package's
files under dist-packages). In the official python images every preinstalled distribution was
installed by pip, so ``pip install mlflow`` may upgrade ``packaging``; without these lists pip
stops with "Cannot uninstall packaging: no RECORD file was found ... installed by debian"."""


class BuildError(SandboxError):
    """An image build failed; the message has the tail of the build log and where the rest is."""


# --------------------------------------------------------------------------------- engine


@dataclass
class Engine:
    """A container engine and how to call it.

    Attributes:
        name: ``podman`` or ``docker``.
        argv: the command prefix, e.g. ``["podman", "--runtime", "runc", "--cgroup-manager", "cgroupfs"]``.
        cfg: the settings it was resolved from.
    """

    name: str
    argv: list[str]
    cfg: ContainerConfig = field(default_factory=ContainerConfig)

    def run(self, *args: str, timeout_s: float = 120.0, check: bool = True, stdin: bytes | None = None,
            stdout: IO | int | None = None) -> subprocess.CompletedProcess:
        """Run ``<engine> args...``; output captured (stdout to ``stdout`` if given).

        Raises:
            SandboxError: it overran ``timeout_s``, or failed with ``check`` (message: the command
                and the tail of its output).
        """
        argv = [*self.argv, *args]
        try:
            done = subprocess.run(argv, input=stdin, stdout=stdout if stdout is not None else subprocess.PIPE,
                                  stderr=subprocess.STDOUT if stdout is not None else subprocess.PIPE,
                                  timeout=timeout_s, cwd=ENGINE_CWD)
        except subprocess.TimeoutExpired:
            raise SandboxError(f"`{' '.join(argv[:6])} ...` did not finish within {timeout_s:g} s") from None
        if check and done.returncode != 0:
            text = (done.stderr or b"").decode("utf-8", "replace").strip() or (done.stdout or b"").decode("utf-8", "replace").strip()
            raise SandboxError(f"`{self.name} {' '.join(args[:3])}` failed (exit {done.returncode}): {text[-800:]}")
        return done

    def image_exists(self, ref: str) -> bool:
        """Whether the image ``ref`` is in local storage (never pulls)."""
        return bool(self.image_id(ref))

    def image_id(self, ref: str) -> str:
        """The ID of the local image ``ref`` ("" when missing; never pulls)."""
        done = self.run("image", "inspect", "--format", "{{.Id}}", ref, check=False, timeout_s=60)
        return done.stdout.decode().strip().removeprefix("sha256:") if done.returncode == 0 else ""

    def image_config(self, ref: str) -> dict:
        """The image's ``Config`` (WorkingDir, Env, User, ...) from ``image inspect``."""
        out = self.run("image", "inspect", ref, timeout_s=60).stdout
        data = json.loads(out)
        entry = data[0] if isinstance(data, list) else data
        return entry.get("Config") or {}

    def ulimits(self) -> list[str]:
        """``--ulimit`` options at or below the host's hard limits (the engines' defaults ask for
        more than some hosts allow: ``setrlimit`` EPERM at container start)."""
        out = []
        for name, want, which in (("nofile", self.cfg.ulimit_nofile, resource.RLIMIT_NOFILE),
                                  ("nproc", self.cfg.ulimit_nproc, resource.RLIMIT_NPROC)):
            if want <= 0:
                continue
            hard = resource.getrlimit(which)[1]
            value = want if hard == resource.RLIM_INFINITY else min(want, hard)
            out += ["--ulimit", f"{name}={value}:{value}"]
        return out


def resolve_engine(cfg: ContainerConfig | None = None) -> Engine:
    """The engine ``cfg.engine`` names (``auto``: podman if installed, else docker).

    Raises:
        SandboxUnavailable: no engine installed, or docker's daemon does not answer; the message
            says what to install.
    """
    cfg = cfg or ContainerConfig()
    wanted = cfg.engine
    if wanted not in ("auto", "podman", "docker"):
        raise SandboxUnavailable(f"env.container.engine = {wanted!r}: choose podman, docker or auto")
    if wanted in ("auto", "podman") and shutil.which("podman"):
        argv = ["podman"]
        if cfg.runtime:
            argv += ["--runtime", cfg.runtime]
        if cfg.cgroup_manager:
            argv += ["--cgroup-manager", cfg.cgroup_manager]
        return Engine("podman", argv, cfg)
    if wanted in ("auto", "docker") and shutil.which("docker"):
        probe = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, timeout=20)
        if probe.returncode == 0:
            return Engine("docker", ["docker"], cfg)
        if wanted == "docker":
            raise SandboxUnavailable("docker is installed but its daemon does not answer (`docker info` failed): "
                                     "start dockerd or use env.container.engine=podman")
    raise SandboxUnavailable("no container engine: install podman (`apt-get install podman runc`; tools/setup.sh "
                             "does it) or start a docker daemon")


def check_container_available(cfg: ContainerConfig | None = None) -> None:
    """Raise :class:`SandboxUnavailable` unless an engine can be used here (see :func:`resolve_engine`)."""
    resolve_engine(cfg)


def ca_bundle(cfg: ContainerConfig) -> Path | None:
    """The host CA bundle to pass into builds and networked containers, or None (off or absent)."""
    if not cfg.ca_bundle:
        return None
    if cfg.ca_bundle != "auto":
        path = Path(cfg.ca_bundle)
        if not path.is_file():
            raise SandboxUnavailable(f"env.container.ca_bundle = {cfg.ca_bundle!r} is not a file; fix it or set it empty")
        return path
    for candidate in (os.environ.get("SSL_CERT_FILE", ""), *HOST_CA_FILES):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


def ca_mounts(cfg: ContainerConfig, scratch: Path) -> list[str]:
    """``-v`` options that give a build or a container the host's CA bundle, with pip
    (``/etc/pip.conf``) and uv (``/etc/uv/uv.toml``) set to use it; empty when off."""
    bundle = ca_bundle(cfg)
    if bundle is None:
        return []
    scratch.mkdir(parents=True, exist_ok=True)
    pip_conf = scratch / "pip.conf"
    pip_conf.write_text("[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n")
    uv_toml = scratch / "uv.toml"
    uv_toml.write_text("native-tls = true\n")
    return ["-v", f"{bundle}:/etc/ssl/certs/ca-certificates.crt:ro", "-v", f"{pip_conf}:/etc/pip.conf:ro",
            "-v", f"{uv_toml}:/etc/uv/uv.toml:ro"]


def proxy_build_args(cfg: ContainerConfig) -> list[str]:
    """``--build-arg`` options for the host's proxy variables (Docker predefines these ARGs)."""
    if not cfg.pass_proxy:
        return []
    return [opt for var in PROXY_VARS if os.environ.get(var) for opt in ("--build-arg", f"{var}={os.environ[var]}")]


# --------------------------------------------------------------------------------- Dockerfiles


def expand_heredocs(text: str) -> tuple[str, dict[str, str]]:
    """Rewrite heredocs for builders that lack them; returns (new Dockerfile, {file name: content}).

    * ``COPY [flags] <<EOT dest`` (one heredoc, its body) becomes ``COPY [flags] .t1async-heredoc-N
      dest``, the body written to that file in the build context (Docker writes it without the
      terminator line, with a final newline).
    * ``RUN <<EOT`` alone runs the body as a script: ``RUN ["/bin/sh", "-c", BODY]``.
    * ``RUN cmd <<EOT ...`` (a heredoc fed to a command) stays shell text:
      ``RUN ["/bin/sh", "-c", "cmd <<EOT\\nBODY\\nEOT"]`` (the shell reads the heredoc itself).

    Lines without heredocs are kept byte for byte.
    """
    lines = text.splitlines()
    out: list[str] = []
    files: dict[str, str] = {}
    index = 0
    pending = ""
    while index < len(lines):
        raw = lines[index]
        index += 1
        if raw.rstrip().endswith("\\") and not raw.lstrip().startswith("#"):
            pending += raw + "\n"
            continue
        logical = pending + raw
        pending = ""
        flat = " ".join(part.strip().rstrip("\\").strip() for part in logical.splitlines())
        terminators = heredoc_terminators(flat)
        if not terminators:
            out.append(logical)
            continue
        bodies: list[tuple[str, list[str]]] = []
        for terminator, strip_tabs in terminators:
            body: list[str] = []
            while index < len(lines):
                line = lines[index]
                index += 1
                if (line.lstrip("\t") if strip_tabs else line) == terminator:
                    break
                body.append(line.lstrip("\t") if strip_tabs else line)
            bodies.append((terminator, body))
        word, _, rest = flat.strip().partition(" ")
        if word.upper() in ("COPY", "ADD"):
            for (terminator, body), match in zip(bodies, re.finditer(r"<<-?\s*(['\"]?)[A-Za-z_][A-Za-z0-9_]*\1", rest)):
                name = f".t1async-heredoc-{len(files)}"
                files[name] = "\n".join(body) + "\n"
                rest = rest.replace(match.group(0), name, 1)
            out.append(f"{word} {rest}")
        else:
            command = rest.strip()
            if re.fullmatch(r"<<-?\s*(['\"]?)[A-Za-z_][A-Za-z0-9_]*\1", command) and len(bodies) == 1:
                script = "\n".join(bodies[0][1]) + "\n"
            else:
                script = command + "\n" + "".join("\n".join(body) + "\n" + terminator + "\n" for terminator, body in bodies)
            out.append(f"{word} {json.dumps(['/bin/sh', '-c', script])}")
    if pending:
        out.append(pending.rstrip("\n"))
    return "\n".join(out) + "\n", files


_FROM = re.compile(r"^\s*FROM\s+(?:--\S+\s+)*(\S+)(?:\s+AS\s+(\S+))?", re.IGNORECASE | re.MULTILINE)


def from_images(text: str) -> list[str]:
    """The images a Dockerfile's ``FROM`` lines name, without earlier stages' names (``FROM x AS y``)."""
    stages: set[str] = set()
    images: list[str] = []
    for match in _FROM.finditer(text):
        image, alias = match.group(1), match.group(2)
        if image.lower() not in stages and image not in images and "$" not in image:
            images.append(image)
        if alias:
            stages.add(alias.lower())
    return images


def context_hash(dockerfile_text: str, context_dir: Path | None, extra: str = "") -> str:
    """16 hex digits of sha256 over the Dockerfile, every file under ``context_dir`` (relative
    path, executable bit, content; ``.git`` skipped; symlinks by target) and ``extra``."""
    digest = hashlib.sha256()
    digest.update(dockerfile_text.encode())
    digest.update(b"\0" + extra.encode() + b"\0")
    if context_dir is not None and context_dir.is_dir():
        for path in sorted(context_dir.rglob("*")):
            rel = path.relative_to(context_dir)
            if rel.parts and rel.parts[0] == ".git":
                continue
            if path.is_symlink():
                digest.update(f"L {rel} {os.readlink(path)}\n".encode())
            elif path.is_file():
                digest.update(f"F {rel} {os.access(path, os.X_OK)} {path.stat().st_size}\n".encode())
                with open(path, "rb") as handle:
                    for chunk in iter(lambda: handle.read(1 << 20), b""):
                        digest.update(chunk)
            elif path.is_dir():
                digest.update(f"D {rel}\n".encode())
    return digest.hexdigest()[:16]


@contextmanager
def _build_lock(key: str) -> Iterator[None]:
    """An exclusive file lock per image key, across threads and processes."""
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    with open(CACHE_DIR / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', key)}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _safe_name(name: str) -> str:
    return re.sub(r"[^a-z0-9_.-]", "-", name.lower()).strip("-.")[:60] or "task"


def _build(engine: Engine, tag: str, dockerfile_text: str, context_dir: Path | None, files: dict[str, str],
           log: Path | None) -> None:
    """``<engine> build`` of ``dockerfile_text`` in a copy of ``context_dir`` (plus ``files``),
    tagged ``tag``; the build log goes to ``log`` (appended) when given.

    Raises:
        BuildError: the build failed or timed out (the tail of its log in the message).
    """
    cfg = engine.cfg
    with tempfile.TemporaryDirectory(prefix="t1async-build-") as tmp:
        context = Path(tmp) / "context"
        if context_dir is not None and context_dir.is_dir():
            shutil.copytree(context_dir, context, symlinks=True, ignore=shutil.ignore_patterns(".git"))
        else:
            context.mkdir()
        for name, content in files.items():
            (context / name).write_text(content)
        dockerfile = Path(tmp) / "Dockerfile"
        dockerfile.write_text(dockerfile_text)
        args = ["build", "-f", str(dockerfile), "-t", tag, *engine.ulimits(), *proxy_build_args(cfg)]
        if engine.name == "podman":
            pip_cache = CACHE_DIR / "pip"  # wheels kept between builds (verifier layers repeat them)
            pip_cache.mkdir(parents=True, exist_ok=True)
            args += ["--pull=never", *ca_mounts(cfg, Path(tmp) / "ca"), "-v", f"{pip_cache}:/root/.cache/pip"]
        started = time.monotonic()
        with tempfile.TemporaryFile() as output:
            try:
                done = engine.run(*args, str(context), timeout_s=cfg.build_timeout_s, check=False, stdout=output)
                code: int | str = done.returncode
            except SandboxError as exc:
                code = str(exc)
            output.seek(0)
            text = output.read().decode("utf-8", "replace")
        if log is not None:
            log.parent.mkdir(parents=True, exist_ok=True)
            with open(log, "a") as handle:
                handle.write(f"$ {engine.name} {' '.join(args)} CONTEXT\n# Dockerfile as built:\n{dockerfile_text}\n"
                             f"{text}\n# exit {code}, {time.monotonic() - started:.1f} s\n")
        if code != 0:
            where = f" (full log: {log})" if log is not None else ""
            raise BuildError(f"image build of {tag} failed ({'exit ' + str(code) if isinstance(code, int) else code}): "
                             f"{text.strip()[-1200:]!r}{where}")
        logger.info("built {} in {:.1f} s", tag, time.monotonic() - started)


def ensure_task_image(engine: Engine, *, name: str, dockerfile: Path | None, context_dir: Path | None,
                      docker_image: str = "", log: Path | None = None) -> str:
    """The image of a task, built if missing (see the module docstring); returns its reference.

    Without a Dockerfile the task's ``docker_image`` is used (its stand-in if missing locally),
    else ``debian:bookworm``.

    Raises:
        BuildError: the build failed.
        SandboxError: a ``FROM`` image is missing and has no stand-in (run ``t1async images bootstrap``).
    """
    if dockerfile is None:
        return ensure_base(engine, docker_image or "debian:bookworm")
    original = dockerfile.read_text()
    text, files = expand_heredocs(original)
    bases = [ensure_base_id(engine, image) for image in from_images(text)]
    key = context_hash(original, context_dir, extra=f"{engine.name}|{sorted(files)}|{bases}")
    tag = f"{TASK_REPO}/{_safe_name(name)}:{key}"
    with _build_lock(tag):
        if not engine.image_exists(tag):
            _build(engine, tag, text, context_dir, files, log)
        elif log is not None:
            log.parent.mkdir(parents=True, exist_ok=True)
            with open(log, "a") as handle:
                handle.write(f"# image {tag} found in the cache (Dockerfile and context unchanged)\n")
    return tag


def ensure_verifier_image(engine: Engine, base: str, *, debs: list[str], requirements: list[str],
                          log: Path | None = None) -> str:
    """``base`` plus the verifier layer (see the module docstring); returns its reference.

    Args:
        base: the task image.
        debs: Debian packages the test script installs with apt.
        requirements: Python requirements it installs (``pytest`` is added when absent).

    Raises:
        BuildError: the layer could not be built (no network at build time, a package that does
            not exist); callers fall back to the task image.
    """
    reqs = list(dict.fromkeys(requirements))
    if not any(re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() == "pytest" for r in reqs):
        reqs.insert(0, "pytest")
    user = engine.image_config(base).get("User") or ""
    lines = [f"FROM {base}", "USER root"]
    apt = ("if command -v apt-get >/dev/null; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive "
           "apt-get install -y -qq --no-install-recommends {} >/dev/null; fi")
    needs = list(debs)
    lines.append("RUN " + " && ".join(filter(None, [
        apt.format(" ".join(sorted(set(needs)))) if needs else "",
        "(command -v python3 >/dev/null && python3 -m venv --help >/dev/null 2>&1) || " + apt.format("python3 python3-venv"),
    ])))
    quoted = " ".join(json.dumps(r) for r in reqs)
    lines.append(f"RUN python3 -m venv --system-site-packages {VERIFIER_DIR} && "
                 f"{VERIFIER_DIR}/bin/python -m pip install -q --disable-pip-version-check --no-input {quoted}")
    if user and user not in ("root", "0"):
        lines.append(f"USER {user}")
    text = "\n".join(lines) + "\n"
    key = hashlib.sha256(text.encode()).hexdigest()[:16]
    tag = f"{base.rsplit(':', 1)[0]}-verifier:{key}"
    with _build_lock(tag):
        if not engine.image_exists(tag):
            _build(engine, tag, text, None, {}, log)
    return tag


# --------------------------------------------------------------------------------- stand-ins


@dataclass(frozen=True)
class StandIn:
    """A locally bootstrapped image that stands in for a registry image.

    Attributes:
        pattern: regular expression over the normalised image reference (``repo:tag``, a
            ``docker.io/library/`` prefix removed).
        suite: Debian suite of the root filesystem (``bookworm``, ``trixie``).
        extra: Debian packages beyond :data:`BOOTSTRAP_PACKAGES`.
        differences: what differs from the official image, for the report.
    """

    pattern: str
    suite: str
    extra: tuple[str, ...] = ()
    differences: str = ""


_DEB_EXTRAS = "Debian minbase plus python3, pip, venv, ca-certificates, procps, netbase"
STAND_INS: tuple[StandIn, ...] = (
    StandIn(r"python:3\.13(?:[.\d]*)(?:-slim)?(?:-bookworm|-trixie)?", "trixie",
            differences="Debian trixie's Python 3.13 (/usr/bin, Debian pip) on a trixie userland instead of "
                        "python.org's build in /usr/local on bookworm"),
    StandIn(r"python:3\.11(?:[.\d]*)(?:-slim)?(?:-bookworm)?", "bookworm",
            differences="Debian bookworm's Python 3.11 (/usr/bin, Debian pip) instead of python.org's in /usr/local"),
    StandIn(r"python:3\.1[2-9](?:[.\d]*)(?:-slim)?(?:-bookworm|-trixie)?|python:3(?:-slim)?|python:latest|python:slim",
            "trixie", differences="Python 3.13 (Debian trixie) stands in for another Python 3 version"),
    StandIn(r"python:3\.(?:[7-9]|10)(?:[.\d]*)(?:-slim)?(?:-bookworm|-bullseye)?", "bookworm",
            differences="Python 3.11 (Debian bookworm) stands in for an older Python 3 version"),
    StandIn(r"debian:(?:bookworm|12)(?:[.\d]*)(?:-slim)?", "bookworm", differences=_DEB_EXTRAS),
    StandIn(r"debian:(?:trixie|13|stable|latest)(?:[.\d]*)(?:-slim)?|debian", "trixie", differences=_DEB_EXTRAS),
    StandIn(r"ubuntu:(?:24\.04|noble|latest)|ubuntu", "trixie",
            differences="Debian trixie stands in for Ubuntu 24.04 (glibc 2.41 vs 2.39, Python 3.13 vs 3.12, Debian "
                        "archive instead of Ubuntu's; apt-get works the same)"),
    StandIn(r"ubuntu:(?:22\.04|jammy|20\.04|focal)", "bookworm",
            differences="Debian bookworm stands in for Ubuntu 22.04/20.04 (Debian archive instead of Ubuntu's)"),
    StandIn(r"ghcr\.io/laude-institute/t-bench/python-3-13:.*", "trixie",
            differences="Terminal-Bench 1 python-3-13 base: Debian trixie's Python 3.13, without the harness's tmux "
                        "and asciinema (t1async drives no terminal)"),
    StandIn(r"ghcr\.io/laude-institute/t-bench/ubuntu-24-04:.*", "trixie",
            differences="Terminal-Bench 1 ubuntu-24-04 base: Debian trixie (see ubuntu:24.04), without tmux and asciinema"),
)
"""Registry images and the stand-in that replaces each, first match wins."""

DEFAULT_BOOTSTRAP_TAGS = (
    "python:3.13-slim-bookworm", "python:3.13-slim", "python:3.12-slim-bookworm", "python:3.11-slim-bookworm",
    "python:3.11-slim", "debian:bookworm", "debian:bookworm-slim", "debian:trixie", "ubuntu:24.04", "ubuntu:22.04",
    "ghcr.io/laude-institute/t-bench/python-3-13:20250620", "ghcr.io/laude-institute/t-bench/ubuntu-24-04:latest",
)
"""Names ``t1async images bootstrap`` tags by default (others are tagged on first use)."""


def normalise(ref: str) -> str:
    """``ref`` without a ``docker.io/`` / ``docker.io/library/`` / ``library/`` prefix, ``:latest`` added if untagged."""
    for prefix in ("docker.io/library/", "docker.io/", "library/", "index.docker.io/library/"):
        if ref.startswith(prefix):
            ref = ref[len(prefix):]
            break
    if "@" in ref:
        ref = ref.split("@", 1)[0]
    last = ref.rsplit("/", 1)[-1]
    return ref if ":" in last else ref + ":latest"


def qualified(ref: str) -> str:
    """The fully qualified name a short reference resolves to (``python:3.13`` ->
    ``docker.io/library/python:3.13``), so ``FROM`` finds the local tag without a registry."""
    ref = normalise(ref)
    first = ref.split("/", 1)[0]
    if "/" not in ref:
        return f"docker.io/library/{ref}"
    if "." in first or ":" in first or first == "localhost":
        return ref
    return f"docker.io/{ref}"


def stand_in_for(ref: str) -> StandIn | None:
    """The stand-in rule for the image ``ref``, or None."""
    name = normalise(ref)
    for rule in STAND_INS:
        if re.fullmatch(rule.pattern, name) or re.fullmatch(rule.pattern, name.removesuffix(":latest")):
            return rule
    return None


def rootfs_tag(rule: StandIn) -> str:
    """Local tag of the root filesystem a stand-in is imported as."""
    suffix = "-".join((rule.suite, *rule.extra))
    return f"{BASE_REPO}/{suffix}:{ROOTFS_VERSION}"


def ensure_base(engine: Engine, ref: str, *, bootstrap_missing: bool = False) -> str:
    """Make ``ref`` resolvable locally (:func:`ensure_base_id`). Returns ``ref``."""
    ensure_base_id(engine, ref, bootstrap_missing=bootstrap_missing)
    return ref


def ensure_base_id(engine: Engine, ref: str, *, bootstrap_missing: bool = False) -> str:
    """Make ``ref`` resolvable locally: present, or tagged from its stand-in's root filesystem
    (bootstrapped first when ``bootstrap_missing``). Returns the image ID it resolves to.

    Raises:
        SandboxError: missing, with no stand-in (or its root filesystem not bootstrapped); the
            message says to run ``t1async images bootstrap`` or pull it.
    """
    found = engine.image_id(ref) or engine.image_id(qualified(ref))
    if found:
        return found
    rule = stand_in_for(ref)
    if rule is None:
        raise SandboxError(f"base image {ref!r} is not in local storage and t1async has no stand-in for it: "
                           f"`{engine.name} pull {ref}` where a registry is reachable")
    base = rootfs_tag(rule)
    if not engine.image_exists(base):
        if not bootstrap_missing:
            raise SandboxError(f"base image {ref!r} is not in local storage: run `t1async images bootstrap` (builds a "
                               f"Debian {rule.suite} stand-in offline) or `{engine.name} pull {ref}`")
        build_rootfs(engine, rule)
    engine.run("tag", base, qualified(ref), timeout_s=60)
    logger.info("{} stands in for {}: {}", base, ref, rule.differences)
    return engine.image_id(base)


def build_rootfs(engine: Engine, rule: StandIn, *, mirror: str = DEBIAN_MIRROR, log: Path | None = None) -> float:
    """mmdebstrap a root filesystem for ``rule`` and import it as :func:`rootfs_tag`; seconds taken.

    Raises:
        SandboxUnavailable: mmdebstrap is not installed.
        BuildError: mmdebstrap or the import failed.
    """
    if shutil.which("mmdebstrap") is None:
        raise SandboxUnavailable("mmdebstrap not found: `apt-get install mmdebstrap` (tools/setup.sh does it)")
    started = time.monotonic()
    packages = ",".join(BOOTSTRAP_PACKAGES + rule.extra)
    hooks = [
        'rm -f "$1"/usr/lib/python3*/EXTERNALLY-MANAGED',  # pip may install system-wide, as in python images
        'mkdir -p "$1"/usr/local/bin && ln -sf /usr/bin/python3 "$1"/usr/local/bin/python3 && '
        'ln -sf /usr/bin/python3 "$1"/usr/local/bin/python && ln -sf /usr/bin/pip3 "$1"/usr/local/bin/pip',
        'rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin',
        f'{shlex.quote(sys.executable)} -c {shlex.quote(PIP_RECORDS_SCRIPT)} "$1"',  # pip may upgrade them
    ]
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="t1async-rootfs-", dir=CACHE_DIR) as tmp:
        tar = Path(tmp) / "rootfs.tar"
        argv = ["mmdebstrap", "--variant=minbase", f"--include={packages}",
                "--dpkgopt=path-exclude=/usr/share/doc/*", "--dpkgopt=path-exclude=/usr/share/man/*",
                "--dpkgopt=path-exclude=/usr/share/locale/*", "--dpkgopt=path-include=/usr/share/doc/*/copyright",
                *[f"--customize-hook={hook}" for hook in hooks], rule.suite, str(tar), mirror]
        done = subprocess.run(argv, capture_output=True, timeout=1800)
        text = (done.stdout + done.stderr).decode("utf-8", "replace")
        if log is not None:
            with open(log, "a") as handle:
                handle.write(f"$ {' '.join(argv)}\n{text}\n")
        if done.returncode != 0:
            raise BuildError(f"mmdebstrap {rule.suite} failed (exit {done.returncode}): {text.strip()[-1000:]!r}")
        changes = ["ENV LANG=C.UTF-8", "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                   'CMD ["bash"]']
        engine.run("import", *[opt for change in changes for opt in ("--change", change)], str(tar), rootfs_tag(rule),
                   timeout_s=600)
    return time.monotonic() - started


@dataclass
class BootstrapReport:
    """What ``t1async images bootstrap`` did.

    Attributes:
        built: root filesystems built, {tag: seconds}.
        tagged: {image name: (stand-in tag, differences from the official image)}.
        present: names already in local storage (left alone: a pulled real image wins).
    """

    built: dict[str, float] = field(default_factory=dict)
    tagged: dict[str, tuple[str, str]] = field(default_factory=dict)
    present: list[str] = field(default_factory=list)


def bootstrap(engine: Engine, names: list[str], *, mirror: str = DEBIAN_MIRROR, rebuild: bool = False,
              log: Path | None = None) -> BootstrapReport:
    """Build the stand-in root filesystems ``names`` need and tag each name (see the module docstring).

    Raises:
        SandboxError: a name has no stand-in (the message lists the patterns), or a build failed.
    """
    report = BootstrapReport()
    rules = {}
    for ref in names:
        rule = stand_in_for(ref)
        if rule is None:
            raise SandboxError(f"no stand-in for {ref!r}; known patterns: {', '.join(r.pattern for r in STAND_INS)}")
        rules[ref] = rule
    for rule in dict.fromkeys(rules.values()):
        tag = rootfs_tag(rule)
        if rebuild or not engine.image_exists(tag):
            with _build_lock(tag):
                if rebuild or not engine.image_exists(tag):
                    report.built[tag] = round(build_rootfs(engine, rule, mirror=mirror, log=log), 1)
    for ref, rule in rules.items():
        target = qualified(ref)
        if not rebuild and engine.image_exists(target) and not _is_stand_in(engine, target):
            report.present.append(ref)
            continue
        engine.run("tag", rootfs_tag(rule), target, timeout_s=60)
        report.tagged[ref] = (rootfs_tag(rule), rule.differences)
    return report


def _is_stand_in(engine: Engine, ref: str) -> bool:
    """Whether ``ref`` is a tag of a bootstrapped root filesystem (this version's or an older
    one's, which a new bootstrap replaces), rather than a pulled image, which it leaves alone."""
    image_id = engine.image_id(ref)
    listed = engine.run("images", "--no-trunc", "--format", "{{.ID}} {{.Repository}}", check=False, timeout_s=60)
    ours = {line.split()[0].removeprefix("sha256:") for line in listed.stdout.decode().splitlines()
            if len(line.split()) == 2 and line.split()[1].startswith(BASE_REPO + "/")}
    return bool(image_id) and image_id in ours
