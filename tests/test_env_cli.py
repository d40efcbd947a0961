"""`t1async eval`, `t1async synth`, `t1async decontam` through the real CLI entry point."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from t1async.cli import main
from t1async.envs.synth import FAMILIES

FIXTURES = Path(__file__).parent / "fixtures"


def test_eval_oracle_table_and_json(tmp_path, capsys):
    tasks = tmp_path / "tasks"
    shutil.copytree(FIXTURES / "layouts", tasks)
    shutil.copytree(FIXTURES / "tasks" / "count-words", tasks / "count-words")
    out = tmp_path / "report.json"
    assert main(["eval", "--tasks", str(tasks), "--agent", "oracle", "--concurrency", "2", "--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert "tb1-reverse-lines" in table and "resolved 3/6 = 50.0%" in table
    doc = json.loads(out.read_text())
    rows = {r["task"]: r for r in doc["tasks"]}
    assert set(rows["count-words"]) == {"task", "passed", "total", "resolved", "seconds", "error"}
    assert (rows["count-words"]["passed"], rows["count-words"]["total"], rows["count-words"]["resolved"]) == (3, 3, True)
    assert rows["tb1-reverse-lines"]["resolved"] and rows["tb2-reward-file"]["resolved"]
    assert "solution.yaml" in rows["tb1-keystrokes"]["error"]
    assert "refused by the local sandbox" in rows["tb1-two-services"]["error"]
    assert "t1async-fixture-rust-toolchain" in rows["tb2-needs-toolchain"]["error"]
    assert doc["summary"]["resolved_rate"] == 0.5 and doc["summary"]["tasks"] == 6 and doc["summary"]["errors"] == 3


def test_eval_noop_and_bad_input(tmp_path, capsys):
    assert main(["eval", "--tasks", str(FIXTURES / "tasks"), "--agent", "noop"]) == 0
    assert "resolved 0/2" in capsys.readouterr().out
    assert main(["eval", "--tasks", str(FIXTURES / "tasks"), "--agent", "magic"]) == 2
    assert "unknown agent 'magic'" in capsys.readouterr().err
    assert main(["eval", "--tasks", str(tmp_path / "nope"), "--agent", "noop"]) == 2


def test_eval_policy_runs_real_episodes(tmp_path, capsys):
    from t1async.config import ModelConfig
    from t1async.model import Qwen3MoeForCausalLM

    checkpoint = tmp_path / "ckpt"
    Qwen3MoeForCausalLM(ModelConfig()).save_pretrained(checkpoint)
    config = tmp_path / "eval.yaml"
    config.write_text("env:\n  max_turns: 2\ngeneration:\n  max_new_tokens: 8\n")
    tasks = tmp_path / "tasks"
    shutil.copytree(FIXTURES / "tasks" / "count-words", tasks / "count-words")
    out = tmp_path / "policy.json"
    assert main(["eval", "--tasks", str(tasks), "--agent", f"policy:{checkpoint}", "--config", str(config),
                 "--out", str(out)]) == 0
    row = json.loads(out.read_text())["tasks"][0]
    assert row["error"] is None and row["total"] == 3 and not row["resolved"]  # random weights: 1/3 (input untouched)
    assert main(["eval", "--tasks", str(tasks), "--agent", f"policy:{tmp_path / 'missing'}"]) == 2


def test_synth_every_family_validates(tmp_path, capsys):
    assert len(FAMILIES) >= 5
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
