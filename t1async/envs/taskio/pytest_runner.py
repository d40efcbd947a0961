"""The test runner of an adapted test script: pytest through uv, uvx, ``pytest`` or ``python -m pytest``,
rewritten to the sandbox's own pytest.

Each flavour runs pytest as :func:`pytest_command` gives it (the host's ``python3`` for the local sandbox,
:data:`CONTAINER_PYTHON` in a container), imported with the working folder off ``sys.path``
(:data:`PYTEST_RUNNER`), with ``-rA`` added when missing (the reward is read from its summary) and the
options of absent report-only plugins (``--ctrf FILE``, ``--json-report...``) dropped
(:func:`runner_command`). ``uv run --with`` requirements are checked against the host (local) or recorded
for the verifier layer (container).
"""

from __future__ import annotations

import re

from .packages import REPORT_PLUGINS, Refusal, VerifierNeeds, host_python_lacks, is_runner, requirement_name

CONTAINER_PYTHON = "${T1ASYNC_VERIFIER_PYTHON:-python3}"
"""The Python a container's adapted test script runs pytest with (the verifier layer's when built)."""

PYTEST_RUNNER = ("-c 'import os, sys; here = sys.path.pop(0) if sys.path and sys.path[0] in (\"\", os.getcwd()) "
                 "else None; import pytest; sys.path[:0] = [] if here is None else [here]; sys.argv[0] = \"pytest\"; "
                 "raise SystemExit(getattr(pytest, \"console_main\", pytest.main)())'")
"""What follows the Python in an adapted pytest command, in place of ``-m pytest``: pytest is
imported with the working folder off ``sys.path`` (so an agent-planted ``/app/pytest.py``,
``_pytest/`` or ``pluggy.py`` cannot stand in for it), then the folder goes back, so the tests
see what ``python -m pytest`` gives them (``import solution`` from ``/app``), and processes they
start get an unchanged environment (``python /app/tool.py`` imports its sibling modules)."""


def pytest_command(python: str) -> str:
    """The adapted pytest invocation for ``python`` (see :data:`PYTEST_RUNNER`); arguments follow."""
    return f"{python} {PYTEST_RUNNER}"


_PLUGIN_OPTIONS = {
    "pytest-json-ctrf": re.compile(r"\s--ctrf(?:=\S+|\s+\S+)"),
    "pytest-json-report": re.compile(r"\s--json-report-file(?:=\S+|\s+\S+)|\s--json-report\b"),
}
_UV_VALUE_OPTIONS = ("-w", "--with", "--from", "-p", "--python", "--directory", "--project", "--index-url",
                     "--with-requirements", "--extra-index-url")
_PYTEST_WORD = re.compile(r"^(?:\S*/)?pytest(?:[<>=!~]=?\S*)?$")


def _raw_words(text: str) -> list[tuple[str, int]]:
    """(word, end offset) of each unquoted-whitespace-separated word of ``text`` (quotes kept)."""
    words, start, quote, i = [], None, "", 0
    while i < len(text):
        ch = text[i]
        if quote:
            if ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
            start = i if start is None else start
        elif ch.isspace():
            if start is not None:
                words.append((text[start:i], i))
                start = None
        else:
            start = i if start is None else start
        i += 1
    if start is not None:
        words.append((text[start:], len(text)))
    return words


def _collect_withs(withs: list[str], collect: VerifierNeeds | None) -> None:
    """Record ``uv run --with`` requirements (container) or check them on the host (local).

    Raises:
        Refusal: (local) the host lacks one.
    """
    for req in withs:
        name = requirement_name(req)
        if collect is not None:
            if name not in REPORT_PLUGINS:
                collect.requirements.append(req)
        elif name not in REPORT_PLUGINS and (why := host_python_lacks(req, runner=is_runner(req, True))):
            raise Refusal(f"the test runner needs Python packages the host lacks: {why}")


def runner_command(command: str, collect: VerifierNeeds | None = None) -> str | None:
    """``python3 PYTEST_RUNNER ARGS`` (:func:`pytest_command`) for a pytest invocation through
    uv/uvx/pytest/python -m pytest, ARGS kept as written (expansions intact), ``-rA`` added when
    missing, options of absent report plugins dropped. None if ``command`` is not one.
    With ``collect`` (container flavour): ``--with`` requirements are recorded there, report
    plugin options always dropped, and the Python is :data:`CONTAINER_PYTHON`."""
    text = command.strip()
    words = _raw_words(text)
    if not words:
        return None
    head = words[0][0].rsplit("/", 1)[-1]
    index = None
    if head in ("uvx", "uv"):
        i = 1
        if head == "uv":
            if [w for w, _ in words[1:3]] == ["tool", "run"]:
                i = 3
            elif words[1:2] and words[1][0] == "run":
                i = 2
            else:
                return None
        withs = []
        while i < len(words):
            word = words[i][0]
            if _PYTEST_WORD.match(word):
                index = i
                break
            if word in _UV_VALUE_OPTIONS:
                if word in ("-w", "--with", "--from") and i + 1 < len(words):
                    withs.append(words[i + 1][0].strip("'\""))
                i += 2
                continue
            if not word.startswith("-"):
                if head != "uv":
                    return None  # uvx runs another tool: as written
                # `uv run CMD ARGS`: CMD in the verifier environment (python: its Python)
                _collect_withs(withs, collect)
                python = CONTAINER_PYTHON if collect is not None else "python3"
                rest = text[words[i - 1][1]:].lstrip()
                if re.match(r"^python3?(?:\.\d+)?$", word):
                    rest = "python3" + rest[len(word):]
                    return runner_command(rest, collect) or (python + rest[len("python3"):])
                return rest
            i += 1
        _collect_withs(withs, collect)
    elif _PYTEST_WORD.match(words[0][0]):
        index = 0
    elif re.match(r"^python3?(?:\.\d+)?$", head) and [w for w, _ in words[1:3]] == ["-m", "pytest"]:
        index = 2
    if index is None:
        return None
    rest = text[words[index][1]:]
    changed = True  # `python -m pytest` as written would import a pytest.py from the working folder
    for package, pattern in _PLUGIN_OPTIONS.items():
        if pattern.search(rest) and (collect is not None or host_python_lacks(package) is not None):
            rest = pattern.sub("", rest)
            changed = True
    if not re.search(r"(?:^|\s)-r\w*A", rest):
        rest = " -rA" + rest
        changed = True
    python = CONTAINER_PYTHON if collect is not None else "python3"
    return pytest_command(python) + rest if changed else None
