"""The sandbox contract: one isolated, persistent shell per episode, whatever runs it.

Every backend (see :data:`t1async.envs.sandboxes.sandbox.SANDBOXES`) implements :class:`Sandbox`: start a
shell, run commands in it (cwd and exported variables carry over, per-command timeouts kill the
whole process tree, output bounded with a visible marker), move files in and out, close. The
episode code (:mod:`t1async.envs.terminal`) talks to a sandbox only through this Protocol, so a
task runs unchanged on bubblewrap here or on Modal in the cloud.

Paths passed to :meth:`Sandbox.put`, :meth:`Sandbox.clear` and :meth:`Sandbox.read` are paths
*inside* the sandbox, under one of the three roots every backend provides:

* ``/app``   the episode's workspace (the agent's working directory);
* ``/tests`` the verifier's files: empty while the agent acts, staged by the host before
  verification (read-only to the agent on backends that can enforce it);
* ``/logs``  where verifiers write (``/logs/verifier/reward.txt``, the test output).
"""

from __future__ import annotations

import posixpath
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, Sequence, runtime_checkable

ROOTS = ("/app", "/tests", "/logs")
"""Sandbox folders the host may put files into, clear or read from."""

SANDBOX_BIN = "/opt/t1async/bin"
"""Folder inside a local sandbox holding ``python3``/``python`` symlinks to the host's
interpreter; first on ``PATH``."""


@dataclass
class CommandResult:
    """Result of one command run in a sandbox's persistent shell.

    Attributes:
        output: stdout and stderr merged, decoded as UTF-8 (errors replaced); longer than the
            sandbox's ``max_output_bytes`` it keeps head and tail around a visible
            ``[... truncated N bytes ...]`` marker. Notes from the sandbox (timeout, restart, a
            limit that refused something) are appended on their own line in square brackets.
        exit_code: the command's exit status; 124 when it timed out.
        timed_out: the command overran its timeout and its processes were killed.
        truncated: bytes were dropped from ``output``.
        seconds: wall time of the round trip, seconds.
        refused: short names of the limits this command ran into, e.g. ``("processes",
            "memory")`` (empty when none; also reported in ``output``).
    """

    output: str
    exit_code: int
    timed_out: bool
    truncated: bool
    seconds: float
    refused: tuple[str, ...] = ()


class SandboxError(RuntimeError):
    """The sandbox failed or died; the message says what happened and what to do."""


class SandboxUnavailable(SandboxError):
    """The backend cannot run here (bubblewrap missing, no Modal credentials or network...)."""


@dataclass
class SandboxLimits:
    """Resource limits of one sandbox (all of its processes together unless said otherwise).

    Attributes:
        cpus: CPU share, cores (cgroup ``cpu`` quota); 0 = unlimited.
        memory_mb: memory of every process plus files written to the sandbox's tmpfs folders,
            MiB (cgroup ``memory``; RLIMIT_AS per process without cgroups); 0 = unlimited.
        max_processes: processes and threads alive at once (cgroup ``pids``; RLIMIT_NPROC of the
            sandbox uid without cgroups); 0 = unlimited.
        cpu_time_s: CPU seconds any one process may use (RLIMIT_CPU); 0 = unlimited.
        max_file_mb: largest file a process may write, MiB (RLIMIT_FSIZE); 0 = unlimited.
        disk_mb: size of the workspace /app (and of /tmp, HOME and /logs each), MiB: a tmpfs of
            that size where the host allows mounts, else only ``max_file_mb`` holds; 0 = unlimited.
    """

    cpus: float = 1.0
    memory_mb: int = 2048
    max_processes: int = 256
    cpu_time_s: int = 600
    max_file_mb: int = 512
    disk_mb: int = 1024


@dataclass(frozen=True)
class ServiceSpec:
    """An extra service of a task's docker-compose.yaml (a sidecar beside the agent's container,
    e.g. an API server the agent talks to), as the ``container`` backend starts it.

    The backend runs it in the agent container's network namespace (no network of its own, as
    the agent's) and maps its name to 127.0.0.1 in the agent's ``/etc/hosts``, so
    ``http://NAME:PORT`` reaches it as on a Compose network (two services must not listen on one
    port).

    Attributes:
        name: the compose service name (also its host name for the agent).
        dockerfile: its Dockerfile (``build.dockerfile``, default ``Dockerfile`` in the context), or None.
        context_dir: its build context (``build`` / ``build.context``), or None with ``image``.
        image: ``image`` when it is not built.
        command: ``command`` as an argv (a string one runs under ``sh -c``), or None: the image's own.
        environment: its ``environment`` entries.
        healthcheck: ``healthcheck.test`` as an argv run inside the service, or None.
        wait_healthy: the agent's service ``depends_on`` it with ``condition: service_healthy``:
            the episode starts only once the health check passes.
        health_interval_s, health_retries, health_start_period_s: the health check's schedule.
    """

    name: str
    dockerfile: Path | None = None
    context_dir: Path | None = None
    image: str = ""
    command: tuple[str, ...] | None = None
    environment: tuple[tuple[str, str], ...] = ()
    healthcheck: tuple[str, ...] | None = None
    wait_healthy: bool = False
    health_interval_s: float = 2.0
    health_retries: int = 15
    health_start_period_s: float = 0.0


@dataclass
class SandboxSpec:
    """Everything a backend needs to create one episode's sandbox.

    Attributes:
        episode_dir: host scratch folder of this episode (created by the caller; the local
            backend keeps ``app/``, ``tests/`` and ``logs/`` in it).
        allow_network: give the sandbox network access (the task's ``allow_internet``).
        command_timeout_s: default per-command timeout, seconds.
        max_output_bytes: longest output returned per command, bytes (head and tail kept).
        env: variables set on top of :func:`sandbox_environment` when the shell starts.
        limits: resource limits.
        workdir: the shell's starting directory (``/app`` or a folder under it locally).
        dockerfile: the task's Dockerfile, for backends that build images (Modal); None if absent.
        context_dir: the Dockerfile's build context (COPY sources), or None.
        docker_image: a prebuilt image name (``[environment] docker_image``), or "".
        name: a short label for logs and cloud dashboards (the task's name).
        container: settings of the ``container`` backend (:class:`~t1async.config.ContainerConfig`;
            None: its defaults). Other backends ignore it.
        log_dir: where a backend that builds images writes ``build.log`` (None: nowhere).
        writable: top-level folders outside the system ones (``/db``, ``/data``...) that the task
            writes: the ``local`` backend gives each a private, size-capped tmpfs (images that
            build them need no such help).
        verifier_debs, verifier_requirements: what the task's test script would install at test
            time (Debian packages, Python requirements), for backends that can pre-install it in
            a verifier layer (``container``); ``verifier_requirements`` None: no layer.
        verifier_optional_debs: ``apt-get install`` lines of the test script whose failure the
            script survives (no ``set -e`` in effect, or the line guarded by ``||``/``&&``/``if``):
            each group is installed with its failure tolerated, as the script would run past it.
        services: the task's extra compose services (:class:`ServiceSpec`), started beside the
            agent's container by the ``container`` backend (the ``local`` backend refuses such
            tasks).
        host_mounts: (host path, path inside) pairs the ``container`` backend binds read-only: what a named
            harness borrows of the host (t1async/rollout/harnesses.py :func:`container_plan`). Other backends
            ignore it (bubblewrap shares ``/usr`` and the Python already).
        host_ports: host loopback TCP ports the ``container`` backend serves on the container's own loopback
            at the same numbers (:mod:`t1async.envs.sandboxes.loopback_relay`): the rollout actor's agent
            endpoint, for a named harness. The container's network is otherwise unchanged.
    """

    episode_dir: Path
    allow_network: bool = False
    command_timeout_s: float = 10.0
    max_output_bytes: int = 2048
    env: dict[str, str] = field(default_factory=dict)
    limits: SandboxLimits = field(default_factory=SandboxLimits)
    workdir: str = "/app"
    dockerfile: Path | None = None
    context_dir: Path | None = None
    docker_image: str = ""
    name: str = "episode"
    container: Any = None
    log_dir: Path | None = None
    writable: tuple[str, ...] = ()
    verifier_debs: tuple[str, ...] = ()
    verifier_requirements: tuple[str, ...] | None = None
    verifier_optional_debs: tuple[tuple[str, ...], ...] = ()
    services: tuple[ServiceSpec, ...] = ()
    host_mounts: tuple[tuple[str, str], ...] = ()
    host_ports: tuple[int, ...] = ()


@runtime_checkable
class Sandbox(Protocol):
    """One isolated, persistent shell for one episode. Not thread-safe: one caller at a time.

    Backends also provide ``from_spec(spec: SandboxSpec) -> Sandbox`` (a classmethod) and a
    class attribute ``builds_image``: True when the backend builds the task's Dockerfile itself
    (Modal); False when the episode code applies the supported subset through :meth:`exec` and
    :meth:`put` (local).
    """

    builds_image: bool

    def start(self) -> None:
        """Start the sandbox and its shell (in ``spec.workdir``). Raises :class:`SandboxError`."""
        ...

    def exec(self, command: str, timeout_s: float | None = None) -> CommandResult:
        """Run ``command`` in the one persistent shell; ``timeout_s`` overrides the default."""
        ...

    def put(self, sources: Sequence[Path], dest: str) -> None:
        """Copy host files/folders into the sandbox with Docker ``COPY`` semantics: a file goes
        to ``dest`` (or into it when ``dest`` ends in ``/`` or is a folder); a folder's contents
        are merged into ``dest``. ``dest`` lies under one of :data:`ROOTS`; the copies belong
        to the sandbox's user."""
        ...

    def clear(self, path: str) -> None:
        """Remove everything inside the folder ``path`` (under :data:`ROOTS`; created if
        missing), whatever the agent did to it (symlinks are removed, never followed)."""
        ...

    def read(self, path: str, max_bytes: int) -> bytes:
        """The last ``max_bytes`` of the regular file ``path`` (under :data:`ROOTS`); ``b""``
        when it is missing or not a regular file (a symlink is never followed)."""
        ...

    def end_agent(self) -> int:
        """Kill every process the agent left running except the shell (before the verifier runs,
        so nothing of the agent's can tamper with the tests or their output); returns how many."""
        ...

    def close(self) -> None:
        """Kill everything in the sandbox and release its resources. Idempotent."""
        ...


def bash_quote(text: str) -> str:
    """Quote ``text`` as a one-line bash ANSI-C string (``$'...'``) that evaluates to it exactly.

    NUL characters are dropped (bash cannot hold them); non-ASCII text is written as UTF-8
    ``\\xHH`` escapes, so the result is printable ASCII without newlines.
    """
    out = ["$'"]
    for byte in text.encode("utf-8", errors="replace"):
        if byte == 0:
            continue
        if byte in (0x27, 0x5C):  # ' and \
            out.append("\\" + chr(byte))
        elif 0x20 <= byte < 0x7F:
            out.append(chr(byte))
        else:
            out.append(f"\\x{byte:02x}")
    out.append("'")
    return "".join(out)


def sandbox_environment() -> dict[str, str]:
    """The environment every sandbox shell starts with (before a task's ``ENV`` overrides)."""
    python_bin = str(Path(sys.executable).parent) if sys.executable else "/usr/bin"
    return {
        "PATH": f"{SANDBOX_BIN}:{python_bin}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": "/root",
        "SHELL": "/bin/bash",
        "LANG": "C.UTF-8",
        "TERM": "dumb",
        "PAGER": "cat",
        "GIT_PAGER": "cat",
        "DEBIAN_FRONTEND": "noninteractive",
        "PYTHONUNBUFFERED": "1",
        "TMPDIR": "/tmp",
        "TEST_DIR": "/tests",  # Terminal-Bench 1 test scripts read it
        # The host's site-packages carry heavy pytest plugins (hypothesis alone costs ~1.5 s per
        # run); verifiers use plain pytest, so autoloading them only slows every verification.
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
    }


def split_root(path: str) -> tuple[str, str]:
    """Split an absolute sandbox path into (root in :data:`ROOTS`, relative rest).

    Raises:
        SandboxError: the path is not under /app, /tests or /logs, or climbs out with ``..``.
    """
    norm = posixpath.normpath(path)
    for root in ROOTS:
        if norm == root or norm.startswith(root + "/"):
            rest = norm[len(root):].lstrip("/")
            return root, rest
    raise SandboxError(f"sandbox path {path!r} is not under {', '.join(ROOTS)}")
