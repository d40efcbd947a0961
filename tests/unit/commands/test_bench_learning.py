"""``t1async bench learning``: the held-out split cannot be solved from memory; bad arguments are one line."""

from __future__ import annotations

import subprocess
import sys

import pytest

from t1async.config import load_config
from tests.support import REPO
from tests.support.tools import load_tool


def bench():
    return load_tool("bench_learning")


@pytest.mark.slow
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


@pytest.mark.slow
def test_rl_trains_only_on_measured_families_unless_asked_for_all(tmp_path):
    """--rl-families measured: RL's tasks are the families with held-out instances (make-executable
    has none); SFT still demonstrates every family."""
    b = bench()
    cfg = load_config(REPO / "configs" / "learning.yaml")
    split = b.make_split(tmp_path / "m", ["grep-count", "make-executable"], 12, 3, 2, cfg, rl_families="measured")
    rl = {p.name for p in (tmp_path / "m" / "rl").iterdir()}
    sft = {p.name for p in (tmp_path / "m" / "sft").iterdir()}
    assert split["rl_families"] == ["grep-count"] and len(rl) == 10 and split["rl_tasks"] == 10
    assert all(n.startswith("grep-count-") for n in rl) and any(n.startswith("make-executable-") for n in sft)
    split = b.make_split(tmp_path / "a", ["grep-count", "make-executable"], 12, 3, 2, cfg, rl_families="all")
    assert split["rl_families"] == ["grep-count", "make-executable"] and split["rl_tasks"] == 20


def test_families_whose_commands_do_not_fit_are_left_out():
    b = bench()
    fit = b.fitting_families(load_config(REPO / "configs" / "learning.yaml", ["generation.max_new_tokens=24"]))
    assert "grep-count" in fit and "count-matches" not in fit and "json-filter" not in fit
    assert "slow-build" not in fit  # fits, but a timing family (t1async bench async) is left out


@pytest.mark.slow
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


def test_warm_start_per_seed_names_the_missing_checkpoint(tmp_path):
    """--warm-start OUT/seed{seed}/sft-checkpoint: each seed's folder is checked; a missing one is named."""
    ok = tmp_path / "seed0" / "sft-checkpoint"
    ok.mkdir(parents=True)
    for f in ("config.json", "model.safetensors"):
        (ok / f).write_text("{}")
    b = bench()
    args = b.parse_args(["--seeds", "0", "--warm-start", str(tmp_path / "seed{seed}" / "sft-checkpoint")])
    assert args.warm_start.replace("{seed}", "0") == str(ok)
    r = subprocess.run([sys.executable, "-m", "t1async.cli", "bench", "learning", "--seeds", "0,1", "--warm-start",
                        str(tmp_path / "seed{seed}" / "sft-checkpoint")], capture_output=True, text=True, cwd=REPO,
                       timeout=120)
    assert r.returncode == 2 and str(tmp_path / "seed1" / "sft-checkpoint") in r.stderr and r.stderr.count("\n") == 1


def test_training_by_family_splits_a_runs_episodes_by_finish_time_and_family(tmp_path):
    """tools/training_by_family.py: the receive log's episodes, ordered by finish time, in equal parts;
    per synth family the resolved rate and the turns (every assistant turn)."""
    import dataclasses
    import json

    from t1async.trajectory import encode
    from t1async.transport.delivery import ReceiveLog
    from tests.support.trajectories import make_traj

    log = ReceiveLog(tmp_path / "run" / "receive_log", fsync="never", reset=True)
    base = make_traj()  # two assistant turns
    episodes = [("grep-count-1000-0001", False, 4.0), ("grep-count-1000-0002", True, 3.0),
                ("tar-folder-1000-0001", True, 1.0), ("odd-name", False, 2.0)]
    for i, (task, resolved, finished) in enumerate(episodes):
        t = dataclasses.replace(base, task=task, resolved=resolved, passed=3 if resolved else 2, reward=3.0 if resolved else 2.0,
                                tests=[("a", True), ("b", True), ("c", resolved)], finished_at=finished,
                                trajectory_id=f"id-{i}")
        log.append(t.trajectory_id, encode(t))
    log.close()
    out = subprocess.run([sys.executable, str(REPO / "tools" / "training_by_family.py"), str(tmp_path / "run"),
                          "--parts", "2"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    first, second = [json.loads(line) for line in out.stdout.splitlines()]
    assert first["families"] == {"tar-folder": {"episodes": 1, "resolved_rate": 1.0, "turns_mean": 2.0},
                                 "odd-name": {"episodes": 1, "resolved_rate": 0.0, "turns_mean": 2.0}}
    assert second["families"] == {"grep-count": {"episodes": 2, "resolved_rate": 0.5, "turns_mean": 2.0}}


def test_a_family_is_measured_by_its_demonstrated_turns_not_its_bare_commands():
    """With env.action_format tool_call a demonstrated turn wraps the command in the call's layout; a family
    whose bare commands fit but whose calls do not was kept, and SFT then skipped all its demonstrations as
    too long (issue 44: count-matches and json-filter on Qwen3.5's template at 64 tokens)."""
    b = bench()
    cfg = load_config(REPO / "configs" / "learning.yaml", ["generation.max_new_tokens=24"])
    assert "grep-count" in b.fitting_families(cfg)
    cfg = load_config(REPO / "configs" / "learning.yaml", ["generation.max_new_tokens=24", "env.action_format=tool_call"])
    assert "grep-count" not in b.fitting_families(cfg)
