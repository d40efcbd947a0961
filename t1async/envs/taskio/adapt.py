"""Adapting a task to the ``local`` backend: what the host provides, what it replaces, what it refuses.

The local sandbox has no image: it runs the host's ``/usr`` and the host's Python. A task's
Dockerfile RUN steps and test script are read command by command (split and read into words as a
shell does, by :mod:`t1async.envs.taskio.shell_words`; a pipeline stays one command) and each command is
classified:

* **package installs** (``apt-get install``, ``pip install``, ``uv pip install``, ...): satisfied
  when the host already provides every package (Debian packages by ``dpkg-query``, Python
  distributions by ``importlib.metadata`` of the Python the sandbox runs, version specifiers
  checked; ``pytest`` and runner plugins in a test script need only be present); the command is
  then replaced by ``true``. Otherwise the task is refused, naming the missing packages.
  ``apt-get update``/``clean``, ``rm -rf /var/lib/apt/lists/*`` become ``true`` too. Other
  package managers (apk, yum, dnf, conda, npm install -g, ...) are refused.
* **test-runner bootstraps** in test scripts (``curl ... astral.sh/uv ... | sh``, ``source
  $HOME/.local/bin/env``, ``uv venv``, ``source .../bin/activate``): replaced by ``true``; the
  runner itself (``uv run pytest``, ``uvx ... pytest``, ``pytest``) becomes ``python3 -m pytest``
  (the host's pytest), with ``-rA`` added when missing (the reward is read from its summary) and
  options of absent report-only plugins (``--ctrf FILE``, ``--json-report...``) dropped.
* **network use** (``curl``, ``wget``, ``git clone``, a URL) at build or test time: refused
  unless the task allows internet access.

Everything else runs as written. The package checks (and :class:`VerifierNeeds`, :class:`Refusal`) are
:mod:`t1async.envs.taskio.packages`; the runner's rewriting is :mod:`t1async.envs.taskio.pytest_runner`;
this module reads scripts command by command and plans each flavour. The result is stored on the task:
:attr:`Task.steps` (RUN steps rewritten or dropped), :attr:`Task.local_test_script` and :attr:`Task.local_refusal`.
Terminal-Bench's harness-only packages (:data:`HARNESS_PACKAGES`) are not needed here.

**Missing Terminal-Bench 1 helpers.** TB1 test scripts ``source $TEST_DIR/setup-uv-pytest.sh``
and run ``bash $TEST_DIR/run-uv-pytest.sh``, which the TB1 harness supplies (they install uv
and pytest from the network, then run ``uv run pytest $TEST_DIR/test_outputs.py -rA``). When the
task's tests/ lacks them, the first becomes ``true`` (pytest comes from the host or the verifier
layer) and the second the pytest run itself. When tests/ has them, or any other script that the
test script runs, each is adapted like the test script itself (:func:`adapt_tests`).

**The container flavour** (:func:`plan_container`): the task's image is built for real, so only
the test script is adapted, and nothing is refused: package installs in it (apt-get, pip,
``uv pip install``, ``uv add``, ``uvx --with``) are collected into :class:`VerifierNeeds` and
become ``true`` (an ``apt-get install`` line the script survives the failure of, see
:func:`survivable_commands`, into :attr:`VerifierNeeds.optional_debs`, installed with its failure
tolerated) (they are installed at build time in the verifier layer, see
:mod:`t1async.envs.images.engine`); uv bootstraps become ``true``; the runner becomes
``${T1ASYNC_VERIFIER_PYTHON:-python3} -m pytest -rA ...`` (the verifier layer's Python when it
was built). Stored in :attr:`Task.container_test_script` and :attr:`Task.verifier_needs`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import replace

from .packages import (
    HARNESS_PACKAGES,
    OTHER_PACKAGE_MANAGERS,
    REPORT_PLUGINS,
    Refusal,
    VerifierNeeds,
    host_has_deb,
    host_python_lacks,
    is_runner,
    pip_requirements,
    requirement_name,
)
from .pytest_runner import CONTAINER_PYTHON, pytest_command, runner_command
from .shell_words import Command, parse_command, split_commands
from .task import DockerStep, Task, test_script_text

_NETWORK_WORDS = ("curl", "wget", "ssh", "scp", "rsync", "nc", "ncat", "telnet", "ftp")
_URL = re.compile(r"\b(https?|ftp|git)://")
_KEYWORDS = re.compile(r"\s*(?:(?:if|elif|while|until|then|else|do|!|\{|\()\s+)*")


TB1_HELPERS = ("setup-uv-pytest.sh", "run-uv-pytest.sh")
"""Terminal-Bench 1 harness scripts that test scripts call but task folders usually lack."""

def _words(command: str) -> list[str]:
    """The words of ``command``'s first pipeline stage (see :func:`~t1async.envs.taskio.shell_words.parse_command`):
    quotes removed; assignments, redirections and wrappers such as ``sudo`` left out."""
    return list(parse_command(command).first.words)


def classify(command: str, *, test_script: bool, allow_internet: bool, collect: VerifierNeeds | None = None,
             present: frozenset[str] | None = None, survivable: bool = False) -> str | None:
    """The replacement of one command (None: run it as written): for the local sandbox, or for a
    container's test script when ``collect`` is given (installs are recorded there instead of
    checked against the host; nothing is refused).

    Args:
        present: files of the task's tests/ folder (a missing TB1 helper is replaced); None:
            unknown, helpers are left alone.
        survivable: (container) the script runs past this command when it fails (see
            :func:`survivable_commands`): its apt packages go to :attr:`VerifierNeeds.optional_debs`.

    Raises:
        Refusal: (local only) the command needs what the host lacks (packages, another package
            manager, network).
    """
    words = _words(command)
    if not words:
        return None
    head = words[0].rsplit("/", 1)[-1]
    text = " ".join(words)
    if test_script and present is not None:
        helper = _missing_helper(words, present)
        if helper == "setup-uv-pytest.sh":
            return "true"
        if helper == "run-uv-pytest.sh":
            python = CONTAINER_PYTHON if collect is not None else "python3"
            return f'{pytest_command(python)} -rA "$TEST_DIR/test_outputs.py"'
    if collect is not None:
        return _classify_container(command, words, head, text, collect, survivable)
    if head in ("apt-get", "apt", "aptitude"):
        sub = next((w for w in words[1:] if not w.startswith("-")), "")
        if sub in ("update", "clean", "autoclean", "autoremove", "upgrade", "dist-upgrade"):
            return "true"
        if sub == "install":
            packages = [w for w in words[words.index("install") + 1:] if not w.startswith("-")]
            missing = [p for p in packages if p.split("=")[0] not in HARNESS_PACKAGES and not host_has_deb(p)]
            if missing:
                raise Refusal(f"needs Debian packages the host lacks: {', '.join(missing)} (`{command.strip()[:160]}`)")
            return "true"
        raise Refusal(f"`{command.strip()[:160]}`: apt operations other than install/update are not reproduced locally")
    if head in ("rm",) and "/var/lib/apt/lists" in text:
        return "true"
    if head in OTHER_PACKAGE_MANAGERS or (head == "npm" and "-g" in words):
        raise Refusal(f"uses a package manager the local sandbox cannot reproduce: `{command.strip()[:160]}`")
    pip = (head in ("pip", "pip3") or (head.startswith("python") and words[1:3] == ["-m", "pip"])
           or (head == "uv" and words[1:3] == ["pip", "install"]))
    uv_add = head == "uv" and words[1:2] == ["add"]
    if (pip and "install" in words) or uv_add:
        reqs = pip_requirements(words) if not uv_add else [w for w in words[2:] if not w.startswith("-")]
        lacking = [why for r in reqs if (why := host_python_lacks(r, runner=is_runner(r, test_script)))]
        lacking = [w for w in lacking if not (test_script and w.split()[0].split(":")[0] in REPORT_PLUGINS)]
        if lacking:
            raise Refusal(f"needs Python packages the host lacks: {'; '.join(lacking)} (`{command.strip()[:160]}`)")
        return "true"
    if test_script:
        if "astral.sh/uv" in text or re.search(r"\buv/[^ ]*install\.sh", text):
            return "true"  # downloads the uv installer: the host's pytest replaces uv
        if head in ("source", ".") and len(words) == 2 and (words[1].endswith("/bin/activate")
                                                            or words[1].endswith(".local/bin/env")):
            return "true"
        if head == "uv" and len(words) > 1 and words[1] in ("venv", "init", "sync", "lock"):
            return "true"
        runner = runner_command(command)
        if runner is not None:
            return runner
    if test_script and (words[1:3] == ["-m", "venv"] and head.startswith("python") or head == "virtualenv"):
        raise Refusal(f"the test script creates a Python virtual environment (`{command.strip()[:120]}`), which "
                      "the local sandbox cannot populate (the host's Python, no installs): use env.sandbox=container")
    if not test_script and (target := _system_write(parse_command(command))):
        raise Refusal(f"the Dockerfile writes {target}, which the local sandbox keeps read-only (only /app, /tmp, "
                      f"HOME and the task's own top-level folders are writable): `{command.strip()[:120]}`; use "
                      "env.sandbox=container")
    git_remote = head == "git" and len(words) > 1 and words[1] in ("clone", "fetch", "pull", "ls-remote")
    network = head in _NETWORK_WORDS or git_remote or bool(_URL.search(command))
    if network and not allow_internet:
        when = "test" if test_script else "build"
        raise Refusal(f"needs network access at {when} time, which the task does not allow: `{command.strip()[:160]}`")
    return None


LOCAL_READ_ONLY = ("/usr", "/opt", "/etc", "/bin", "/sbin", "/lib", "/lib64", "/var", "/srv", "/home", "/boot",
                   "/mnt", "/media")
"""Folders the local sandbox shows read-only (the host's, or empty); ``/var/tmp`` is writable."""

_WRITERS = {"mkdir", "cp", "mv", "ln", "install", "touch", "tee", "chmod", "chown", "chgrp", "rm", "rmdir", "tar",
            "unzip", "curl", "wget", "git", "rsync", "dd", "sed", "useradd", "adduser", "groupadd", "update-alternatives"}
"""Programs whose path arguments :func:`_system_write` reads as written to."""


def _system_write(command: Command) -> str | None:
    """The first path under :data:`LOCAL_READ_ONLY` that ``command`` (a parsed
    :class:`~t1async.envs.taskio.shell_words.Command`) writes: an output redirection's target, a
    path argument of a program of :data:`_WRITERS` (for ``cp``/``mv``/``ln``/``install``/``rsync``
    the destination only; ``sed`` only with ``-i``), or a user account (``useradd`` writes
    /etc/passwd); None if none."""
    def read_only(path: str) -> bool:
        return (path.startswith("/") and not path.startswith("/var/tmp")
                and any(path == top or path.startswith(top + "/") for top in LOCAL_READ_ONLY))

    for stage in command.stages:
        for target in stage.writes():
            if read_only(target):
                return target
        program, args = stage.program, [w for w in stage.words[1:] if not w.startswith("-")]
        if program not in _WRITERS:
            continue
        if program in ("useradd", "adduser", "groupadd"):
            return "/etc/passwd"
        if program == "update-alternatives":
            return "/etc/alternatives"
        if program == "sed" and not any(w.startswith("-i") or w == "--in-place" for w in stage.words[1:]):
            continue
        if program in ("curl", "wget", "tar", "unzip", "git"):
            words = list(stage.words)
            flags = {"curl": ("-o", "--output"), "wget": ("-O", "-P", "--output-document", "--directory-prefix"),
                     "tar": ("-C", "--directory"), "unzip": ("-d",), "git": ("clone",)}[program]
            args = [words[i + 1] for i, w in enumerate(words[:-1]) if w in flags]
            if program == "git" and "clone" in words:
                args = [w for w in words[words.index("clone") + 1:] if not w.startswith("-")][1:2]
        elif program in ("cp", "mv", "ln", "install", "rsync"):
            args = args[-1:]
        for path in args:
            if read_only(path):
                return path
    return None


def _missing_helper(words: list[str], present: frozenset[str]) -> str | None:
    """The TB1 helper a ``source``/``.``/``bash``/``sh`` command runs when tests/ lacks it, else None."""
    if len(words) < 2 or words[0].rsplit("/", 1)[-1] not in ("source", ".", "bash", "sh"):
        return None
    name = words[1].rsplit("/", 1)[-1]
    return name if name in TB1_HELPERS and name not in present else None


def _classify_container(command: str, words: list[str], head: str, text: str, collect: VerifierNeeds,
                        survivable: bool = False) -> str | None:
    """:func:`classify` for a container's test script (see the module docstring)."""
    if head in ("apt-get", "apt", "aptitude"):
        sub = next((w for w in words[1:] if not w.startswith("-")), "")
        if sub == "install":
            packages = [p for p in words[words.index("install") + 1:] if not p.startswith("-")]
            if survivable:
                collect.optional_debs.append(tuple(packages))
            else:
                collect.debs += packages
            return "true"
        return "true" if sub in ("update", "clean", "autoclean", "autoremove") else None
    if head == "rm" and "/var/lib/apt/lists" in text:
        return "true"
    pip = (head in ("pip", "pip3") or (head.startswith("python") and words[1:3] == ["-m", "pip"])
           or (head == "uv" and words[1:3] == ["pip", "install"]))
    if (pip and "install" in words) or (head == "uv" and words[1:2] == ["add"]):
        try:
            reqs = pip_requirements(words) if pip else [w for w in words[2:] if not w.startswith("-")]
        except Refusal:
            return None  # a requirements file or a local project: run it as written
        collect.requirements += [r for r in reqs if requirement_name(r) not in REPORT_PLUGINS]
        return "true"
    if "astral.sh/uv" in text or re.search(r"\buv/[^ ]*install\.sh", text):
        return "true"
    if head in ("source", ".") and len(words) == 2 and (words[1].endswith("/bin/activate")
                                                        or words[1].endswith(".local/bin/env")):
        return "true"
    if head == "uv" and len(words) > 1 and words[1] in ("venv", "init", "sync", "lock"):
        return "true"
    return runner_command(command, collect=collect)


def _commands(text: str) -> Iterator[tuple[str, int, int, int]]:
    """``(joined, start, lead, end)`` for each command of shell ``text``: ``joined`` is ``text``
    with line continuations removed (as the shell reads it), ``joined[start:end]`` the command
    and ``start + lead`` where it begins after leading keywords (``if``, ``then``, ``{``, ...)."""
    joined = re.sub(r"\\\n", " ", text)
    for start, end in split_commands(joined):
        keywords = _KEYWORDS.match(joined, start, end)
        yield joined, start, (keywords.end() - start) if keywords else 0, end


def _errexit_change(words: list[str]) -> bool | None:
    """What ``set ...`` (``words``) does to errexit: True (``-e``, ``-euo pipefail``, ``-o
    errexit``), False (``+e``, ``+o errexit``), None (no change, or not ``set``)."""
    if not words or words[0] != "set":
        return None
    change = None
    for i, word in enumerate(words[1:], start=1):
        if re.fullmatch(r"[-+][a-zA-Z]+", word) and "e" in word:
            change = word[0] == "-"
        elif word in ("-o", "+o") and i + 1 < len(words) and words[i + 1] == "errexit":
            change = word == "-o"
    return change


def survivable_commands(text: str) -> list[bool]:
    """For each command of shell script ``text`` (in :func:`_commands` order), whether the script
    runs past it when it fails, as bash does when a harness runs ``bash /tests/test.sh`` (the
    shebang's options are not read): always, unless errexit is on (``set -e``, ``set -o errexit``
    before it, at the top level) and the command is neither guarded by a condition (``if``,
    ``while``, ``!``) nor followed by ``&&`` or ``||`` (bash ignores errexit there; ``a || b``
    with ``b`` failing stops it). Source: bash(1), ``set -e``."""
    errexit = False
    found: list[bool] = []
    for joined, start, lead, end in _commands(text):
        after = joined[end:].lstrip(" \t")
        condition = {"if", "elif", "while", "until", "!"} & set(joined[start:start + lead].split())
        guarded = bool(condition) or after.startswith(("&&", "||"))
        found.append(not errexit or guarded)
        change = _errexit_change(_words(joined[start + lead:end]))
        if change is not None:
            errexit = change
    return found


def adapt_script(text: str, *, test_script: bool, allow_internet: bool, collect: VerifierNeeds | None = None,
                 present: frozenset[str] | None = None) -> str:
    """``text`` with each command replaced per :func:`classify` (unchanged text if nothing applies).

    Raises:
        Refusal: a command the local sandbox cannot run faithfully (never with ``collect``).
    """
    out: list[str] = []
    last = 0
    joined = text
    survives = survivable_commands(text) if collect is not None else []
    for index, (joined, start, lead, end) in enumerate(_commands(text)):
        command = joined[start:end]
        replacement = classify(command[lead:], test_script=test_script, allow_internet=allow_internet,
                               collect=collect, present=present,
                               survivable=survives[index] if index < len(survives) else False)
        if replacement is None:
            continue
        out.append(joined[last:start + lead])
        out.append(replacement)
        last = end - (len(command) - len(command.rstrip()))
    if not out:
        return text
    out.append(joined[last:])
    return "".join(out)


def plan_local(task: Task, *, network: bool | None = None) -> None:
    """Fill :attr:`Task.steps` (RUN steps adapted), :attr:`Task.local_test_script` and
    :attr:`Task.local_refusal` (kept if already set) for the local backend. ``network``: whether
    its sandbox will have network (None: the task's ``allow_internet``; True, e.g. for ``t1async
    eval --network on``, lifts the refusal of commands that need it)."""
    internet = task.allow_internet if network is None else network
    notes: list[str] = []
    if task.verifier_mode == "separate":
        task.local_refusal = task.local_refusal or (
            "[verifier] environment_mode = \"separate\": Harbor runs the tests in an image of their own (tests/Dockerfile "
            "or [verifier.environment] docker_image) and hands it only the declared artifacts; the local sandbox builds "
            "no image, so it cannot: use env.sandbox=container")
    try:
        steps: list[DockerStep] = []
        for step in task.steps:
            if step.instruction != "RUN":
                steps.append(step)
                continue
            adapted = adapt_script(step.args[0], test_script=False, allow_internet=internet)
            if adapted != step.args[0]:
                notes.append(f"Dockerfile:{step.line}: host-provided packages: `{step.args[0][:120]}` -> `{adapted[:120]}`")
            if adapted.replace("true", "").strip(" &;|\n") == "":
                continue
            steps.append(replace(step, args=(adapted,)))
        task.steps = steps
        original = test_script_text(task)
        if original is not None:
            adapted, helpers = adapt_tests(task, original, network=internet)
            task.local_helpers = helpers
            if adapted != original:
                task.local_test_script = adapted
            if adapted != original or helpers:
                changed = ", ".join([task.test_script.name] * (adapted != original) + sorted(helpers))
                notes.append(f"{changed}: the test runner is the host's pytest (downloads replaced, the working "
                             "folder kept off sys.path while pytest is imported)")
    except Refusal as exc:
        task.local_refusal = task.local_refusal or str(exc)
    task.notes = notes
    task.writable = writable_folders(task)


def plan_container(task: Task) -> None:
    """Fill :attr:`Task.container_test_script` and :attr:`Task.verifier_needs` (container flavour,
    see the module docstring; never refuses). A separate verifier environment's test script
    runs as written in its own image (Harbor's semantics: that image holds what the tests need),
    so nothing is planned for it."""
    original = test_script_text(task)
    if original is None or task.verifier_mode == "separate":
        return
    needs = VerifierNeeds(present=_tests_files(task))
    adapted, task.container_helpers = adapt_tests(task, original, collect=needs)
    task.container_test_script = adapted if adapted != original else None
    task.verifier_needs = needs


MAX_HELPER_DEPTH = 4
"""How deep scripts that run scripts of tests/ are followed (:func:`adapt_tests`)."""

_TESTS_PREFIX = re.compile(r"^(?:\$\{?TEST_DIR\}?/|/tests/|\./)")


def invoked_test_files(text: str, present: frozenset[str]) -> list[str]:
    """Paths, relative to tests/, of the shell scripts of tests/ that ``text`` runs with
    ``source``, ``.``, ``bash`` or ``sh`` (``$TEST_DIR/x.sh``, ``/tests/x.sh``, ``x.sh``),
    in order, each once; ``present`` holds the relative paths of the files tests/ has."""
    found: list[str] = []
    for joined, start, lead, end in _commands(text):
        stage = parse_command(joined[start + lead:end]).first
        if stage.program not in ("source", ".", "bash", "sh") or len(stage.words) < 2:
            continue
        script = next((w for w in stage.words[1:] if not w.startswith("-")), "")
        rel = _TESTS_PREFIX.sub("", script)
        if rel in present and rel not in found:
            found.append(rel)
    return found


def adapt_tests(task: Task, original: str, *, collect: VerifierNeeds | None = None,
                network: bool | None = None) -> tuple[str, dict[str, str]]:
    """The test script adapted (:func:`adapt_script`), and every shell script of tests/ that it
    runs, directly or through another such script, adapted the same way: ``{path relative to
    tests/: adapted text}`` for those that changed. So a task's own copy of the TB1 uv helper
    pair, or any variant of it, is read by what its commands do (curl the uv installer, ``uv
    init``, ``uv add pytest``, ``uv run pytest``), not by its name or text.

    ``network``: whether the sandbox will have network (None: the task's ``allow_internet``).

    Raises:
        Refusal: (local, ``collect`` None) a command of one of them the host cannot run.
    """
    internet = task.allow_internet if network is None else network
    files = _tests_files(task)
    adapted = adapt_script(original, test_script=True, allow_internet=internet, collect=collect, present=files)
    helpers: dict[str, str] = {}
    queue = [(rel, 1) for rel in invoked_test_files(original, files)]
    seen: set[str] = set()
    while queue:
        rel, depth = queue.pop(0)
        if rel in seen or depth > MAX_HELPER_DEPTH:
            continue
        seen.add(rel)
        try:
            text = (task.tests_dir / rel).read_text()
        except (OSError, UnicodeDecodeError):
            continue
        new = adapt_script(text, test_script=True, allow_internet=internet, collect=collect, present=files)
        if new != text:
            helpers[rel] = new
        queue += [(r, depth + 1) for r in invoked_test_files(text, files)]
    return adapted, helpers


def _tests_files(task: Task) -> frozenset[str]:
    """Relative paths of the files under the task's tests/ (empty without it)."""
    if not task.tests_dir.is_dir():
        return frozenset()
    return frozenset(str(p.relative_to(task.tests_dir)) for p in task.tests_dir.rglob("*") if p.is_file())


SYSTEM_TOP = frozenset({"app", "tests", "logs", "usr", "bin", "sbin", "lib", "lib32", "lib64", "etc", "proc", "dev",
                        "sys", "tmp", "root", "var", "run", "home", "opt", "boot", "srv", "mnt", "media", "nix"})
"""Top-level folders that are the system's (never given a tmpfs by :func:`writable_folders`)."""

_ABS_PATH = re.compile(r"(?<![\w.~$/-])/([A-Za-z0-9_][A-Za-z0-9_.-]*)/")


def writable_folders(task: Task) -> tuple[str, ...]:
    """Top-level folders outside :data:`SYSTEM_TOP` that the task's test script, tests, oracle or
    instruction name by absolute path (``/db/...``): a container's root could create them, so the
    local sandbox gives each a private tmpfs (at most 8)."""
    texts = [task.instruction, test_script_text(task) or ""]
    files = [task.solution] if task.solution is not None else []
    if task.tests_dir.is_dir():
        files += sorted(p for p in task.tests_dir.rglob("*") if p.is_file() and p.suffix in (".py", ".sh", ""))
    for path in files:
        try:
            texts.append(path.read_text()[:200_000])
        except (OSError, UnicodeDecodeError):
            continue
    texts += [command for command, _ in task.solution_commands]
    found = dict.fromkeys(m.group(1) for text in texts for m in _ABS_PATH.finditer(text))
    return tuple(f"/{name}" for name in found if name not in SYSTEM_TOP)[:8]
