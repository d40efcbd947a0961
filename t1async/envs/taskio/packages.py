"""Packages a task's scripts install: what the host provides, what the verifier layer must install.

The local flavour (:func:`t1async.envs.taskio.adapt.plan_local`) checks each install against the host: Debian
packages by ``dpkg-query`` (:func:`host_has_deb`), Python distributions by ``importlib.metadata`` of the
Python the sandbox runs, version specifiers checked (:func:`host_python_lacks`); a package the host lacks
refuses the task (:class:`Refusal`). The container flavour records them instead in :class:`VerifierNeeds`
(installed at build time in the verifier layer, :mod:`t1async.envs.images.engine`).
"""

from __future__ import annotations

import functools
import importlib.metadata
import re
import shutil
import subprocess
from dataclasses import dataclass, field

from packaging.requirements import InvalidRequirement, Requirement

HARNESS_PACKAGES = frozenset({"tmux", "asciinema"})
"""Debian packages Terminal-Bench images install for its own harness (tmux sessions, recordings)."""

RUNNER_PACKAGES = frozenset({"pytest", "uv"})
"""Test-runner packages: the host's own are used, whatever version a script pins."""

REPORT_PLUGINS = ("pytest-json-ctrf", "pytest-json-report")
"""Report-only pytest plugins: when absent, their options are dropped from the pytest command."""

OTHER_PACKAGE_MANAGERS = ("apk", "yum", "dnf", "zypper", "pacman", "conda", "mamba", "brew", "snap")


class Refusal(Exception):
    """Raised inside the planner with the reason the local backend refuses the task."""


@dataclass
class VerifierNeeds:
    """What a test script would install at test time (container flavour; see the module docstring).

    Attributes:
        debs: Debian packages (apt-get install) of lines whose failure would stop the script
            (``set -e`` in effect, the line unguarded).
        optional_debs: the packages of each ``apt-get install`` line whose failure the script
            survives (no ``set -e``, or guarded by ``||``, ``&&`` or a condition), one tuple a
            line: a pin the archive no longer has (``jq=1.6-2.1``) fails that line only, and the
            tests then use what the image has, as under the harness.
        requirements: Python requirements (pip, uv pip install, uv add, uvx --with), report-only
            plugins left out.
        present: paths, relative to tests/, of the files the task's tests/ folder holds (a TB1
            helper among them is adapted, not supplied; see :func:`adapt_tests`).
    """

    debs: list[str] = field(default_factory=list)
    optional_debs: list[tuple[str, ...]] = field(default_factory=list)
    requirements: list[str] = field(default_factory=list)
    present: frozenset[str] = frozenset()


@functools.lru_cache(maxsize=512)
def host_has_deb(package: str) -> bool:
    """Whether the Debian package ``package`` (``name[:arch][=version]``, version ignored) is
    installed on the host (``dpkg-query``); False without dpkg."""
    name = package.split("=", 1)[0].split(":", 1)[0]
    dpkg_query = shutil.which("dpkg-query") or "/usr/bin/dpkg-query"  # the host's packages, whatever PATH says
    try:
        out = subprocess.run([dpkg_query, "-W", "-f=${Status}", name], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and out.stdout.strip().endswith("install ok installed")


@functools.lru_cache(maxsize=512)
def host_python_lacks(requirement: str, runner: bool = False) -> str | None:
    """Why the sandbox's Python (the host's, the one running t1async) does not satisfy
    ``requirement`` (a PEP 508 string), or None when it does. With ``runner``, a test-runner
    package only needs to be present (its version pin is ignored)."""
    try:
        req = Requirement(requirement)
    except InvalidRequirement:
        return f"{requirement!r} (not a package requirement t1async can check)"
    try:
        version = importlib.metadata.version(req.name)
    except importlib.metadata.PackageNotFoundError:
        return f"{req.name} (not installed)"
    if runner or not req.specifier or req.specifier.contains(version, prereleases=True):
        return None
    return f"{req}: the host has {version}"


def pip_requirements(words: list[str]) -> list[str]:
    """Requirement strings after ``install`` in a pip command (options and their values skipped)."""
    takes_value = {"-r", "--requirement", "-c", "--constraint", "-i", "--index-url", "--extra-index-url",
                   "-f", "--find-links", "--python", "-p", "--target", "-t", "--prefix", "--root"}
    reqs, skip = [], False
    after = words[words.index("install") + 1:]
    for word in after:
        if skip:
            skip = False
            continue
        if word in takes_value:
            if word in ("-r", "--requirement"):
                raise Refusal("pip install -r <file>: requirements files are not read by the local sandbox")
            skip = True
            continue
        if word.startswith("-"):
            if word.startswith(("-e", "--editable")):
                raise Refusal(f"pip install {word}: installing a local project is not reproduced locally")
            continue
        if word == "." or word.startswith(("./", "/", "../")) or "$" in word or "`" in word:
            raise Refusal(f"pip install {word}: a local path or a variable, not a requirement t1async can "
                          "install ahead of time")
        reqs.append(word)
    return reqs


def requirement_name(requirement: str) -> str:
    """The lower-cased distribution name a requirement string starts with (``Flask[async]>=2`` -> ``flask``)."""
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower()


def is_runner(requirement: str, test_script: bool) -> bool:
    """Whether ``requirement`` names a test-runner package (pytest, its plugins, uv) of a test script:
    the host's own serves, whatever version it pins."""
    name = requirement_name(requirement)
    return test_script and (name in RUNNER_PACKAGES or name.startswith("pytest"))
