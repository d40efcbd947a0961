"""Verifier results: per-test outcomes parsed from pytest's ``-rA`` short test summary.

A task's ``tests/test.sh`` runs pytest with ``-rA``, which ends with a section like::

    =========================== short test summary info ============================
    PASSED tests/test_outputs.py::test_file_exists
    FAILED tests/test_outputs.py::test_content[case - 1] - AssertionError: ...
    SKIPPED [2] tests/test_outputs.py:12: needs a GPU
    ERROR tests/test_outputs.py - ModuleNotFoundError: ...      (a collection error)

PASSED, SKIPPED and XFAIL count as passed; FAILED, ERROR and XPASS as failed. ``SKIPPED [N]``
stands for N tests. A missing summary is a parse error; zero parsed tests never resolve.

**A verifier timeout is a failure, scored as the harnesses score it**: Harbor stops a test
script that outlives ``[verifier] timeout_sec`` and the trial gets no reward (0), Terminal-Bench 1
marks it unresolved (failure mode ``test_timeout``). So a run killed at its timeout is
:attr:`VerifierResult.timed_out`, not resolved, with reward 0 and one failed pseudo-test
(:data:`TIMEOUT_TEST`) whatever it printed before, and *no* ``error``: the learner trains it as
the reward it is (an agent that never starts the server its tests poll is penalised, instead of
learning to make verifiers hang). ``error`` is kept for results that are not the agent's doing
(no summary, the verifier environment's own missing module, a reward file that is not a number). A run
that collected nothing because the verifier environment lacks a module the tests import is an
error too (:func:`collection_failure`: the episode is dropped as a verifier error, not trained
as reward 0); the agent's own missing or broken module stays a failed test.
The reward is dense: the absolute number of passed tests.

A Terminal-Bench 2 / Harbor verifier may also write the task's own reward to
``/logs/verifier/reward.txt`` (a number) or ``reward.json`` (a number, an object with a numeric
``reward``, or Harbor's multi-dimensional object of named numeric rewards such as
``{"correctness": 1, "performance": 0}``, which counts as its smallest value so that it resolves
only when every dimension reaches 1). It is recorded as :attr:`VerifierResult.task_reward`. When there is no pytest
summary at all, that reward stands in as the one test (passed when it is >= 1); when there is a
summary and the task's own reward says < 1 although every test passed, the run is not resolved
and ``error`` says why (the two verdicts disagree).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

OUTCOMES = ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS")
"""Outcome words of pytest's short test summary."""

PASSING = frozenset({"PASSED", "SKIPPED", "XFAIL"})
"""Outcomes that count as a passed test."""

TIMEOUT_TEST = "verifier_timeout"
"""Name of the failed pseudo-test a timed-out verifier run records (its only test)."""

MAX_OUTPUT_CHARS = 64 * 1024
"""Bound on :attr:`VerifierResult.output` (head and tail kept)."""

_HEADER = re.compile(r"^=+ short test summary info =+\s*$")
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_SKIPPED = re.compile(r"^\[(\d+)\]\s+(.*?)(?::\s(.*))?$")
_SECTION_END = re.compile(r"^(=|!|-{3,}|\d+ (passed|failed|error|errors|skipped|deselected|xfailed|xpassed)\b|no tests ran)")


@dataclass
class TestResult:
    """One test's outcome.

    Attributes:
        name: pytest node id (``path::test[params]``), or ``path:line`` for a folded skip, or the
            file for a collection error.
        outcome: one of :data:`OUTCOMES`.
        passed: True for PASSED, SKIPPED, XFAIL.
    """

    __test__ = False  # not a pytest test class

    name: str
    outcome: str
    passed: bool = field(init=False)

    def __post_init__(self) -> None:
        if self.outcome not in OUTCOMES:
            raise ValueError(f"unknown pytest outcome {self.outcome!r}: expected one of {OUTCOMES}")
        self.passed = self.outcome in PASSING


@dataclass
class VerifierResult:
    """The verdict of one run of a task's verifier.

    Attributes:
        tests: parsed per-test results, in summary order.
        passed: number of passed tests.
        total: number of parsed tests.
        resolved: ``total > 0 and passed == total`` and no ``error``.
        reward: dense reward = ``passed`` (absolute count of passed tests), as a float; 0 for a
            timed-out run.
        error: why the result is not trustworthy (parse error, collection failure of the verifier
            environment, a bad reward file), else None. A timeout is not one (see ``timed_out``).
        output: raw verifier output, truncated to about 64 KiB (head and tail).
        seconds: wall time of the verifier run, seconds.
        exit_code: exit status of ``tests/test.sh`` (None when unknown, e.g. a timeout).
        task_reward: the task's own reward from reward.txt / reward.json, else None.
        timed_out: the run was killed at the verifier timeout: a failure (reward 0, the one
            test :data:`TIMEOUT_TEST` failed), as the harnesses score it.
    """

    tests: list[TestResult]
    passed: int
    total: int
    resolved: bool
    reward: float
    error: str | None
    output: str
    seconds: float
    exit_code: int | None = None
    task_reward: float | None = None
    timed_out: bool = False


class VerifierParseError(ValueError):
    """The verifier output has no pytest short test summary to read."""


def _split_nodeid(rest: str) -> tuple[str, str]:
    """Split ``nodeid[ - message]``; a node id may hold spaces, ``]`` and `` - `` in its params."""
    first = rest.find("::")
    bracket = rest.find("[", max(first, 0))
    if first >= 0 and bracket >= 0 and " " not in rest[first:bracket]:
        for i in range(bracket, len(rest)):
            if rest[i] == "]" and (i + 1 == len(rest) or rest.startswith(" - ", i + 1)):
                return rest[: i + 1], rest[i + 4 :]
    name, _, message = rest.partition(" - ")
    return name.strip(), message


def parse_pytest_summary(text: str) -> list[TestResult]:
    """Parse every ``short test summary info`` section of pytest ``-rA`` output.

    Args:
        text: the verifier's output (ANSI colour codes are ignored).

    Returns:
        One :class:`TestResult` per test (``SKIPPED [N]`` expands to N results); may be empty
        when a summary exists but lists nothing.

    Raises:
        VerifierParseError: no ``short test summary info`` section (pytest did not run, crashed,
            or ran without ``-rA``).
    """
    results: list[TestResult] = []
    found = False
    in_section = False
    for raw in _ANSI.sub("", text).splitlines():
        line = raw.rstrip()
        if _HEADER.match(line):
            found = in_section = True
            continue
        if not in_section:
            continue
        word, _, rest = line.partition(" ")
        if word in OUTCOMES:
            if word == "SKIPPED" and (m := _SKIPPED.match(rest)):
                results += [TestResult(m.group(2), "SKIPPED") for _ in range(int(m.group(1)))]
            else:
                results.append(TestResult(_split_nodeid(rest)[0], word))
        elif _SECTION_END.match(line):
            in_section = False
    if not found:
        raise VerifierParseError(
            "no pytest 'short test summary info' section in the verifier output: the tests did not "
            "run (see the output), or the test script does not call pytest with -rA"
        )
    return results


_ERROR_LINE = re.compile(
    r"(?i)\b(error|fatal|failed|failure|not found|no such file|permission denied|cannot|can.t|could not|couldn.t|unable to|"
    r"traceback|exception|refused|denied|timed out)\b")


def first_error_line(text: str, limit: int = 200) -> str | None:
    """The first line of ``text`` that reads as an error (``E: ...``, ``command not found``,
    ``Traceback``, ``ModuleNotFoundError``, ...), stripped and cut to ``limit`` characters,
    or None. Lines of a pytest summary's PASSED entries are never taken."""
    for raw in _ANSI.sub("", text).splitlines():
        line = raw.strip()
        if not line or line.startswith(("PASSED ", "SKIPPED ")):
            continue
        if _ERROR_LINE.search(line) or line.startswith(("E: ", "E ")):
            return line[:limit]
    return None


def truncate_middle(text: str, limit: int = MAX_OUTPUT_CHARS) -> str:
    """Keep the first eighth and the last seven eighths of ``limit`` characters of ``text``."""
    if len(text) <= limit:
        return text
    head = limit // 8
    tail = limit - head
    return f"{text[:head]}\n[... truncated {len(text) - head - tail} chars ...]\n{text[-tail:]}"


def parse_task_reward(reward_txt: str | None, reward_json: str | None) -> tuple[float | None, str | None]:
    """The task's own reward from the contents of reward.txt (preferred) or reward.json.

    Returns:
        (reward or None when neither file exists, error text when a file exists but holds no
        finite number).
    """
    if reward_txt is not None:
        try:
            value = float(reward_txt.strip())
        except ValueError:
            return None, f"reward.txt holds {reward_txt.strip()[:80]!r}, not a number"
    elif reward_json is not None:
        try:
            data = json.loads(reward_json)
        except json.JSONDecodeError as exc:
            return None, f"reward.json is not JSON ({exc})"
        if isinstance(data, dict) and "reward" not in data and data:
            # Harbor's multi-dimensional form: {"correctness": 1, "performance": 0, ...}. Every
            # named reward must be a number; the run counts as its weakest dimension (min), so it
            # resolves only when every dimension reaches 1.
            if any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in data.values()):
                return None, (f"reward.json's named rewards are not all numbers ({json.dumps(data)[:80]}); "
                              "expected a number, {\"reward\": number} or {\"NAME\": number, ...}")
            data = min(data.values())
        elif isinstance(data, dict):
            data = data.get("reward")
        if isinstance(data, bool) or not isinstance(data, (int, float)):
            return None, ("reward.json holds no number (expected a number, {\"reward\": number} "
                          "or {\"NAME\": number, ...})")
        value = float(data)
    else:
        return None, None
    if not math.isfinite(value):
        return None, f"the task reward {value} is not finite"
    return value, None


_MISSING_MODULE = re.compile(r"^E\s+(?:ModuleNotFoundError: No module named|ImportError: No module named) '([\w.]+)'", re.M)
_FRAME = re.compile(r"^(\S+?):\d+: in ", re.M)


def collection_failure(output: str, tests: list[TestResult], *, instruction: str | None,
                       workspace: str = "/app") -> str | None:
    """Why a pytest run that collected nothing is the verifier environment's fault, or None.

    The rule (a verifier error, so the episode is dropped and counted, not trained as reward 0):
    no test ran (every summary entry is a file-level ``ERROR``, i.e. a collection error), every
    collection error is a missing module, no traceback frame lies in the agent's ``workspace``,
    and no missing module is named in the task's ``instruction``. A module the agent was asked
    to write (``solution.py`` named in the instruction), or the agent's own code importing
    something absent (a frame under ``/app``), stays the agent's failure: reward 0, as before.

    Args:
        output: the verifier's output (pytest's ``ERRORS`` section holds the tracebacks).
        tests: the parsed summary (:func:`parse_pytest_summary`).
        instruction: the task's instruction (None: the rule is not applied).
        workspace: the agent's working folder in the sandbox.
    """
    if instruction is None or not tests or any(t.outcome != "ERROR" or "::" in t.name for t in tests):
        return None
    text = _ANSI.sub("", output)
    found = _MISSING_MODULE.findall(text)
    missing = list(dict.fromkeys(found))
    collecting = text.count("ERROR collecting ")
    if not missing or collecting < len(tests) or len(found) < collecting:
        return None
    test_files = {t.name for t in tests}
    for frame in _FRAME.findall(text):
        # pytest prints frames under its working folder (the workspace, where the harnesses run
        # the tests) relative to it, others absolute or with ../
        relative_here = not frame.startswith(("/", "../")) and frame not in test_files
        if relative_here or frame == workspace or frame.startswith(workspace.rstrip("/") + "/"):
            return None
    for name in missing:
        top = name.split(".")[0]
        if re.search(rf"(?<![\w.]){re.escape(top)}(?![\w])", instruction):
            return None
    return (f"the verifier could not collect its tests: {', '.join(repr(m) for m in missing)} is missing from the "
            f"verifier environment (collection error, no test ran); add it to the task's image or test script")


def verifier_result(
    output: str, *, seconds: float, exit_code: int | None = None, timed_out_after_s: float | None = None,
    reward_txt: str | None = None, reward_json: str | None = None, script: str = "tests/test.sh",
    instruction: str | None = None,
) -> VerifierResult:
    """Build a :class:`VerifierResult` from a verifier's raw output.

    Args:
        output: everything ``tests/test.sh`` printed.
        seconds: wall time of the run, seconds.
        exit_code: the script's exit status, if known.
        timed_out_after_s: set when the run was killed at this timeout (seconds): a failure as
            the harnesses score it (``timed_out``, reward 0, the one failed test
            :data:`TIMEOUT_TEST`, no ``error``), whatever was printed before.
        reward_txt, reward_json: contents of /logs/verifier/reward.txt / reward.json, if written.
        script: the task's test script as its layout names it (``tests/test.sh``, TB2;
            ``run-tests.sh``, TB1), for the error of a missing pytest summary.
        instruction: the task's instruction; with it, a run that only failed to collect its
            tests because the verifier environment lacks a module is an ``error``
            (:func:`collection_failure`), not reward 0.
    """
    error: str | None = None
    task_reward, reward_error = parse_task_reward(reward_txt, reward_json)
    try:
        tests = parse_pytest_summary(output)
    except VerifierParseError:
        first = first_error_line(output)
        tests, error = [], (f"no pytest summary in the verifier output: the tests did not run, or {script} does not "
                            f"call pytest with -rA; " + (f"first error line: {first!r}" if first else
                                                         "its output shows no error line (see the verifier output)"))
        if task_reward is not None:  # a non-pytest verifier: its own reward is the one test
            tests, error = [TestResult("reward.txt" if reward_txt is not None else "reward.json",
                                       "PASSED" if task_reward >= 1.0 else "FAILED")], None
    if error is None:
        error = collection_failure(output, tests, instruction=instruction)
    if reward_error and error is None:
        error = reward_error
    if error is None and task_reward is not None and task_reward < 1.0 and tests and all(t.passed for t in tests):
        error = f"the task's own reward is {task_reward:g} although all {len(tests)} tests passed"
    if timed_out_after_s is not None:  # Harbor: no reward (0); TB1: unresolved (test_timeout)
        tests, error = [TestResult(TIMEOUT_TEST, "FAILED")], None
    passed = sum(t.passed for t in tests)
    total = len(tests)
    return VerifierResult(
        tests=tests,
        passed=passed,
        total=total,
        resolved=error is None and total > 0 and passed == total,
        reward=float(passed),
        error=error,
        output=truncate_middle(output),
        seconds=seconds,
        exit_code=exit_code,
        task_reward=task_reward,
        timed_out=timed_out_after_s is not None,
    )
