"""Dockerfiles: the subset a task may use, parsed into :class:`~t1async.envs.taskio.task.DockerStep` s,
and the reading that image builds need (heredocs rewritten for builders without them, the images
a build uses, instructions by stage for build-failure reports).

:func:`parse_dockerfile` reads ``FROM``, ``WORKDIR``, ``ENV``, ``ARG``, ``COPY``/``ADD`` and
``RUN`` (continuations joined, comments dropped, heredoc bodies kept with their instruction) and
checks ``COPY`` sources against the build context; instructions that change nothing the shell sees
(``CMD``, ``EXPOSE``, ...) are accepted and ignored, any other is a local refusal
(:class:`~t1async.envs.taskio.task.TaskRefused`). Source of the syntax: the Dockerfile reference
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
ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
"""A valid environment variable name."""
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
                raise TaskRefused(f"{at}: WORKDIR {target} is outside /app; the local sandbox has only /app writable "
                                  f"({LAYOUT_HINT})")
            workdir = target
            steps.append(DockerStep("WORKDIR", (target,), line, workdir))
        elif instruction == "ENV":
            steps.append(DockerStep("ENV", _parse_env(rest, at), line, workdir))
        elif instruction == "ARG":
            key, _, default = rest.partition("=")
            if not ENV_KEY.match(key.strip()):
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
            if not eq or not ENV_KEY.match(key):
                raise TaskError(f"{at}: ENV expects KEY=VALUE pairs, got {word!r} ({LAYOUT_HINT})")
            pairs += [key, value]
    else:
        key, _, value = rest.partition(" ")
        if not ENV_KEY.match(key) or not value.strip():
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
            raise TaskRefused(f"{at}: {instruction} flag {flag!r} is not supported locally (no multi-stage builds) "
                              f"({LAYOUT_HINT})")
    if len(words) < 2:
        raise TaskError(f"{at}: {instruction} needs at least one source and a destination ({LAYOUT_HINT})")
    sources, dest = words[:-1], words[-1]
    for source in sources:
        if instruction == "ADD" and (re.match(r"^[a-z]+://", source) or source.startswith("git@")):
            raise TaskRefused(f"{at}: ADD from a URL ({source}) needs network at build time; vendor the file into the "
                              f"build context ({LAYOUT_HINT})")
        if instruction == "ADD" and _ARCHIVE.search(source):
            raise TaskRefused(f"{at}: ADD of an archive ({source}) would unpack it in Docker; not reproduced locally: "
                              f"use COPY and RUN tar ({LAYOUT_HINT})")
        norm = posixpath.normpath(source)
        if posixpath.isabs(norm) or norm == ".." or norm.startswith("../"):
            raise TaskError(f"{at}: {instruction} source {source!r} must be relative to the build context and stay "
                            f"inside it ({LAYOUT_HINT})")
        if not glob.glob(str(context_dir / norm)):
            raise TaskError(f"{at}: {instruction} source {source!r} not found in {context_dir}; add the file or fix the "
                            f"path ({LAYOUT_HINT})")
    target = posixpath.normpath(posixpath.join(workdir, dest))
    if not _under_app(target):
        raise TaskRefused(f"{at}: {instruction} destination {target} is outside /app; the local sandbox has only /app "
                          f"writable ({LAYOUT_HINT})")
    if dest.endswith("/") or dest in (".", "./"):
        target += "/"
    if len(sources) > 1 and not target.endswith("/"):
        raise TaskError(f"{at}: {instruction} with several sources needs a destination folder ending in '/' ({LAYOUT_HINT})")
    return (*sources, target)


def expand_heredocs(text: str) -> tuple[str, dict[str, str]]:
    """Rewrite heredocs for builders that lack them; returns (new Dockerfile, {file name: content}).

    * ``COPY [flags] <<EOT dest`` (one heredoc, its body) becomes ``COPY [flags] .t1async-heredoc-N
      dest``, the body written to that file in the build context (Docker writes it without the
      terminator line, with a final newline).
    * ``RUN <<EOT`` alone runs the body as a script: ``RUN ["/bin/sh", "-c", BODY]``.
    * ``RUN cmd <<EOT ...`` (a heredoc fed to a command) stays shell text:
      ``RUN ["/bin/sh", "-c", "cmd <<EOT\\nBODY\\nEOT"]`` (the shell reads the heredoc itself).

    Lines without heredocs are kept byte for byte.
    """
    lines = text.splitlines()
    out: list[str] = []
    files: dict[str, str] = {}
    index = 0
    pending = ""
    while index < len(lines):
        raw = lines[index]
        index += 1
        if raw.rstrip().endswith("\\") and not raw.lstrip().startswith("#"):
            pending += raw + "\n"
            continue
        logical = pending + raw
        pending = ""
        flat = " ".join(part.strip().rstrip("\\").strip() for part in logical.splitlines())
        terminators = heredoc_terminators(flat)
        if not terminators:
            out.append(logical)
            continue
        bodies: list[tuple[str, list[str]]] = []
        for terminator, strip_tabs in terminators:
            body: list[str] = []
            while index < len(lines):
                line = lines[index]
                index += 1
                if (line.lstrip("\t") if strip_tabs else line) == terminator:
                    break
                body.append(line.lstrip("\t") if strip_tabs else line)
            bodies.append((terminator, body))
        word, _, rest = flat.strip().partition(" ")
        if word.upper() in ("COPY", "ADD"):
            for (terminator, body), match in zip(bodies, re.finditer(r"<<-?\s*(['\"]?)[A-Za-z_][A-Za-z0-9_]*\1", rest)):
                name = f".t1async-heredoc-{len(files)}"
                files[name] = "\n".join(body) + "\n"
                rest = rest.replace(match.group(0), name, 1)
            out.append(f"{word} {rest}")
        else:
            command = rest.strip()
            if re.fullmatch(r"<<-?\s*(['\"]?)[A-Za-z_][A-Za-z0-9_]*\1", command) and len(bodies) == 1:
                script = "\n".join(bodies[0][1]) + "\n"
            else:
                script = command + "\n" + "".join("\n".join(body) + "\n" + terminator + "\n" for terminator, body in bodies)
            out.append(f"{word} {json.dumps(['/bin/sh', '-c', script])}")
    if pending:
        out.append(pending.rstrip("\n"))
    return "\n".join(out) + "\n", files


_FROM = re.compile(r"^\s*FROM\s+(?:--\S+\s+)*(\S+)(?:\s+AS\s+(\S+))?", re.IGNORECASE | re.MULTILINE)
_COPY_FROM = re.compile(r"^(\s*(?:COPY|ADD)\s+(?:--\S+\s+)*?--from=)(\S+)", re.IGNORECASE | re.MULTILINE)


def _image_refs(text: str) -> list[tuple[re.Match, int]]:
    """Every image reference of a Dockerfile, in order: (match, group of the name) for ``FROM``
    images and ``COPY --from=IMAGE`` sources, without earlier stages' names or indices and
    without references built from ``ARG`` values (``$``)."""
    stages: set[str] = set()
    refs: list[tuple[re.Match, int]] = []
    events = sorted([(m.start(), m, 1) for m in _FROM.finditer(text)] + [(m.start(), m, 2) for m in _COPY_FROM.finditer(text)],
                    key=lambda e: e[0])
    count = 0
    for _, match, group in events:
        image = match.group(group)
        if image.lower() not in stages and not image.isdigit() and "$" not in image:
            refs.append((match, group))
        if group == 1:
            stages.add(str(count))
            count += 1
            if match.group(2):
                stages.add(match.group(2).lower())
    return refs


def from_images(text: str) -> list[str]:
    """The images a Dockerfile uses: ``FROM`` images and ``COPY --from=IMAGE`` sources, each once,
    without earlier stages' names (``FROM x AS y``, ``--from=y``, ``--from=0``)."""
    images: list[str] = []
    for match, group in _image_refs(text):
        if match.group(group) not in images:
            images.append(match.group(group))
    return images


def rewrite_from(text: str, names: dict[str, str]) -> str:
    """``text`` with each image of :func:`from_images` that is a key of ``names`` replaced by its
    value (flags such as ``--platform`` and ``AS stage`` kept): how a task's ``FROM
    mirror/debian@sha256:...`` is pointed at the local stand-in's name."""
    if not names:
        return text
    spans = sorted((m.span(g), names[m.group(g)]) for m, g in _image_refs(text) if m.group(g) in names)
    for (start, end), name in reversed(spans):
        text = text[:start] + name + text[end:]
    return text


def dockerfile_instructions(text: str) -> list[list[tuple[int, str]]]:
    """The instructions of a Dockerfile by build stage: ``[[(line number, instruction), ...], ...]``,
    one list per ``FROM`` (its ``FROM`` first; instructions before the first ``FROM`` dropped, as
    builders do not count them as steps). Line numbers are 1-based, of the instruction's first
    line; continuation lines are joined, comments and heredoc bodies skipped."""
    stages: list[list[tuple[int, str]]] = []
    lines = text.splitlines()
    index = 0
    while index < len(lines):
        start = index
        logical = lines[index]
        index += 1
        if not logical.strip() or logical.lstrip().startswith("#"):
            continue
        while logical.rstrip().endswith("\\") and index < len(lines):
            nxt = lines[index]
            index += 1
            if nxt.lstrip().startswith("#"):
                continue
            logical = logical.rstrip()[:-1] + " " + nxt.strip()
        flat = " ".join(logical.split())
        for terminator, strip_tabs in heredoc_terminators(flat):
            while index < len(lines):
                line = lines[index]
                index += 1
                if (line.lstrip("\t") if strip_tabs else line) == terminator:
                    break
        if flat.split(" ", 1)[0].upper() == "FROM":
            stages.append([])
        if stages:
            stages[-1].append((start + 1, flat))
    return stages
