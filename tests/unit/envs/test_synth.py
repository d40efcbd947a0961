"""Synthesized task families (t1async/commands/synth.py): oracle command splitting, learnability bounds of the
oracle lines, determinism, and per-command episodes in the real local sandbox (dense reward)."""

import filecmp
import re
from pathlib import Path

import pytest

from t1async.commands.synth import FAMILIES, WORDS, oracle_commands, synthesize
from t1async.envs.sandboxes.sandbox import SandboxUnavailable, check_sandbox_available
from t1async.envs.taskio.loading import load_task
from t1async.envs.terminal import TerminalEnv
from t1async.models.tokenizer import ChatTokenizer
from tests.support import REPO

SHIPPED = REPO / "t1async" / "envs" / "tasks"
NEW_FAMILIES = ("mkdir-write", "copy-count", "grep-count", "tar-folder")
# words of an oracle line that are the command's own vocabulary, not the instance's parameters
SHELL_WORDS = {"mkdir", "-p", "echo", ">", "<", "cp", "wc", "-l", "grep", "tar", "czf", "rm", "-r"}


def _solution(path: Path) -> str:
    return (path / "solution" / "solve.sh").read_text()


# --- oracle_commands ------------------------------------------------------------------------------

def test_single_lines_and_preamble_dropped():
    text = "#!/bin/bash\nset -euo pipefail\n\n# make it\ncd /app\nmkdir -p out\n\necho hi > out/a.txt\n"
    assert oracle_commands(text) == ["mkdir -p out", "echo hi > out/a.txt"]
    assert oracle_commands("#!/bin/bash\nset -e\nset -o pipefail\ncd /app/\n") == []


def test_cd_app_kept_when_not_leading():
    assert oracle_commands("cd /tmp\ncd /app\nls\n") == ["cd /tmp", "cd /app", "ls"]


def test_backslash_continuation_is_one_command():
    text = "set -e\nprintf '%s\\n' a \\\n    b \\\n    c > x.txt\nwc -l x.txt\n"
    assert oracle_commands(text) == ["printf '%s\\n' a \\\n    b \\\n    c > x.txt", "wc -l x.txt"]


def test_heredoc_is_one_command_with_its_comment_and_blank_lines():
    text = "cat > conf.ini <<'EOF'\n# not a comment here\n\nkey = 1\nEOF\nchmod 600 conf.ini\n"
    assert oracle_commands(text) == ["cat > conf.ini <<'EOF'\n# not a comment here\n\nkey = 1\nEOF", "chmod 600 conf.ini"]


def test_for_loop_over_several_lines_and_quote_spanning_lines():
    text = ('for f in *.log; do\n  if [ -s "$f" ]; then\n    gzip "$f"\n  fi\ndone\n'
            'echo "two\nlines" > t.txt\n')
    assert oracle_commands(text) == ['for f in *.log; do\n  if [ -s "$f" ]; then\n    gzip "$f"\n  fi\ndone',
                                     'echo "two\nlines" > t.txt']


def test_unterminated_command_raises_naming_its_text():
    with pytest.raises(ValueError, match=r"line 3.*echo 'oops"):
        oracle_commands("#!/bin/bash\nls\necho 'oops\nmore\n")
    with pytest.raises(ValueError, match="while true"):
        oracle_commands("while true; do\n  sleep 1\n")


@pytest.mark.parametrize("task", sorted(p.name for p in SHIPPED.iterdir() if (p / "solution" / "solve.sh").is_file()))
def test_shipped_solutions_split(task):
    text = _solution(SHIPPED / task)
    commands = oracle_commands(text)
    assert commands, task
    source_lines = set(text.splitlines())
    for command in commands:  # verbatim lines of the script, none of them the preamble
        assert all(line in source_lines for line in command.splitlines()), command
        assert command.strip() not in ("set -e", "cd /app") and not command.startswith("#")


# --- families -------------------------------------------------------------------------------------

def test_family_count_and_multi_step_families(tmp_path):
    assert len(FAMILIES) >= 9 and set(NEW_FAMILIES) <= set(FAMILIES)
    multi = []
    for family in FAMILIES:
        task = synthesize(family, 1, tmp_path / family, seed=3)[0]
        if 2 <= len(oracle_commands(_solution(task))) <= 4:
            multi.append(family)
    assert len(multi) >= 3, multi


def test_new_family_oracle_lines_short_and_copied_from_instruction(tmp_path):
    tok = ChatTokenizer.load()
    for family in NEW_FAMILIES:
        instructions = set()
        for task in synthesize(family, 30, tmp_path / family, seed=11):
            instruction = (task / "instruction.md").read_text()
            wording = re.sub("|".join(WORDS) + r"|\d+", "_", instruction)  # without the instance's parameters
            instructions.add(" ".join(wording.split()[:2]))
            commands = oracle_commands(_solution(task))
            assert 2 <= len(commands) <= 4, (task.name, commands)
            for command in commands:
                assert len(tok.encode(command)) <= 32, (task.name, command)
                for word in command.split():
                    if word not in SHELL_WORDS:  # every parameter is copied from the instruction
                        assert all(part in instruction for part in word.split("/") if part), (task.name, word)
        assert len(instructions) >= 2, family  # several instruction templates in use


def test_synthesize_is_deterministic(tmp_path):
    for family in FAMILIES:
        a, b = synthesize(family, 2, tmp_path / "a", seed=5), synthesize(family, 2, tmp_path / "b", seed=5)
        assert [p.name for p in a] == [f"{family}-5-0000", f"{family}-5-0001"] == [p.name for p in b]
        for x, y in zip(a, b):
            files = sorted(str(p.relative_to(x)) for p in x.rglob("*") if p.is_file())
            assert files == sorted(str(p.relative_to(y)) for p in y.rglob("*") if p.is_file())
            match, mismatch, errors = filecmp.cmpfiles(x, y, files, shallow=False)
            assert not mismatch and not errors
    other = synthesize("grep-count", 1, tmp_path / "c", seed=6)[0]
    assert (other / "instruction.md").read_text() != (tmp_path / "a" / "grep-count-5-0000" / "instruction.md").read_text()


@pytest.fixture(scope="module")
def sandbox():
    try:
        check_sandbox_available("local")
    except SandboxUnavailable as exc:
        pytest.skip(f"local sandbox unavailable: {exc}")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_oracle_one_command_per_turn_resolves_with_dense_reward(family, sandbox, tmp_path):
    """The SFT demonstration: each oracle command is one step in the episode's shell; the verifier
    gives the no-op agent less than full credit, and the oracle full credit after its last command.
    For the new (multi-step) families every command also adds credit."""
    task = load_task(synthesize(family, 1, tmp_path / "tasks", seed=1)[0])
    with TerminalEnv(task, root=tmp_path / "episodes", command_timeout_s=30) as env:
        env.reset()
        noop = env.verify()
        assert noop.total >= 3 and not noop.resolved
        passed = [noop.passed]
        for command in oracle_commands(task.solution_path.read_text()):
            run = env.step(command)
            assert run.exit_code == 0, (command, run.output)
            if family in NEW_FAMILIES:
                passed.append(env.verify().passed)
        final = env.verify()
    assert final.resolved and final.passed == noop.total
    if family in NEW_FAMILIES:
        assert all(a < b for a, b in zip(passed, passed[1:])), passed


# --- the long-tail family -------------------------------------------------------------------------

def _drawn_seconds(task_dir: Path) -> tuple[float, float]:
    """(verifier seconds, build seconds) written into a slow-build task."""
    tests = (task_dir / "tests" / "test_outputs.py").read_text()
    build = (task_dir / "environment" / "files" / "build.sh").read_text()
    return (float(re.search(r"time\.sleep\(([\d.]+)\)", tests).group(1)),
            float(re.search(r"sleep ([\d.]+)", build).group(1)))


def test_slow_build_times_are_heavy_tailed_and_scaled_down(tmp_path):
    from t1async.commands.synth import SLOW_BUILD_MAX_S, SLOW_VERIFIER_MAX_S

    draws = [_drawn_seconds(p) for p in synthesize("slow-build", 300, tmp_path / "a", seed=0)]
    verifier = sorted(v for v, _ in draws)
    build = sorted(b for _, b in draws)
    median, p90, p99 = verifier[150], verifier[270], verifier[297]
    assert 1.0 <= median <= 2.5  # seconds, where Terminal-Bench's are tens of seconds to minutes
    assert p90 >= 3 * median and p99 >= 10 * median  # heavy tail: p99 tens of seconds
    assert verifier[-1] <= SLOW_VERIFIER_MAX_S and build[-1] <= SLOW_BUILD_MAX_S and build[0] > 0
    assert sum(verifier) / len(verifier) > 1.5 * median  # the mean is pulled up by the tail
    # the time is a property of the task: the same seed draws the same seconds
    again = [_drawn_seconds(p) for p in synthesize("slow-build", 5, tmp_path / "b", seed=0)]
    assert again == draws[:5]


def test_slow_build_verifier_takes_its_drawn_time(sandbox, tmp_path):
    import time

    path = synthesize("slow-build", 1, tmp_path / "tasks", seed=1)[0]
    verifier_s, _ = _drawn_seconds(path)
    with TerminalEnv(load_task(path), root=tmp_path / "episodes", command_timeout_s=10) as env:
        env.reset()
        t0 = time.monotonic()
        noop = env.verify()
        assert time.monotonic() - t0 >= verifier_s and noop.total == 3 and noop.passed == 1  # the script is untouched
