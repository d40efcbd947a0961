"""TerminalEnv: one task plus one sandbox for one episode (reset, step, verify, close).

The env talks to its sandbox only through the :class:`~t1async.envs.protocol.Sandbox` Protocol
(backend chosen by name in :data:`~t1async.envs.sandboxes.sandbox.SANDBOXES`), so the same episode runs on
bubblewrap here or on Modal. Episode scratch space on the host: ``<root>/<task>-<random>/``
(the local backend keeps ``app/``, ``tests/``, ``logs/`` there); :meth:`TerminalEnv.close`
removes it.

Environment build (:meth:`TerminalEnv.reset`). A backend that builds images (Modal) gets the
task's Dockerfile or image and does it all. Otherwise (local) the task must not be refused
(:attr:`Task.local_refusal`, see :mod:`t1async.envs.taskio.adapt`) and its Dockerfile subset is applied
in order: WORKDIR creates the folder; ENV (and ARG, for the build only) values are expanded
(``$VAR``/``${VAR}``) against the environment so far; COPY goes through :meth:`Sandbox.put`
(a folder source copies its contents); RUN runs ``/bin/sh -c`` in the sandbox from the current
WORKDIR with exactly the environment so far (``env -i``), as Docker does, with package installs
the host satisfies already replaced. The agent's shell then starts with every ENV applied (and
docker-compose ``environment`` entries), in the last WORKDIR.

Oracle (:meth:`TerminalEnv.run_solution`): a TB2 task's ``solution/`` folder is copied to
``/solution`` as Harbor's oracle does (staged through the otherwise empty /tests, which is emptied
again) and ``bash /solution/solve.sh`` runs in the agent's shell from the WORKDIR (stdin /dev/null)
with the task's agent timeout; /solution exists only once the oracle runs (the ``local`` backend
gives TB2 tasks with a solution an empty, private /solution folder to copy it into). TB1's
``solution.sh`` is staged in /tests and run as ``bash /tests/solution.sh``; TB1 ``solution.yaml``
steps are replayed one by one. The script's text never appears in a process's command line.

Network (:func:`network_allowed`): ``task`` (the default, training's) gives a sandbox network only
when the task says so (TB2 ``allow_internet``; TB1 declares nothing, so none); ``harness`` does
what the benchmark's harness does (TB1: always, TB2: ``allow_internet``), which ``t1async eval``
uses by default; ``on``/``off`` force it.

Verification (:meth:`TerminalEnv.verify`): ``tests/`` (and TB1's ``run-tests.sh``) are staged in
/tests (the local backend stages its adapted test script, see :mod:`t1async.envs.taskio.adapt`),
``/logs/verifier`` is emptied, and ``bash /tests/<script>`` runs from the WORKDIR in a clean
environment (the shell's starting one, so the agent's exported variables do not leak in; TB1
tasks with ``run_tests_in_same_shell`` run in the agent's shell as it is) with output to a fresh,
unpredictable file in /logs/verifier that the host then reads (bounded), with
``reward.txt``/``reward.json``. A verifier timeout kills every process the tests (or the agent)
started. A Harbor task with ``[verifier] environment_mode = "separate"`` is verified in a second
sandbox of its verifier's own image, with only its declared artifacts copied over
(:meth:`TerminalEnv._verify_separate`).
"""

from __future__ import annotations

import glob
import re
import secrets
import shlex
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path

from loguru import logger

from t1async.config import ContainerConfig

from .protocol import CommandResult, Sandbox, SandboxError, SandboxLimits, SandboxSpec, sandbox_environment
from .sandboxes.sandbox import SANDBOXES, check_sandbox_available, make_sandbox
from .taskio.loading import load_task
from .taskio.task import APP, Task, TaskError, TaskRefused, test_script_text
from .verifier import VerifierResult, verifier_result

SETUP_STEP_TIMEOUT_S = 300.0
"""Bound on one Dockerfile RUN step during reset, seconds."""

MAX_VERIFIER_READ_BYTES = 8 * 1024 * 1024
"""The verifier output file is read up to its last 8 MiB (the summary is at the end)."""

MAX_ARTIFACT_BYTES = 256 * 1024 * 1024
"""Bound on the artifacts handed to a separate verifier (one tar archive), bytes."""

DEFAULT_LIMITS = SandboxLimits()
"""Limits of a task that states no ``[environment]`` resources."""

_VAR = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")


def expand_vars(value: str, env: dict[str, str]) -> str:
    """Expand ``$VAR`` and ``${VAR}`` in ``value`` from ``env`` (unknown names become empty)."""
    return _VAR.sub(lambda m: env.get(m.group(1) or m.group(2), ""), value)


NETWORK_MODES = ("task", "harness", "on", "off")
"""Values of ``env.network`` and ``t1async eval --network`` (see :func:`network_allowed`)."""

SOLUTION_DIR = "/solution"
"""Where a TB2 task's ``solution/`` folder is copied for the oracle (Harbor's place)."""


def network_allowed(task: Task, mode: str = "task") -> bool:
    """Whether an episode of ``task`` gets network under ``mode`` (one of :data:`NETWORK_MODES`):
    ``task``: the task's own ``allow_internet`` (TB1 tasks declare none: off); ``harness``: as the
    benchmark's harness does (TB1: on, its containers have the engine's network; TB2: the task's
    ``allow_internet``); ``on``/``off``: always/never.

    Raises:
        ValueError: an unknown ``mode``.
    """
    if mode not in NETWORK_MODES:
        raise ValueError(f"network mode {mode!r} is not one of {', '.join(NETWORK_MODES)}")
    if mode in ("on", "off"):
        return mode == "on"
    if mode == "harness" and task.layout == "tb1":
        return True
    return bool(task.allow_internet)


def task_limits(task: Task, base: SandboxLimits | None = None) -> SandboxLimits:
    """``base`` (default :data:`DEFAULT_LIMITS`) with the task's own cpus, memory_mb and
    storage_mb where it states them."""
    base = base or DEFAULT_LIMITS
    return SandboxLimits(
        cpus=task.cpus or base.cpus,
        memory_mb=task.memory_mb or base.memory_mb,
        max_processes=base.max_processes,
        cpu_time_s=base.cpu_time_s,
        max_file_mb=base.max_file_mb,
        disk_mb=task.storage_mb or base.disk_mb,
    )


class TerminalEnv:
    """One episode of a task in a sandbox.

    Args:
        task: the loaded task.
        root: host folder under which episode folders are created.
        sandbox: backend name in :data:`~t1async.envs.sandboxes.sandbox.SANDBOXES`.
        command_timeout_s: per-command timeout of :meth:`step`, seconds.
        max_output_bytes: longest output per command, bytes (head and tail kept).
        verifier_timeout_s: overrides the task's verifier timeout when not None, seconds.
        limits: resource limits (default: :func:`task_limits` of the task).
        container: settings of the ``container`` backend (default: its defaults).
        log_dir: where to keep this episode's logs (the image build's ``build.log``); None: none.
        keep_agent_processes: leave what the agent left running alive through the verifier (the
            harnesses' behaviour); False: kill it first (``env.keep_agent_processes``).
        network: one of :data:`NETWORK_MODES` (``env.network``); :attr:`allow_network` is what
            it gives this task.

    Raises:
        SandboxUnavailable: at construction, when the backend cannot run here.
        TaskRefused: at construction, when the local backend refuses the task (the reason is
            :attr:`Task.local_refusal`).
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
        limits: SandboxLimits | None = None,
        container: ContainerConfig | None = None,
        log_dir: Path | None = None,
        keep_agent_processes: bool = False,
        network: str = "task",
    ):
        check_sandbox_available(sandbox)
        if (not SANDBOXES[sandbox].builds_image and task.local_refusal and not task.allow_internet
                and network_allowed(task, network)):  # planned without network at load: plan again with it
            task = load_task(task.path, network=True)
        if not SANDBOXES[sandbox].builds_image and task.local_refusal:
            raise TaskRefused(f"task {task.path}: refused by the {sandbox} sandbox: {task.local_refusal}")
        self.task = task
        self.root = Path(root)
        self.sandbox_name = sandbox
        self.command_timeout_s = command_timeout_s
        self.max_output_bytes = max_output_bytes
        self.verifier_timeout_s = task.verifier_timeout_s if verifier_timeout_s is None else verifier_timeout_s
        self.limits = limits or task_limits(task)
        self.container = container
        self.log_dir = log_dir
        self.keep_agent_processes = keep_agent_processes
        self.network = network
        self.allow_network = network_allowed(task, network)
        """Whether this task's sandboxes get network (see :func:`network_allowed`)."""
        self.stopped_agent_processes = 0
        """How many processes the agent left running the last :meth:`verify` killed first."""
        self.episode_dir: Path | None = None
        self.sandbox: Sandbox | None = None
        self.workdir = APP
        """The shell's starting folder: the Dockerfile's last WORKDIR (set by reset())."""
        self.env: dict[str, str] = {}
        """The shell's starting environment (the sandbox's plus the task's ENV), set by reset()."""
        self.host_mounts: tuple[tuple[str, str], ...] = ()
        self.host_ports: tuple[int, ...] = ()

    @classmethod
    def from_config(cls, task: Task, root: Path, env_cfg) -> TerminalEnv:
        """A TerminalEnv configured by an :class:`~t1async.config.EnvConfig` section (its sandbox
        backend, timeouts, output bound and limits)."""
        base = SandboxLimits(cpus=env_cfg.cpus, memory_mb=env_cfg.memory_mb, max_processes=env_cfg.max_processes,
                             cpu_time_s=env_cfg.cpu_time_s, max_file_mb=env_cfg.max_file_mb, disk_mb=env_cfg.disk_mb)
        return cls(task, root=root, sandbox=env_cfg.sandbox, command_timeout_s=env_cfg.command_timeout_s,
                   max_output_bytes=env_cfg.max_output_bytes, verifier_timeout_s=env_cfg.verifier_timeout_s or None,
                   limits=task_limits(task, base), container=env_cfg.container,
                   keep_agent_processes=env_cfg.keep_agent_processes, network=getattr(env_cfg, "network", "task"))

    @property
    def lends_host(self) -> bool:
        """Whether this backend runs a named harness with what it borrows of the host (:meth:`lend_host`):
        ``container``. ``local`` (bubblewrap) shares the host's ``/usr`` and Python already."""
        return bool(getattr(SANDBOXES[self.sandbox_name], "lends_host", False))

    def lend_host(self, mounts: tuple[tuple[str, str], ...], ports: tuple[int, ...]) -> None:
        """From the next :meth:`reset` on, bind ``mounts`` ((host path, path inside) pairs) read-only into the
        sandbox and serve the host loopback ``ports`` on its loopback (see :class:`SandboxSpec`)."""
        self.host_mounts, self.host_ports = tuple(mounts), tuple(ports)

    @property
    def workspace(self) -> Path:
        """Host folder bound at /app by the local backend (valid after :meth:`reset`)."""
        if self.episode_dir is None:
            raise SandboxError("no episode: call reset() first")
        return self.episode_dir / "app"

    def reset(self) -> str:
        """Start a fresh episode: new sandbox, the task's environment built, the shell started.

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
        self.episode_dir.mkdir(parents=True)
        base = sandbox_environment()
        env = dict(base)
        workdir = APP
        for step in self.task.steps:
            if step.instruction == "ENV":
                for key, value in zip(step.args[::2], step.args[1::2]):
                    env[key] = expand_vars(value, env)
            elif step.instruction == "WORKDIR":
                workdir = step.args[0]
        env.update(self.task.compose_env)
        builds = SANDBOXES[self.sandbox_name].builds_image
        self.env = env
        self.workdir = workdir
        task_env = {k: v for k, v in env.items() if base.get(k) != v} if not builds else dict(self.task.compose_env)
        spec = SandboxSpec(
            episode_dir=self.episode_dir, allow_network=self.allow_network,
            command_timeout_s=self.command_timeout_s, max_output_bytes=self.max_output_bytes, env=task_env,
            limits=self.limits, workdir=workdir if not builds else "/app", dockerfile=self.task.dockerfile,
            context_dir=self.task.context_dir, docker_image=self.task.docker_image, name=self.task.name,
            container=self.container, log_dir=self.log_dir, writable=self._writable(builds),
            services=tuple(self.task.services), host_mounts=self.host_mounts, host_ports=self.host_ports,
        )
        needs = self.task.verifier_needs
        if builds and needs is not None:
            spec.verifier_debs = tuple(needs.debs)
            spec.verifier_requirements = tuple(needs.requirements)
            spec.verifier_optional_debs = tuple(needs.optional_debs)
        self.sandbox = make_sandbox(self.sandbox_name, spec)
        try:
            self.sandbox.start()
            if builds:  # the image's own WORKDIR (Docker semantics): ask the shell
                self.workdir = self.sandbox.exec("pwd", timeout_s=30).output.strip() or APP
                self.sandbox.exec(f"cd {shlex.quote(self.workdir)}")
            else:
                self._build_environment(base)
        except BaseException:
            self.close()
            raise
        return self.task.instruction

    def _writable(self, builds: bool) -> tuple[str, ...]:
        """The task's writable folders, plus :data:`SOLUTION_DIR` for the oracle of a TB2 task on
        a backend that does not build images (its root is read-only)."""
        extra = (SOLUTION_DIR,) if not builds and self.task.layout == "tb2" and self.task.solution else ()
        return tuple(dict.fromkeys((*self.task.writable, *extra)))

    def _build_environment(self, base: dict[str, str]) -> None:
        """Apply the Dockerfile subset in order through the sandbox (local backend)."""
        assert self.sandbox is not None
        env = dict(base)
        build_args: dict[str, str] = {}
        for step in self.task.steps:
            if step.instruction == "WORKDIR":
                self.sandbox.exec(f"mkdir -p {shlex.quote(step.args[0])}")
            elif step.instruction == "ENV":
                for key, value in zip(step.args[::2], step.args[1::2]):
                    env[key] = expand_vars(value, {**build_args, **env})
            elif step.instruction == "ARG":
                build_args[step.args[0]] = expand_vars(step.args[1], {**build_args, **env})
            elif step.instruction == "COPY":
                context = str(self.task.environment_dir)
                sources = sorted(Path(p) for s in step.args[:-1] for p in glob.glob(f"{context}/{s}"))
                self.sandbox.put(sources, step.args[-1])
            elif step.instruction == "RUN":
                assignments = " ".join(shlex.quote(f"{k}={v}") for k, v in {**build_args, **env}.items())
                command = (f"mkdir -p {shlex.quote(step.workdir)} && cd {shlex.quote(step.workdir)} && "
                           f"env -i {assignments} /bin/sh -c {shlex.quote(step.args[0])}")
                result = self._exec(command, SETUP_STEP_TIMEOUT_S, what=f"Dockerfile:{step.line}")
                if result.exit_code != 0:
                    raise TaskError(
                        f"task {self.task.path}: {self.task.dockerfile.name if self.task.dockerfile else 'Dockerfile'}:"
                        f"{step.line} `RUN {step.args[0][:200]}` failed with exit code {result.exit_code}"
                        f"{' (timed out)' if result.timed_out else ''}: {result.output[-1500:]!r}; fix the step (the "
                        "local sandbox runs it as an unprivileged user without network unless allow_internet = "
                        "true, and only /app, /tmp and HOME are writable)"
                    )

    def _exec(self, command: str, timeout_s: float | None = None, *, what: str = "command") -> CommandResult:
        """:meth:`Sandbox.exec`, recorded in ``log_dir/commands.log`` (command, status, seconds, output)."""
        assert self.sandbox is not None
        result = self.sandbox.exec(command, timeout_s=timeout_s)
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            with open(self.log_dir / "commands.log", "a") as handle:
                handle.write(f"### {what} (exit {result.exit_code}{', timed out' if result.timed_out else ''}, "
                             f"{result.seconds:.2f} s)\n$ {command}\n{result.output}"
                             f"{'' if result.output.endswith(chr(10)) or not result.output else chr(10)}\n")
        return result

    def step(self, command: str) -> CommandResult:
        """Run one agent command in the episode's shell (see :meth:`Sandbox.exec`)."""
        if self.sandbox is None:
            raise SandboxError("no episode: call reset() before step()")
        return self._exec(command, what="agent")

    def run_agent(self, command: str, timeout_s: float) -> CommandResult:
        """Run a named agent harness (``rollout.agent``, t1async/rollout/harnesses.py) as one command in the episode's shell,
        killed with every process it started after ``timeout_s`` seconds (see :meth:`Sandbox.exec`)."""
        if self.sandbox is None:
            raise SandboxError("no episode: call reset() before run_agent()")
        return self._exec(command, timeout_s, what="agent harness")

    def run_solution(self) -> CommandResult:
        """Run the task's oracle solution (see the module docstring).

        Raises:
            TaskError: the task has no runnable solution (none, or TB1's solution.yaml).
        """
        if self.sandbox is None:
            raise SandboxError("no episode: call reset() before run_solution()")
        solve = self.task.solution_path
        if solve is None and self.task.solution_commands:
            return self._replay_commands()
        if solve is None:
            raise TaskError(self.task.solution_refusal or
                            f"task {self.task.path}: missing solution/solve.sh; add an oracle solution to validate the task")
        self.sandbox.clear("/tests")
        if self.task.layout != "tb2":
            self.sandbox.put([solve], "/tests/")
            return self._exec(f"cd {shlex.quote(self.workdir)} && bash /tests/{shlex.quote(solve.name)}",
                              self.task.agent_timeout_s, what="oracle")
        self.sandbox.put([solve.parent], "/tests/")
        # Harbor copies solution/ to /solution; the sandbox API writes under /app, /tests and /logs
        # only, so the folder is staged in /tests and copied by the shell (the image's user).
        staged = self._exec(f"rm -rf {SOLUTION_DIR} 2>/dev/null; mkdir -p {SOLUTION_DIR} && "
                            f"cp -R /tests/. {SOLUTION_DIR}/", 60.0, what=f"oracle: stage {SOLUTION_DIR}")
        note = ""
        folder = SOLUTION_DIR
        if staged.exit_code == 0:
            self.sandbox.clear("/tests")
        else:  # e.g. an image whose USER may not create /solution: say so, run it where it is
            folder = "/tests"
            note = (f"[t1async: {SOLUTION_DIR} could not be created ({staged.output.strip()[-200:]}); the oracle runs "
                    "from /tests]\n")
        run = self._exec(f"cd {shlex.quote(self.workdir)} && bash {folder}/{shlex.quote(solve.name)}",
                         self.task.agent_timeout_s, what="oracle")
        return replace(run, output=note + run.output) if note else run

    def _replay_commands(self) -> CommandResult:
        """TB1 ``solution.yaml`` steps, one command each in the agent's shell; the results merged
        (outputs joined, the last exit status, timed out if any step did)."""
        assert self.sandbox is not None
        self.sandbox.exec(f"cd {shlex.quote(self.workdir)}")
        results = [self._exec(command, timeout, what="solution.yaml step") for command, timeout in self.task.solution_commands]
        return CommandResult("".join(r.output for r in results), results[-1].exit_code, any(r.timed_out for r in results),
                             any(r.truncated for r in results), sum(r.seconds for r in results))

    def verify(self) -> VerifierResult:
        """Run the task's verifier against the current state of the sandbox.

        Returns:
            The parsed per-test result (``error`` set on a timeout or a missing pytest summary).

        Raises:
            SandboxError: no episode, or the sandbox failed.
        """
        if self.sandbox is None or self.episode_dir is None:
            raise SandboxError("no episode: call reset() before verify()")
        task = self.task
        if task.verifier_mode == "separate":
            return self._verify_separate()
        assert task.test_script is not None
        script = task.test_script.name
        self.sandbox.clear("/tests")
        if task.tests_dir.is_dir():
            self.sandbox.put([task.tests_dir], "/tests/")
        if task.layout == "tb1" and task.test_script.is_file():
            self.sandbox.put([task.test_script], "/tests/")
        # The container flavour of the scripts only where the verifier layer holds what they no
        # longer install (env.container.verifier_tools false: the scripts run as written).
        layer = getattr(type(self.sandbox), "verifier_layer", False) and bool(getattr(self.sandbox, "verifier_python", ""))
        adapted_text = task.container_test_script if layer else (None if self.sandbox.builds_image else task.local_test_script)
        if adapted_text is None and not task.test_script.is_file():
            adapted_text = test_script_text(task)  # the TB1 harness default
        helpers = task.container_helpers if layer else ({} if self.sandbox.builds_image else task.local_helpers)
        for rel, text in {**helpers, **({script: adapted_text} if adapted_text is not None else {})}.items():
            adapted = self.episode_dir / "adapted" / rel
            adapted.parent.mkdir(parents=True, exist_ok=True)
            adapted.write_text(text)
            self.sandbox.put([adapted], f"/tests/{rel}")
        python = getattr(self.sandbox, "verifier_python", "") if layer else ""
        verifier_env = f"T1ASYNC_VERIFIER_PYTHON={shlex.quote(python)} " if python else ""
        # Nothing the agent started may run beside the verifier: a left-over process of the same
        # uid could kill pytest and forge its output (reward hacking). Tasks whose tests need a
        # service the agent started need env.keep_agent_processes (the harnesses' behaviour).
        stopped = 0 if self.keep_agent_processes else self.sandbox.end_agent()
        self.stopped_agent_processes = stopped
        if stopped:
            logger.debug("stopped {} process(es) the agent left running before verifying {}", stopped, task.name)
        self.sandbox.clear("/logs/verifier")  # the agent may have planted files or symlinks there
        # A shell the agent left unable to answer (e.g. `exec >/dev/null`) is restarted here,
        # within seconds, instead of costing the whole verifier timeout.
        self.sandbox.exec("true", timeout_s=3.0)
        output_name = f"test_output.{secrets.token_hex(6)}.txt"
        run_script = f"bash /tests/{shlex.quote(script)} > /logs/verifier/{output_name} 2>&1"
        cd = f"cd {shlex.quote(self.workdir)}"
        # An agent-planted /app/pytest.py cannot replace pytest: the adapted test script imports
        # pytest with the working folder off sys.path (t1async/envs/taskio/pytest_runner.py PYTEST_RUNNER). The script's
        # environment is otherwise the harness's (no PYTHONSAFEPATH: `python /app/tool.py` run by
        # a test must import its sibling modules, as under the harness).
        if task.run_tests_in_same_shell:
            command = f"{cd} && {verifier_env}TEST_DIR=/tests {run_script}"
        elif self.sandbox.builds_image:  # the image's environment, as pid 1 (the container) has it
            command = (f"{cd} && xargs -0 -a /proc/1/environ sh -c 'exec env -i \"$@\" TEST_DIR=/tests "
                       f"{verifier_env}bash /tests/{shlex.quote(script)}' sh > /logs/verifier/{output_name} 2>&1")
        else:
            assignments = " ".join(shlex.quote(f"{k}={v}") for k, v in self.env.items())
            command = f"{cd} && env -i {assignments} {run_script}"
        started = time.monotonic()
        run = self._exec(command, self.verifier_timeout_s, what="verifier")
        seconds = time.monotonic() - started
        output = self.sandbox.read(f"/logs/verifier/{output_name}", MAX_VERIFIER_READ_BYTES).decode("utf-8", "replace")
        if run.output.strip():  # a failure of the wrapper itself (cd, env, a restart note)
            output += ("\n" if output and not output.endswith("\n") else "") + run.output
        rewards = {}
        for name in ("reward.txt", "reward.json"):
            data = self.sandbox.read(f"/logs/verifier/{name}", 64 * 1024)
            rewards[name] = data.decode("utf-8", "replace") if data else None
        result = verifier_result(
            output,
            seconds=seconds,
            exit_code=None if run.timed_out else run.exit_code,
            timed_out_after_s=self.verifier_timeout_s if run.timed_out else None,
            reward_txt=rewards["reward.txt"],
            reward_json=rewards["reward.json"],
            script=str(task.test_script.relative_to(task.path)) if task.test_script.is_relative_to(task.path) else script,
            instruction=task.instruction,
        )
        logger.debug("verified {}: {}/{} passed, error={}", task.name, result.passed, result.total, result.error)
        return result

    def _collect_artifacts(self) -> bytes:
        """A tar archive (paths relative to ``/``) of the task's :attr:`Task.artifacts` that exist
        in the agent's sandbox, made there and read back (at most :data:`MAX_ARTIFACT_BYTES`).

        Raises:
            SandboxError: the archive could not be made or is larger than the bound.
        """
        assert self.sandbox is not None
        staged = "/logs/.t1async-artifacts.tar"
        paths = " ".join(shlex.quote(p) for p in self.task.artifacts)
        made = self._exec(f"( cd / && set -- && for p in {paths}; do [ -e \"$p\" ] && set -- \"$@\" \".${{p}}\"; done; "
                          f"tar -cf {staged} -T /dev/null \"$@\" && wc -c < {staged} )", 300.0,
                          what="verifier: collect artifacts")
        size = made.output.strip().splitlines()[-1] if made.output.strip() else ""
        if made.exit_code != 0 or not size.isdigit():
            raise SandboxError(f"the artifacts {list(self.task.artifacts)} could not be collected for the separate "
                               f"verifier: {made.output.strip()[-300:]!r}")
        if int(size) > MAX_ARTIFACT_BYTES:
            raise SandboxError(f"the artifacts {list(self.task.artifacts)} are {int(size)} bytes, more than the "
                               f"{MAX_ARTIFACT_BYTES} bytes t1async hands to a separate verifier")
        return self.sandbox.read(staged, MAX_ARTIFACT_BYTES)

    def _verify_separate(self) -> VerifierResult:
        """Harbor's ``[verifier] environment_mode = "separate"``: the agent's declared artifacts
        (and ``/logs/artifacts``) are copied, at the same absolute paths, into a fresh sandbox of
        the verifier's own image (``tests/Dockerfile`` built with tests/ as its context, or
        ``[verifier.environment] docker_image``), whose ``/tests/test.sh`` (the image's own: tests
        are not uploaded) runs there as root's image environment gives it; the reward files are
        read from that sandbox, which is then removed. Nothing else of the agent's container
        (processes, other files) reaches the tests.

        Raises:
            SandboxError: the artifacts could not be handed over or the verifier sandbox failed
                (an infrastructure failure: no trajectory).
            BuildError: the verifier's image could not be built.
        """
        assert self.sandbox is not None and self.episode_dir is not None
        task = self.task
        self.stopped_agent_processes = 0 if self.keep_agent_processes else self.sandbox.end_agent()
        handoff = self.episode_dir / "verifier-artifacts.tar"
        handoff.write_bytes(self._collect_artifacts())
        spec = SandboxSpec(
            episode_dir=self.episode_dir / "verifier", allow_network=self.allow_network,
            command_timeout_s=self.command_timeout_s, max_output_bytes=self.max_output_bytes, limits=self.limits,
            dockerfile=task.verifier_dockerfile, context_dir=task.tests_dir, docker_image=task.verifier_image,
            name=f"{task.name}-verifier", container=self.container, log_dir=self.log_dir)
        spec.episode_dir.mkdir(parents=True, exist_ok=True)
        verifier = make_sandbox(self.sandbox_name, spec)
        try:
            verifier.start()
            verifier.put([handoff], "/logs/")
            unpacked = verifier.exec(f"tar -xpf /logs/{handoff.name} -C / && rm -f /logs/{handoff.name}", timeout_s=300)
            if unpacked.exit_code != 0:
                raise SandboxError(f"the artifacts could not be unpacked in the verifier's container: "
                                   f"{unpacked.output.strip()[-300:]!r}")
            verifier.clear("/logs/verifier")
            workdir = verifier.exec("pwd", timeout_s=30).output.strip() or "/"
            output_name = f"test_output.{secrets.token_hex(6)}.txt"
            command = (f"cd {shlex.quote(workdir)} && xargs -0 -a /proc/1/environ sh -c 'exec env -i \"$@\" "
                       f"TEST_DIR=/tests bash /tests/test.sh' sh > /logs/verifier/{output_name} 2>&1")
            started = time.monotonic()
            run = verifier.exec(command, timeout_s=self.verifier_timeout_s)
            seconds = time.monotonic() - started
            output = verifier.read(f"/logs/verifier/{output_name}", MAX_VERIFIER_READ_BYTES).decode("utf-8", "replace")
            if run.output.strip():
                output += ("\n" if output and not output.endswith("\n") else "") + run.output
            rewards = {name: (verifier.read(f"/logs/verifier/{name}", 64 * 1024) or None)
                       for name in ("reward.txt", "reward.json")}
        finally:
            verifier.close()
        return verifier_result(
            output, seconds=seconds, exit_code=None if run.timed_out else run.exit_code,
            timed_out_after_s=self.verifier_timeout_s if run.timed_out else None,
            reward_txt=rewards["reward.txt"].decode("utf-8", "replace") if rewards["reward.txt"] else None,
            reward_json=rewards["reward.json"].decode("utf-8", "replace") if rewards["reward.json"] else None,
            script="tests/test.sh (in the separate verifier's image)", instruction=task.instruction)

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
    if task.solution_path is None and not task.solution_commands and task.solution_refusal:
        report.error = task.solution_refusal
        return report
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
