"""`t1async eval`, `t1async synth`, `t1async decontam` through the real CLI entry point."""

from __future__ import annotations

import json
import shutil

import pytest

from t1async.cli import main
from t1async.commands.synth import FAMILIES
from tests.support import FIXTURES

FIXTURES = FIXTURES


def test_eval_oracle_table_and_json(tmp_path, capsys):
    tasks = tmp_path / "tasks"
    shutil.copytree(FIXTURES / "layouts", tasks)
    shutil.copytree(FIXTURES / "tasks" / "count-words", tasks / "count-words")
    out = tmp_path / "report.json"
    # exit 1: some tasks errored (refused, unparsable, missing toolchain); the report is still written
    assert main(["eval", "--tasks", str(tasks), "--agent", "oracle", "--concurrency", "2", "--out", str(out),
                 "--sandbox", "local"]) == 1
    captured = capsys.readouterr()
    assert "2 of 6 tasks errored" in captured.err
    table = captured.out
    assert "tb1-reverse-lines" in table and "resolved 4/6 = 66.7%" in table
    doc = json.loads(out.read_text())
    rows = {r["task"]: r for r in doc["tasks"]}
    assert set(rows["count-words"]) == {"task", "passed", "total", "resolved", "seconds", "error", "network",
                                        "agent_processes", "note"}
    assert (rows["count-words"]["passed"], rows["count-words"]["total"], rows["count-words"]["resolved"]) == (3, 3, True)
    assert rows["tb1-reverse-lines"]["resolved"] and rows["tb2-reward-file"]["resolved"]
    assert rows["tb1-keystrokes"]["resolved"]  # its solution.yaml steps are plain commands: replayed
    assert "refused by the local sandbox" in rows["tb1-two-services"]["error"]
    assert "t1async-fixture-rust-toolchain" in rows["tb2-needs-toolchain"]["error"]
    assert doc["summary"]["resolved_rate"] == 0.6667 and doc["summary"]["tasks"] == 6 and doc["summary"]["errors"] == 2


def test_eval_noop_and_bad_input(tmp_path, capsys):
    assert main(["eval", "--tasks", str(FIXTURES / "tasks"), "--agent", "noop"]) == 0
    assert "resolved 0/2" in capsys.readouterr().out
    assert main(["eval", "--tasks", str(FIXTURES / "tasks"), "--agent", "magic"]) == 2
    assert "unknown agent 'magic'" in capsys.readouterr().err
    assert main(["eval", "--tasks", str(tmp_path / "nope"), "--agent", "noop"]) == 2


def test_eval_policy_runs_real_episodes(tmp_path, capsys):
    from t1async.config import ModelConfig
    from t1async.models.model import Qwen3MoeForCausalLM

    checkpoint = tmp_path / "ckpt"
    Qwen3MoeForCausalLM(ModelConfig()).save_pretrained(checkpoint)
    config = tmp_path / "eval.yaml"
    config.write_text("env:\n  max_turns: 2\ngeneration:\n  max_new_tokens: 8\n")
    tasks = tmp_path / "tasks"
    shutil.copytree(FIXTURES / "tasks" / "count-words", tasks / "count-words")
    out = tmp_path / "policy.json"
    assert main(["eval", "--tasks", str(tasks), "--agent", f"policy:{checkpoint}", "--config", str(config),
                 "--out", str(out), "--sandbox", "local"]) == 0
    row = json.loads(out.read_text())["tasks"][0]
    assert row["error"] is None and row["total"] == 3 and not row["resolved"]  # random weights: 1/3 (input untouched)
    assert main(["eval", "--tasks", str(tasks), "--agent", f"policy:{tmp_path / 'missing'}"]) == 2


@pytest.mark.slow
def test_synth_every_family_validates(tmp_path, capsys):
    assert len(FAMILIES) >= 9
    for family in FAMILIES:
        assert main(["synth", "--family", family, "--n", "1", "--out", str(tmp_path / "train"), "--seed", "7"]) == 0, family
    out = capsys.readouterr().out
    assert out.count("validated: 1/1 ok") == len(FAMILIES)
    first = (tmp_path / "train" / "sum-column-7-0000" / "instruction.md").read_text()
    main(["synth", "--family", "sum-column", "--n", "1", "--out", str(tmp_path / "again"), "--seed", "7", "--no-validate"])
    assert (tmp_path / "again" / "sum-column-7-0000" / "instruction.md").read_text() == first  # reproducible
    assert main(["synth", "--family", "nope", "--n", "1", "--out", str(tmp_path / "x")]) == 2


def test_decontam_reports_and_drops(tmp_path, capsys):
    train = tmp_path / "train"
    main(["synth", "--family", "json-filter", "--n", "3", "--out", str(train), "--no-validate"])
    bench = tmp_path / "bench"
    shutil.copytree(train / "json-filter-0-0001", bench / "leaked")
    shutil.copytree(FIXTURES / "tasks" / "count-words", bench / "count-words")
    report = tmp_path / "d.json"
    assert main(["decontam", "--train", str(train), "--benchmark", str(bench), "--out", str(report)]) == 1
    doc = json.loads(report.read_text())
    flagged = {r["task"] for r in doc["tasks"] if r["flagged"]}
    assert "json-filter-0-0001" in flagged and doc["ngram"] == 8
    assert main(["decontam", "--train", str(train), "--benchmark", str(bench), "--threshold", "0.99", "--drop"]) == 0
    assert not (train / "json-filter-0-0001").exists() and (train / "json-filter-0-0000").exists()
    assert "dropped" in capsys.readouterr().out


def _one_line_error(capsys, *needles: str) -> str:
    """The captured stderr is one ``t1async: error:`` line containing every needle; stdout is empty."""
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("t1async: error: "), captured.err
    assert "Traceback" not in captured.err and captured.out == "", captured
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def test_eval_refuses_bad_input_before_running(tmp_path, capsys):
    tasks = str(FIXTURES / "tasks")
    eval_ = ["eval", "--tasks", tasks, "--agent", "noop"]
    assert main([*eval_, "--out", str(tmp_path / "missing" / "o.json")]) == 2
    _one_line_error(capsys, "--out", "does not exist")
    assert main([*eval_, "--out", str(tmp_path)]) == 2
    _one_line_error(capsys, "--out", "is a folder")
    for n in ("0", "-3"):
        assert main([*eval_, "--concurrency", n]) == 2
        _one_line_error(capsys, "--concurrency must be >= 1")
    assert main([*eval_, "--sandbox", "nope"]) == 2
    _one_line_error(capsys, "unknown sandbox backend 'nope'")
    assert main([*eval_, "--config", str(tmp_path / "nope.yaml")]) == 2
    _one_line_error(capsys, "nope.yaml does not exist")
    (tmp_path / "empty").mkdir()
    assert main(["eval", "--tasks", str(tmp_path / "empty"), "--agent", "noop"]) == 2
    _one_line_error(capsys, "no task folders under")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("garbage{")
    (ckpt / "model.safetensors").write_bytes(b"garbage")
    assert main([*eval_[:-1], f"policy:{ckpt}"]) == 2
    _one_line_error(capsys, "config.json cannot be loaded")
    (ckpt / "config.json").write_text("{}")
    assert main([*eval_[:-1], f"policy:{ckpt}"]) == 2
    _one_line_error(capsys, "config.json has model_type None, which t1async does not run; supported: qwen3_moe")
    (ckpt / "config.json").write_text('{"model_type": "qwen3_moe"}')
    assert main([*eval_[:-1], f"policy:{ckpt}"]) == 2
    _one_line_error(capsys, "the weights cannot be loaded")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "empty"]  # the --out probe left nothing


def test_eval_of_one_task_folder_evaluates_that_task(tmp_path, capsys):
    out = tmp_path / "o.json"
    assert main(["eval", "--tasks", str(FIXTURES / "tasks" / "count-words"), "--agent", "oracle", "--out", str(out)]) == 0
    assert "resolved 1/1" in capsys.readouterr().out
    assert [r["task"] for r in json.loads(out.read_text())["tasks"]] == ["count-words"]


def test_synth_refuses_bad_input(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("keep me\n")
    synth = ["synth", "--family", "sum-column", "--n", "1", "--no-validate"]
    assert main([*synth, "--out", str(afile)]) == 2
    _one_line_error(capsys, "not a folder")
    assert afile.read_text() == "keep me\n"
    assert main([*synth, "--out", "/proc/t1async-test/x"]) == 2
    _one_line_error(capsys, "cannot create the folder")
    for jobs in ("0", "-1"):
        assert main([*synth, "--out", str(tmp_path / "t"), "--jobs", jobs]) == 2
        _one_line_error(capsys, "--jobs must be >= 1")
    assert not (tmp_path / "t").exists()  # refused before writing anything


def test_decontam_refuses_bad_input_and_reports_unreadable(tmp_path, capsys):
    train, bench = tmp_path / "train", tmp_path / "bench"
    main(["synth", "--family", "json-filter", "--n", "2", "--out", str(train), "--no-validate"])
    shutil.copytree(train / "json-filter-0-0001", bench / "leaked")
    capsys.readouterr()
    dec = ["decontam", "--train", str(train), "--benchmark", str(bench)]
    assert main([*dec, "--out", str(tmp_path / "missing" / "d.json")]) == 2
    _one_line_error(capsys, "--out", "does not exist")
    assert main([*dec, "--out", str(tmp_path)]) == 2
    _one_line_error(capsys, "--out", "is a folder")
    for n in ("-1", "0"):  # 0 is refused, not silently replaced by the config default
        assert main([*dec, "--ngram", n]) == 2
        _one_line_error(capsys, f"--ngram must be >= 1, got {n}")
    for t in ("2", "-1", "nan"):
        assert main([*dec, "--threshold", t]) == 2
        _one_line_error(capsys, "--threshold must be a fraction")
    cfg = tmp_path / "d.yaml"
    cfg.write_text("env:\n  decontam_ngram: 0\n")
    assert main([*dec, "--config", str(cfg)]) == 2
    _one_line_error(capsys, "env.decontam_ngram", "d.yaml")
    for other in (train, tmp_path):  # the same folder, or one containing the other: would delete everything
        assert main(["decontam", "--train", str(train), "--benchmark", str(other), "--drop"]) == 2
        _one_line_error(capsys, "--drop refused")
    assert sorted(p.name for p in train.iterdir()) == ["json-filter-0-0000", "json-filter-0-0001"]
    (train / "broken").mkdir()
    report = tmp_path / "d.json"
    assert main([*dec, "--threshold", "0.99", "--drop", "--out", str(report)]) == 1  # an unreadable task was not checked
    out = capsys.readouterr().out
    assert "broken: " in out and "missing task.toml" in out and "could not be read" in out
    doc = json.loads(report.read_text())
    assert doc["unreadable"] == 1 and doc["dropped"] == 1
    assert (train / "broken").is_dir() and not (train / "json-filter-0-0001").exists()
    with pytest.raises(SystemExit):
        main(["decontam", "--help"])
    assert "1 when a training task is flagged and not dropped" in " ".join(capsys.readouterr().out.split())


def test_a_bench_that_exits_with_a_message_prints_it_with_status_1(tmp_path, capsys):
    """``sys.exit("why")`` in a benchmark reaches the user (it was swallowed: status 1 and no word)."""
    import argparse

    from t1async.cli import run_bench

    (tmp_path / "bench_says_why.py").write_text("import sys\nsys.exit('the policy could not be packed')\n")
    (tmp_path / "bench_code.py").write_text("import sys\nsys.exit(3)\n")
    assert run_bench(argparse.Namespace(name="says-why", args=[]), tools=tmp_path) == 1
    assert capsys.readouterr().err.strip() == "the policy could not be packed"
    assert run_bench(argparse.Namespace(name="code", args=[]), tools=tmp_path) == 3
    assert capsys.readouterr().err == ""


def test_bench_sandbox_refuses_bad_counts_and_targets_the_fair_figure(capsys):
    for args in (["--commands", "0"], ["--commands", "-5"], ["--episodes", "0"]):
        assert main(["bench", "sandbox", *args]) == 2
        _one_line_error(capsys, "must be an integer >= 1")
    assert main(["bench", "sandbox", "--commands", "3", "--episodes", "1"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["target_basis"] == "added_vs_plain_shell_median_ms"
    assert doc["meets_target"] == (doc["added_vs_plain_shell_median_ms"] < doc["target_added_ms"])
    assert "added_median_ms" in doc  # kept, for reference
