"""The Dockerfile subset a task may use, parsed into :class:`~t1async.envs.task.DockerStep` s.

:func:`parse_dockerfile` reads ``FROM``, ``WORKDIR``, ``ENV``, ``ARG``, ``COPY``/``ADD`` and
``RUN`` (continuations joined, comments dropped, heredoc bodies kept with their instruction) and
checks ``COPY`` sources against the build context; instructions that change nothing the shell sees
(``CMD``, ``EXPOSE``, ...) are accepted and ignored, any other is a local refusal
(:class:`~t1async.envs.task.TaskRefused`). Source of the syntax: the Dockerfile reference
(https://docs.docker.com/reference/dockerfile/).
"""

from __future__ import annotations

import glob
import json
import posixpath
import re
import shlex
from pathlib import Path

from .task import APP, LAYOUT_HINT, DockerStep, TaskError, TaskRefused

SUPPORTED_INSTRUCTIONS = ("FROM", "WORKDIR", "ENV", "ARG", "COPY", "ADD", "RUN")
IGNORED_INSTRUCTIONS = ("CMD", "ENTRYPOINT", "EXPOSE", "LABEL", "MAINTAINER", "STOPSIGNAL", "HEALTHCHECK",
                        "VOLUME", "ONBUILD")
"""Instructions that do not change the image's files or the shell's environment: accepted, ignored."""
_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_ARCHIVE = re.compile(r"\.(tar|tgz|tbz2?|txz|tar\.(gz|bz2|xz|zst))$")


_HEREDOC_START = re.compile(r"(?<!<)<<(-?)\s*(['\"]?)([A-Za-z_][A-Za-z0-9_]*)\2")


def heredoc_terminators(line: str) -> list[tuple[str, bool]]:
    """The heredocs a ``RUN``/``COPY``/``ADD`` line opens, in order: (terminator word, strip
    leading tabs (``<<-``)); empty for other instructions or when it opens none."""
    word = line.strip().partition(" ")[0].upper()
    if word not in ("RUN", "COPY", "ADD"):
        return []
    return [(m.group(3), m.group(1) == "-") for m in _HEREDOC_START.finditer(line)]


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """Join ``\\`` continuations, drop comments and blank lines: [(first line number, text)].
    A line that opens heredocs (:func:`heredoc_terminators`) keeps their bodies and terminator
    lines verbatim after it, joined with newlines (comments inside a body are kept)."""
    out: list[tuple[int, str]] = []
    parts: list[str] = []
    start = 0
    lines = text.splitlines()
    index = 0
    while index < len(lines):
        number, raw = index + 1, lines[index]
        index += 1
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not parts):
            continue  # comments vanish even inside a continuation, as in Docker
        if not parts:
            start = number
        if stripped.endswith("\\"):
            parts.append(raw.rstrip()[:-1])
            continue
        parts.append(raw)
        logical = " ".join(p.strip() for p in parts if p.strip())
        parts = []
        for terminator, strip_tabs in heredoc_terminators(logical):
            body = []
            while index < len(lines):
                line = lines[index]
                index += 1
                body.append(line)
                if (line.lstrip("\t") if strip_tabs else line) == terminator:
                    break
            logical += "\n" + "\n".join(body)
        out.append((start, logical))
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
    relative to the current one); ``ENV K=V ...`` and ``ENV K V``; ``ARG K[=default]`` (seen by
    later RUN steps only); ``COPY``/``ADD <src>... <dst>`` (sources inside ``context_dir``, globs
    allowed; destination under /app, relative to WORKDIR; ``--chown``/``--chmod``/``--link`` flags
    ignored; no URLs or archives for ADD); ``RUN`` in shell or JSON form (no heredocs); ``USER
    root``. :data:`IGNORED_INSTRUCTIONS` are accepted and ignored. Line continuations and comments
    as in Docker.

    Raises:
        TaskRefused: a valid instruction the local sandbox cannot reproduce (another USER or
            SHELL, WORKDIR or COPY outside /app, multi-stage COPY, ADD from a URL or of an
            archive, RUN heredocs); the message names ``where``, the line and the reason.
        TaskError: the Dockerfile is malformed or names missing files.
    """
    steps: list[DockerStep] = []
    workdir = APP
    for line, logical in _logical_lines(text):
        word, _, rest = logical.strip().partition(" ")
        instruction, rest = word.upper(), rest.strip()
        at = f"{where}:{line}"
        if instruction in IGNORED_INSTRUCTIONS:
            continue
        if instruction == "USER":
            if rest.split(":")[0] in ("root", "0"):
                continue
            raise TaskRefused(f"{at}: USER {rest} is not supported by the local sandbox (it has one unprivileged user)")
        if instruction not in SUPPORTED_INSTRUCTIONS:
            raise TaskRefused(
                f"{at}: unsupported Dockerfile instruction {word!r} in {logical!r}; the local sandbox "
                f"supports only {', '.join(SUPPORTED_INSTRUCTIONS + ('USER root',))} (and ignores "
                f"{', '.join(IGNORED_INSTRUCTIONS)}): remove it or express it with RUN ({LAYOUT_HINT})"
            )
        if not rest:
            raise TaskError(f"{at}: {instruction} needs arguments ({LAYOUT_HINT})")
        if instruction in ("COPY", "ADD", "RUN") and heredoc_terminators(logical):
            raise TaskRefused(f"{at}: heredocs in {instruction} are not supported locally; put the file in the build "
                              f"context and COPY it, or use the container sandbox ({LAYOUT_HINT})")
        if instruction == "FROM":
            image = [w for w in rest.split() if not w.startswith("--")]
            steps.append(DockerStep("FROM", (image[0] if image else rest,), line, workdir))
        elif instruction == "WORKDIR":
            target = posixpath.normpath(posixpath.join(workdir, rest.strip("\"'")))
            if not _under_app(target):
                raise TaskRefused(f"{at}: WORKDIR {target} is outside /app; the local sandbox has only /app writable ({LAYOUT_HINT})")
            workdir = target
            steps.append(DockerStep("WORKDIR", (target,), line, workdir))
        elif instruction == "ENV":
            steps.append(DockerStep("ENV", _parse_env(rest, at), line, workdir))
        elif instruction == "ARG":
            key, _, default = rest.partition("=")
            if not _ENV_KEY.match(key.strip()):
                raise TaskError(f"{at}: ARG expects NAME or NAME=default, got {rest!r} ({LAYOUT_HINT})")
            steps.append(DockerStep("ARG", (key.strip(), default.strip().strip("\"'")), line, workdir))
        elif instruction in ("COPY", "ADD"):
            steps.append(DockerStep("COPY", _parse_copy(instruction, rest, at, workdir, context_dir), line, workdir))
        else:  # RUN
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
            raise TaskRefused(f"{at}: {instruction} flag {flag!r} is not supported locally (no multi-stage builds) ({LAYOUT_HINT})")
    if len(words) < 2:
        raise TaskError(f"{at}: {instruction} needs at least one source and a destination ({LAYOUT_HINT})")
    sources, dest = words[:-1], words[-1]
    for source in sources:
        if instruction == "ADD" and (re.match(r"^[a-z]+://", source) or source.startswith("git@")):
            raise TaskRefused(f"{at}: ADD from a URL ({source}) needs network at build time; vendor the file into the build context ({LAYOUT_HINT})")
        if instruction == "ADD" and _ARCHIVE.search(source):
            raise TaskRefused(f"{at}: ADD of an archive ({source}) would unpack it in Docker; not reproduced locally: use COPY and RUN tar ({LAYOUT_HINT})")
        norm = posixpath.normpath(source)
        if posixpath.isabs(norm) or norm == ".." or norm.startswith("../"):
            raise TaskError(f"{at}: {instruction} source {source!r} must be relative to the build context and stay inside it ({LAYOUT_HINT})")
        if not glob.glob(str(context_dir / norm)):
            raise TaskError(f"{at}: {instruction} source {source!r} not found in {context_dir}; add the file or fix the path ({LAYOUT_HINT})")
    target = posixpath.normpath(posixpath.join(workdir, dest))
    if not _under_app(target):
        raise TaskRefused(f"{at}: {instruction} destination {target} is outside /app; the local sandbox has only /app writable ({LAYOUT_HINT})")
    if dest.endswith("/") or dest in (".", "./"):
        target += "/"
    if len(sources) > 1 and not target.endswith("/"):
        raise TaskError(f"{at}: {instruction} with several sources needs a destination folder ending in '/' ({LAYOUT_HINT})")
    return (*sources, target)
