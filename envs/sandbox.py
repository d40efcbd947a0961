"""Sandboxes: one persistent, isolated shell per episode.

A :class:`Sandbox` runs shell commands for one episode in ONE long-lived ``bash``: the working
directory, exported variables and background jobs carry over between :meth:`Sandbox.exec` calls,
as in a terminal. Backends are listed in the literal registry :data:`SANDBOXES`.

The ``local`` backend (:class:`LocalSandbox`) runs that shell under bubblewrap (``bwrap``) with
every namespace unshared (no network unless allowed), all capabilities dropped and a new session.
What the shell sees:

* ``/app``   the episode's workspace (a host folder), read-write;
* ``/tests`` a host staging folder, read-only, empty while the agent acts, filled for the verifier;
* ``/logs``  a host folder, read-write (a verifier may write ``/logs/verifier/reward.txt``);
* ``/usr`` read-only, ``/bin``, ``/lib``, ``/lib64``, ``/sbin`` as symlinks into it, a curated
  list of ``/etc`` entries (never all of ``/etc``: the shell is root in a user namespace mapped to
  host root, and would own ``/etc/shadow``), fresh ``/proc``, ``/dev``, ``/tmp``;
* the Python running t1async (its prefixes, read-only, at their host paths), so that
  ``python3 -m pytest`` works inside with the host's pytest; ``python3`` comes first on ``PATH``.

Nothing else of the host is visible (not ``/root``, ``/work``, the repository, ``~/.ssh``).

Wire protocol with the shell: each command is sent as one line,
``eval $'<command>' </dev/null; printf '\\n%s%s %d\\n' <sentinel halves> "$?"``. The command is
quoted as an ANSI-C string, so no command text (an unclosed quote, a heredoc) can desynchronise
the shell; its stdin is ``/dev/null``, so it cannot eat the next command; the sentinel is random
per sandbox and is printed from two halves, so an ``set -x``/``set -v`` echo of the line never
contains it whole. Output is read with bounded memory (head and tail kept, the middle counted).

Timeouts: when a command overruns, every process in the sandbox's PID namespace other than its
init and the shell is SIGKILLed (``setsid`` and double-forked daemons included, they are in the
namespace too); the shell then prints the sentinel and the result has ``exit_code`` 124 and
``timed_out``. If the shell itself does not come back (a builtin loop, ``exec sleep``), or it
exits (``exit``, ``kill $$``, ``set -e`` and a failure), the whole sandbox is restarted: a NEW
shell in ``/app`` with the sandbox's starting environment; exported variables, the working
directory and background processes are lost, and the output says so.

Not enforced (yet): CPU, memory, disk and process-count limits (``/tmp`` and ``/`` are tmpfs in
host memory; RLIMIT_NPROC does nothing for host uid 0; cgroups would be the way).
"""

from __future__ import annotations

import fnmatch
import json
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from loguru import logger

SANDBOX_BIN = "/opt/t1async/bin"
"""Folder inside the sandbox holding ``python3``/``python`` symlinks to the host's interpreter;
first on ``PATH``."""

ETC_ENTRIES = (
    "passwd", "group", "hosts", "hostname", "host.conf", "nsswitch.conf", "gai.conf",
    "networks", "protocols", "services", "ld.so.cache", "ld.so.conf", "ld.so.conf.d",
    "alternatives", "localtime", "timezone", "locale.alias", "ssl", "ca-certificates",
    "ca-certificates.conf", "mime.types", "magic", "magic.mime", "os-release", "debian_version",
    "inputrc", "shells", "terminfo", "python3", "python3.*", "perl", "vim", "xml", "sgml",
    "java-*",
)
"""Host ``/etc`` entries (fnmatch patterns) bound read-only into the sandbox. Deliberately not
``shadow``, ``sudoers``, ``ssh``, ``pip.conf``, ``npmrc``, ``gitconfig`` (credentials live there)."""

KILL_GRACE_S = 2.0
"""After a timeout kill, how long to wait for the shell's sentinel before restarting the sandbox."""

START_TIMEOUT_S = 15.0
"""Bound on starting bwrap and getting the first answer from the shell."""


@dataclass
class CommandResult:
    """Result of one command run in a sandbox's persistent shell.

    Attributes:
        output: stdout and stderr merged, decoded as UTF-8 (errors replaced); longer than the
            sandbox's ``max_output_bytes`` it keeps head and tail around a visible
            ``[... truncated N bytes ...]`` marker. Notes from the sandbox (timeout, restart) are
            appended on their own line in square brackets.
        exit_code: the command's exit status; 124 when it timed out.
        timed_out: the command overran its timeout and its processes were killed.
        truncated: bytes were dropped from ``output``.
        seconds: wall time of the round trip, seconds.
    """

    output: str
    exit_code: int
    timed_out: bool
    truncated: bool
    seconds: float


class SandboxError(RuntimeError):
    """The sandbox failed or died; the message says what happened and what to do."""


class SandboxUnavailable(SandboxError):
    """The sandbox backend cannot run on this machine (e.g. bubblewrap is not installed)."""


@runtime_checkable
class Sandbox(Protocol):
    """One isolated, persistent shell for one episode. Not thread-safe: one caller at a time."""

    def start(self) -> None:
        """Start the sandbox and its shell (in ``/app``). Raises :class:`SandboxError`."""
        ...

    def exec(self, command: str, timeout_s: float | None = None) -> CommandResult:
        """Run ``command`` in the one persistent shell; ``timeout_s`` overrides the default."""
        ...

    def close(self) -> None:
        """Kill everything in the sandbox. Idempotent."""
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
    """The environment every sandbox shell starts with (before a backend's ``env`` overrides)."""
    python_bin = str(Path(sys.executable).parent) if sys.executable else "/usr/bin"
    return {
        "PATH": f"{SANDBOX_BIN}:{python_bin}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": "/root",
        "USER": "root",
        "LOGNAME": "root",
        "SHELL": "/bin/bash",
        "LANG": "C.UTF-8",
        "TERM": "dumb",
        "PAGER": "cat",
        "GIT_PAGER": "cat",
        "DEBIAN_FRONTEND": "noninteractive",
        "PYTHONUNBUFFERED": "1",
        "TMPDIR": "/tmp",
        # The host's site-packages carry heavy pytest plugins (hypothesis alone costs ~1.5 s per
        # run); verifiers use plain pytest, so autoloading them only slows every verification.
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
    }


def _python_paths() -> list[Path]:
    """Host folders that make the running Python work inside the sandbox (outside ``/usr``)."""
    candidates = [Path(sys.base_prefix), Path(sys.prefix)]
    if sys.executable:
        candidates += [Path(sys.executable).parent, Path(os.path.realpath(sys.executable)).parent]
    paths: list[Path] = []
    for path in sorted({Path(os.path.realpath(p)) for p in candidates} | set(candidates), key=lambda p: len(p.parts)):
        if not path.is_absolute() or not path.exists() or path.is_relative_to("/usr"):
            continue
        if any(path.is_relative_to(kept) for kept in paths):
            continue
        paths.append(path)
    return paths


class _OutputBuffer:
    """Bounded reader state: keeps the first ``head_cap`` and the last ``tail_cap`` bytes of a
    stream that ends with ``marker``; counts dropped bytes. Memory is O(caps + chunk)."""

    def __init__(self, max_bytes: int, marker: bytes):
        self.head_cap = max_bytes // 2
        self.tail_cap = max_bytes - self.head_cap
        self.max_bytes = max_bytes
        self.marker = marker
        self.head = bytearray()
        self.tail = bytearray()
        self.dropped = 0
        self._search_from = 0

    def feed(self, chunk: bytes) -> int | None:
        """Add ``chunk``; return the exit status once the marker line is complete, else None."""
        self.tail += chunk
        idx = self.tail.find(self.marker, self._search_from)
        if idx >= 0:
            end = self.tail.find(b"\n", idx + len(self.marker))
            if end < 0:
                self._search_from = idx
                return None
            status = int(self.tail[idx + len(self.marker) : end].strip() or b"1")
            rest = bytes(self.tail[end + 1 :])
            del self.tail[idx:]
            if self.tail.endswith(b"\n"):  # the newline printed before the sentinel
                del self.tail[-1:]
            if rest:  # a background job wrote after the sentinel: keep it for the record
                self.tail += rest
            return status
        keep = self.tail_cap + len(self.marker) + 32
        if len(self.tail) > keep:
            overflow = len(self.tail) - keep
            room = max(0, self.head_cap - len(self.head))
            self.head += self.tail[: min(room, overflow)]
            self.dropped += overflow - min(room, overflow)
            del self.tail[:overflow]
        self._search_from = max(0, len(self.tail) - len(self.marker) - 32)
        return None

    def result(self) -> tuple[str, bool]:
        """The collected output (decoded, truncated with a marker) and whether it was truncated."""
        data = bytes(self.head + self.tail)
        if self.dropped == 0 and len(data) <= self.max_bytes:
            return data.decode("utf-8", errors="replace"), False
        head = bytes(self.head[: self.head_cap])
        rest = bytes(self.head[self.head_cap :] + self.tail)
        tail = rest[len(rest) - self.tail_cap :] if self.tail_cap else b""
        dropped = self.dropped + len(rest) - len(tail)
        text = (
            head.decode("utf-8", errors="replace")
            + f"\n[... truncated {dropped} bytes ...]\n"
            + tail.decode("utf-8", errors="replace")
        )
        return text, True


_TIMEOUT = "timeout"
_EOF = "eof"


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

    Raises:
        SandboxUnavailable: from :meth:`start` when bubblewrap is missing or cannot run.
        SandboxError: from :meth:`start`/:meth:`exec` when the sandbox fails.
    """

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
    ):
        if command_timeout_s <= 0:
            raise ValueError(f"command_timeout_s must be > 0, got {command_timeout_s}")
        if max_output_bytes < 64:
            raise ValueError(f"max_output_bytes must be >= 64, got {max_output_bytes}")
        self.workspace = Path(workspace).resolve()
        self.tests_dir = Path(tests_dir).resolve()
        self.logs_dir = Path(logs_dir).resolve()
        self.allow_network = allow_network
        self.command_timeout_s = command_timeout_s
        self.max_output_bytes = max_output_bytes
        self.env = {**sandbox_environment(), **(env or {})}
        token = secrets.token_hex(8)
        self._halves = (f"__T1_{token[:8]}", f"{token[8:]}__")
        self._marker = ("".join(self._halves) + " ").encode()
        self._proc: subprocess.Popen[bytes] | None = None
        self._init_pid: int | None = None  # host pid of the namespace's init (bwrap, ns pid 1)
        self._pidns: str | None = None
        self._shell_nspid: int | None = None
        self.restarts = 0
        """How many times the shell was restarted (after an exit or a stuck timeout)."""

    # ----------------------------------------------------------------------------- lifecycle

    def bwrap_argv(self, info_fd: int | None = None) -> list[str]:
        """The full ``bwrap`` command line of this sandbox (``info_fd``: for ``--info-fd``)."""
        argv = ["bwrap", "--unshare-all", "--die-with-parent", "--cap-drop", "ALL", "--new-session"]
        if self.allow_network:
            argv.append("--share-net")
        argv += ["--ro-bind", "/usr", "/usr"]
        for name in ("bin", "lib", "lib64", "sbin"):
            host = Path("/") / name
            if host.is_symlink():
                argv += ["--symlink", os.readlink(host), f"/{name}"]
            elif host.is_dir():
                argv += ["--ro-bind", str(host), f"/{name}"]
        argv += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--tmpfs", "/dev/shm"]
        argv += ["--dir", "/root", "--dir", "/var/tmp", "--dir", "/run"]
        etc = Path("/etc")
        patterns = ETC_ENTRIES + (("resolv.conf",) if self.allow_network else ())
        for entry in sorted(os.listdir(etc)):
            if any(fnmatch.fnmatchcase(entry, p) for p in patterns) and (etc / entry).exists():
                argv += ["--ro-bind", str(etc / entry), f"/etc/{entry}"]
        argv += ["--symlink", "/proc/self/mounts", "/etc/mtab"]
        for path in _python_paths():
            argv += ["--ro-bind", str(path), str(path)]
        if sys.executable:
            for name in ("python3", "python"):
                argv += ["--symlink", sys.executable, f"{SANDBOX_BIN}/{name}"]
        argv += ["--bind", str(self.workspace), "/app"]
        argv += ["--ro-bind", str(self.tests_dir), "/tests"]
        argv += ["--bind", str(self.logs_dir), "/logs"]
        argv += ["--chdir", "/app", "--clearenv"]
        for key, value in self.env.items():
            argv += ["--setenv", key, value]
        if info_fd is not None:
            argv += ["--info-fd", str(info_fd)]
        argv += ["--", "/bin/bash", "--noprofile", "--norc"]
        return argv

    def start(self) -> None:
        """Start bwrap and the shell in ``/app``. Raises SandboxUnavailable/SandboxError."""
        if self._proc is not None:
            raise SandboxError("sandbox already started: call close() before starting it again")
        check_sandbox_available("local")
        for folder in (self.workspace, self.tests_dir, self.logs_dir):
            folder.mkdir(parents=True, exist_ok=True)
        self._spawn()

    def _spawn(self) -> None:
        read_fd, write_fd = os.pipe()
        try:
            self._proc = subprocess.Popen(
                self.bwrap_argv(write_fd),
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
        for stream in (proc.stdin, proc.stdout):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass

    def close(self) -> None:
        """Kill every process in the sandbox and bwrap itself. Idempotent."""
        self._kill()

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

    # ----------------------------------------------------------------------------- commands

    def exec(self, command: str, timeout_s: float | None = None) -> CommandResult:
        """Run ``command`` in the persistent shell (cwd and exported variables carry over).

        Args:
            command: bash source (any text: multi-line, heredocs; stdin is ``/dev/null``).
            timeout_s: seconds before every process of the command is killed (default: the
                sandbox's ``command_timeout_s``).

        Returns:
            The merged, bounded output and exit status (124 on timeout).

        Raises:
            SandboxError: the sandbox is not started or could not be restarted.
        """
        if self._proc is None:
            raise SandboxError("sandbox is not running: call start() before exec()")
        timeout = self.command_timeout_s if timeout_s is None else float(timeout_s)
        started = time.monotonic()
        notes: list[str] = []
        if self._proc.poll() is not None:
            notes.append("[the shell had died since the last command; a new shell was started in /app]")
            self._restart()
        status, output, truncated, note = self._run_full(command, timeout)
        if note:
            notes.append(note)
        timed_out = status == _TIMEOUT
        if notes:
            output = output + ("" if not output or output.endswith("\n") else "\n") + "\n".join(notes)
        exit_code = 124 if timed_out else int(status)
        return CommandResult(output, exit_code, timed_out, truncated, time.monotonic() - started)

    def _run_full(self, command: str, timeout: float, recover: bool = True) -> tuple[int | str, str, bool, str]:
        """Send one command and read to its sentinel. Returns (status or _TIMEOUT, output,
        truncated, note); restarts the sandbox when the shell exits or stays stuck (if
        ``recover``; else returns _TIMEOUT/_EOF as the status)."""
        assert self._proc is not None
        deadline = time.monotonic() + timeout
        line = (
            f"eval {bash_quote(command)} </dev/null; "
            f"printf '\\n%s%s %d\\n' {self._halves[0]} {self._halves[1]} \"$?\"\n"
        )
        buf = _OutputBuffer(self.max_output_bytes, self._marker)
        status = self._write(line.encode(), deadline)
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
                    "started in /app: exported variables, the working directory and background "
                    "processes were reset]"
                )
                self._restart()
        elif status == _EOF:
            code = self._proc.wait() if self._proc.poll() is None else self._proc.returncode
            status = code if code >= 0 else 128 - code
            note = (
                f"[the shell exited (status {status}); a new shell was started in /app: exported "
                "variables, the working directory and background processes were reset]"
            )
            self._restart()
        output, truncated = buf.result()
        return status, output, truncated, note

    def _write(self, data: bytes, deadline: float) -> str | None:
        """Write ``data`` to the shell's stdin; returns _EOF/_TIMEOUT on failure, else None."""
        assert self._proc is not None and self._proc.stdin is not None
        fd = self._proc.stdin.fileno()
        view = memoryview(data)
        while view:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return _TIMEOUT
            _, ready, _ = select.select([], [fd], [], remaining)
            if not ready:
                continue
            try:
                written = os.write(fd, view[: select.PIPE_BUF])
            except (BrokenPipeError, OSError):
                return _EOF
            view = view[written:]
        return None

    def _read(self, buf: _OutputBuffer, deadline: float) -> int | str:
        """Read into ``buf`` until the sentinel (returns its status), EOF or the deadline."""
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return _TIMEOUT
            ready, _, _ = select.select([fd], [], [], remaining)
            if not ready:
                return _TIMEOUT
            chunk = os.read(fd, 65536)
            if not chunk:
                return _EOF
            status = buf.feed(chunk)
            if status is not None:
                return status

    def _namespace_pids(self) -> list[tuple[int, int]]:
        """(host pid, namespace pid) of every live process in the sandbox's PID namespace."""
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                if os.readlink(f"/proc/{entry}/ns/pid") != self._pidns:
                    continue
                status = Path(f"/proc/{entry}/status").read_text()
            except OSError:
                continue
            fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
            if fields.get("State", "").strip().startswith(("Z", "X")):
                continue
            nspid = int(fields.get("NSpid", "0 0").split()[-1])
            found.append((int(entry), nspid))
        return found

    def _kill_command_processes(self) -> int:
        """SIGKILL every process in the namespace except init (ns pid 1) and the shell; repeat
        until none is left (bounded), so fast forkers are caught. Returns how many were killed."""
        killed: set[int] = set()
        stop_at = time.monotonic() + KILL_GRACE_S
        while time.monotonic() < stop_at:
            victims = [host for host, ns in self._namespace_pids() if ns not in (1, self._shell_nspid)]
            if not victims:
                break
            for host in victims:
                try:
                    os.kill(host, signal.SIGKILL)
                    killed.add(host)
                except ProcessLookupError:
                    pass
            time.sleep(0.005)
        return len(killed)


SANDBOXES: dict[str, type] = {"local": LocalSandbox}
"""Sandbox backends by name (config ``env.sandbox``)."""

_available: set[str] = set()


def check_sandbox_available(backend: str = "local") -> None:
    """Check that ``backend`` can run here (once per process for a success).

    Raises:
        SandboxUnavailable: with a one-line message saying what to install or change.
    """
    if backend in _available:
        return
    if backend not in SANDBOXES:
        raise SandboxUnavailable(f"unknown sandbox backend {backend!r}: choose one of {sorted(SANDBOXES)}")
    if backend == "local":
        if shutil.which("bwrap") is None:
            raise SandboxUnavailable("bubblewrap (bwrap) not found: install it with `apt-get install bubblewrap`")
        probe = subprocess.run(
            ["bwrap", "--unshare-all", "--die-with-parent", "--cap-drop", "ALL", "--ro-bind", "/usr", "/usr",
             "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64", "--", "/usr/bin/true"],
            capture_output=True, text=True, timeout=30,
        )
        if probe.returncode != 0:
            raise SandboxUnavailable(
                f"bubblewrap cannot create a sandbox here ({probe.stderr.strip() or probe.returncode}): "
                "enable unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1) or run as root"
            )
    _available.add(backend)
