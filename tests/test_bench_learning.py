"""``t1async bench learning``: the held-out split cannot be solved from memory; bad arguments are one line."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from t1async.config import load_config

REPO = Path(__file__).resolve().parents[1]


def bench():
    spec = importlib.util.spec_from_file_location("bench_learning", REPO / "tools" / "bench_learning.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_heldout_shares_no_instruction_command_sequence_or_files_with_training(tmp_path):
    b = bench()
    cfg = load_config(REPO / "configs" / "learning.yaml")
    split = b.make_split(tmp_path, ["grep-count", "sum-column", "make-executable"], 12, 3, 2, cfg)
    train = sorted((tmp_path / "train").iterdir())
    heldout = sorted((tmp_path / "heldout").iterdir())
    assert len(train) == 36 and len(list((tmp_path / "sft").iterdir())) == 6
    sft = {p.name for p in (tmp_path / "sft").iterdir()}
    rl = {p.name for p in (tmp_path / "rl").iterdir()}  # RL never trains on a demonstration
    assert len(rl) == 30 and not rl & sft and rl | sft == {p.name for p in train} and split["rl_tasks"] == 30
    seen = {b._signature(p)[0] for p in train} | {b._signature(p)[1] for p in train}
    hashes = {b.instance_hash(p) for p in train}
    for p in heldout:
        text, cmds = b._signature(p)
        assert text not in seen and cmds not in seen and b.instance_hash(p) not in hashes
    # make-executable's command depends on one of three prefixes: twelve training tasks use them all
    assert split["heldout_per_family"]["make-executable"] == 0
    assert "make-executable" in split["families_without_heldout"]
    assert split["heldout_per_family"]["grep-count"] == 3 and split["heldout"] == len(heldout)


def test_families_whose_commands_do_not_fit_are_left_out():
    b = bench()
    fit = b.fitting_families(load_config(REPO / "configs" / "learning.yaml", ["generation.max_new_tokens=24"]))
    assert "grep-count" in fit and "count-matches" not in fit and "json-filter" not in fit
    assert "slow-build" not in fit  # fits, but a timing family (t1async bench async) is left out


@pytest.mark.parametrize("args, message", [
    (["--seeds", "a,b"], "--seeds must be comma-separated integers"),
    (["--minutes", "0"], "--minutes and --eval-every must be positive"),
    (["--reward", "sparse"], "invalid choice: 'sparse'"),
    (["--train-per-family", "10", "--sft-demos-per-family", "10"], "must be less than --train-per-family"),
])
def test_bad_arguments_are_one_line(args, message):
    r = subprocess.run([sys.executable, "-m", "t1async.cli", "bench", "learning", *args], capture_output=True,
                       text=True, cwd=REPO, timeout=120)
    assert r.returncode == 2 and message in r.stderr and r.stderr.count("\n") == 1
