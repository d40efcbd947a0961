"""Loading a task folder in either Terminal-Bench layout into a :class:`~t1async.envs.taskio.task.Task`.

Terminal-Bench 2 / Harbor layout::

    task.toml               [task] name; [metadata] difficulty, category, tags; [verifier] timeout_sec;
                            [agent] timeout_sec; [environment] docker_image, cpus, memory_mb,
                            storage_mb, allow_internet
    instruction.md          what the agent is asked to do
    environment/Dockerfile  optional (missing means an empty /app); files that COPY/ADD refer to
    tests/test.sh           the verifier, run as ``bash /tests/test.sh``; it may also write the task's
                            own reward to /logs/verifier/reward.txt or reward.json
    tests/...               e.g. test_outputs.py
    solution/solve.sh       optional oracle solution

Terminal-Bench 1 layout (:func:`load_tb1_task`)::

    task.yaml               instruction, difficulty, max_agent_timeout_sec (360),
                            max_test_timeout_sec (60), parser_name (pytest), run_tests_in_same_shell
    Dockerfile, docker-compose.yaml   the image (build context: the task folder); the ``client``
                            service is the agent's, others run beside it (container backend)
    run-tests.sh            the verifier, staged as /tests/run-tests.sh with tests/ (TEST_DIR=/tests)
    tests/...               e.g. test_outputs.py
    solution.sh             optional oracle; solution.yaml steps are replayed as commands (keystrokes
                            and steps typed into a still-running interactive program are refused)

Loading never depends on the backend: what only the ``local`` backend cannot do (a Dockerfile
instruction outside the supported subset, packages the host lacks, network at build or test time,
several containers) is recorded in :attr:`Task.local_refusal` (see :mod:`t1async.envs.taskio.adapt`), and
the local backend refuses such a task with that reason instead of running it wrong. A folder that
is invalid in itself (missing files, bad TOML/YAML, a Dockerfile that names missing files) raises
:class:`TaskError`. The shipped tasks live in ``t1async/envs/tasks/*``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import tomllib
import yaml
from loguru import logger

from .adapt import plan_container, plan_local
from .compose import ComposeError, harness_variables, read_compose
from .dockerfile import parse_dockerfile
from .shell_words import parse_command, split_commands
from .task import (
    DEFAULT_AGENT_TIMEOUT_S,
    DEFAULT_TB1_AGENT_TIMEOUT_S,
    DEFAULT_TB1_TEST_TIMEOUT_S,
    DEFAULT_VERIFIER_TIMEOUT_S,
    LAYOUT_HINT,
    Task,
    TaskError,
    TaskRefused,
)
from .task import task_error as _error


def _number(table: dict, key: str, default: float, path: Path, section: str) -> float:
    value = table.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        where = "task.yaml" if section == "task.yaml" else f"task.toml [{section}]"
        raise _error(path, f"{where} {key} = {value!r} is not a positive number", f"fix {where.split()[0]}")
    return float(value)


def load_task(path: str | Path, *, network: bool | None = None) -> Task:
    """Load and validate one task folder, either layout (``task.toml``: TB2; ``task.yaml``: TB1).

    ``network``: whether the local sandbox will give it network, for planning its adaptation
    (None: as the task declares, ``allow_internet``; True lifts the local refusal of commands that
    need network, for ``--network on``/``harness``).

    Raises:
        TaskError: the folder is missing, lacks its required files, has invalid TOML/YAML or
            fields, or a Dockerfile that is malformed or names missing files. (What only the
            local backend cannot run is recorded in :attr:`Task.local_refusal` instead.)
    """
    folder = Path(path).resolve()
    if not folder.is_dir():
        raise _error(folder, "not a folder", "pass the path of a task folder")
    if not (folder / "task.toml").is_file() and (folder / "task.yaml").is_file():
        return load_tb1_task(folder, network=network)
    if not (folder / "task.toml").is_file():
        raise _error(folder, "missing task.toml", "add it")
    try:
        config = tomllib.loads((folder / "task.toml").read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise _error(folder, f"task.toml is not valid TOML ({exc})", "fix its syntax") from None
    _refuse_multi_step(folder, config)
    for required in ("instruction.md", "tests/test.sh"):
        if not (folder / required).is_file():
            raise _error(folder, f"missing {required}", "add it")
    sections = {}
    for section in ("task", "metadata", "verifier", "agent", "environment"):
        sections[section] = config.get(section, {})
        if not isinstance(sections[section], dict):
            raise _error(folder, f"task.toml [{section}] must be a table", "fix task.toml")
    instruction = (folder / "instruction.md").read_text()
    if not instruction.strip():
        raise _error(folder, "instruction.md is empty", "write the task's instruction in it")
    name = sections["task"].get("name", folder.name)
    if not isinstance(name, str) or not name.strip():
        raise _error(folder, f"task.toml [task] name = {name!r} is not a non-empty string", "fix task.toml")
    environment = sections["environment"]
    allow_internet = environment.get("allow_internet", False)
    if not isinstance(allow_internet, bool):
        raise _error(folder, f"task.toml [environment] allow_internet = {allow_internet!r} is not a boolean", "use true or false")
    resources = {key: _optional_number(environment, key, folder) for key in ("cpus", "memory_mb", "storage_mb")}
    verifier_mode, verifier_image, artifacts = _verifier_environment(folder, config)
    task = Task(
        name=name.strip(),
        path=folder,
        instruction=instruction,
        agent_timeout_s=_number(sections["agent"], "timeout_sec", DEFAULT_AGENT_TIMEOUT_S, folder, "agent"),
        verifier_timeout_s=_number(sections["verifier"], "timeout_sec", DEFAULT_VERIFIER_TIMEOUT_S, folder, "verifier"),
        allow_internet=allow_internet,
        steps=[],
        docker_image=str(environment.get("docker_image") or ""),
        metadata=dict(sections["metadata"]),
        layout="tb2",
        context_dir=folder / "environment",
        test_script=folder / "tests" / "test.sh",
        cpus=resources["cpus"],
        memory_mb=None if resources["memory_mb"] is None else int(resources["memory_mb"]),
        storage_mb=None if resources["storage_mb"] is None else int(resources["storage_mb"]),
        verifier_mode=verifier_mode,
        verifier_image=verifier_image,
        artifacts=artifacts,
    )
    dockerfile = folder / "environment" / "Dockerfile"
    return _finish(task, dockerfile if dockerfile.is_file() else None, folder / "environment" / "docker-compose.yaml",
                   network)


HARBOR_ARTIFACTS_DIR = "/logs/artifacts"
"""Harbor's artifact folder, always handed to a separate verifier."""


def _verifier_environment(folder: Path, config: dict) -> tuple[str, str, tuple[str, ...]]:
    """``(verifier_mode, verifier_image, artifacts)`` of a Harbor task.toml, as Harbor resolves
    them: ``[verifier] environment_mode`` ``"shared"`` (default) or ``"separate"``; a
    ``[verifier.environment]`` table implies ``"separate"``; a separate verifier is built from
    ``tests/Dockerfile`` (context tests/) or runs ``[verifier.environment] docker_image``. The
    top-level ``artifacts`` are strings or tables with an absolute ``source`` (Harbor's
    ``destination`` only places the file on the host); ``/logs/artifacts`` is always added.

    Raises:
        TaskError: an unknown mode, ``"shared"`` with a ``[verifier.environment]``, a separate
            verifier with neither tests/Dockerfile nor an image, an artifact that is not an
            absolute path or names a sidecar service.
    """
    verifier = config.get("verifier") if isinstance(config.get("verifier"), dict) else {}
    environment = verifier.get("environment")
    if environment is not None and not isinstance(environment, dict):
        raise _error(folder, "task.toml [verifier.environment] must be a table", "fix task.toml")
    mode = verifier.get("environment_mode", "separate" if environment is not None else "shared")
    if mode not in ("shared", "separate"):
        raise _error(folder, f"task.toml [verifier] environment_mode = {mode!r} is not \"shared\" or \"separate\"",
                     "fix task.toml")
    if mode == "shared" and environment is not None:
        raise _error(folder, "task.toml [verifier] environment_mode = \"shared\" with a [verifier.environment] table",
                     "drop one of them (Harbor refuses this too)")
    image = str((environment or {}).get("docker_image") or "")
    if mode == "separate" and not image and not (folder / "tests" / "Dockerfile").is_file():
        raise _error(folder, "[verifier] environment_mode = \"separate\" but there is neither tests/Dockerfile nor "
                     "[verifier.environment] docker_image to build the verifier from", "add one")
    raw = config.get("artifacts", [])
    if not isinstance(raw, list):
        raise _error(folder, "task.toml artifacts must be a list", "fix task.toml")
    paths: list[str] = []
    for entry in raw:
        source = entry.get("source") if isinstance(entry, dict) else entry
        if isinstance(entry, dict) and entry.get("service") not in (None, "main"):
            raise _error(folder, f"task.toml artifact {source!r} is collected from the service {entry.get('service')!r}, "
                         "which t1async does not hand to a verifier", "collect it from the main container")
        if not isinstance(source, str) or not source.startswith("/") or ".." in source.split("/"):
            raise _error(folder, f"task.toml artifact {source!r} is not an absolute path", "fix task.toml")
        paths.append(source.rstrip("/") or "/")
    return mode, image, tuple(dict.fromkeys([HARBOR_ARTIFACTS_DIR, *paths]))


def _refuse_multi_step(folder: Path, config: dict) -> None:
    """Refuse a multi-step Harbor task (``[[steps]]`` in task.toml, instructions in
    ``steps/<name>/instruction.md``) in one line saying what is unsupported.

    Harbor runs such a task's steps in order in one environment: the agent gets each step's
    instruction in turn, each step's verifier (the task's tests/ with the step's own tests/ over
    it) runs after it, a step under its ``min_reward`` ends the trial, and the trial's reward is
    the mean (``multi_step_reward_strategy = "mean"``, the default) or the last step's
    (``"final"``). t1async's episode has one instruction and one verifier run, so it cannot
    reproduce that; the task is refused rather than run as something else.

    Raises:
        TaskRefused: the task declares ``[[steps]]`` or has a ``steps/`` folder.
    """
    steps = config.get("steps")
    if steps is None and not (folder / "steps").is_dir():
        return
    names = [str(step.get("name", "?")) for step in steps if isinstance(step, dict)] if isinstance(steps, list) else []
    listed = f"{len(names)} [[steps]] ({', '.join(names[:4])}{', ...' if len(names) > 4 else ''})" if names else "a steps/ folder"
    raise TaskRefused(
        f"task {folder}: multi-step Harbor task (schema_version {config.get('schema_version', config.get('version', '?'))!s}, "
        f"{listed}) is not supported: t1async runs one instruction and one verifier per episode, not each step's "
        "instruction, verifier and min_reward in turn with a mean/final reward; leave it out of env.tasks or split "
        "its steps into single-step tasks")


def load_tb1_task(folder: Path, *, network: bool | None = None) -> Task:
    """Load a Terminal-Bench 1 task folder (``task.yaml``; see the module docstring).

    Raises:
        TaskError: missing files, invalid YAML, a missing or empty instruction, bad timeouts.
    """
    if not (folder / "task.yaml").is_file():
        raise _error(folder, "missing task.yaml", "add it (Terminal-Bench 1 layout)")
    if not (folder / "run-tests.sh").is_file() and not (folder / "tests").is_dir():
        raise _error(folder, "missing run-tests.sh and tests/", "add them (Terminal-Bench 1 layout)")
    try:
        config = yaml.safe_load((folder / "task.yaml").read_text()) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise _error(folder, f"task.yaml is not valid YAML ({str(exc).splitlines()[0]})", "fix its syntax") from None
    if not isinstance(config, dict):
        raise _error(folder, "task.yaml must be a mapping", "fix task.yaml")
    instruction = config.get("instruction")
    if instruction is None and isinstance(config.get("descriptions"), list):  # early TB1 form
        base = [d for d in config["descriptions"] if isinstance(d, dict) and d.get("key", "base") == "base"]
        instruction = base[0].get("description") if base else None
    if not isinstance(instruction, str) or not instruction.strip():
        raise _error(folder, "task.yaml has no non-empty `instruction`", "write the task's instruction in it")
    parser = config.get("parser_name", "pytest")
    same_shell = config.get("run_tests_in_same_shell", False)
    if not isinstance(same_shell, bool):
        raise _error(folder, f"task.yaml run_tests_in_same_shell = {same_shell!r} is not a boolean", "use true or false")
    metadata = {k: config[k] for k in ("difficulty", "category", "tags", "author_email", "author_name") if k in config}
    solution, solution_refusal, commands = None, None, []
    if (folder / "solution.sh").is_file():
        solution = folder / "solution.sh"
    elif (folder / "solution.yaml").is_file():
        commands, why = _solution_commands(folder / "solution.yaml")
        if why:
            solution_refusal = (
                f"task {folder}: solution.yaml {why}: t1async's shell is not a terminal, so keystrokes cannot be "
                "replayed faithfully; add an equivalent solution.sh"
            )
    task = Task(
        name=folder.name,
        path=folder,
        instruction=instruction,
        agent_timeout_s=_number(config, "max_agent_timeout_sec", DEFAULT_TB1_AGENT_TIMEOUT_S, folder, "task.yaml"),
        verifier_timeout_s=_number(config, "max_test_timeout_sec", DEFAULT_TB1_TEST_TIMEOUT_S, folder, "task.yaml"),
        allow_internet=False,
        steps=[],
        metadata=metadata,
        layout="tb1",
        context_dir=folder,
        test_script=folder / "run-tests.sh",
        solution=solution,
        solution_refusal=solution_refusal,
        run_tests_in_same_shell=same_shell,
        solution_commands=commands,
    )
    if parser != "pytest":
        task.local_refusal = f"task.yaml parser_name {parser!r} is not supported: only pytest results are read"
    dockerfile = folder / "Dockerfile"
    return _finish(task, dockerfile if dockerfile.is_file() else None, folder / "docker-compose.yaml", network)


TMUX_KEYS = re.compile(r"^(?:[CM]-.|Escape|Enter|Tab|BSpace|Up|Down|Left|Right|Home|End|PPage|NPage|F\d+)$")
"""tmux key names: a solution.yaml step that is one of these is a keystroke, not a command."""

TB1_NONBLOCKING_TIMEOUT_S = 180.0
"""Least timeout of a ``block: false`` solution.yaml step: the TB1 harness waits for it only until
the next blocking step is done, which it bounds by that step's ``max_timeout_sec`` (180 s by default)."""

INTERACTIVE_PROGRAMS = frozenset({
    "python", "python2", "python3", "ipython", "ipython3", "node", "irb", "ghci", "julia", "lua", "R", "tclsh",
    "jimsh", "bc", "dc", "coqtop", "ocaml", "utop", "swipl", "guile", "sbcl", "racket", "erl", "iex", "scala",
    "bash", "sh", "dash", "zsh", "fish", "sqlite3", "psql", "mysql", "mariadb", "mongo", "mongosh", "redis-cli",
    "gdb", "lldb", "ftp", "sftp", "telnet", "ssh", "vim", "vi", "nvim", "nano", "emacs", "less", "more", "top",
    "htop", "watch",
})
"""Programs that read keystrokes from the terminal when started without a script or a command
argument (REPLs, database shells, editors, pagers): see :func:`reads_keystrokes`."""

_SCRIPT_FLAGS = frozenset({"-c", "-m", "-e", "--eval", "--command", "--execute", "-f", "--file", "-batch", "--batch",
                           "--version", "-V", "--help", "-h"})
"""Flags after which one of :data:`INTERACTIVE_PROGRAMS` runs a given command or script and ends."""

def reads_keystrokes(command: str) -> str | None:
    """The interactive program (one of :data:`INTERACTIVE_PROGRAMS`) that ``command`` leaves
    reading the terminal, else None.

    Only the last simple command of the line counts, and only when its input is the terminal
    (not the far end of a pipe, not redirected with ``<``, not put in the background with ``&``);
    it counts when it names no script or command to run (``python3``, ``python3 -i x.py``,
    ``sqlite3 db``, ``vim notes.txt``; not ``python3 x.py``, ``python3 -c ...``, ``psql -c ...``).
    A heuristic: TB1's tmux types the next step into such a program, which a shell that is not a
    terminal cannot reproduce.
    """
    text = command.strip()
    spans = split_commands(text)
    if not spans:
        return None
    start, end = spans[-1]
    if text[end:].strip().startswith("&") and not text[end:].strip().startswith("&&"):
        return None  # `prog &`: a background job does not read the terminal
    stages = parse_command(text[start:end]).stages
    if not stages:
        return None
    last = stages[-1]
    if len(stages) > 1 or any(r.startswith(("<", "0<")) for r in last.redirections):
        return None  # the far end of a pipe reads the pipe; `prog < file` reads the file
    words = list(last.words)
    if not words:
        return None
    program = words[0].rsplit("/", 1)[-1]
    base = re.sub(r"\d+(\.\d+)*$", "", program) if program.startswith("python") else program
    if program not in INTERACTIVE_PROGRAMS and base not in INTERACTIVE_PROGRAMS:
        return None
    args = words[1:]
    if program in ("vim", "vi", "nvim", "nano", "emacs", "less", "more", "top", "htop", "watch"):
        return program if "--version" not in args and "--help" not in args else None
    if any(a in _SCRIPT_FLAGS or a.startswith(("--command=", "--eval=", "--execute=")) for a in args):
        return None
    positional = [a for a in args if not a.startswith("-")]
    if "-i" in args or not positional:
        return program
    if program in ("sqlite3", "psql", "mysql", "mariadb", "mongo", "mongosh", "redis-cli", "gdb", "lldb", "ftp",
                   "sftp", "telnet", "ssh"):
        # a database or host argument still leaves the client reading (sqlite3 DB "SQL" does not)
        return program if len(positional) <= (1 if program != "redis-cli" else 0) else None
    return None  # a script argument: it runs and ends


def _solution_commands(path: Path) -> tuple[list[tuple[str, float]], str | None]:
    """TB1 ``solution.yaml`` steps as (command, timeout seconds), or why they are not plain commands.

    A step is a mapping with a ``command`` string; it is a plain command unless it is sent without
    Enter (``append_enter: false``) or is a tmux key name (``C-c``, ``Escape``). TB1's
    ``block: false`` means the harness does not wait for the step to finish before typing the next
    one, which the terminal holds until the step's program ends (type-ahead): such steps are
    replayed in order like the others, with a timeout of at least
    :data:`TB1_NONBLOCKING_TIMEOUT_S`. The one case a shell that is not a terminal cannot replay is
    a ``block: false`` step that leaves an interactive program reading keystrokes
    (:func:`reads_keystrokes`, e.g. ``python`` then ``import x`` typed into it): refused. A step's
    timeout is ``max_timeout_sec`` (else ``min_timeout_sec``), at least 60 s.
    """
    try:
        steps = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        return [], f"is not valid YAML ({str(exc).splitlines()[0]})"
    if not isinstance(steps, list) or not steps:
        return [], "is not a list of steps"
    commands: list[tuple[str, float]] = []
    for number, step in enumerate(steps, start=1):
        if not isinstance(step, dict) or not isinstance(step.get("command"), str):
            return [], f"step {number} has no `command` string"
        command = step["command"]
        if step.get("append_enter") is False or TMUX_KEYS.match(command.strip()):
            return [], f"step {number} ({command.strip()[:40]!r}) is a keystroke, not a command"
        previous = steps[number - 2] if number > 1 else None
        if previous is not None and previous.get("block") is False:
            program = reads_keystrokes(previous["command"])
            if program is not None:
                return [], (f"step {number} is typed into the interactive program {program!r} that step {number - 1} "
                            "starts without waiting for it (block: false)")
        timeout = step.get("max_timeout_sec") or step.get("min_timeout_sec") or 0
        seconds = max(60.0, float(timeout) if isinstance(timeout, (int, float)) else 0.0)
        if step.get("block") is False:
            seconds = max(seconds, TB1_NONBLOCKING_TIMEOUT_S)
        commands.append((command, seconds))
    return commands, None


def _optional_number(table: dict, key: str, path: Path) -> float | None:
    if key not in table:
        return None
    return _number(table, key, 1.0, path, "environment")


def _apply_compose(task: Task, path: Path) -> None:
    """The compose file's agent service gives the build, image and :attr:`Task.compose_env`;
    its other services become :attr:`Task.services` (a local refusal: see :mod:`.compose`).

    Raises:
        TaskError: the compose file cannot be used (the message says why).
    """
    try:
        compose = read_compose(path, harness_variables(task.layout, path.parent))
    except ComposeError as exc:
        raise _error(task.path, exc.what, exc.todo) from None
    if len(compose.service_names) > 1:
        task.local_refusal = task.local_refusal or (
            f"{path.name} defines {len(compose.service_names)} services ({', '.join(sorted(compose.service_names))}): "
            "a multi-container task needs Docker Compose, which the local sandbox does not reproduce")
    task.services = compose.services
    if compose.dockerfile is not None:
        task.context_dir, task.dockerfile = compose.context_dir, compose.dockerfile
    if compose.image and not task.docker_image:
        task.docker_image = compose.image
    task.compose_env.update(compose.environment)


def _finish(task: Task, dockerfile: Path | None, compose: Path, network: bool | None = None) -> Task:
    """Parse the Dockerfile and compose file, then plan the local adaptation (refusals)."""
    task.dockerfile = dockerfile
    if compose.is_file():
        _apply_compose(task, compose)  # the agent's service may build from another folder
    dockerfile = task.dockerfile
    if dockerfile is not None:
        try:
            task.steps = parse_dockerfile(dockerfile.read_text(), task.environment_dir, where=str(dockerfile))
        except TaskRefused as exc:
            task.local_refusal = task.local_refusal or str(exc)
            task.steps = []
        except TaskError as exc:
            raise TaskError(f"task {task.path}: {exc}") from None
    if not task.docker_image:
        task.docker_image = next((s.args[0] for s in task.steps if s.instruction == "FROM"), "")
    plan_local(task, network=network)
    plan_container(task)
    return task




def task_folders(root: str | Path) -> list[Path]:
    """Candidate task folders under ``root``: sub-folders not starting with ``.`` or ``_``, sorted."""
    base = Path(root)
    if not base.is_dir():
        raise TaskError(f"tasks folder {base} does not exist or is not a folder; pass a folder of task folders ({LAYOUT_HINT})")
    return sorted(p for p in base.iterdir() if p.is_dir() and not p.name.startswith((".", "_")))


def discover_tasks(root: str | Path, names: Sequence[str] = (), *, skip_invalid: bool = False,
                   sandbox: str = "local") -> list[Task]:
    """Load the tasks under ``root`` (all, or those in ``names``), sorted by name.

    An invalid folder, or with ``sandbox="local"`` a task that backend refuses, raises unless
    ``skip_invalid`` is set (then it is skipped with a warning, except when named in ``names``);
    several are reported together, one line each after a first line that counts them.
    A name matches a folder name or a ``[task] name``.

    Raises:
        TaskError: ``root`` is missing or holds no valid task, a folder is invalid (and not
            skipped; every such folder is named), a named task is missing or invalid, or two tasks share a name.
        TaskRefused: a task the local backend cannot run (and not skipped).
    """
    wanted = set(names)
    tasks: list[Task] = []
    available: list[str] = []
    broken: list[TaskError] = []  # every invalid folder that is not skipped: reported together
    for folder in task_folders(root):
        try:
            task = load_task(folder)
            if sandbox == "local" and task.local_refusal:
                raise TaskRefused(f"task {folder}: refused by the local sandbox: {task.local_refusal}")
        except TaskError as exc:
            if folder.name in wanted or not (skip_invalid or wanted):  # named tasks: a broken sibling is not used
                broken.append(exc)
            else:
                logger.warning("skipping invalid task folder: {}", exc)
            continue
        available.append(task.name)
        if wanted and folder.name not in wanted and task.name not in wanted:
            continue
        tasks.append(task)
    if len(broken) == 1:
        raise broken[0]
    if broken:  # one line each, so that one pass fixes them all
        kind = TaskRefused if all(isinstance(e, TaskRefused) for e in broken) else TaskError
        raise kind(f"{len(broken)} task folders under {root} are invalid (fix each, or name the good ones in "
                   "env.tasks):\n" + "\n".join(f"  {str(e).splitlines()[0] if str(e) else type(e).__name__}"
                                                for e in broken))
    seen: dict[str, Path] = {}
    for task in tasks:
        if task.name in seen:
            raise TaskError(f"tasks {seen[task.name]} and {task.path} share the name {task.name!r}; rename one in its task.toml")
        seen[task.name] = task.path
    missing = sorted(wanted - {t.name for t in tasks} - {t.path.name for t in tasks})
    if missing:
        raise TaskError(f"task(s) {missing} not found under {root}; available: {sorted(available)} ({LAYOUT_HINT})")
    if not tasks:
        raise TaskError(f"no valid task under {root} ({LAYOUT_HINT})")
    return sorted(tasks, key=lambda t: t.name)
