"""TerminalEnv: one task plus one sandbox for one episode (reset, step, verify, close).

Episode layout on the host, under ``root``: ``<task>-<random>/`` holding ``app/`` (bound at /app),
``tests/`` (bound read-only at /tests; empty until :meth:`TerminalEnv.verify`) and ``logs/``
(bound at /logs). :meth:`TerminalEnv.close` removes it.

Environment build (:meth:`TerminalEnv.reset`), following the task's Dockerfile subset in order:
WORKDIR creates the folder; ENV values are expanded (``$VAR``/``${VAR}``) against the environment
so far; COPY copies from ``environment/`` into the workspace on the host side (a folder source
copies its contents); RUN runs ``/bin/sh -c`` in the sandbox from the current WORKDIR with exactly
the environment so far (``env -i``), as Docker does. The agent's shell then starts with every
ENV applied, in the last WORKDIR.

Oracle (:meth:`TerminalEnv.run_solution`): the task's ``solution/`` folder is staged in the
otherwise empty /tests folder and ``bash /tests/solve.sh`` runs in the agent's shell from /app
(stdin /dev/null) with the task's agent timeout. The script's text never appears in a process's
command line (a solution that runs ``pgrep -f`` would otherwise find itself), and sibling files
are at ``$(dirname "$0")``. :meth:`TerminalEnv.verify` empties the staging folder first.

Verification (:meth:`TerminalEnv.verify`): ``tests/`` is copied into the /tests staging folder,
``/logs/verifier`` is recreated, and ``bash /tests/test.sh`` runs from /app in a clean
environment (the sandbox's starting one, so the agent's exported variables do not leak in) with
output to a fresh, unpredictable file in /logs/verifier that the host then reads (bounded).
"""

from __future__ import annotations

import glob
import os
import re
import secrets
import shlex
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from loguru import logger

from .sandbox import SANDBOXES, CommandResult, Sandbox, SandboxError, check_sandbox_available, sandbox_environment
from .task import APP, Task, TaskError
from .verifier import VerifierResult, verifier_result

SETUP_STEP_TIMEOUT_S = 300.0
"""Bound on one Dockerfile RUN step during reset, seconds."""

MAX_VERIFIER_READ_BYTES = 8 * 1024 * 1024
"""The verifier output file is read up to its last 8 MiB (the summary is at the end)."""

_VAR = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")


def expand_vars(value: str, env: dict[str, str]) -> str:
    """Expand ``$VAR`` and ``${VAR}`` in ``value`` from ``env`` (unknown names become empty)."""
    return _VAR.sub(lambda m: env.get(m.group(1) or m.group(2), ""), value)


def _host_path(workspace: Path, sandbox_path: str) -> Path:
    """Host path of ``sandbox_path`` (absolute, /app or under it) inside ``workspace``."""
    relative = sandbox_path.rstrip("/")[len(APP) :].lstrip("/")
    return workspace / relative if relative else workspace


def copy_into_workspace(sources: list[Path], dest: str, workspace: Path) -> None:
    """Docker COPY semantics on the host: a file goes to ``dest`` (or into it when ``dest`` ends in
    ``/`` or is an existing folder); a folder's contents are merged into ``dest``."""
    target = _host_path(workspace, dest)
    into_folder = dest.endswith("/") or target.is_dir() or len(sources) > 1
    for source in sources:
        if source.is_dir():
            shutil.copytree(source, target, symlinks=True, dirs_exist_ok=True)
        elif into_folder:
            target.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / source.name)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


class TerminalEnv:
    """One episode of a task in a sandbox.

    Args:
        task: the loaded task.
        root: host folder under which episode folders are created.
        sandbox: backend name in :data:`~t1async.envs.sandbox.SANDBOXES`.
        command_timeout_s: per-command timeout of :meth:`step`, seconds.
        max_output_bytes: longest output per command, bytes (head and tail kept).
        verifier_timeout_s: overrides the task's ``[verifier] timeout_sec`` when not None, seconds.

    Raises:
        SandboxUnavailable: at construction, when the backend cannot run here.
    """

    def __init__(
        self,
        task: Task,
        *,
        root: Path,
        sandbox: str = "local",
        command_timeout_s: float = 10.0,
        max_output_bytes: int = 2048,
        verifier_timeout_s: float | None = None,
    ):
        check_sandbox_available(sandbox)
        self.task = task
        self.root = Path(root)
        self.sandbox_name = sandbox
        self.command_timeout_s = command_timeout_s
        self.max_output_bytes = max_output_bytes
        self.verifier_timeout_s = task.verifier_timeout_s if verifier_timeout_s is None else verifier_timeout_s
        self.episode_dir: Path | None = None
        self.sandbox: Sandbox | None = None
        self.env: dict[str, str] = {}
        """The shell's starting environment (the sandbox's plus the task's ENV), set by reset()."""

    @property
    def workspace(self) -> Path:
        """Host folder bound at /app (valid after :meth:`reset`)."""
        if self.episode_dir is None:
            raise SandboxError("no episode: call reset() first")
        return self.episode_dir / "app"

    def reset(self) -> str:
        """Start a fresh episode: new workspace, the task's environment built, the shell started.

        Returns:
            The task's instruction text.

        Raises:
            TaskError: a Dockerfile step failed (the message has the step's output).
            SandboxError: the sandbox could not start.
        """
        self.close()
        self.root.mkdir(parents=True, exist_ok=True)
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", self.task.name)[:60]
        self.episode_dir = self.root / f"{safe}-{secrets.token_hex(4)}"
        for sub in ("app", "tests", "logs/verifier", "logs/agent"):
            (self.episode_dir / sub).mkdir(parents=True)
        base = sandbox_environment()
        env = dict(base)
        for step in self.task.steps:
            if step.instruction == "ENV":
                for key, value in zip(step.args[::2], step.args[1::2]):
                    env[key] = expand_vars(value, env)
        self.env = env
        task_env = {k: v for k, v in env.items() if base.get(k) != v}
        self.sandbox = SANDBOXES[self.sandbox_name](
            self.workspace,
            tests_dir=self.episode_dir / "tests",
            logs_dir=self.episode_dir / "logs",
            allow_network=self.task.allow_internet,
            command_timeout_s=self.command_timeout_s,
            max_output_bytes=self.max_output_bytes,
            env=task_env,
        )
        try:
            self.sandbox.start()
            workdir = self._build_environment(base)
            if workdir != APP:
                self.sandbox.exec(f"cd {shlex.quote(workdir)}")
        except BaseException:
            self.close()
            raise
        return self.task.instruction

    def _build_environment(self, base: dict[str, str]) -> str:
        """Apply the Dockerfile subset in order; returns the final WORKDIR."""
        assert self.sandbox is not None
        env = dict(base)
        workdir = APP
        for step in self.task.steps:
            if step.instruction == "WORKDIR":
                workdir = step.args[0]
                _host_path(self.workspace, workdir).mkdir(parents=True, exist_ok=True)
            elif step.instruction == "ENV":
                for key, value in zip(step.args[::2], step.args[1::2]):
                    env[key] = expand_vars(value, env)
            elif step.instruction == "COPY":
                sources = sorted(Path(p) for s in step.args[:-1] for p in glob.glob(str(self.task.environment_dir / s)))
                copy_into_workspace(sources, step.args[-1], self.workspace)
            elif step.instruction == "RUN":
                _host_path(self.workspace, step.workdir).mkdir(parents=True, exist_ok=True)
                assignments = " ".join(shlex.quote(f"{k}={v}") for k, v in env.items())
                command = f"cd {shlex.quote(step.workdir)} && env -i {assignments} /bin/sh -c {shlex.quote(step.args[0])}"
                result = self.sandbox.exec(command, timeout_s=SETUP_STEP_TIMEOUT_S)
                if result.exit_code != 0:
                    raise TaskError(
                        f"task {self.task.path}: environment/Dockerfile:{step.line} `RUN {step.args[0][:200]}` "
                        f"failed with exit code {result.exit_code}{' (timed out)' if result.timed_out else ''}: "
                        f"{result.output[-1500:]!r}; fix the step (the local sandbox has no network unless "
                        "allow_internet = true, and /usr is read-only)"
                    )
        return workdir

    def step(self, command: str) -> CommandResult:
        """Run one agent command in the episode's shell (see :meth:`Sandbox.exec`)."""
        if self.sandbox is None:
            raise SandboxError("no episode: call reset() before step()")
        return self.sandbox.exec(command)

    def run_solution(self) -> CommandResult:
        """Run the task's oracle ``solution/solve.sh`` (see the module docstring).

        Raises:
            TaskError: the task has no solution/solve.sh.
        """
        if self.sandbox is None:
            raise SandboxError("no episode: call reset() before run_solution()")
        solve = self.task.solution_path
        if solve is None:
            raise TaskError(f"task {self.task.path}: missing solution/solve.sh; add an oracle solution to validate the task")
        assert self.episode_dir is not None
        staging = self.episode_dir / "tests"
        _empty_folder(staging)
        shutil.copytree(solve.parent, staging, symlinks=True, dirs_exist_ok=True)
        return self.sandbox.exec("cd /app && bash /tests/solve.sh", timeout_s=self.task.agent_timeout_s)

    def verify(self) -> VerifierResult:
        """Run the task's verifier against the current state of the sandbox.

        Returns:
            The parsed per-test result (``error`` set on a timeout or a missing pytest summary).

        Raises:
            SandboxError: no episode, or the sandbox failed.
        """
        if self.sandbox is None or self.episode_dir is None:
            raise SandboxError("no episode: call reset() before verify()")
        staging = self.episode_dir / "tests"
        _empty_folder(staging)
        shutil.copytree(self.task.tests_dir, staging, symlinks=True, dirs_exist_ok=True)
        verifier_logs = self.episode_dir / "logs" / "verifier"
        if verifier_logs.is_symlink() or verifier_logs.is_file():
            verifier_logs.unlink()
        elif verifier_logs.exists():
            shutil.rmtree(verifier_logs)  # the agent may have planted files or symlinks there
        verifier_logs.mkdir(parents=True)
        # A shell the agent left unable to answer (e.g. `exec >/dev/null`) is restarted here,
        # within seconds, instead of costing the whole verifier timeout.
        self.sandbox.exec("true", timeout_s=3.0)
        output_name = f"test_output.{secrets.token_hex(6)}.txt"
        assignments = " ".join(shlex.quote(f"{k}={v}") for k, v in self.env.items())
        # PYTHONSAFEPATH: `python3 -m pytest` run from /app must not import an agent-planted
        # /app/pytest.py or sitecustomize.py (reward hacking); the host's pytest runs.
        command = (f"cd /app && env -i {assignments} PYTHONSAFEPATH=1 bash /tests/test.sh "
                   f"> /logs/verifier/{output_name} 2>&1")
        started = time.monotonic()
        run = self.sandbox.exec(command, timeout_s=self.verifier_timeout_s)
        seconds = time.monotonic() - started
        output = _read_tail(verifier_logs / output_name, MAX_VERIFIER_READ_BYTES)
        if run.output.strip():  # a failure of the wrapper itself (cd, env, a restart note)
            output += ("\n" if output and not output.endswith("\n") else "") + run.output
        result = verifier_result(
            output,
            seconds=seconds,
            exit_code=None if run.timed_out else run.exit_code,
            timed_out_after_s=self.verifier_timeout_s if run.timed_out else None,
        )
        logger.debug("verified {}: {}/{} passed, error={}", self.task.name, result.passed, result.total, result.error)
        return result

    def close(self) -> None:
        """Kill the sandbox and remove the episode folder. Idempotent."""
        sandbox, self.sandbox = self.sandbox, None
        if sandbox is not None:
            sandbox.close()
        episode, self.episode_dir = self.episode_dir, None
        if episode is not None:
            shutil.rmtree(episode, ignore_errors=True)

    def __enter__(self) -> TerminalEnv:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _empty_folder(folder: Path) -> None:
    """Remove everything inside ``folder`` (symlinks are removed, never followed)."""
    for entry in folder.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def _read_tail(path: Path, limit: int) -> str:
    """Read a regular file's last ``limit`` bytes without following symlinks ('' if absent)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return ""
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return ""
        if info.st_size > limit:
            os.lseek(fd, info.st_size - limit, os.SEEK_SET)
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)[-limit:].decode("utf-8", errors="replace")
    finally:
        os.close(fd)


@dataclass
class TaskValidation:
    """Outcome of running a task's oracle and a no-op agent (see :func:`validate_task`).

    Attributes:
        name: the task's name.
        oracle: verifier result after ``solution/solve.sh`` (None if it could not run).
        noop: verifier result of an agent that does nothing (None if it could not run).
        error: what went wrong building or running the task, else None.
        oracle_exit_code: exit status of ``solve.sh`` (None if it did not run).
    """

    name: str
    oracle: VerifierResult | None = None
    noop: VerifierResult | None = None
    error: str | None = None
    oracle_exit_code: int | None = None

    @property
    def ok(self) -> bool:
        """The oracle resolves the task (>= 1 test, all passed) and the no-op agent does not."""
        return (
            self.error is None
            and self.oracle is not None
            and self.oracle.resolved
            and self.noop is not None
            and not self.noop.resolved
        )


def validate_task(task: Task, root: Path, *, sandbox: str = "local") -> TaskValidation:
    """Run the no-op agent (reset, then verify) and the oracle (reset, ``solve.sh``, verify) on
    ``task``, each in a fresh episode under ``root``. Never raises for a broken task: the problem
    is in :attr:`TaskValidation.error`."""
    report = TaskValidation(task.name)
    try:
        with TerminalEnv(task, root=root, sandbox=sandbox, command_timeout_s=task.agent_timeout_s) as env:
            env.reset()
            report.noop = env.verify()
            env.reset()
            run = env.run_solution()
            report.oracle_exit_code = run.exit_code
            report.oracle = env.verify()
            if run.timed_out:
                report.error = f"solution/solve.sh timed out after {task.agent_timeout_s:g} s: {run.output[-500:]!r}"
    except (TaskError, SandboxError) as exc:
        report.error = str(exc)
    return report
