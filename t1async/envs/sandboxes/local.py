"""The ``local`` sandbox backend: a persistent ``bash`` under bubblewrap, as an unprivileged uid.

What the shell sees:

* ``/app``   the episode's workspace (a host folder; a ``disk_mb`` tmpfs where mounts are
  allowed), read-write;
* ``/tests`` a host staging folder, read-only, empty while the agent acts, filled for the verifier;
* ``/logs``  a host folder (tmpfs like /app), read-write (``/logs/verifier/reward.txt``);
* ``/usr`` read-only, ``/bin``, ``/lib``, ``/lib64``, ``/sbin`` as symlinks into it, a curated
  list of ``/etc`` entries, fresh ``/proc``, ``/dev``, and size-capped tmpfs ``/tmp``,
  ``/dev/shm``, ``/root`` (HOME; mode 1777), ``/var/tmp``, ``/run``, and private writable
  size-capped tmpfs folders where tasks write outside /app: :data:`WRITABLE` always, plus the
  task's own top-level folders (``writable``, e.g. ``/db``); ``/`` itself read-only;
* the Python running t1async (its prefixes, read-only, at their host paths), so that
  ``python3 -m pytest`` works inside with the host's pytest; ``python3`` comes first on ``PATH``.

Nothing else of the host is visible (not ``/root``'s files, ``/work``, the repository, ``~/.ssh``).

**Who the shell is.** When t1async runs as host root (this machine), bubblewrap runs privileged
(no user namespace: PID, IPC, UTS, network and cgroup namespaces only) so that root builds the
mounts, including the host Python under ``/root/.pyenv`` that a uid-65534 process could not reach
(``/root`` is mode 700); then ``setpriv`` switches to ``run_as`` (default 65534, ``nobody``),
clears the supplementary groups and empties every capability set including the bounding set,
and execs the shell. ``no_new_privs`` (set by bubblewrap) keeps setuid binaries from regaining
anything. The shell is thus a real unprivileged host uid: the kernel enforces file permissions
against it, and RLIMIT_NPROC would apply (unlike uid 0 in a user namespace, which maps back to
host root). The workspace and logs belong to that uid. As a non-root host user, bubblewrap
runs in a user namespace as that user (already unprivileged), as before.

**Limits** (:mod:`t1async.envs.sandboxes.limits`): cgroup v1 ``pids``/``memory``/``cpu`` groups per sandbox
where writable, tmpfs disks, RLIMIT_CPU/RLIMIT_FSIZE (and RLIMIT_AS/NPROC without cgroups). A
command that hits a limit gets a note (``[refused: ...]``) and ``CommandResult.refused``.

**Timeouts**: when a command overruns, every process in the sandbox's PID namespace other than
its init and the shell is SIGKILLed (``setsid`` and double-forked daemons included); the result
has ``exit_code`` 124 and ``timed_out``. If the shell itself does not come back, or exits, the
whole sandbox is restarted: a NEW shell in the start folder with the starting environment (the
output says so). :meth:`LocalSandbox.close` kills the PID namespace (every process in it).
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from loguru import logger

from ..protocol import (
    SANDBOX_BIN,
    CommandResult,
    SandboxError,
    SandboxLimits,
    SandboxSpec,
    sandbox_environment,
    split_root,
)
from .hostfs import _chown_tree, _etc_entries, _python_paths, _read_tail, check_local_available
from .limits import LimitGroup
from .shell_io import EOF as _EOF
from .shell_io import TIMEOUT as _TIMEOUT
from .shell_io import OutputBuffer, Sentinel, close_pipes, kill_repeatedly, process_status, read_to_marker, write_all

WRITABLE = ("/srv", "/mnt", "/data", "/var/lib", "/var/log", "/var/cache")
"""Folders every local sandbox has as private, writable, size-capped tmpfs (empty at start; the host's
are never visible): tasks write there as root would in their container."""

SANDBOX_UID = 65534
"""Host uid (and gid) the shell runs as when t1async runs as root: ``nobody``."""

KILL_GRACE_S = 2.0
"""After a timeout kill, how long to wait for the shell's sentinel before restarting the sandbox."""

START_TIMEOUT_S = 15.0
"""Bound on starting bwrap and getting the first answer from the shell."""


def _venv_argv() -> list[str]:
    """bwrap options that make ``/opt/t1async/bin/python3`` the interpreter whose packages the task
    adaptation checked (``importlib.metadata`` of the running Python) when t1async runs from a
    virtual environment: Python finds a venv by the ``pyvenv.cfg`` one folder above the path it
    was started by (not its symlink target), so the venv's ``pyvenv.cfg`` is bound at
    ``/opt/t1async/pyvenv.cfg`` and ``/opt/t1async/lib`` points at the venv's ``lib``. Without this,
    the symlink ran the base interpreter, whose packages may differ (no pytest: every verifier fails)."""
    prefix = Path(sys.prefix)
    if sys.prefix == sys.base_prefix or not (prefix / "pyvenv.cfg").is_file():
        return []
    argv = ["--ro-bind", str(prefix / "pyvenv.cfg"), "/opt/t1async/pyvenv.cfg"]
    for name in ("lib", "lib64"):
        if (prefix / name).is_dir():
            argv += ["--symlink", str((prefix / name).resolve()), f"/opt/t1async/{name}"]
    return argv


class LocalSandbox:
    """The ``local`` backend: a persistent ``bash`` under bubblewrap (see the module docstring).

    Args:
        workspace: host folder bound read-write at ``/app`` (created if missing).
        tests_dir: host staging folder bound read-only at ``/tests`` (created if missing).
        logs_dir: host folder bound read-write at ``/logs`` (created if missing).
        allow_network: keep the host's network (and ``/etc/resolv.conf``); default: only ``lo``.
        command_timeout_s: default per-command timeout, seconds.
        max_output_bytes: longest output returned per command, bytes (head and tail kept).
        env: variables set on top of :func:`sandbox_environment` when the shell starts (and
            restarts).
        limits: resource limits (default :class:`SandboxLimits`).
        workdir: where the shell starts (and restarts): ``/app`` or a folder under it.
        writable: extra top-level folders the task writes (see :data:`WRITABLE`).
        run_as: host uid/gid of the shell when t1async runs as root (default
            :data:`SANDBOX_UID`); None keeps the user-namespace mode (the shell is then uid 0
            mapped to host root: only for tests of that mode). Ignored when not root.

    Raises:
        SandboxUnavailable: from :meth:`start` when bubblewrap is missing or cannot run.
        SandboxError: from :meth:`start`/:meth:`exec` when the sandbox fails.
    """

    builds_image = False

    def __init__(
        self,
        workspace: Path,
        *,
        tests_dir: Path,
        logs_dir: Path,
        allow_network: bool = False,
        command_timeout_s: float = 10.0,
        max_output_bytes: int = 2048,
        env: dict[str, str] | None = None,
        limits: SandboxLimits | None = None,
        workdir: str = "/app",
        writable: Sequence[str] = (),
        run_as: int | None = SANDBOX_UID,
    ):
        if command_timeout_s <= 0:
            raise ValueError(f"command_timeout_s must be > 0, got {command_timeout_s}")
        if max_output_bytes < 64:
            raise ValueError(f"max_output_bytes must be >= 64, got {max_output_bytes}")
        if split_root(workdir)[0] != "/app":
            raise ValueError(f"workdir must be /app or under it, got {workdir!r}")
        self.workspace = Path(workspace).resolve()
        self.tests_dir = Path(tests_dir).resolve()
        self.logs_dir = Path(logs_dir).resolve()
        self.allow_network = allow_network
        self.command_timeout_s = command_timeout_s
        self.max_output_bytes = max_output_bytes
        self.workdir = workdir
        self.writable = tuple(dict.fromkeys((*WRITABLE, *writable)))
        self.privileged = os.geteuid() == 0 and run_as is not None
        self.uid = int(run_as) if self.privileged else os.geteuid()
        self.gid = int(run_as) if self.privileged else os.getegid()
        if self.privileged and self.uid == SANDBOX_UID:
            user = "nobody"
        else:
            user = "root" if not self.privileged and self.uid == 0 else str(self.uid)
        self.env = {**sandbox_environment(), "USER": user, "LOGNAME": user, **(env or {})}
        self.limits = limits or SandboxLimits()
        self._group = LimitGroup(self.limits, self.uid, self.gid)
        self._sentinel = Sentinel()
        self._proc: subprocess.Popen[bytes] | None = None
        self._init_pid: int | None = None  # host pid of the namespace's init (bwrap, ns pid 1)
        self._pidns: str | None = None
        self._shell_nspid: int | None = None
        self.restarts = 0
        """How many times the shell was restarted (after an exit or a stuck timeout)."""

    @classmethod
    def from_spec(cls, spec: SandboxSpec) -> LocalSandbox:
        """The sandbox of one episode: ``app/``, ``tests/``, ``logs/`` under ``spec.episode_dir``."""
        return cls(spec.episode_dir / "app", tests_dir=spec.episode_dir / "tests", logs_dir=spec.episode_dir / "logs",
                   allow_network=spec.allow_network, command_timeout_s=spec.command_timeout_s,
                   max_output_bytes=spec.max_output_bytes, env=spec.env, limits=spec.limits, workdir=spec.workdir,
                   writable=spec.writable)

    def mechanisms(self) -> dict[str, str]:
        """What enforces each limit in this sandbox (valid after :meth:`start`), plus the uid."""
        return {**self._group.mechanisms(), "uid": str(self.uid)}

    # ----------------------------------------------------------------------------- lifecycle

    def bwrap_argv(self, info_fd: int | None = None) -> list[str]:
        """The full ``bwrap`` command line of this sandbox (``info_fd``: for ``--info-fd``)."""
        argv = ["bwrap", "--die-with-parent", "--new-session"]
        if self.privileged:  # no user namespace: root sets up the mounts, setpriv drops to run_as
            argv += ["--unshare-ipc", "--unshare-pid", "--unshare-uts", "--unshare-cgroup-try"]
            if not self.allow_network:
                argv.append("--unshare-net")
            argv += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID",
                     "--cap-add", "CAP_SETPCAP"]
        else:
            argv += ["--unshare-all", "--cap-drop", "ALL"]
            if self.allow_network:
                argv.append("--share-net")
        argv += ["--ro-bind", "/usr", "/usr"]
        for name in ("bin", "lib", "lib64", "sbin"):
            host = Path("/") / name
            if host.is_symlink():
                argv += ["--symlink", os.readlink(host), f"/{name}"]
            elif host.is_dir():
                argv += ["--ro-bind", str(host), f"/{name}"]
        argv += ["--proc", "/proc", "--dev", "/dev"]
        for folder in ("/etc", "/var", "/opt", "/opt/t1async", SANDBOX_BIN):  # privileged bwrap: else 0700
            argv += ["--perms", "0755", "--dir", folder]
        size = str(int(self.limits.disk_mb) << 20) if self.limits.disk_mb else None
        for folder in ("/tmp", "/dev/shm", "/root", "/var/tmp", "/run", *self.writable):
            argv += ["--perms", "1777"] + (["--size", size] if size else []) + ["--tmpfs", folder]
        parents = {str(parent) for path in _python_paths() for parent in path.parents}
        for folder in sorted(parents - {"/", "/root", "/tmp", "/opt"}, key=lambda f: f.count("/")):
            argv += ["--perms", "0755", "--dir", folder]
        for entry in _etc_entries(self.allow_network):
            argv += ["--ro-bind", f"/etc/{entry}", f"/etc/{entry}"]
        argv += ["--symlink", "/proc/self/mounts", "/etc/mtab"]
        for path in _python_paths():
            argv += ["--ro-bind", str(path), str(path)]
        if sys.executable:
            for name in ("python3", "python"):
                argv += ["--symlink", sys.executable, f"{SANDBOX_BIN}/{name}"]
            argv += _venv_argv()
        argv += ["--bind", str(self.workspace), "/app"]
        argv += ["--ro-bind", str(self.tests_dir), "/tests"]
        argv += ["--bind", str(self.logs_dir), "/logs"]
        argv += ["--remount-ro", "/", "--chdir", self.workdir, "--clearenv"]
        for key, value in self.env.items():
            argv += ["--setenv", key, value]
        if info_fd is not None:
            argv += ["--info-fd", str(info_fd)]
        argv.append("--")
        if self.privileged:
            argv += ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--clear-groups",
                     "--inh-caps=-all", "--bounding-set=-all", "--"]
        argv += ["/bin/bash", "--noprofile", "--norc"]
        return argv

    def start(self) -> None:
        """Create the limits, start bwrap and the shell. Raises SandboxUnavailable/SandboxError."""
        if self._proc is not None:
            raise SandboxError("sandbox already started: call close() before starting it again")
        check_local_available()
        for folder in (self.workspace, self.tests_dir, self.logs_dir):
            folder.mkdir(parents=True, exist_ok=True)
        try:
            self._group.create()
            self._group.mount_disk([self.workspace, self.logs_dir])
            if self.privileged:
                for folder in (self.workspace, self.logs_dir):
                    _chown_tree(folder, self.uid, self.gid)
            workdir_host = self._host(self.workdir)
            workdir_host.mkdir(parents=True, exist_ok=True)
            if self.privileged:
                _chown_tree(workdir_host, self.uid, self.gid, recursive=False)
            self._spawn()
        except BaseException:
            self.close()
            raise

    def _spawn(self) -> None:
        read_fd, write_fd = os.pipe()
        try:
            self._proc = subprocess.Popen(
                self._group.wrapper() + self.bwrap_argv(write_fd),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                pass_fds=(write_fd,),
                start_new_session=True,  # a Ctrl-C to our process group does not reach it
            )
        finally:
            os.close(write_fd)
        try:
            info = self._read_info(read_fd)
        finally:
            os.close(read_fd)
        if info is None:
            output = self._drain_dead_output()
            self._kill()
            raise SandboxError(
                f"bubblewrap failed to start the sandbox for {self.workspace}: {output.strip()!r}; "
                "check that the workspace, tests and logs folders exist and that user namespaces are allowed"
            )
        self._init_pid = int(info["child-pid"])
        self._pidns = os.readlink(f"/proc/{self._init_pid}/ns/pid")
        status, output, _, _ = self._run_full("printf '%s\\n' \"$$\"", START_TIMEOUT_S, recover=False)
        if status != 0 or not output.strip().isdigit():
            self._kill()
            raise SandboxError(
                f"the sandbox shell did not answer at start (status {status}, output {output.strip()[:500]!r}); "
                "run the bwrap command from LocalSandbox.bwrap_argv() by hand to see why"
            )
        self._shell_nspid = int(output.strip())

    def _read_info(self, fd: int) -> dict | None:
        data = b""
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            data += chunk
        try:
            return json.loads(data) if data else None
        except json.JSONDecodeError:
            return None

    def _drain_dead_output(self) -> str:
        assert self._proc is not None and self._proc.stdout is not None
        try:
            self._proc.wait(timeout=5)
            return self._proc.stdout.read(8192).decode("utf-8", errors="replace")
        except (subprocess.TimeoutExpired, OSError):
            return "(no output)"

    def _kill(self) -> None:
        """SIGKILL the namespace's init (the kernel then kills every process in the namespace)
        and bwrap itself; reap; close pipes."""
        proc, self._proc = self._proc, None
        init, self._init_pid = self._init_pid, None
        try:  # only if that pid is still our namespace's init (never a recycled pid)
            if init is not None and os.readlink(f"/proc/{init}/ns/pid") == self._pidns:
                os.kill(init, signal.SIGKILL)
        except OSError:
            pass
        if proc is None:
            return
        try:
            proc.kill()
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            logger.warning("bwrap (pid {}) did not exit 10 s after SIGKILL", proc.pid)
        close_pipes(proc)

    def close(self) -> None:
        """Kill every process in the sandbox and bwrap itself; remove its cgroups and unmount its
        tmpfs folders (their files are gone). Idempotent."""
        self._kill()
        self._group.release()

    def __enter__(self) -> LocalSandbox:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _restart(self) -> None:
        logger.info("restarting the sandbox shell for {} (restart #{})", self.workspace, self.restarts + 1)
        self._kill()
        self.restarts += 1
        self._spawn()

    # ----------------------------------------------------------------------------- files

    def _host(self, path: str) -> Path:
        root, rest = split_root(path)
        base = {"/app": self.workspace, "/tests": self.tests_dir, "/logs": self.logs_dir}[root]
        return base / rest if rest else base

    def _safe_host(self, path: str) -> Path:
        """Host path of ``path``; raises SandboxError if a component on the way is a symlink
        (the agent could point it anywhere on the host)."""
        root, rest = split_root(path)
        host = self._host(root)
        for part in [p for p in rest.split("/") if p]:
            host = host / part
            if host.is_symlink():
                raise SandboxError(f"{path}: {host} is a symlink; refusing to follow it from the host side")
        return host

    def put(self, sources: Sequence[Path], dest: str) -> None:
        """Docker COPY of host ``sources`` to ``dest`` (see :meth:`Sandbox.put`), owned by the shell's uid."""
        target = self._safe_host(dest)
        into_folder = dest.endswith("/") or target.is_dir() or len(sources) > 1
        written: list[Path] = []
        for source in sources:
            if source.is_dir():
                shutil.copytree(source, target, symlinks=True, dirs_exist_ok=True)
                written.append(target)
            elif into_folder:
                target.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, target / source.name)
                written.append(target / source.name)
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, target)
                written.append(target)
        root = split_root(dest)[0]
        if self.privileged and root != "/tests":
            base = self._host(root)
            for path in written:
                _chown_tree(path, self.uid, self.gid)
            folder = target if into_folder else target.parent
            while folder != base and folder.is_relative_to(base):  # folders mkdir created
                os.chown(folder, self.uid, self.gid, follow_symlinks=False)
                folder = folder.parent

    def clear(self, path: str) -> None:
        """Empty the folder ``path`` from the host side (a symlink in its place is removed)."""
        root, rest = split_root(path)
        host = self._host(root)
        for part in [p for p in rest.split("/") if p]:
            host = host / part
            if host.is_symlink() or (host.exists() and not host.is_dir()):
                host.unlink()
            if not host.exists():
                host.mkdir()
                if self.privileged and root != "/tests":
                    os.chown(host, self.uid, self.gid)
        for entry in host.iterdir():
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()

    def read(self, path: str, max_bytes: int) -> bytes:
        """The last ``max_bytes`` of the regular file ``path`` (no symlink followed on the way)."""
        split_root(path)  # a path outside the roots is an error, not an empty file
        try:
            host = self._safe_host(path)
        except SandboxError:
            return b""
        return _read_tail(host, max_bytes)

    # ----------------------------------------------------------------------------- commands

    def exec(self, command: str, timeout_s: float | None = None) -> CommandResult:
        """Run ``command`` in the persistent shell (cwd and exported variables carry over).

        Args:
            command: bash source (any text: multi-line, heredocs; stdin is ``/dev/null``).
            timeout_s: seconds before every process of the command is killed (default: the
                sandbox's ``command_timeout_s``).

        Returns:
            The merged, bounded output and exit status (124 on timeout), with the limits it hit.

        Raises:
            SandboxError: the sandbox is not started or could not be restarted.
        """
        if self._proc is None:
            raise SandboxError("sandbox is not running: call start() before exec()")
        timeout = self.command_timeout_s if timeout_s is None else float(timeout_s)
        started = time.monotonic()
        notes: list[str] = []
        if self._proc.poll() is not None:
            notes.append("[the shell had died since the last command; a new shell was started]")
            self._restart()
        status, output, truncated, note = self._run_full(command, timeout)
        if note:
            notes.append(note)
        refused = self._group.refusals()
        if self._group.disk_full():
            refused.append("disk")
        if refused:
            notes.append(self._refusal_note(refused))
        timed_out = status == _TIMEOUT
        if notes:
            output = output + ("" if not output or output.endswith("\n") else "\n") + "\n".join(notes)
        exit_code = 124 if timed_out else int(status)
        return CommandResult(output, exit_code, timed_out, truncated, time.monotonic() - started, tuple(refused))

    def _refusal_note(self, refused: list[str]) -> str:
        what = {
            "processes": f"process limit ({self.limits.max_processes}) reached: new processes were refused",
            "memory": f"memory limit ({self.limits.memory_mb} MiB) reached: a process was killed",
            "disk": f"disk limit ({self.limits.disk_mb} MiB) reached: the workspace or logs are full",
        }
        return "[refused: " + "; ".join(what[r] for r in refused) + "]"

    def _run_full(self, command: str, timeout: float, recover: bool = True) -> tuple[int | str, str, bool, str]:
        """Send one command and read to its sentinel. Returns (status or _TIMEOUT, output,
        truncated, note); restarts the sandbox when the shell exits or stays stuck (if
        ``recover``; else returns _TIMEOUT/_EOF as the status)."""
        assert self._proc is not None
        deadline = time.monotonic() + timeout
        buf = OutputBuffer(self.max_output_bytes, self._sentinel.marker)
        status = self._write(self._sentinel.line(command), deadline)
        if status is None:
            status = self._read(buf, deadline)
        note = ""
        if not recover and not isinstance(status, int):
            return status, buf.result()[0], False, ""
        if status == _TIMEOUT:
            killed = self._kill_command_processes()
            after = self._read(buf, time.monotonic() + KILL_GRACE_S)
            note = f"[timed out after {timeout:g} s; killed {killed} process(es)]"
            if not isinstance(after, int):
                note = (
                    f"[timed out after {timeout:g} s and the shell did not come back; a new shell was "
                    f"started in {self.workdir}: exported variables, the working directory and background "
                    "processes were reset]"
                )
                self._restart()
        elif status == _EOF:
            code = self._proc.wait() if self._proc.poll() is None else self._proc.returncode
            status = code if code >= 0 else 128 - code
            note = (
                f"[the shell exited (status {status}); a new shell was started in {self.workdir}: exported "
                "variables, the working directory and background processes were reset]"
            )
            self._restart()
        output, truncated = buf.result()
        return status, output, truncated, note

    def _write(self, data: bytes, deadline: float) -> str | None:
        """Write ``data`` to the shell's stdin; returns _EOF/_TIMEOUT on failure, else None."""
        assert self._proc is not None and self._proc.stdin is not None
        return write_all(self._proc.stdin.fileno(), data, deadline)

    def _read(self, buf: OutputBuffer, deadline: float) -> int | str:
        """Read into ``buf`` until the sentinel (returns its status), EOF or the deadline."""
        assert self._proc is not None and self._proc.stdout is not None
        return read_to_marker(self._proc.stdout.fileno(), buf, deadline)

    def _namespace_pids(self) -> list[tuple[int, int]]:
        """(host pid, namespace pid) of every live process in the sandbox's PID namespace."""
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                if os.readlink(f"/proc/{entry}/ns/pid") != self._pidns:
                    continue
            except OSError:
                continue
            fields = process_status(entry)
            if fields is not None:
                found.append((int(entry), int(fields.get("NSpid", "0 0").split()[-1])))
        return found

    def end_agent(self) -> int:
        """Kill every process in the sandbox except init and the shell (see :class:`Sandbox`)."""
        if self._pidns is None:
            return 0
        return self._kill_command_processes()

    def _kill_command_processes(self) -> int:
        """SIGKILL every process in the namespace except init (ns pid 1) and the shell; repeat
        until none is left (bounded), so fast forkers are caught. Returns how many were killed."""
        return kill_repeatedly(lambda: [host for host, ns in self._namespace_pids() if ns not in (1, self._shell_nspid)],
                               KILL_GRACE_S)
