"""Bad input to ``t1async launch``: one line naming the problem and the fix, exit status 2, no traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support.cli import LOCAL, REPO, assert_main_one_line


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "t1async.cli", "launch", *args], capture_output=True, text=True,
                          timeout=120, env=env, cwd=REPO)


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("t1async: error: "), proc.stderr
    assert "Traceback" not in proc.stderr
    for n in needles:
        assert n in lines[0]


def test_missing_config_file():
    assert_one_line_error(run_cli("configs/nope.yaml"), "configs/nope.yaml", "does not exist")


def test_unknown_key_in_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("learner:\n  max_stepz: 2\n")
    assert_one_line_error(run_cli(str(bad)), "learner.max_stepz", "bad.yaml")


def test_wrong_type_override():
    assert_one_line_error(run_cli(LOCAL, "learner.batch_size=lots"), "learner.batch_size", "command line")


def test_invalid_task_directory(tmp_path):
    (tmp_path / "broken-task").mkdir()
    (tmp_path / "broken-task" / "instruction.md").write_text("do it")
    assert_one_line_error(run_cli(LOCAL, f"env.tasks_dir={tmp_path}"), "broken-task", "task.toml")


def test_unknown_task_name():
    assert_one_line_error(run_cli(LOCAL, "env.tasks=[no-such-task]"), "no-such-task")


def test_missing_bubblewrap(tmp_path):
    env = dict(os.environ, PATH=str(tmp_path))  # no bwrap on PATH
    assert_one_line_error(run_cli(LOCAL, env=env), "bwrap", "apt-get install bubblewrap")


def test_unwritable_run_dir():
    assert_one_line_error(run_cli(LOCAL, "run.dir=/proc/t1async-run"), "run.dir", "writable")


def test_model_vocab_smaller_than_tokenizer():
    assert_one_line_error(run_cli(LOCAL, "model.vocab_size=100"), "model.vocab_size", "tokenizer")


def test_usage_errors_are_one_line():
    proc = subprocess.run([sys.executable, "-m", "t1async.cli", "launch"], capture_output=True, text=True, timeout=60)
    assert_one_line_error(proc, "config", "--help")
    assert "overrides" not in proc.stderr  # optional, not reported as required


def test_run_dir_braces_other_than_now(capsys, tmp_path):
    assert_main_one_line(capsys, ["launch", LOCAL, f"run.dir={tmp_path}/r-{{date}}"], "run.dir", "{now}")


def test_busy_transport_port(capsys):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert_main_one_line(capsys, ["launch", LOCAL, f"transport.port={port}"], f"transport.port={port}",
                             "transport.port=0")


def test_invalid_yaml_is_one_line_with_where(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("learner:\n  max_steps: [1,\n  batch_size: 2\n")
    assert_main_one_line(capsys, ["launch", str(bad)], "not valid YAML", "line ")


def test_a_folder_or_a_bare_scalar_as_the_config(capsys, tmp_path):
    assert_main_one_line(capsys, ["launch", str(tmp_path)], "is a folder")
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("42\n")
    assert_main_one_line(capsys, ["launch", str(scalar)], "mapping of sections", "not a int")


def test_a_named_task_is_not_refused_for_a_broken_sibling(tmp_path):
    import shutil

    from t1async.config import load_config
    from t1async.service.preflight import check_inputs

    good = sorted(p for p in (REPO / "t1async" / "envs" / "tasks").iterdir() if p.is_dir())[0]
    shutil.copytree(good, tmp_path / good.name)
    (tmp_path / "broken-task").mkdir()
    (tmp_path / "broken-task" / "instruction.md").write_text("do it")
    cfg = load_config(LOCAL, [f"env.tasks_dir={tmp_path}", f"env.tasks=[{good.name}]"])
    assert check_inputs(cfg) == [good.name]


def test_eval_of_a_folder_without_tasks_is_one_line(capsys):
    assert_main_one_line(capsys, ["eval", "--tasks", "/etc", "--agent", "noop"], "no task folders under /etc")


def test_run_dir_in_use_or_holding_an_earlier_run(capsys, tmp_path):
    from t1async.service.rundir import RunDirLock

    lock = RunDirLock(tmp_path)
    lock.write()
    try:
        assert_main_one_line(capsys, ["launch", LOCAL, f"run.dir={tmp_path}"], f"in use by t1async launch pid {os.getpid()}",
                             "t1async stop")
    finally:
        lock.release()
    (tmp_path / "metrics.jsonl").write_text('{"step": 3}\n')
    assert_main_one_line(capsys, ["launch", LOCAL, f"run.dir={tmp_path}"], "earlier run", "learner.resume=true",
                         "run.overwrite=true")


def test_control_commands_on_a_bad_run_dir(capsys, tmp_path):
    assert_main_one_line(capsys, ["status", str(tmp_path / "nope")], "no run directory")
    assert_main_one_line(capsys, ["stop", str(tmp_path)], "not running")
    assert_main_one_line(capsys, ["scale", str(tmp_path), "env.max_turns=3"], "cannot change live")


def test_overrides_may_follow_the_options(capsys):
    from t1async.cli import parse

    args = parse(["soak", "configs/local.yaml", "a.b=1", "--minutes", "0.5", "learner.lr=2e-4", "x=y z"])
    assert args.overrides == ["a.b=1", "learner.lr=2e-4", "x=y z"] and args.minutes == 0.5
    for argv in (["soak", "configs/local.yaml", "--minutes", "1", "junk"],  # not key=value
                 ["status", "RUN", "a.b=1"]):  # a command without overrides
        with pytest.raises(SystemExit) as e:
            parse(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "unrecognized arguments" in err, err


def test_python_dash_m_t1async_is_the_t1async_command():
    """``python -m t1async`` (a fresh user's first try without the script on PATH) ran nothing:
    "No module named t1async.__main__"."""
    out = subprocess.run([sys.executable, "-m", "t1async", "status", "/nonexistent-run"], capture_output=True,
                         text=True, timeout=120, cwd=REPO)
    direct = subprocess.run([sys.executable, "-m", "t1async.cli", "status", "/nonexistent-run"], capture_output=True,
                            text=True, timeout=120, cwd=REPO)
    assert "No module named" not in out.stderr
    assert (out.returncode, out.stdout, out.stderr) == (direct.returncode, direct.stdout, direct.stderr)
    assert out.returncode != 0 and out.stderr.strip()  # the same one-line refusal as the command's
