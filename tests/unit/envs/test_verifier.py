"""Parsing pytest's -rA short test summary into per-test results and a dense reward."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from t1async.envs.verifier import (
    MAX_OUTPUT_CHARS,
    TestResult,
    VerifierParseError,
    parse_pytest_summary,
    truncate_middle,
    verifier_result,
)

SUMMARY = textwrap.dedent(
    """\
    ============================= test session starts ==============================
    collected 11 items

    ../tests/test_outputs.py .F.sxX.E                                          [100%]
    PASSED lines above the summary are not results: PASSED fake::line
    =========================== short test summary info ============================
    PASSED ../tests/test_outputs.py::test_exists
    PASSED ../tests/test_outputs.py::test_param[with space]
    PASSED ../tests/test_outputs.py::test_param[x]y]
    PASSED ../tests/test_outputs.py::TestGroup::test_method[[nested]]
    SKIPPED [2] ../tests/test_outputs.py:40: needs a GPU
    XFAIL ../tests/test_outputs.py::test_known_bug - reason: tracked upstream
    XPASS ../tests/test_outputs.py::test_unexpected - should have failed
    ERROR ../tests/test_outputs.py::test_fixture - RuntimeError: fixture broke
    FAILED ../tests/test_outputs.py::test_param[a - b] - AssertionError: assert 'a - b' == 'c'
    FAILED ../tests/test_outputs.py::test_content - assert 1 == 2 - with a dash
    ============== 2 failed, 5 passed, 2 skipped, 1 xfailed, 1 xpassed, 1 error in 0.12s ==============
    PASSED after the section is ignored
    """
)


def test_all_outcomes_and_names():
    tests = parse_pytest_summary(SUMMARY)
    assert [(t.name, t.outcome, t.passed) for t in tests] == [
        ("../tests/test_outputs.py::test_exists", "PASSED", True),
        ("../tests/test_outputs.py::test_param[with space]", "PASSED", True),
        ("../tests/test_outputs.py::test_param[x]y]", "PASSED", True),
        ("../tests/test_outputs.py::TestGroup::test_method[[nested]]", "PASSED", True),
        ("../tests/test_outputs.py:40", "SKIPPED", True),
        ("../tests/test_outputs.py:40", "SKIPPED", True),
        ("../tests/test_outputs.py::test_known_bug", "XFAIL", True),
        ("../tests/test_outputs.py::test_unexpected", "XPASS", False),
        ("../tests/test_outputs.py::test_fixture", "ERROR", False),
        ("../tests/test_outputs.py::test_param[a - b]", "FAILED", False),
        ("../tests/test_outputs.py::test_content", "FAILED", False),
    ]


def test_dense_reward_counts_passed_tests():
    result = verifier_result(SUMMARY, seconds=0.5, exit_code=1)
    assert (result.passed, result.total) == (7, 11)
    assert result.reward == 7.0
    assert not result.resolved and result.error is None
    assert result.exit_code == 1 and result.seconds == 0.5


def test_all_passed_resolves():
    text = "=== short test summary info ===\nPASSED t.py::a\nSKIPPED [1] t.py:3: later\nXFAIL t.py::b\n1 passed in 0.01s\n"
    result = verifier_result(text, seconds=0.1)
    assert result.resolved and result.passed == result.total == 3 and result.reward == 3.0


def test_missing_summary_is_a_parse_error_and_not_resolved():
    text = "bash: python3: command not found\n"
    with pytest.raises(VerifierParseError, match="short test summary info"):
        parse_pytest_summary(text)
    result = verifier_result(text, seconds=0.1, exit_code=127)
    assert result.error is not None and "-rA" in result.error
    assert not result.resolved and result.total == 0 and result.reward == 0.0
    assert result.output == text


def test_zero_tests_never_resolve():
    text = "=========================== short test summary info ============================\n1 deselected in 0.01s\n"
    assert parse_pytest_summary(text) == []
    result = verifier_result(text, seconds=0.1)
    assert result.total == 0 and result.passed == 0 and not result.resolved and result.error is None


def test_collection_error_counts_as_a_failed_test():
    text = ("==== short test summary info ====\nERROR ../tests/test_outputs.py - ModuleNotFoundError: No module named 'x'\n"
            "!!!! Interrupted !!!!\n")
    [test] = parse_pytest_summary(text)
    assert (test.name, test.outcome, test.passed) == ("../tests/test_outputs.py", "ERROR", False)


def test_ansi_colours_and_several_sections():
    text = (
        "\x1b[1m==== short test summary info ====\x1b[0m\n\x1b[32mPASSED\x1b[0m a.py::one\n== 1 passed ==\n"
        "noise\n==== short test summary info ====\nFAILED b.py::two - boom\n"
    )
    assert [(t.name, t.outcome) for t in parse_pytest_summary(text)] == [("a.py::one", "PASSED"), ("b.py::two", "FAILED")]


def test_timeout_is_a_failure_scored_as_the_harnesses_score_it_whatever_was_printed():
    """Issue 41 item 5: Harbor gives a timed-out verifier no reward (0), TB1 marks it unresolved;
    it is the agent's failure (trained), not an error (dropped)."""
    text = "==== short test summary info ====\nPASSED a.py::one\n"
    result = verifier_result(text, seconds=60.0, timed_out_after_s=60, reward_txt="1")
    assert result.timed_out and result.error is None and not result.resolved
    assert (result.passed, result.total, result.reward) == (0, 1, 0.0)
    assert [(t.name, t.passed) for t in result.tests] == [("verifier_timeout", False)]
    assert not verifier_result(text, seconds=1.0).timed_out


def test_unknown_outcome_rejected():
    with pytest.raises(ValueError, match="unknown pytest outcome"):
        TestResult("a", "WEIRD")


def test_output_is_truncated_keeping_the_tail():
    text = "x" * (MAX_OUTPUT_CHARS * 2) + "\nEND"
    short = truncate_middle(text)
    assert len(short) < MAX_OUTPUT_CHARS + 100
    assert short.endswith("\nEND") and "[... truncated" in short
    assert truncate_middle("small") == "small"


def test_real_pytest_output(tmp_path):
    """Guard against pytest format drift: run the installed pytest on a small suite."""
    (tmp_path / "test_sample.py").write_text(
        textwrap.dedent(
            """\
            import pytest

            def test_ok():
                pass

            @pytest.mark.parametrize("p", ["with space", "a - b", "x]y"])
            def test_param(p):
                assert p != "a - b", "dash - message"

            @pytest.mark.skip(reason="later")
            def test_skip():
                pass

            @pytest.mark.xfail(reason="known")
            def test_xfail():
                assert False

            @pytest.fixture
            def broken():
                raise RuntimeError("fixture - broke")

            def test_error(broken):
                pass
            """
        )
    )
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-rA", "-q", "-p", "no:cacheprovider", "test_sample.py"],
        cwd=tmp_path, capture_output=True, text=True, env={"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PATH": "/usr/bin:/bin"},
    )
    outcomes = {t.name: t.outcome for t in parse_pytest_summary(run.stdout)}
    assert outcomes == {
        "test_sample.py::test_ok": "PASSED",
        "test_sample.py::test_param[with space]": "PASSED",
        "test_sample.py::test_param[x]y]": "PASSED",
        "test_sample.py::test_param[a - b]": "FAILED",
        "test_sample.py:10": "SKIPPED",
        "test_sample.py::test_xfail": "XFAIL",
        "test_sample.py::test_error": "ERROR",
    }
    result = verifier_result(run.stdout, seconds=0.0, exit_code=run.returncode)
    assert (result.passed, result.total, result.resolved) == (5, 7, False)


def test_task_reward_files():
    from t1async.envs.verifier import parse_task_reward

    assert parse_task_reward("1\n", None) == (1.0, None)
    assert parse_task_reward(None, '{"reward": 0.5}') == (0.5, None)
    assert parse_task_reward(None, "0.25") == (0.25, None)
    assert parse_task_reward(None, None) == (None, None)
    assert parse_task_reward("yes", None)[1].startswith("reward.txt holds")
    assert "no number" in parse_task_reward(None, '{}')[1]
    assert "no number" in parse_task_reward(None, '[1]')[1]
    both = verifier_result(SUMMARY, seconds=0.1, reward_txt="1")
    assert both.task_reward == 1.0 and both.passed == 7 and not both.resolved


def test_reward_file_without_pytest_is_the_one_test():
    ok = verifier_result("custom checker: all good\n", seconds=0.1, reward_txt="1\n")
    assert (ok.passed, ok.total, ok.resolved, ok.error, ok.task_reward) == (1, 1, True, None, 1.0)
    bad = verifier_result("custom checker: nope\n", seconds=0.1, reward_json='{"reward": 0}')
    assert (bad.passed, bad.total, bad.resolved) == (0, 1, False)
    missing = verifier_result("no summary, no reward\n", seconds=0.1)
    assert missing.error and "no pytest summary" in missing.error and not missing.resolved


def test_a_missing_summary_names_the_layouts_script_and_quotes_the_first_error():
    output = ("Hit:1 http://deb.debian.org/debian bookworm InRelease\n"
              "curl: (6) Could not resolve host: astral.sh\n"
              "/tests/setup-uv-pytest.sh: line 10: /root/.local/bin/env: No such file or directory\n")
    tb1 = verifier_result(output, seconds=0.1, exit_code=127, script="run-tests.sh")
    assert "run-tests.sh does not call pytest" in tb1.error and "tests/test.sh" not in tb1.error
    assert "first error line: 'curl: (6) Could not resolve host: astral.sh'" in tb1.error
    quiet = verifier_result("all quiet\n", seconds=0.1)
    assert "tests/test.sh does not call pytest" in quiet.error and "shows no error line" in quiet.error


def test_task_reward_disagreeing_with_tests_is_not_resolved():
    text = "=== short test summary info ===\nPASSED t.py::a\nPASSED t.py::b\n"
    result = verifier_result(text, seconds=0.1, reward_txt="0")
    assert result.passed == 2 and not result.resolved and "own reward is 0" in result.error


def test_multi_dimensional_reward_json_counts_as_its_weakest_dimension():
    """Harbor's multi-reward form (a recipe writes {"correctness": c, "performance": p}): every
    named reward must be a number, and the run resolves only when every dimension reaches 1."""
    from t1async.envs.verifier import parse_task_reward

    assert parse_task_reward(None, '{"correctness": 1, "performance": 1}') == (1.0, None)
    assert parse_task_reward(None, '{"correctness": 1, "performance": 0}') == (0.0, None)
    assert parse_task_reward(None, '{"score": 0.5}') == (0.5, None)
    assert parse_task_reward(None, '{"reward": 1, "aux": 0}') == (1.0, None)  # "reward" wins
    assert "not all numbers" in parse_task_reward(None, '{"correctness": 1, "note": "fast"}')[1]
    assert "not all numbers" in parse_task_reward(None, '{"correctness": true}')[1]
    text = "=== short test summary info ===\nPASSED t.py::a\nPASSED t.py::b\n"
    both = verifier_result(text, seconds=0.1, reward_json='{"correctness": 1, "performance": 1}')
    assert both.resolved and both.task_reward == 1.0
    slow = verifier_result(text, seconds=0.1, reward_json='{"correctness": 1, "performance": 0}')
    assert not slow.resolved and "own reward is 0" in slow.error


def _pytest(tmp_path, test_source: str, workspace_files: dict[str, str] | None = None) -> tuple[str, str]:
    """Run the installed pytest on one test module, with ``workspace`` on sys.path as a task's
    tests put /app there; returns (its -rA output, the workspace path)."""
    workspace, tests = tmp_path / "app", tmp_path / "tests"
    workspace.mkdir(parents=True)
    tests.mkdir()
    for name, text in (workspace_files or {}).items():
        (workspace / name).write_text(text)
    (tests / "test_outputs.py").write_text(f"import sys\nsys.path.insert(0, {str(workspace)!r})\n" + test_source)
    run = subprocess.run(  # from the workspace, as the harnesses run tests from /app
        [sys.executable, "-m", "pytest", "-rA", "-q", "-p", "no:cacheprovider", str(tests / "test_outputs.py")],
        cwd=workspace, capture_output=True, text=True, env={"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PATH": "/usr/bin:/bin"},
    )
    return run.stdout, str(workspace)


def test_a_verifier_that_cannot_collect_its_tests_is_an_error_not_reward_0(tmp_path):
    out, app = _pytest(tmp_path, "import t1async_absent_test_dependency\n\ndef test_x():\n    pass\n")
    result = verifier_result(out, seconds=0.0, instruction="Write the answer to /app/answer.txt.")
    assert result.error and "'t1async_absent_test_dependency' is missing from the verifier environment" in result.error
    assert not result.resolved and result.total == 1  # the collection ERROR is still reported
    assert verifier_result(out, seconds=0.0).error is None  # without the instruction: the old verdict


def test_the_agents_missing_or_broken_module_stays_a_failed_test(tmp_path):
    # the module the instruction asks for was not written: the agent's failure, reward 0
    out, app = _pytest(tmp_path / "a", "from solution import f\n\ndef test_f():\n    assert f() == 1\n")
    result = verifier_result(out, seconds=0.0, instruction="Write solution.py with a function f() returning 1.")
    assert (result.error, result.passed, result.total) == (None, 0, 1)
    # the agent's code imports a package that is absent: a frame in the workspace, the agent's failure
    out, app = _pytest(tmp_path / "b", "from helper import g\n\ndef test_g():\n    assert g()\n",
                       {"helper.py": "import t1async_absent_agent_dependency\n\ndef g():\n    return 1\n"})
    result = verifier_result(out.replace(app, "/app"), seconds=0.0, instruction="Fix the helper so g() works.")
    assert (result.error, result.passed, result.total) == (None, 0, 1)
    # and a run where some tests ran is never this error
    out, app = _pytest(tmp_path / "c", "def test_ok():\n    import t1async_absent_test_dependency\n")
    assert verifier_result(out, seconds=0.0, instruction="x").error is None
