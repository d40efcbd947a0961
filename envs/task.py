"""Terminal tasks: loading and validating a task folder (a subset of the Terminal-Bench 2 layout).

A task folder holds::

    task.toml               [task] name; [metadata] difficulty, category, tags; [verifier] timeout_sec;
                            [agent] timeout_sec; [environment] docker_image, cpus, memory_mb,
                            storage_mb, allow_internet
    instruction.md          what the agent is asked to do
    environment/Dockerfile  optional; the subset FROM, WORKDIR, ENV, COPY, ADD, RUN (see
                            :func:`parse_dockerfile`); missing means an empty /app
    environment/...         files that COPY/ADD refer to
    tests/test.sh           the verifier, run as ``bash /tests/test.sh`` from /app
    tests/...               e.g. test_outputs.py
    solution/solve.sh       optional oracle solution

The shipped tasks live in ``envs/tasks/*``.
"""

from __future__ import annotations

import glob
import json
import posixpath
import re
import shlex
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loguru import logger

LAYOUT_HINT = "see envs/tasks/* for the layout"
DEFAULT_AGENT_TIMEOUT_S = 600.0
DEFAULT_VERIFIER_TIMEOUT_S = 60.0
SUPPORTED_INSTRUCTIONS = ("FROM", "WORKDIR", "ENV", "COPY", "ADD", "RUN")
APP = "/app"

_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_HEREDOC = re.compile(r"(?<!<)<<(?!<)-?\s*['\"]?[A-Za-z_]")
_ARCHIVE = re.compile(r"\.(tar|tgz|tbz2?|txz|tar\.(gz|bz2|xz|zst))$")


class TaskError(ValueError):
    """A task folder is invalid; the message names the folder, what is wrong and what to do."""


@dataclass
class DockerStep:
    """One instruction of the supported Dockerfile subset, parsed.

    Attributes:
        instruction: ``FROM``, ``WORKDIR``, ``ENV``, ``COPY`` (``ADD`` is read as ``COPY``) or ``RUN``.
        args: per instruction: FROM ``(image,)``; WORKDIR ``(absolute path,)``; ENV
            ``(key, value, key, value, ...)`` with values unexpanded (``$VAR`` is expanded when
            applied); COPY ``(source, ..., destination)`` with sources relative to
            ``environment/`` (globs allowed) and an absolute destination under /app (a trailing
            ``/`` kept); RUN ``(shell command,)``.
        line: 1-based line in the Dockerfile where the instruction starts.
        workdir: the WORKDIR in effect for this step (absolute, /app or under it).
    """

    instruction: str
    args: tuple[str, ...]
    line: int
    workdir: str = APP


@dataclass
class Task:
    """A loaded, validated task.

    Attributes:
        name: ``[task] name`` from task.toml, else the folder name.
        path: the task folder (absolute).
        instruction: text of instruction.md.
        agent_timeout_s: ``[agent] timeout_sec``, seconds (default 600).
        verifier_timeout_s: ``[verifier] timeout_sec``, seconds (default 60).
        allow_internet: ``[environment] allow_internet`` (default False).
        steps: the parsed Dockerfile subset, in order (empty without a Dockerfile).
        docker_image: ``[environment] docker_image`` or the Dockerfile's FROM (recorded only).
        metadata: the ``[metadata]`` table (difficulty, category, tags, ...).
    """

    name: str
    path: Path
    instruction: str
    agent_timeout_s: float
    verifier_timeout_s: float
    allow_internet: bool
    steps: list[DockerStep]
    docker_image: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def environment_dir(self) -> Path:
        """Build context of COPY/ADD sources: ``<task>/environment``."""
        return self.path / "environment"

    @property
    def tests_dir(self) -> Path:
        """The verifier files, copied to /tests at verification: ``<task>/tests``."""
        return self.path / "tests"

    @property
    def solution_path(self) -> Path | None:
        """``<task>/solution/solve.sh`` if it exists, else None."""
        solve = self.path / "solution" / "solve.sh"
        return solve if solve.is_file() else None


def _error(path: Path, what: str, todo: str) -> TaskError:
    return TaskError(f"task {path}: {what}; {todo} ({LAYOUT_HINT})")


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """Join ``\\`` continuations, drop comments and blank lines: [(first line number, text)]."""
    out: list[tuple[int, str]] = []
    parts: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not parts):
            continue  # comments vanish even inside a continuation, as in Docker
        if not parts:
            start = number
        if stripped.endswith("\\"):
            parts.append(raw.rstrip()[:-1])
            continue
        parts.append(raw)
        out.append((start, " ".join(p.strip() for p in parts if p.strip())))
        parts = []
    if parts:
        out.append((start, " ".join(p.strip() for p in parts if p.strip())))
    return out


def _under_app(path: str) -> bool:
    return path == APP or path.startswith(APP + "/")


def _json_or_shell_words(text: str) -> list[str] | None:
    if text.startswith("["):
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return None
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return value
        return None
    return shlex.split(text)


def parse_dockerfile(text: str, context_dir: Path, *, where: str = "Dockerfile") -> list[DockerStep]:
    """Parse the supported Dockerfile subset and check it against ``context_dir``.

    Supported: ``FROM`` (recorded, ignored locally); ``WORKDIR`` (must be /app or under it;
    relative to the current one); ``ENV K=V ...`` and ``ENV K V``; ``COPY``/``ADD <src>... <dst>``
    (sources inside ``context_dir``, globs allowed; destination under /app, relative to WORKDIR;
    ``--chown``/``--chmod``/``--link`` flags ignored; no URLs or archives for ADD); ``RUN`` in
    shell or JSON form (no heredocs). Line continuations and comments as in Docker.

    Raises:
        TaskError: naming ``where``, the line and what to change, for anything else.
    """
    steps: list[DockerStep] = []
    workdir = APP
    for line, logical in _logical_lines(text):
        word, _, rest = logical.strip().partition(" ")
        instruction, rest = word.upper(), rest.strip()
        at = f"{where}:{line}"
        if instruction not in SUPPORTED_INSTRUCTIONS:
            raise TaskError(
                f"{at}: unsupported Dockerfile instruction {word!r} in {logical!r}; the local sandbox "
                f"supports only {', '.join(SUPPORTED_INSTRUCTIONS)}: remove it or express it with RUN "
                f"({LAYOUT_HINT})"
            )
        if not rest:
            raise TaskError(f"{at}: {instruction} needs arguments ({LAYOUT_HINT})")
        if instruction == "FROM":
            image = [w for w in rest.split() if not w.startswith("--")]
            steps.append(DockerStep("FROM", (image[0] if image else rest,), line, workdir))
        elif instruction == "WORKDIR":
            target = posixpath.normpath(posixpath.join(workdir, rest.strip("\"'")))
            if not _under_app(target):
                raise TaskError(f"{at}: WORKDIR {target} is outside /app; use /app or a folder under it ({LAYOUT_HINT})")
            workdir = target
            steps.append(DockerStep("WORKDIR", (target,), line, workdir))
        elif instruction == "ENV":
            steps.append(DockerStep("ENV", _parse_env(rest, at), line, workdir))
        elif instruction in ("COPY", "ADD"):
            steps.append(DockerStep("COPY", _parse_copy(instruction, rest, at, workdir, context_dir), line, workdir))
        else:  # RUN
            if _HEREDOC.search(rest):
                raise TaskError(f"{at}: heredocs in RUN are not supported; put the script in environment/ and COPY it ({LAYOUT_HINT})")
            words = _json_or_shell_words(rest) if rest.startswith("[") else None
            if rest.startswith("[") and words is None:
                raise TaskError(f"{at}: RUN in JSON form must be a list of strings ({LAYOUT_HINT})")
            steps.append(DockerStep("RUN", (shlex.join(words) if words else rest,), line, workdir))
    return steps


def _parse_env(rest: str, at: str) -> tuple[str, ...]:
    try:
        words = shlex.split(rest)
    except ValueError as exc:
        raise TaskError(f"{at}: cannot parse ENV {rest!r} ({exc}); quote values properly ({LAYOUT_HINT})") from None
    pairs: list[str] = []
    if "=" in words[0]:
        for word in words:
            key, eq, value = word.partition("=")
            if not eq or not _ENV_KEY.match(key):
                raise TaskError(f"{at}: ENV expects KEY=VALUE pairs, got {word!r} ({LAYOUT_HINT})")
            pairs += [key, value]
    else:
        key, _, value = rest.partition(" ")
        if not _ENV_KEY.match(key) or not value.strip():
            raise TaskError(f"{at}: ENV expects `ENV KEY VALUE` or `ENV KEY=VALUE`, got {rest!r} ({LAYOUT_HINT})")
        pairs += [key, value.strip()]
    return tuple(pairs)


def _parse_copy(instruction: str, rest: str, at: str, workdir: str, context_dir: Path) -> tuple[str, ...]:
    try:
        words = _json_or_shell_words(rest)
    except ValueError as exc:
        raise TaskError(f"{at}: cannot parse {instruction} {rest!r} ({exc}) ({LAYOUT_HINT})") from None
    if words is None:
        raise TaskError(f"{at}: {instruction} in JSON form must be a list of strings ({LAYOUT_HINT})")
    flags = [w for w in words if w.startswith("--")]
    words = [w for w in words if not w.startswith("--")]
    for flag in flags:
        if flag.split("=", 1)[0] not in ("--chown", "--chmod", "--link"):
            raise TaskError(f"{at}: {instruction} flag {flag!r} is not supported (no multi-stage builds) ({LAYOUT_HINT})")
    if len(words) < 2:
        raise TaskError(f"{at}: {instruction} needs at least one source and a destination ({LAYOUT_HINT})")
    sources, dest = words[:-1], words[-1]
    for source in sources:
        if instruction == "ADD" and (re.match(r"^[a-z]+://", source) or source.startswith("git@")):
            raise TaskError(f"{at}: ADD from a URL ({source}) is not supported; vendor the file into environment/ ({LAYOUT_HINT})")
        if instruction == "ADD" and _ARCHIVE.search(source):
            raise TaskError(f"{at}: ADD of an archive ({source}) would unpack it in Docker; use COPY and RUN tar ({LAYOUT_HINT})")
        norm = posixpath.normpath(source)
        if posixpath.isabs(norm) or norm == ".." or norm.startswith("../"):
            raise TaskError(f"{at}: {instruction} source {source!r} must be relative to environment/ and stay inside it ({LAYOUT_HINT})")
        if not glob.glob(str(context_dir / norm)):
            raise TaskError(f"{at}: {instruction} source {source!r} not found in {context_dir}; add the file or fix the path ({LAYOUT_HINT})")
    target = posixpath.normpath(posixpath.join(workdir, dest))
    if not _under_app(target):
        raise TaskError(f"{at}: {instruction} destination {target} is outside /app; copy into /app ({LAYOUT_HINT})")
    if dest.endswith("/") or dest in (".", "./"):
        target += "/"
    if len(sources) > 1 and not target.endswith("/"):
        raise TaskError(f"{at}: {instruction} with several sources needs a destination folder ending in '/' ({LAYOUT_HINT})")
    return (*sources, target)


def _number(table: dict, key: str, default: float, path: Path, section: str) -> float:
    value = table.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise _error(path, f"task.toml [{section}] {key} = {value!r} is not a positive number", "fix task.toml")
    return float(value)


def load_task(path: str | Path) -> Task:
    """Load and validate one task folder.

    Raises:
        TaskError: the folder is missing, lacks task.toml, instruction.md or tests/test.sh, has
            invalid TOML or fields, or an unsupported/inconsistent Dockerfile.
    """
    folder = Path(path).resolve()
    if not folder.is_dir():
        raise _error(folder, "not a folder", "pass the path of a task folder")
    for required in ("task.toml", "instruction.md", "tests/test.sh"):
        if not (folder / required).is_file():
            raise _error(folder, f"missing {required}", "add it")
    try:
        config = tomllib.loads((folder / "task.toml").read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise _error(folder, f"task.toml is not valid TOML ({exc})", "fix its syntax") from None
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
    allow_internet = sections["environment"].get("allow_internet", False)
    if not isinstance(allow_internet, bool):
        raise _error(folder, f"task.toml [environment] allow_internet = {allow_internet!r} is not a boolean", "use true or false")
    dockerfile = folder / "environment" / "Dockerfile"
    steps = parse_dockerfile(dockerfile.read_text(), folder / "environment", where=str(dockerfile)) if dockerfile.is_file() else []
    image = sections["environment"].get("docker_image") or next((s.args[0] for s in steps if s.instruction == "FROM"), "")
    return Task(
        name=name.strip(),
        path=folder,
        instruction=instruction,
        agent_timeout_s=_number(sections["agent"], "timeout_sec", DEFAULT_AGENT_TIMEOUT_S, folder, "agent"),
        verifier_timeout_s=_number(sections["verifier"], "timeout_sec", DEFAULT_VERIFIER_TIMEOUT_S, folder, "verifier"),
        allow_internet=allow_internet,
        steps=steps,
        docker_image=str(image),
        metadata=dict(sections["metadata"]),
    )


def task_folders(root: str | Path) -> list[Path]:
    """Candidate task folders under ``root``: sub-folders not starting with ``.`` or ``_``, sorted."""
    base = Path(root)
    if not base.is_dir():
        raise TaskError(f"tasks folder {base} does not exist or is not a folder; pass a folder of task folders ({LAYOUT_HINT})")
    return sorted(p for p in base.iterdir() if p.is_dir() and not p.name.startswith((".", "_")))


def discover_tasks(root: str | Path, names: Sequence[str] = (), *, skip_invalid: bool = False) -> list[Task]:
    """Load the tasks under ``root`` (all, or those in ``names``), sorted by name.

    An invalid folder raises, unless ``skip_invalid`` is set (then it is skipped with a warning,
    except when named in ``names``). A name matches a folder name or a ``[task] name``.

    Raises:
        TaskError: ``root`` is missing or holds no valid task, a folder is invalid (and not
            skipped), a named task is missing or invalid, or two tasks share a name.
    """
    wanted = set(names)
    tasks: list[Task] = []
    available: list[str] = []
    for folder in task_folders(root):
        try:
            task = load_task(folder)
        except TaskError as exc:
            if folder.name in wanted or not skip_invalid:
                raise
            logger.warning("skipping invalid task folder: {}", exc)
            continue
        available.append(task.name)
        if wanted and folder.name not in wanted and task.name not in wanted:
            continue
        tasks.append(task)
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
