"""The ``modal`` sandbox backend: one Modal cloud sandbox per episode (optional ``modal`` package).

Lifecycle (``modal`` 1.6 API, read from its sources; docs/environments.md):

* :meth:`ModalSandbox.start`: credentials from ``MODAL_TOKEN_ID``/``MODAL_TOKEN_SECRET`` or
  ``~/.modal.toml`` (``MODAL_CONFIG_PATH``), else :class:`SandboxUnavailable` at once. Then
  ``modal.App.lookup(app, create_if_missing=True)`` runs in a worker thread bounded by
  ``connect_timeout_s`` (5 s): Modal's own client waits about a minute before it gives up on
  wrong credentials or a missing route, so the bound is ours. The image is the task's
  Dockerfile (``modal.Image.from_dockerfile(path, context_dir=...)``, built by Modal with full
  Docker semantics), else ``[environment] docker_image`` (``from_registry``), else
  ``debian_slim``. ``modal.Sandbox.create("sleep", "infinity", image=..., cpu=..., memory=...,
  workdir=..., block_network=not allow_network, timeout=...)``; then one ``bash`` started with
  ``sb.exec`` is the persistent shell, driven with the same sentinel protocol as the local
  backend (:mod:`t1async.envs.sandboxes.shell_io`); a reader thread moves its stdout into a queue so reads
  have deadlines.
* Timeouts: a second ``sb.exec`` SIGKILLs every process of the container that is neither pid 1,
  the shell nor the killer itself and its parents, and was started after the shell (higher pid:
  a command's children, ``setsid`` and double-forked daemons alike); a shell that still does not
  answer is replaced by a new one.
* Files: ``sb.filesystem.write_bytes``/``make_directory`` for :meth:`put`; ``rm``/``tail`` run
  with ``sb.exec`` for :meth:`clear`/:meth:`read`.
* :meth:`close`: ``sb.terminate()`` (bounded too).

The test scripts run unchanged (the image is the task's own), so a script that downloads its
test runner needs ``allow_internet`` on this backend. Every Modal call that may touch the network
runs under a deadline; a call that overruns raises :class:`SandboxError` naming it.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any, Callable, Sequence

from loguru import logger

from ..protocol import CommandResult, SandboxError, SandboxSpec, SandboxUnavailable, split_root
from .shell_io import KILL_SCRIPT, OutputBuffer, Sentinel, clear_command, read_command

APP_NAME = "t1async-sandboxes"
"""Modal app that owns the sandboxes (created on first use)."""

CONNECT_TIMEOUT_S = 5.0
"""Bound on reaching Modal (App.lookup), seconds: no credentials or no network fail within it."""

CREATE_TIMEOUT_S = 600.0
"""Bound on building the image and creating the sandbox, seconds (a first image build is slow)."""

CALL_TIMEOUT_S = 60.0
"""Bound on one file operation, exec start or terminate, seconds."""

KILL_GRACE_S = 3.0
"""After a timeout kill, how long to wait for the shell's sentinel before replacing the shell."""

SHELL_ENV = {"TERM": "dumb", "PAGER": "cat", "GIT_PAGER": "cat", "DEBIAN_FRONTEND": "noninteractive",
             "PYTHONUNBUFFERED": "1", "TEST_DIR": "/tests"}
"""Variables the shell gets on top of the image's own environment."""

_EXECUTOR = ThreadPoolExecutor(max_workers=8, thread_name_prefix="t1async-modal")


def _import_modal() -> Any:
    try:
        import modal  # modal: an optional extra, absent on most machines
    except ImportError:
        raise SandboxUnavailable(
            "the modal sandbox backend needs the `modal` package: pip install 't1async[modal]'"
        ) from None
    return modal


def has_modal_credentials() -> bool:
    """Whether Modal credentials are configured (environment variables or the config file)."""
    if os.environ.get("MODAL_TOKEN_ID") and os.environ.get("MODAL_TOKEN_SECRET"):
        return True
    config = Path(os.environ.get("MODAL_CONFIG_PATH", Path.home() / ".modal.toml"))
    try:
        text = config.read_text()
    except OSError:
        return False
    return "token_id" in text and "token_secret" in text


def check_modal_available() -> None:
    """Raise :class:`SandboxUnavailable` unless the ``modal`` package is importable and
    credentials are configured (no network access: that is bounded in :meth:`ModalSandbox.start`)."""
    _import_modal()
    if not has_modal_credentials():
        raise SandboxUnavailable(
            "no Modal credentials: set MODAL_TOKEN_ID and MODAL_TOKEN_SECRET or run `modal token new` "
            "(writes ~/.modal.toml)"
        )


def bounded(what: str, timeout_s: float, fn: Callable[..., Any], *args: Any, connecting: bool = False,
            **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` in a worker thread and wait at most ``timeout_s`` seconds.

    Raises:
        SandboxUnavailable: the call overran (the thread is abandoned; Modal's client gives up
            on its own later), or it raised while ``connecting`` (reaching Modal at all) or with
            an authentication/connection error.
        SandboxError: the call raised otherwise; the message names ``what`` and the cause.
    """
    future = _EXECUTOR.submit(fn, *args, **kwargs)
    try:
        return future.result(timeout=timeout_s)
    except FutureTimeout:
        raise SandboxUnavailable(
            f"Modal did not answer {what} within {timeout_s:g} s: check the network and the credentials "
            "(MODAL_TOKEN_ID/MODAL_TOKEN_SECRET or ~/.modal.toml)"
        ) from None
    except SandboxError:
        raise
    except Exception as exc:
        kind = type(exc).__name__
        error = SandboxUnavailable if connecting or kind in ("AuthError", "ConnectionError") else SandboxError
        raise error(f"Modal failed {what}: {kind}: {exc}") from None


class ModalSandbox:
    """A Modal cloud sandbox with one persistent ``bash`` (see the module docstring).

    Args:
        spec: the episode's sandbox spec (image source, limits, network, timeouts).
        connect_timeout_s: bound on reaching Modal, seconds.
        modal_module: the ``modal`` module to use (tests pass a fake of Modal's cloud).
    """

    builds_image = True

    def __init__(self, spec: SandboxSpec, *, connect_timeout_s: float = CONNECT_TIMEOUT_S, modal_module: Any = None):
        self.spec = spec
        self.command_timeout_s = spec.command_timeout_s
        self.max_output_bytes = spec.max_output_bytes
        self.connect_timeout_s = connect_timeout_s
        self._modal = modal_module
        self._sb: Any = None
        self._proc: Any = None
        self._queue: queue.Queue[bytes | None] = queue.Queue()
        self._sentinel = Sentinel()
        self._shell_pid = 0
        self.restarts = 0

    @classmethod
    def from_spec(cls, spec: SandboxSpec) -> ModalSandbox:
        """A Modal sandbox for ``spec`` (not started)."""
        return cls(spec)

    # ----------------------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Reach Modal (bounded), build or fetch the image, create the sandbox, start the shell.

        Raises:
            SandboxUnavailable: no package, no credentials, or Modal unreachable within
                ``connect_timeout_s``.
            SandboxError: the image build or the sandbox failed.
        """
        if self._sb is not None:
            raise SandboxError("sandbox already started: call close() before starting it again")
        if self.spec.services:
            raise SandboxError(f"task {self.spec.name} has compose services beside the agent's "
                               f"({', '.join(s.name for s in self.spec.services)}); a Modal sandbox runs one "
                               "container: use the container backend (--sandbox container)")
        if self._modal is None:
            check_modal_available()
            self._modal = _import_modal()
        modal = self._modal
        app = bounded("App.lookup", self.connect_timeout_s, modal.App.lookup, APP_NAME, create_if_missing=True,
                      connecting=True)
        spec = self.spec
        if spec.dockerfile is not None:
            image = modal.Image.from_dockerfile(str(spec.dockerfile), context_dir=str(spec.context_dir or spec.dockerfile.parent))
        elif spec.docker_image:
            image = modal.Image.from_registry(spec.docker_image)
        else:
            image = modal.Image.debian_slim()
        limits = spec.limits
        kwargs: dict[str, Any] = {"app": app, "image": image, "timeout": int(max(300, 4 * 3600)),
                                  "workdir": spec.workdir, "block_network": not spec.allow_network}
        if limits.cpus:
            kwargs["cpu"] = float(limits.cpus)
        if limits.memory_mb:
            kwargs["memory"] = int(limits.memory_mb)
        self._sb = bounded("Sandbox.create", CREATE_TIMEOUT_S, modal.Sandbox.create, "sleep", "infinity", **kwargs)
        try:
            self._start_shell()
        except BaseException:
            self.close()
            raise

    def _start_shell(self) -> None:
        env = {**SHELL_ENV, **self.spec.env}
        self._proc = bounded("exec bash", CALL_TIMEOUT_S, self._sb.exec, "bash", "--noprofile", "--norc",
                             text=False, env=env, workdir=self.spec.workdir)
        self._queue = queue.Queue()
        threading.Thread(target=self._pump, args=(self._proc, self._queue), daemon=True,
                         name="t1async-modal-reader").start()
        status, output, _ = self._run("printf '%s\\n' \"$$\"", CALL_TIMEOUT_S)
        if status != 0 or not output.strip().isdigit():
            raise SandboxError(f"the Modal sandbox shell did not answer at start (status {status}, output {output[:300]!r})")
        self._shell_pid = int(output.strip())

    @staticmethod
    def _pump(proc: Any, out: queue.Queue) -> None:
        """Reader thread: the shell's stdout chunks into ``out``; None at the end."""
        try:
            for chunk in proc.stdout:
                out.put(chunk.encode() if isinstance(chunk, str) else bytes(chunk))
        except Exception as exc:  # the stream broke: the shell is gone for us
            logger.debug("modal shell stream ended: {}", exc)
        finally:
            out.put(None)

    def close(self) -> None:
        """Terminate the Modal sandbox (bounded; never raises). Idempotent."""
        sb, self._sb, self._proc = self._sb, None, None
        if sb is None:
            return
        try:
            bounded("terminate", CALL_TIMEOUT_S, sb.terminate)
        except SandboxError as exc:
            logger.warning("could not terminate the Modal sandbox: {}", exc)

    # ----------------------------------------------------------------------------- commands

    def _run(self, command: str, timeout: float) -> tuple[int | str, str, bool]:
        """Send one command; read to its sentinel. Returns (status | "timeout" | "eof", output, truncated)."""
        buf = OutputBuffer(self.max_output_bytes, self._sentinel.marker)
        try:
            self._proc.stdin.write(self._sentinel.line(command))
            bounded("stdin.drain", CALL_TIMEOUT_S, self._proc.stdin.drain)
        except SandboxUnavailable:
            raise
        except Exception:
            return "eof", "", False
        status = self._read(buf, time.monotonic() + timeout)
        output, truncated = buf.result()
        return status, output, truncated

    def _read(self, buf: OutputBuffer, deadline: float) -> int | str:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return "timeout"
            try:
                chunk = self._queue.get(timeout=remaining)
            except queue.Empty:
                return "timeout"
            if chunk is None:
                return "eof"
            status = buf.feed(chunk)
            if status is not None:
                return status

    def exec(self, command: str, timeout_s: float | None = None) -> CommandResult:
        """Run ``command`` in the persistent shell (see :meth:`Sandbox.exec`).

        Raises:
            SandboxError: not started, or Modal failed.
        """
        if self._sb is None or self._proc is None:
            raise SandboxError("sandbox is not running: call start() before exec()")
        timeout = self.command_timeout_s if timeout_s is None else float(timeout_s)
        started = time.monotonic()
        status, output, truncated = self._run(command, timeout)
        note = ""
        if status == "timeout":
            killed = self._exec_simple(["bash", "-c", KILL_SCRIPT, "kill", str(self._shell_pid)]).decode().strip()
            buf = OutputBuffer(self.max_output_bytes, self._sentinel.marker)
            after = self._read(buf, time.monotonic() + KILL_GRACE_S)
            note = f"[timed out after {timeout:g} s; killed {killed or 0} process(es)]"
            if not isinstance(after, int):
                note = (f"[timed out after {timeout:g} s and the shell did not come back; a new shell was started "
                        f"in {self.spec.workdir}: exported variables and the working directory were reset]")
                self._replace_shell()
        elif status == "eof":
            try:
                status = int(bounded("wait", KILL_GRACE_S, self._proc.wait))
            except (SandboxError, TypeError, ValueError):
                status = 1
            note = (f"[the shell exited (status {status}); a new shell was started in {self.spec.workdir}: "
                    "exported variables and the working directory were reset]")
            self._replace_shell()
        if note:
            output = output + ("" if not output or output.endswith("\n") else "\n") + note
        timed_out = status == "timeout"
        code = 124 if timed_out else int(status)
        return CommandResult(output, code, timed_out, truncated, time.monotonic() - started)

    def _replace_shell(self) -> None:
        self.restarts += 1
        self._start_shell()

    def end_agent(self) -> int:
        """Kill every process started after the shell, except the shell (see :class:`Sandbox`)."""
        if self._sb is None:
            return 0
        out = self._exec_simple(["bash", "-c", KILL_SCRIPT, "kill", str(self._shell_pid)]).decode().strip()
        return int(out) if out.isdigit() else 0

    def _exec_simple(self, argv: list[str], timeout_s: float = CALL_TIMEOUT_S) -> bytes:
        """Run ``argv`` as a separate process in the sandbox; its stdout bytes (bounded in time)."""
        def run() -> bytes:
            proc = self._sb.exec(*argv, timeout=int(timeout_s), text=False)
            out = proc.stdout.read()
            proc.wait()
            return out.encode() if isinstance(out, str) else bytes(out)

        return bounded(f"exec {argv[0]}", timeout_s + 5, run)

    # ----------------------------------------------------------------------------- files

    def put(self, sources: Sequence[Path], dest: str) -> None:
        """Docker COPY of host ``sources`` to ``dest`` through ``sb.filesystem``."""
        split_root(dest)
        fs = self._sb.filesystem
        dest_is_dir = dest.endswith("/") or len(sources) > 1
        for source in sources:
            if source.is_dir():
                for path in sorted(source.rglob("*")):
                    if path.is_file():
                        remote = dest.rstrip("/") + "/" + path.relative_to(source).as_posix()
                        bounded("filesystem.write_bytes", CALL_TIMEOUT_S, fs.write_bytes, path.read_bytes(), remote)
            else:
                remote = dest.rstrip("/") + "/" + source.name if dest_is_dir else dest
                bounded("filesystem.write_bytes", CALL_TIMEOUT_S, fs.write_bytes, source.read_bytes(), remote)

    def clear(self, path: str) -> None:
        """Empty (and create) the folder ``path`` in the sandbox."""
        split_root(path)
        self._exec_simple(["bash", "-c", clear_command(path)])

    def read(self, path: str, max_bytes: int) -> bytes:
        """The last ``max_bytes`` of the regular file ``path`` (b"" if missing or a symlink)."""
        split_root(path)
        return self._exec_simple(["bash", "-c", read_command(path, max_bytes)])
