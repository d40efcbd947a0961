"""The ``container`` sandbox backend: one OCI container per episode, built from the task's own
Dockerfile by podman or docker (:mod:`t1async.envs.images.engine`), with one persistent ``bash`` in it.

Lifecycle:

* :meth:`ContainerSandbox.start`: the task image (built once per content hash; a task without a
  Dockerfile gets its ``docker_image`` or ``debian:bookworm``), plus the verifier layer when the
  episode code asks for one (:attr:`SandboxSpec.verifier_debs`/``verifier_requirements``); then
  ``<engine> run -d`` of :data:`KEEPER` as the container's main process (pid 1) with
  ``--network=none`` (unless the task allows internet), ``--cpus``, ``--memory`` (=
  ``--memory-swap``), ``--pids-limit``, explicit ``--ulimit`` nofile/nproc (engine defaults fail
  with EPERM on some hosts), ``fsize`` and ``cpu`` rlimits; then one ``<engine> exec -i`` of
  ``bash --noprofile --norc`` in the image's WORKDIR (``spec.workdir`` when the image sets
  none), driven over pipes with the sentinel protocol of :mod:`t1async.envs.sandboxes.shell_io`, so cwd
  and exported variables carry over (an ``exec`` costs about 0.19 s here; a command through the
  persistent shell costs about a millisecond). The image's environment applies, with
  :data:`SHELL_ENV` on top.
* Timeouts: every process of the container but pid 1 and the shell is SIGKILLed (the command's
  whole process group, ``setsid`` and double-forked daemons alike), from the host through the
  container's pids cgroup (so it works at the process limit too), else with
  :data:`~t1async.envs.sandboxes.shell_io.KILL_SCRIPT` in a second ``exec``; a shell that still does not
  answer is replaced by a new one.
* Limits that refused something are read from the container's own cgroup v1 counters on the host
  (``pids.events``, ``memory.oom_control``) when visible, as the local backend does.
* Files: :meth:`put` streams a tar archive into ``exec -i tar -x`` (one call, Docker COPY
  semantics, owned by the container's user); :meth:`clear`/:meth:`read` are one ``exec`` each.
* Sidecars (:attr:`SandboxSpec.services`, a docker-compose.yaml's other services): each image
  is built like the task's, and each runs as its own container in the agent container's network
  namespace (``--network container:NAME``: no network beyond the agent's; the task's memory and
  process limits apply to each), its name mapped to
  127.0.0.1 in the agent's ``/etc/hosts``; when the agent's service ``depends_on`` one with
  ``condition: service_healthy``, start waits for its health check (run inside it) to pass.
* A named harness (:attr:`SandboxSpec.host_mounts`, ``host_ports``): its host install bound read-only
  (``-v HOST:INSIDE:ro``), and the rollout actor's endpoint port served on the container's own loopback
  by :class:`~t1async.envs.sandboxes.loopback_relay.LoopbackRelay` (the container's network is unchanged).
* :meth:`close`: the relay, then ``<engine> rm -f`` (the sidecars, then the container and every process in it).

What the agent sees is what the task's author built: any path writable, the image's tools and
users. ``/app``, ``/tests`` and ``/logs`` are created at start; the tests are copied in only at
verification (see :mod:`t1async.envs.terminal`), and the verifier runs in the same container (a
Harbor task with a separate verifier environment gets a second sandbox of its verifier's image
instead, see :meth:`~t1async.envs.terminal.TerminalEnv.verify`).
"""

from __future__ import annotations

import io
import json
import os
import secrets
import socket
import subprocess
import tarfile
import time
from pathlib import Path
from typing import Sequence

from loguru import logger

from t1async.config import ContainerConfig

from ..images.engine import ENGINE_CWD, BuildError, Engine, ca_mounts, resolve_engine
from ..images.task_images import ensure_task_image, ensure_verifier_image
from ..protocol import CommandResult, SandboxError, SandboxSpec, ServiceSpec, split_root
from .limits import LimitGroup
from .loopback_relay import LoopbackRelay
from .shell_io import (
    EOF,
    KILL_SCRIPT,
    TIMEOUT,
    OutputBuffer,
    Sentinel,
    clear_command,
    close_pipes,
    kill_repeatedly,
    process_status,
    read_command,
    read_to_marker,
    write_all,
)

SHELL_ENV = {"TERM": "dumb", "PAGER": "cat", "GIT_PAGER": "cat", "DEBIAN_FRONTEND": "noninteractive",
             "PYTHONUNBUFFERED": "1", "TEST_DIR": "/tests"}
"""Variables the shell gets on top of the image's own environment."""

KILL_GRACE_S = 3.0
"""After a timeout kill, how long to wait for the shell's sentinel before replacing the shell."""

SHELL_START_TRIES = 3
"""Starts of the shell's exec session when it ends before the shell answers (see ``_start_shell``)."""

CALL_TIMEOUT_S = 60.0
"""Bound on one ``exec`` used for files and kills, seconds."""

KEEPER = "trap '' TERM INT HUP; while :; do tail -f /dev/null & wait; done"
"""The container's main process (pid 1): the kernel ignores signals to a namespace's init from
inside it, so a ``kill -9 -1`` of the agent's cannot stop the container (with ``--init`` it
could: killing the init's only child ends it); its ``wait`` reaps adopted orphans, and a killed
``tail`` is restarted (``tail``, not ``sleep``, so that the agent's ``pgrep sleep`` finds only its own)."""

LABEL = "t1async.sandbox=1"
"""Label on every container this backend starts (``podman ps -a --filter label=...`` finds leftovers)."""

OWNER_LABELS = ("t1async.owner.host", "t1async.owner.pid", "t1async.owner.start", "t1async.episode_dir")
"""Labels naming who owns a container: the host, pid and start time (clock ticks since boot, from
``/proc/PID/stat``, so a reused pid is not mistaken for the owner) of the process that started
it, and its episode folder. :func:`remove_orphan_containers` removes those whose owner is dead."""


def _start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (``/proc/PID/stat`` field 22), or None."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(raw[raw.rindex(")") + 2:].split()[19])


def owner_labels(episode_dir: Path | None) -> list[str]:
    """``--label`` options that name this process as a container's owner (see :data:`OWNER_LABELS`)."""
    values = (socket.gethostname(), str(os.getpid()), str(_start_ticks(os.getpid()) or 0),
              str(episode_dir.resolve()) if episode_dir is not None else "")
    return [opt for key, value in zip(OWNER_LABELS, values) for opt in ("--label", f"{key}={value}")]


def remove_orphan_containers(under: Path, cfg: ContainerConfig | None = None) -> list[str]:
    """Remove every container of this backend whose episode folder lies under ``under`` and whose
    owner (see :data:`OWNER_LABELS`) is dead on this host; containers of live owners, of other
    hosts, or without owner labels are left alone. Without a usable engine, nothing is done.

    Called when a rollout actor starts (a killed predecessor's containers), by the reaper after
    ``kill -9`` of a launch, and by a launch into a run folder that holds an earlier run.

    Returns:
        The names of the containers removed.
    """
    try:
        engine = resolve_engine(cfg)
    except SandboxError:
        return []
    listed = engine.run("ps", "-a", "--filter", f"label={LABEL}", "--format", "{{.Names}}\t{{json .Labels}}",
                        check=False, timeout_s=60)
    root = str(Path(under).resolve()).rstrip("/") + "/"
    host = socket.gethostname()
    removed = []
    for line in listed.stdout.decode(errors="replace").splitlines():
        name, _, labels_json = line.partition("\t")
        try:
            labels = json.loads(labels_json) or {}
        except json.JSONDecodeError:
            continue
        episode = labels.get("t1async.episode_dir", "")
        if not episode or not (episode + "/").startswith(root) or labels.get("t1async.owner.host") != host:
            continue
        try:
            pid, start = int(labels.get("t1async.owner.pid", "")), int(labels.get("t1async.owner.start", ""))
        except ValueError:
            continue
        if pid > 0 and _start_ticks(pid) == start:
            continue  # its owner is alive
        force = ["-f", "-t", "0"] if engine.name == "podman" else ["-f"]
        engine.run("rm", *force, name, check=False, timeout_s=60)
        removed.append(name)
    if removed:
        logger.warning("removed {} container(s) whose owner had died: {}", len(removed), ", ".join(removed))
    return removed


class ContainerSandbox:
    """An OCI container with one persistent ``bash`` (see the module docstring).

    Args:
        spec: the episode's sandbox spec (image source, limits, network, timeouts).
        cfg: engine settings (default :class:`~t1async.config.ContainerConfig`; ``spec.container``
            when set).

    Raises:
        SandboxUnavailable: from :meth:`start`, when no engine is usable.
        SandboxError: from :meth:`start` when the build or the container fails (a
            :class:`~t1async.envs.images.engine.BuildError` for a failed build).
    """

    builds_image = True
    lends_host = True
    """It binds :attr:`SandboxSpec.host_mounts` and relays :attr:`SandboxSpec.host_ports` (a named harness)."""
    verifier_layer = True
    """The episode code stages the container flavour of the test script (see :mod:`t1async.envs.taskio.adapt`)."""

    def __init__(self, spec: SandboxSpec, cfg: ContainerConfig | None = None):
        self.spec = spec
        self.cfg = cfg or spec.container or ContainerConfig()
        self.command_timeout_s = spec.command_timeout_s
        self.max_output_bytes = spec.max_output_bytes
        self.engine: Engine | None = None
        self.image = ""
        """The image the container runs (valid after :meth:`start`)."""
        self.verifier_python = ""
        """The verifier layer's Python inside the container, or "" without the layer."""
        self.notes: list[str] = []
        """What differed from the request (a verifier layer that could not be built, ...)."""
        self.timings: dict[str, float] = {}
        """Seconds spent in ``image`` (build or cache hit), ``run`` and ``shell`` at start."""
        self.workdir = spec.workdir
        self.name = ""
        self._proc: subprocess.Popen[bytes] | None = None
        self._sentinel = Sentinel()
        self._shell_pid = 0
        self._group: LimitGroup | None = None
        self.restarts = 0
        self._service_images: list[str] = []
        self._services: list[str] = []
        """Names of the running sidecar containers (removed before the main one)."""
        self._pid = ""
        """Host pid of the container's main process (after start)."""
        self._relay: LoopbackRelay | None = None

    @classmethod
    def from_spec(cls, spec: SandboxSpec) -> ContainerSandbox:
        """A container sandbox for ``spec`` (not started)."""
        return cls(spec)

    # ----------------------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Build or find the image, start the container and the shell (see the module docstring)."""
        if self.name:
            raise SandboxError("sandbox already started: call close() before starting it again")
        self.engine = resolve_engine(self.cfg)
        spec = self.spec
        log = spec.log_dir / "build.log" if spec.log_dir is not None else None
        started = time.monotonic()
        self.image = ensure_task_image(self.engine, name=spec.name, dockerfile=spec.dockerfile,
                                       context_dir=spec.context_dir, docker_image=spec.docker_image, log=log)
        if spec.verifier_requirements is not None and self.cfg.verifier_tools:
            try:
                self.image = ensure_verifier_image(self.engine, self.image, debs=list(spec.verifier_debs),
                                                   requirements=list(spec.verifier_requirements), log=log,
                                                   optional_debs=[list(g) for g in spec.verifier_optional_debs])
            except BuildError as exc:
                # The task's own install lines became `true` in its adapted test script: without the
                # layer its tests would run without what they install, and a 0/N would read as the
                # agent's failure. So the episode fails, naming what could not be installed.
                raise BuildError(f"verifier layer (what the test script installs: Debian "
                                 f"{', '.join(spec.verifier_debs) or 'none'}; Python "
                                 f"{', '.join(spec.verifier_requirements) or 'pytest'}) could not be built: "
                                 f"{exc}") from None
            self.verifier_python = "/opt/t1async-verifier/bin/python"
        self._service_images = [
            ensure_task_image(self.engine, name=f"{spec.name}-{svc.name}", dockerfile=svc.dockerfile,
                              context_dir=svc.context_dir, docker_image=svc.image, log=log)
            for svc in spec.services]
        self.timings["image"] = time.monotonic() - started
        try:
            self._run_container()
            self._run_services()
            self._start_shell()
        except BaseException:
            self.close()
            raise

    def _run_container(self) -> None:
        assert self.engine is not None
        spec, limits = self.spec, self.spec.limits
        started = time.monotonic()
        config = self.engine.image_config(self.image)
        image_workdir = config.get("WorkingDir") or ""
        self.workdir = image_workdir if image_workdir not in ("", "/") else spec.workdir
        self.name = f"t1async-{_slug(spec.name)}-{secrets.token_hex(4)}"
        args = ["run", "-d", "--name", self.name, "--label", LABEL, *owner_labels(spec.episode_dir),
                "--hostname", "sandbox", *self.engine.ulimits()]
        if not spec.allow_network:
            args.append("--network=none")
        elif spec.episode_dir is not None:
            args += ca_mounts(self.cfg, spec.episode_dir / "ca")
        if limits.cpus:
            args += ["--cpus", f"{limits.cpus:g}"]
        if limits.memory_mb:
            args += ["--memory", f"{int(limits.memory_mb)}m", "--memory-swap", f"{int(limits.memory_mb)}m"]
        if limits.max_processes:
            args += ["--pids-limit", str(int(limits.max_processes))]
        if limits.max_file_mb:
            size = int(limits.max_file_mb) << 20
            args += ["--ulimit", f"fsize={size}:{size}"]
        if limits.cpu_time_s:
            args += ["--ulimit", f"cpu={int(limits.cpu_time_s)}:{int(limits.cpu_time_s) + 1}"]
        for host, inside in spec.host_mounts:
            args += ["-v", f"{host}:{inside}:ro"]
        args += ["--entrypoint", "/bin/sh", self.image, "-c", KEEPER]
        self.engine.run(*args, timeout_s=self.cfg.start_timeout_s)
        self.timings["run"] = time.monotonic() - started
        self._watch_cgroups()
        if spec.host_ports:
            if not self._pid.isdigit():
                raise SandboxError(f"container {self.name}: its main process is not visible from here "
                                   f"(inspect gave {self._pid!r}): cannot serve the agent endpoint inside it")
            self._relay = LoopbackRelay(f"/proc/{self._pid}/ns/net", spec.host_ports)
            self._relay.start()
        self._exec_simple(["sh", "-c", "mkdir -p /app /tests /logs/verifier"], user="0")

    def _run_services(self) -> None:
        """Start the sidecars in the container's network namespace, name them in its /etc/hosts,
        and wait for the health checks the agent's service depends on (see the module docstring).

        Raises:
            SandboxError: a sidecar did not start, or its health check did not pass in time
                (the message has the tail of its log).
        """
        assert self.engine is not None
        if not self.spec.services:
            return
        started = time.monotonic()
        for svc, image in zip(self.spec.services, self._service_images):
            name = f"{self.name}-{_slug(svc.name)}"
            env = [opt for key, value in svc.environment for opt in ("-e", f"{key}={value}")]
            limits = self.spec.limits  # each sidecar gets the task's memory and process limits too
            if limits.memory_mb:
                env += ["--memory", f"{int(limits.memory_mb)}m", "--memory-swap", f"{int(limits.memory_mb)}m"]
            if limits.max_processes:
                env += ["--pids-limit", str(int(limits.max_processes))]
            self.engine.run("run", "-d", "--name", name, "--label", LABEL, *owner_labels(self.spec.episode_dir),
                            "--network", f"container:{self.name}",
                            *self.engine.ulimits(), *env, image, *(svc.command or ()), timeout_s=self.cfg.start_timeout_s)
            self._services.append(name)
        hosts = "".join(f"127.0.0.1 {svc.name}\n" for svc in self.spec.services)
        self._exec_simple(["sh", "-c", 'printf "%s" "$1" >> /etc/hosts', "sh", hosts], user="0")
        for svc, name in zip(self.spec.services, self._services):
            if svc.wait_healthy and svc.healthcheck:
                self._wait_healthy(svc, name)
        self.timings["services"] = time.monotonic() - started

    def _wait_healthy(self, svc: ServiceSpec, name: str) -> None:
        """Run ``svc``'s health check inside ``name`` until it passes (start period, then up to
        ``health_retries`` failures ``health_interval_s`` apart)."""
        assert self.engine is not None and svc.healthcheck
        deadline = time.monotonic() + svc.health_start_period_s + svc.health_retries * svc.health_interval_s
        failures, last = 0, b""
        while True:
            done = self.engine.run("exec", name, *svc.healthcheck, check=False, timeout_s=CALL_TIMEOUT_S)
            if done.returncode == 0:
                return
            last = (done.stdout or b"") + (done.stderr or b"")
            failures += 1
            if time.monotonic() >= deadline and failures >= svc.health_retries:
                break
            time.sleep(svc.health_interval_s)
        logs = self.engine.run("logs", "--tail", "20", name, check=False, timeout_s=30)
        raise SandboxError(
            f"service {svc.name!r} of task {self.spec.name} did not become healthy ({failures} failed checks; last: "
            f"{last.decode('utf-8', 'replace').strip()[-300:]!r}); its log ends: "
            f"{((logs.stdout or b'') + (logs.stderr or b'')).decode('utf-8', 'replace').strip()[-600:]!r}")

    def _watch_cgroups(self) -> None:
        """Find the container's pids/memory cgroup v1 folders on the host, for refusal notes."""
        assert self.engine is not None
        out = self.engine.run("inspect", "--format", "{{.State.Pid}}", self.name, check=False, timeout_s=30)
        pid = self._pid = out.stdout.decode().strip()
        groups: dict[str, Path] = {}
        try:
            lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
        except OSError:
            lines = []
        for line in lines:
            _, names, path = line.split(":", 2)
            for controller in ("pids", "memory"):
                folder = Path("/sys/fs/cgroup") / controller / path.lstrip("/")
                if controller in names.split(",") and folder.is_dir():
                    groups[controller] = folder
        self._group = LimitGroup.watch(self.spec.limits, groups)

    def _start_shell(self) -> None:
        """Start the persistent shell with ``<engine> exec -i``; its pid in the container.

        An exec session that ends before the shell answers (EOF) is started again, up to
        :data:`SHELL_START_TRIES` times with 0.5, 1, 2 s between, after SIGKILLing every process
        of the container but pid 1 (the old shell included): runc's exec fails (``read init-p:
        connection reset by peer``) while the container's pids cgroup is full, as after a fork
        bomb that outlived its command's timeout kill on a loaded machine. Each retry is logged.

        Raises:
            SandboxError: the shell did not answer after the last try, or answered something else
                than its pid (an image without bash).
        """
        assert self.engine is not None
        started = time.monotonic()
        env = [opt for key, value in {**SHELL_ENV, **self.spec.env}.items() for opt in ("-e", f"{key}={value}")]
        self._exec_simple(["mkdir", "-p", self.workdir])
        for attempt in range(1, SHELL_START_TRIES + 1):
            self._proc = subprocess.Popen(
                # stderr joins stdout inside the container: the engine relays the two on separate
                # streams, which would reorder a command's error after its end-of-command marker
                [*self.engine.argv, "exec", "-i", "-w", self.workdir, *env, self.name, "bash", "--noprofile",
                 "--norc", "-c", "exec 2>&1; exec bash --noprofile --norc"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                cwd=ENGINE_CWD)
            status, output, _ = self._run("printf '%s\\n' \"$$\"", self.cfg.start_timeout_s)
            if status == 0 and output.strip().isdigit():
                break
            if status != EOF or attempt == SHELL_START_TRIES:
                raise SandboxError(f"the container's shell did not answer at start (status {status}, output "
                                   f"{output.strip()[:300]!r}, try {attempt} of {SHELL_START_TRIES}); does the "
                                   f"image {self.image} have bash?")
            self._stop_shell()
            # a full pids cgroup (a fork bomb the timeout kill did not finish, the old shell still
            # forking) makes runc's exec fail: clear every process but pid 1 before the next try
            self._shell_pid = 0
            killed = self._kill_commands()
            logger.warning("container {}: the engine's exec session ended before the shell answered ({!r}); "
                           "killed {} process(es) in it, starting the shell again (try {} of {})", self.name,
                           output.strip()[:200], killed, attempt + 1, SHELL_START_TRIES)
            time.sleep(0.5 * 2 ** (attempt - 1))
        self._shell_pid = int(output.strip())
        self.timings["shell"] = time.monotonic() - started

    def _stop_shell(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            proc.kill()
            proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            pass
        close_pipes(proc)

    def close(self) -> None:
        """Remove the container (every process in it), its endpoint relay, and stop the shell's client. Idempotent."""
        self._stop_shell()
        relay, self._relay = self._relay, None
        if relay is not None:
            relay.close()
        name, self.name = self.name, ""
        services, self._services = self._services, []
        if self.engine is None:
            return
        force = ["-f", "-t", "0"] if self.engine.name == "podman" else ["-f"]
        for victim in [*services, name]:  # sidecars first: they hold the main container's network
            if not victim:
                continue
            try:
                self.engine.run("rm", *force, victim, check=False, timeout_s=60)
            except SandboxError as exc:
                logger.warning("could not remove container {}: {}", victim, exc)

    def __enter__(self) -> ContainerSandbox:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def mechanisms(self) -> dict[str, str]:
        """What enforces each limit in this sandbox (valid after :meth:`start`)."""
        engine = self.engine.name if self.engine else "engine"
        return {"processes": f"{engine} --pids-limit (cgroup pids)", "memory": f"{engine} --memory (cgroup memory)",
                "cpu": f"{engine} --cpus (cgroup cpu quota)", "cpu_time": "RLIMIT_CPU (--ulimit cpu)",
                "file_size": "RLIMIT_FSIZE (--ulimit fsize)", "disk": "RLIMIT_FSIZE only",
                "network": ("none" if not self.spec.allow_network else "engine default")
                + (f" + host loopback port(s) {', '.join(map(str, self.spec.host_ports))} relayed"
                   if self.spec.host_ports else "")}

    # ----------------------------------------------------------------------------- commands

    def _run(self, command: str, timeout: float) -> tuple[int | str, str, bool]:
        """Send one command; read to its sentinel. Returns (status | TIMEOUT | EOF, output, truncated)."""
        assert self._proc is not None and self._proc.stdin is not None and self._proc.stdout is not None
        deadline = time.monotonic() + timeout
        buf = OutputBuffer(self.max_output_bytes, self._sentinel.marker)
        status = write_all(self._proc.stdin.fileno(), self._sentinel.line(command), deadline)
        if status is None:
            status = read_to_marker(self._proc.stdout.fileno(), buf, deadline)
        output, truncated = buf.result()
        return status, output, truncated

    def exec(self, command: str, timeout_s: float | None = None) -> CommandResult:
        """Run ``command`` in the persistent shell (see :meth:`Sandbox.exec`).

        Raises:
            SandboxError: not started, or the engine failed.
        """
        if not self.name or self._proc is None:
            raise SandboxError("sandbox is not running: call start() before exec()")
        timeout = self.command_timeout_s if timeout_s is None else float(timeout_s)
        started = time.monotonic()
        status, output, truncated = self._run(command, timeout)
        note = ""
        if status == TIMEOUT:
            killed = self._kill_commands()
            buf = OutputBuffer(self.max_output_bytes, self._sentinel.marker)
            assert self._proc is not None and self._proc.stdout is not None
            after = read_to_marker(self._proc.stdout.fileno(), buf, time.monotonic() + KILL_GRACE_S)
            note = f"[timed out after {timeout:g} s; killed {killed or 0} process(es)]"
            if not isinstance(after, int):
                note = (f"[timed out after {timeout:g} s and the shell did not come back; a new shell was started "
                        f"in {self.workdir}: exported variables and the working directory were reset]")
                self._replace_shell()
        elif status == EOF:
            assert self._proc is not None
            try:
                code = self._proc.wait(timeout=KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                code = 1
            status = code if code >= 0 else 128 - code
            note = (f"[the shell exited (status {status}); a new shell was started in {self.workdir}: exported "
                    "variables and the working directory were reset]")
            self._replace_shell()
        notes = [note] if note else []
        refused = self._group.refusals() if self._group is not None else []
        if refused:
            what = {"processes": f"process limit ({self.spec.limits.max_processes}) reached: new processes were refused",
                    "memory": f"memory limit ({self.spec.limits.memory_mb} MiB) reached: a process was killed"}
            notes.append("[refused: " + "; ".join(what[r] for r in refused if r in what) + "]")
        if notes:
            output = output + ("" if not output or output.endswith("\n") else "\n") + "\n".join(notes)
        timed_out = status == TIMEOUT
        code = 124 if timed_out else int(status)
        return CommandResult(output, code, timed_out, truncated, time.monotonic() - started, tuple(refused))

    def _replace_shell(self) -> None:
        self.restarts += 1
        self._stop_shell()
        self._start_shell()

    def end_agent(self) -> int:
        """Kill every process started after the shell, except the shell (see :class:`Sandbox`)."""
        if not self.name:
            return 0
        return self._kill_commands()

    def _kill_commands(self) -> int:
        """SIGKILL every process of the container except pid 1 and the shell; how many were killed.

        From the host when the container's pids cgroup is visible (``cgroup.procs``, namespace
        pids from ``/proc/PID/status``; repeated until none is left, bounded by
        :data:`KILL_GRACE_S`), which works even when the container is at its process limit and
        could not start one more process; else through :data:`KILL_SCRIPT` in an ``exec``."""
        folder = self._group.groups.get("pids") if self._group is not None else None
        if folder is None:
            out = self._exec_simple(["bash", "-c", KILL_SCRIPT, "kill", str(self._shell_pid)], user="0").decode().strip()
            return int(out) if out.isdigit() else 0

        def victims() -> list[int]:
            try:
                procs = (folder / "cgroup.procs").read_text().split()
            except OSError:
                return []
            statuses = [(int(pid), process_status(pid)) for pid in procs]
            return [pid for pid, fields in statuses
                    if fields is not None and int(fields.get("NSpid", "0").split()[-1]) not in (1, self._shell_pid)]

        return kill_repeatedly(victims, KILL_GRACE_S)

    def _exec_simple(self, argv: list[str], *, stdin: bytes | None = None, user: str | None = None,
                     timeout_s: float = CALL_TIMEOUT_S) -> bytes:
        """Run ``argv`` as a separate process in the container (as ``user`` if given); its stdout."""
        assert self.engine is not None
        opts = ["-i"] if stdin is not None else []
        if user is not None:
            opts += ["--user", user]
        done = self.engine.run("exec", *opts, self.name, *argv, stdin=stdin, timeout_s=timeout_s, check=False)
        return done.stdout or b""

    # ----------------------------------------------------------------------------- files

    def put(self, sources: Sequence[Path], dest: str) -> None:
        """Docker COPY of host ``sources`` to ``dest``: one tar stream into ``tar -x`` in the container."""
        split_root(dest)
        if not self.name:
            raise SandboxError("sandbox is not running: call start() before put()")
        into_folder = dest.endswith("/") or len(sources) > 1 or any(s.is_dir() for s in sources)
        data = io.BytesIO()
        with tarfile.open(fileobj=data, mode="w") as tar:
            for source in sources:
                if source.is_dir():
                    for path in sorted(source.rglob("*")):
                        tar.add(path, arcname=path.relative_to(source).as_posix(), recursive=False)
                else:
                    tar.add(source, arcname=source.name)
        target = dest.rstrip("/") or "/"
        # a file into an existing folder lands inside it (Docker COPY); else it takes dest's name
        script = ('if [ "$2" = folder ] || [ -d "$1" ]; then mkdir -p "$1" && tar -x --no-same-owner -C "$1"; '
                  'else mkdir -p "$(dirname "$1")" && t=$(mktemp -d) && tar -x --no-same-owner -C "$t" && '
                  'mv -f "$t/$3" "$1" && rmdir "$t"; fi && echo t1-put-ok')
        out = self._exec_simple(["sh", "-c", script, "put", target, "folder" if into_folder else "file",
                                 sources[0].name if sources else ""], stdin=data.getvalue())
        if b"t1-put-ok" not in out:
            raise SandboxError(f"could not copy {[str(s) for s in sources][:3]} to {dest} in the container: {out[-300:]!r}")

    def clear(self, path: str) -> None:
        """Empty (and create) the folder ``path`` in the container."""
        split_root(path)
        self._exec_simple(["bash", "-c", clear_command(path)], user="0")

    def read(self, path: str, max_bytes: int) -> bytes:
        """The last ``max_bytes`` of the regular file ``path`` (b"" if missing or a symlink)."""
        split_root(path)
        return self._exec_simple(["bash", "-c", read_command(path, max_bytes)], user="0")


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in name.lower())[:40].strip("-.") or "task"
