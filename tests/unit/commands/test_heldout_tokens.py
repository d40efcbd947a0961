"""tools/heldout_tokens.py: held-out oracle command ids that no demonstration task holds, counted per split."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support import REPO
from tests.support.tools import load_tool


def _task(root, name, instruction, *commands):
    (root / name / "solution").mkdir(parents=True)
    (root / name / "instruction.md").write_text(instruction)
    (root / name / "solution" / "solve.sh").write_text("#!/bin/bash\nset -e\ncd /app\n" + "\n".join(commands) + "\n")


def test_ids_no_demonstration_holds_are_counted_per_token_and_task(tmp_path):
    tool = load_tool("heldout_tokens")
    _task(tmp_path / "sft", "a", "Copy abc.", "cp abc b")
    _task(tmp_path / "heldout", "h1", "Copy cab.", "cp cab ba")        # every character seen in sft
    _task(tmp_path / "heldout", "h2", "Zip it.", "zip -q z.zip abc")    # z, i, -, q, ., and more are not
    assert tool.oracle_commands(tmp_path / "heldout" / "h2") == ["zip -q z.zip abc"]
    got = tool.unseen(tmp_path, lambda s: [ord(c) for c in s])  # one id per character
    unseen_h2 = [c for c in "zip -q z.zip abc" if c not in set("Copy abc.cp abc b")]
    assert got == {"heldout_tasks": 2, "command_tokens": len("cp cab ba") + len("zip -q z.zip abc"),
                   "tokens_no_demonstration_holds": len(unseen_h2), "tasks_needing_one": 1,
                   "demonstration_vocabulary": len(set("Copy abc.cp abc b"))}


def test_the_command_prints_one_json_object_with_the_built_in_tokenizer(tmp_path):
    _task(tmp_path / "sft", "a", "Count the lines of /app/x.log.", "wc -l < x.log > n.txt")
    _task(tmp_path / "heldout", "h", "Count the lines of /app/y.log.", "wc -l < y.log > n.txt")
    out = subprocess.run([sys.executable, "tools/heldout_tokens.py", str(tmp_path)], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout
    got = json.loads(out)
    assert got["tokenizer"] == "built-in" and got["heldout_tasks"] == 1 and got["command_tokens"] > 0
    assert 0 <= got["tokens_no_demonstration_holds"] <= got["command_tokens"]


def test_a_folder_that_is_not_a_split_is_one_line(tmp_path):
    (tmp_path / "sft").mkdir()
    r = subprocess.run([sys.executable, "tools/heldout_tokens.py", str(tmp_path)], cwd=REPO, capture_output=True,
                       text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.splitlines()[-1].endswith(f"{tmp_path} has no heldout/: pass a bench learning split, the tasks/ "
                                              "folder of t1async bench learning's --out")
