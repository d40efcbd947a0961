"""OCI images for the ``container`` sandbox: the engine and the cached, locked image build that
task images (:mod:`.task_images`) and stand-ins (:mod:`.stand_ins`) share.

**Engine** (:func:`resolve_engine`): ``podman`` (driven as ``podman --runtime runc
--cgroup-manager cgroupfs``, see :class:`~t1async.config.ContainerConfig`) or ``docker``; both
are called with the same sub-commands (``build``, ``run``, ``exec``, ``image exists``/``image
inspect``, ``tag``, ``import``, ``rm``).

**Task images** (:func:`~t1async.envs.images.task_images.ensure_task_image`): the task's own Dockerfile and build context, tagged
``localhost/t1async-task/<name>:<hash>`` where the hash (sha256, 16 hex digits) covers the
Dockerfile, every file of the context (path, executable bit, bytes; ``.git`` skipped), the
image IDs its ``FROM`` names resolve to and the build options, so an unchanged task is built once
and a changed one, or one whose base image changed (a new bootstrap, a pulled real image), is
rebuilt. Before the
build: ``COPY``/``RUN`` heredocs are rewritten (:func:`~t1async.envs.taskio.dockerfile.expand_heredocs`: podman 4.3's buildah
lacks them), each ``FROM`` image missing locally is replaced by its bootstrapped stand-in
(:func:`~t1async.envs.images.stand_ins.ensure_base`), and the host CA bundle is mounted (podman ``build -v``; TLS to package
indexes is intercepted on some hosts) with pip and uv pointed at it. Builds run with the same
explicit ulimits as containers. A build lock (``fcntl`` on a file in the cache folder) makes
concurrent episodes of one task build it once.

**Verifier layer** (:func:`~t1async.envs.images.task_images.ensure_verifier_image`): ``FROM`` the task image, the Debian packages
and Python requirements the task's test script would install at test time, installed at build
time into ``/opt/t1async-verifier`` (a venv with ``--system-site-packages``, so the tests see
the image's own packages as the test script's environment would, plus pytest). The venv's own
pip is removed again once they are in (unless a test script installs pip itself), so that a test
running ``python -m pip`` gets the image's pip, in whatever state the agent left it, as the
harness's test run would. Cached by hash too. Network is then needed only at build time.

**Stand-ins** (:mod:`.stand_ins`): with no registry reachable, ``t1async images bootstrap`` builds local
images that stand in for the base images tasks name (Debian root filesystems from
``mmdebstrap``, CPython built from source where the official image has python.org's, the
official image's ``WORKDIR``) and tags them under those names; docs/images.md lists what differs.

**Build failures** (:class:`BuildError`): the message names the failing step (Dockerfile line and
instruction) and its first error line (:func:`summarise_build_failure`); the whole log is kept
in a file named in the message.

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
import shutil
import subprocess
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Iterator

from loguru import logger

from t1async.config import ContainerConfig

from ..protocol import SandboxError, SandboxUnavailable
from ..taskio.dockerfile import dockerfile_instructions

ENGINE_CWD = tempfile.gettempdir()
"""Working directory of every engine process (podman/docker and the conmon it starts): on an
out-of-memory kill conmon writes a file ``oom`` into it (measured: tests run from a checkout left
an empty ``oom`` in the checkout), so never the caller's folder."""

CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "t1async" / "images"
"""Build locks and bootstrap scratch space."""

TASK_REPO = "localhost/t1async-task"
"""Repository of task images (``<TASK_REPO>/<name>:<hash>``)."""

VERIFIER_DIR = "/opt/t1async-verifier"
"""Venv of the verifier layer inside a container (its ``bin/python`` runs the tests)."""

DEBIAN_MIRROR = "http://deb.debian.org/debian"
HOST_CA_FILES = ("/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt")
PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy")
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
            text = ((done.stderr or b"").decode("utf-8", "replace").strip()
                    or (done.stdout or b"").decode("utf-8", "replace").strip())
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


_STEP = re.compile(r"^(?:\[(\d+)/\d+\] )?STEP (\d+)/(\d+): (.*)$")
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_ERROR_LINE = re.compile(
    r"^(?:E: |ERROR[: ]|error[: ]|Error: (?!building at STEP|error building)|fatal: |FATAL|npm ERR!|dpkg: error|"
    r"make: \*\*\*|\w*(?:Error|Exception): |.*: not found$|.*: No such file or directory|.*: error: |"
    r".*Unable to locate package|.*has no installation candidate|.*Permission denied)")


def summarise_build_failure(dockerfile_text: str, output: str) -> str:
    """One line saying where a build failed and why, from the Dockerfile and the build's output.

    Returns:
        ``step S/N (Dockerfile line L: INSTRUCTION): FIRST ERROR LINE``, the instruction cut at
        160 characters and the error line at 300; the step part is left out when the output has
        no ``STEP`` line, and the error is the engine's own last ``Error:`` line, else the last
        output line, when no line after the failing step looks like an error (``E: ...``,
        ``ERROR: ...``, ``...Error: ...``, ``...: not found``, ...). Never raises.
    """
    lines = [_ANSI.sub("", part).strip() for raw in output.splitlines() for part in raw.split("\r")]
    lines = [line for line in lines if line]
    where, after = "", 0
    for number, line in enumerate(lines):
        match = _STEP.match(line)
        if match:
            stage, step, steps, shown = int(match.group(1) or 1), int(match.group(2)), match.group(3), match.group(4)
            after = number + 1
            stages = dockerfile_instructions(dockerfile_text)
            found = stages[stage - 1][step - 1] if stage <= len(stages) and step <= len(stages[stage - 1]) else None
            if found and found[1].split(" ", 1)[0].upper() == shown.split(" ", 1)[0].upper():
                where = f"step {step}/{steps} (Dockerfile line {found[0]}: {_cut(found[1], 160)})"
            else:
                where = f"step {step}/{steps} ({_cut(shown, 160)})"
    tail = lines[after:]
    error = next((line for line in tail if _ERROR_LINE.match(line)), "")
    if not error:
        engine_errors = [line for line in tail if line.lower().startswith(("error", "time=")) and "error" in line.lower()]
        error = engine_errors[-1] if engine_errors else (tail[-1] if tail else (lines[-1] if lines else "no output"))
    return f"{where}: {_cut(error, 300)}" if where else _cut(error, 300)


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _failure_log(tag: str, dockerfile_text: str, output: str) -> Path:
    """Write a failed build's Dockerfile and output to a file under ``CACHE_DIR/logs``; its path."""
    folder = CACHE_DIR / "logs"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', tag)}-{time.strftime('%Y%m%d-%H%M%S')}.log"
    path.write_text(f"# Dockerfile as built:\n{dockerfile_text}\n{output}\n")
    return path


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
           log: Path | None, *, source_text: str | None = None, timeout_s: float | None = None) -> None:
    """``<engine> build`` of ``dockerfile_text`` in a copy of ``context_dir`` (plus ``files``),
    tagged ``tag``; the build log goes to ``log`` (appended) when given, else to a file under
    ``CACHE_DIR/logs`` when the build fails.

    Args:
        source_text: the Dockerfile as the task wrote it (before :func:`expand_heredocs`), whose
            line numbers a failure names; default ``dockerfile_text``.
        timeout_s: limit on the build; default ``engine.cfg.build_timeout_s``.

    Raises:
        BuildError: the build failed or timed out; the message is one line from
            :func:`summarise_build_failure` plus where the full log is.
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
                done = engine.run(*args, str(context), timeout_s=timeout_s or cfg.build_timeout_s, check=False,
                                  stdout=output)
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
            if log is None:
                log = _failure_log(tag, dockerfile_text, text)
            status = f"exit {code}" if isinstance(code, int) else code
            raise BuildError(f"image build of {tag} failed ({status}): "
                             f"{summarise_build_failure(source_text or dockerfile_text, text)} (full log: {log})")
        logger.info("built {} in {:.1f} s", tag, time.monotonic() - started)
