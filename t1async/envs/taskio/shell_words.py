"""Reading shell commands as a POSIX shell reads them, for adapting task scripts.

The adapters (:mod:`t1async.envs.taskio.adapt`) must know what a line of a Dockerfile ``RUN`` step or
a test script *does*: which program it runs, with which arguments, and which words are not
arguments at all. This module gives them two things:

* :func:`split_commands`: the spans of the commands of a script between top-level ``&&``,
  ``||``, ``;``, ``&`` and newlines (quotes, ``$(...)``, backticks and backslash escapes
  respected; a pipeline stays one command; ``#`` comments dropped).
* :func:`parse_command`: one such command as a :class:`Command`: its pipeline stages, each a
  :class:`SimpleCommand` with the variable assignments that prefix it (``FOO=1 cmd``), its words
  with quotes removed, and its redirections (``2>/dev/null``, ``>>log``, ``2>&1``, ``<in``,
  ``&>out``) kept apart, so that ``pip install x 2>/dev/null`` installs ``x`` and nothing else.
  Wrappers that run the rest of the line (``sudo [opts]``, ``env [-i] [K=V]``, ``exec``,
  ``command``, ``nohup``, ``time``) are looked through.

Word splitting follows the Shell Command Language of POSIX.1-2017 (XCU 2.2 Quoting, 2.3 Token
Recognition, 2.7 Redirection, 2.9.1 Simple Commands): single quotes keep everything; inside
double quotes a backslash escapes only ``$``, backtick, ``"``, ``\\`` and newline; a
backslash-newline outside single quotes is removed (a line continuation); an unquoted digit
string directly before ``<`` or ``>`` is the redirection's file descriptor. Expansions
(``$VAR``, ``${...}``, ``$(...)``, backticks) are kept as text, unexpanded: callers that need
their value must treat such words as unknown (:attr:`SimpleCommand.has_expansion`).
Not modelled: here-document bodies, ``case`` patterns, arithmetic ``$((...))`` beyond keeping
it as one word, aliases.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_OPERATORS = ("&&", "||", ";;", ";", "&", "\n")
"""Separators between commands (XCU 2.9.3 lists, 2.9.4 compound commands' ``;;``)."""

_REDIRECTIONS = ("<<<", "<<-", "&>>", ">>", "<<", "<&", ">&", "<>", ">|", "&>", "<", ">")
"""Redirection operators, longest first (XCU 2.7, plus bash's ``&>``, ``&>>`` and ``<<<``)."""

_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\+?=")

WRAPPERS = {
    "sudo": {"-u", "-g", "-h", "-p", "-C", "-D", "-r", "-t", "-U", "--user", "--group", "--host", "--prompt"},
    "env": {"-u", "--unset", "-C", "--chdir", "-S", "--split-string"},
    "exec": {"-a"},
    "command": set(),
    "nohup": set(),
    "time": {"-f", "--format", "-o", "--output"},
    "nice": {"-n", "--adjustment"},
    "timeout": {"-s", "--signal", "-k", "--kill-after"},
}
"""Programs that run the rest of their line, with the options of theirs that take a value."""


@dataclass(frozen=True)
class SimpleCommand:
    """One stage of a pipeline (XCU 2.9.1).

    Attributes:
        assignments: leading ``NAME=value`` words (quotes removed), in order.
        words: the command name and its arguments, quotes removed, expansions kept as text;
            wrappers (:data:`WRAPPERS`) and their options removed.
        redirections: each redirection as written, operator and target joined
            (``"2>/dev/null"``, ``">>out.log"``, ``"2>&1"``).
        wrappers: the wrapper programs that were looked through (``("sudo",)``).
        has_expansion: whether any word holds an unquoted or double-quoted ``$`` or a
            backtick, so its value is not known before the shell runs it.
    """

    assignments: tuple[str, ...] = ()
    words: tuple[str, ...] = ()
    redirections: tuple[str, ...] = ()
    wrappers: tuple[str, ...] = ()
    has_expansion: bool = False

    @property
    def program(self) -> str:
        """The command name's last path component (``/usr/bin/pip3`` -> ``pip3``), or ""."""
        return self.words[0].rsplit("/", 1)[-1] if self.words else ""

    def writes(self) -> tuple[str, ...]:
        """Targets of output redirections (``>``, ``>>``, ``>|``, ``&>``, ``&>>``, ``<>``), paths
        as written; descriptor duplications (``2>&1``) are not files and are left out."""
        out = []
        for redirection in self.redirections:
            match = re.match(r"^\d*(&>>|&>|>>|>\||<>|>)(?!&)(.*)$", redirection)
            if match and match.group(2):
                out.append(match.group(2))
        return tuple(out)


@dataclass(frozen=True)
class Command:
    """A pipeline: one or more :class:`SimpleCommand` joined by ``|``.

    Attributes:
        stages: the pipeline's commands in order (never empty for a non-empty command).
        negated: the pipeline starts with ``!``.
    """

    stages: tuple[SimpleCommand, ...] = field(default_factory=tuple)
    negated: bool = False

    @property
    def first(self) -> SimpleCommand:
        """The first stage (an empty :class:`SimpleCommand` for an empty command)."""
        return self.stages[0] if self.stages else SimpleCommand()


def _past_quoted(text: str, i: int) -> int | None:
    """Where scanning resumes after ``text[i]`` when it opens a quote (``'``, ``"``, a backtick)
    or is a backslash escape: the index past the quoted span or the escaped character; None for
    any other character. An unclosed quote runs to the end of ``text``."""
    ch = text[i]
    if ch == "\\":
        return i + 2
    if ch not in "'\"`":
        return None
    j = i + 1
    while j < len(text) and text[j] != ch:
        j += 2 if text[j] == "\\" and ch != "'" else 1
    return min(j + 1, len(text))


def _skip_group(text: str, i: int, opener: str, closer: str) -> int:
    """Index just past the ``closer`` matching ``text[i]`` == ``opener`` (quotes respected)."""
    depth = 0
    while i < len(text):
        resume = _past_quoted(text, i)
        if resume is not None:
            i = resume
            continue
        if text[i] == opener:
            depth += 1
        elif text[i] == closer:
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return len(text)


def _expansion_end(text: str, i: int) -> int:
    """Index past the expansion starting at ``text[i] == '$'`` (or a backtick)."""
    if text[i] == "`":
        j = i + 1
        while j < len(text) and text[j] != "`":
            j += 2 if text[j] == "\\" else 1
        return min(j + 1, len(text))
    if text.startswith("$(", i):
        return _skip_group(text, i + 1, "(", ")")
    if text.startswith("${", i):
        return _skip_group(text, i + 1, "{", "}")
    match = re.match(r"\$(?:[A-Za-z_][A-Za-z0-9_]*|[0-9@*#?$!-])", text[i:])
    return i + (match.end() if match else 1)


def tokens(text: str) -> list[tuple[str, str, bool]]:
    """Tokens of one command: ``(kind, value, expands)`` with kind ``"word"``, ``"redir"`` (a
    redirection operator with its optional descriptor, e.g. ``"2>"``) or ``"op"`` (``|`` or
    ``!``); a word's value has its quotes removed and ``expands`` says whether it holds an
    expansion. Line continuations are removed; ``#`` at a word start ends the command."""
    out: list[tuple[str, str, bool]] = []
    word: list[str] = []
    started = expands = quoted = False
    i = 0

    def flush() -> None:
        nonlocal word, started, expands, quoted
        if started:
            out.append(("word", "".join(word), expands))
        word, started, expands, quoted = [], False, False, False

    while i < len(text):
        ch = text[i]
        if ch == "\\":
            if text.startswith("\\\n", i):
                i += 2
                continue
            word.append(text[i + 1:i + 2])
            started = quoted = True
            i += 2
            continue
        if ch == "'":
            end = text.find("'", i + 1)
            end = len(text) if end < 0 else end
            word.append(text[i + 1:end])
            started = quoted = True
            i = end + 1
            continue
        if text.startswith("$'", i):  # ANSI-C quoting: escapes are rare in what we read; kept literally
            end = text.find("'", i + 2)
            end = len(text) if end < 0 else end
            word.append(text[i + 2:end])
            started = quoted = True
            i = end + 1
            continue
        if ch == '"':
            j = i + 1
            while j < len(text) and text[j] != '"':
                if text[j] == "\\" and j + 1 < len(text) and text[j + 1] in '$`"\\\n':
                    if text[j + 1] != "\n":
                        word.append(text[j + 1])
                    j += 2
                    continue
                if text[j] in "$`":
                    end = _expansion_end(text, j)
                    word.append(text[j:end])
                    expands = True
                    j = end
                    continue
                word.append(text[j])
                j += 1
            started = quoted = True
            i = j + 1
            continue
        if ch in "$`":
            end = _expansion_end(text, i)
            word.append(text[i:end])
            started = expands = True
            i = end
            continue
        if ch in " \t\n":
            flush()
            i += 1
            continue
        if ch == "#" and not started:
            break
        redirection = next((op for op in _REDIRECTIONS if text.startswith(op, i)), None)
        if redirection is not None:
            fd = ""
            if started and not quoted and not expands and "".join(word).isdigit():
                fd = "".join(word)
                word, started = [], False
            flush()
            out.append(("redir", fd + redirection, False))
            i += len(redirection)
            continue
        if ch == "|" and not text.startswith("||", i):
            flush()
            out.append(("op", "|", False))
            i += 1
            continue
        if ch == "!" and not started and (i + 1 == len(text) or text[i + 1] in " \t"):
            out.append(("op", "!", False))
            i += 1
            continue
        word.append(ch)
        started = True
        i += 1
    flush()
    return out


def _simple(items: list[tuple[str, str, bool]]) -> SimpleCommand:
    assignments: list[str] = []
    words: list[tuple[str, bool]] = []
    redirections: list[str] = []
    pending = ""
    for kind, value, expands in items:
        if pending:
            redirections.append(pending + value)
            pending = ""
        elif kind == "redir":
            pending = value
        elif not words and _ASSIGNMENT.match(value):
            assignments.append(value)
        else:
            words.append((value, expands))
    if pending:
        redirections.append(pending)
    wrappers: list[str] = []
    while words and words[0][0].rsplit("/", 1)[-1] in WRAPPERS:
        name = words[0][0].rsplit("/", 1)[-1]
        takes_value = WRAPPERS[name]
        wrappers.append(name)
        words = words[1:]
        while words:
            head = words[0][0]
            if head == "--":
                words = words[1:]
                break
            if head in takes_value:
                words = words[2:]
            elif head.startswith("-") and len(head) > 1:
                words = words[1:]
            elif name == "env" and _ASSIGNMENT.match(head):
                assignments.append(head)
                words = words[1:]
            elif name == "timeout" and re.fullmatch(r"[\d.]+[smhd]?", head):
                words = words[1:]
            else:
                break
    return SimpleCommand(tuple(assignments), tuple(w for w, _ in words), tuple(redirections), tuple(wrappers),
                         any(e for _, e in words))


def parse_command(text: str) -> Command:
    """``text`` (one command, as :func:`split_commands` yields) as a :class:`Command`.

    Never raises: unbalanced quotes end at the end of the text, as a shell reading to EOF
    would report; callers only classify commands, the shell still runs the original text.
    """
    items = tokens(text)
    negated = bool(items) and items[0] == ("op", "!", False)
    if negated:
        items = items[1:]
    stages: list[SimpleCommand] = []
    current: list[tuple[str, str, bool]] = []
    for item in items:
        if item == ("op", "|", False):
            stages.append(_simple(current))
            current = []
        else:
            current.append(item)
    stages.append(_simple(current))
    return Command(tuple(s for s in stages if s.words or s.assignments or s.redirections), negated)


def split_commands(text: str) -> list[tuple[int, int]]:
    """Spans ``(start, end)`` of the commands of shell ``text`` between top-level ``&&``, ``||``,
    ``;``, ``&`` and newlines (quotes, ``$(...)``, backticks and backslash escapes respected;
    pipelines stay whole; ``#`` comments dropped; ``&>``/``>&`` redirections are not ``&``)."""
    spans: list[tuple[int, int]] = []
    start = i = 0
    depth = 0
    while i < len(text):
        ch = text[i]
        resume = _past_quoted(text, i)
        if resume is not None:
            i = resume
            continue
        if ch == "#" and (i == 0 or text[i - 1] in " \t\n;&|") and depth == 0:
            end = text.find("\n", i)
            spans.append((start, i))
            i = len(text) if end < 0 else end
            start = i
            continue
        elif text.startswith("$(", i):
            depth += 1
        elif ch == ")" and depth:
            depth -= 1
        elif depth == 0:
            if ch == "&" and (text.startswith("&>", i) or (i > 0 and text[i - 1] in "<>")):
                i += 1  # &> and >& are redirections
                continue
            for sep in _OPERATORS:
                if text.startswith(sep, i):
                    spans.append((start, i))
                    i += len(sep)
                    start = i
                    break
            else:
                i += 1
                continue
            continue
        i += 1
    spans.append((start, len(text)))
    return [(a, b) for a, b in spans if text[a:b].strip()]
