"""``t1async sft``: demonstrations are real rollout episodes of the oracle; training fits them; skips are counted."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from t1async.commands.sft import build_demonstrations, demonstration, run_sft
from t1async.config import load_config
from t1async.envs.taskio.loading import load_task
from t1async.envs.terminal import TerminalEnv
from t1async.models.model import Qwen3MoeForCausalLM
from t1async.models.tokenizer import ChatTokenizer
from tests.support import REPO
from tests.support.tasks import note_task

TINY = ["model.hidden_size=32", "model.num_hidden_layers=2", "model.num_attention_heads=2", "model.num_key_value_heads=1",
        "model.head_dim=16", "model.num_experts=4", "model.num_experts_per_tok=2", "model.moe_intermediate_size=32"]


def test_demonstration_is_the_rollout_token_stream(tmp_path):
    task = load_task(note_task(tmp_path / "tasks", "note"))
    cfg = load_config(None)
    tok = ChatTokenizer.load()
    with TerminalEnv.from_config(task, tmp_path / "work", cfg.env) as env:
        traj = demonstration(task, env, cfg, tok)
    assert traj.resolved and traj.passed == 2
    turns = [traj.token_ids[s:e].tolist() for s, e in traj.turn_offsets]
    assert turns == [[*tok.encode(c), tok.im_end_id] for c in ("cat note.txt", "echo done > out.txt", "exit")]
    # loss mask 1 exactly on the assistant turns
    expected = np.zeros(traj.num_tokens, np.uint8)
    for s, e in traj.turn_offsets:
        expected[s:e] = 1
    assert np.array_equal(traj.loss_mask, expected)
    # the observation after the first turn is what the sandbox printed, rendered by the template
    s1, e1 = traj.turn_offsets[0]
    s2 = traj.turn_offsets[1][0]
    assert traj.token_ids[e1:s2].tolist() == tok.render_observation("pebble-42\n")
    assert traj.token_ids[: traj.turn_offsets[0][0]].tolist() == tok.render_prompt(cfg.env.system_prompt, task.instruction)
    assert traj.drift_tokens == 0


def test_unusable_demonstrations_are_skipped_and_counted(tmp_path):
    root = tmp_path / "tasks"
    note_task(root, "good")
    note_task(root, "long", solution="echo " + " ".join(["pebble"] * 60) + " > /dev/null\necho done > out.txt\n")
    note_task(root, "wrong", solution="cat note.txt\necho nope > out.txt\n")
    note_task(root, "many", solution="true\ntrue\ntrue\ntrue\ntrue\necho done > out.txt\n")
    demos = build_demonstrations(root, load_config(None, ["generation.max_new_tokens=48", "env.max_turns=4"]))
    assert [t.task for t in demos.trajectories] == ["good"]
    assert demos.skipped_by_reason() == {"command too long": 1, "oracle unresolved": 1, "too many commands": 1}
    assert demos.skipped["wrong"].startswith("oracle unresolved: 1/2")


@pytest.mark.slow
def test_sft_fits_the_demonstrations_and_the_checkpoint_replays_them(tmp_path):
    root = tmp_path / "tasks"
    note_task(root, "note")
    cfg = load_config(None, [*TINY, "sft.steps=120", "sft.batch_size=1", "sft.lr=1e-2", "sft.log_every=20",
                             "sft.warmup_steps=5", "generation.temperature=0"])
    result = run_sft(cfg, root, tmp_path / "ckpt", heldout=root)
    curve = result["curve"]
    assert result["demonstrations"] == 1 and curve[-1]["loss"] < curve[0]["loss"] / 10
    assert curve[-1]["token_accuracy"] == 1.0
    model = Qwen3MoeForCausalLM.from_pretrained(tmp_path / "ckpt")  # an ordinary HF checkpoint
    assert model.cfg.hidden_size == 32
    # greedy episodes of the checkpoint (t1async eval's policy agent) replay the oracle and resolve the task
    assert result["heldout"]["resolved"] == 1 and result["heldout"]["tasks"] == 1


@pytest.mark.parametrize("args, message", [
    (["--tasks", "/nonexistent/tasks", "--out", "ckpt"], "--tasks /nonexistent/tasks is not a folder"),
    (["--tasks", ".", "--out", "pyproject.toml"], "exists and is not a folder"),
])
def test_cli_refuses_bad_folders_in_one_line(args, message):
    repo = REPO
    r = subprocess.run([sys.executable, "-m", "t1async.cli", "sft", *args], capture_output=True, text=True, cwd=repo,
                       timeout=120)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and message in r.stderr


def test_breakdown_counts_a_task_once_for_pass_at_k_and_groups_synth_families():
    from t1async.commands.evaluate import EvalRow
    from t1async.commands.sft import breakdown

    def row(task, resolved):
        return EvalRow(task=task, passed=int(resolved), total=1, resolved=resolved, seconds=0.1, error=None)

    rows = [row("copy-count-2000-0000", False), row("copy-count-2000-0000", True),
            row("copy-count-2000-0001", False), row("copy-count-2000-0001", False),
            row("grep-count-2000-0000", True), row("grep-count-2000-0000", True), row("hello-world", False)]
    got = breakdown(rows)
    assert got["pass_at_k"] == round(2 / 4, 4)  # tasks with any resolved episode: copy-count-0000, grep-count-0000
    assert got["per_family"] == {"copy-count": 0.25, "grep-count": 1.0, "hello-world": 0.0}


def test_an_imperfect_demonstrator_stops_one_command_early_in_its_share_of_demonstrations(tmp_path):
    """sft.early_stop_frac: that share of the demonstrations (seeded) ends with the end signal in
    place of the oracle's last command, and is kept although unresolved; the rest are the oracle's."""
    root = tmp_path / "tasks"
    for i in range(4):
        note_task(root, f"note-{i}")
    tok = ChatTokenizer.load()
    cfg = load_config(None, ["sft.early_stop_frac=0.5", "sft.seed=3"])
    demos = build_demonstrations(root, cfg)
    assert len(demos.trajectories) == 4 and not demos.skipped
    assert len(demos.stopped_early) == 2
    assert set(demos.stopped_early) == set(build_demonstrations(root, cfg).stopped_early)  # seeded
    for traj in demos.trajectories:
        turns = [traj.token_ids[s:e].tolist() for s, e in traj.turn_offsets]
        if traj.task in demos.stopped_early:
            assert turns == [[*tok.encode(c), tok.im_end_id] for c in ("cat note.txt", "exit")]
            assert not traj.resolved and traj.passed == 1
        else:
            assert len(turns) == 3 and traj.resolved
    assert build_demonstrations(root, load_config(None)).stopped_early == []


def test_early_stop_frac_out_of_range_is_refused():
    from t1async.config import ConfigError

    with pytest.raises(ConfigError, match="early_stop_frac"):
        load_config(None, ["sft.early_stop_frac=1.0"])


def test_a_one_command_oracle_is_played_whole_and_not_counted_as_stopped_early(tmp_path):
    root = tmp_path / "tasks"
    for i in range(2):
        note_task(root, f"one-{i}", solution="echo done > out.txt\n")
    demos = build_demonstrations(root, load_config(None, ["sft.early_stop_frac=0.5"]))
    assert len(demos.trajectories) == 2 and demos.stopped_early == []
    assert all(t.resolved and len(t.turn_offsets) == 2 for t in demos.trajectories)


def test_the_sft_loss_is_the_cross_entropy_of_the_assistant_tokens_of_the_full_logits():
    """sft_train runs the LM head at the loss-mask-1 positions only; its first logged loss and token accuracy
    (measured before the first update) are those of the full [B, T, V] logits masked to the same tokens."""
    from types import SimpleNamespace

    import torch
    import torch.nn.functional as F

    from t1async.commands.sft import sft_train
    from t1async.config import ModelConfig
    from t1async.config.learner import SftConfig

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(ModelConfig(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                            num_key_value_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                            moe_intermediate_size=32))
    rng = np.random.default_rng(0)
    demos = []
    for n in (40, 55):
        mask = np.zeros(n, np.float32)
        mask[10:18] = mask[30:n] = 1
        demos.append(SimpleNamespace(token_ids=rng.integers(0, 300, n), loss_mask=mask))
    ids = torch.zeros(2, 55, dtype=torch.int64)
    m = torch.zeros(2, 55)
    for row, d in enumerate(demos):
        ids[row, :len(d.token_ids)] = torch.from_numpy(d.token_ids)
        m[row, :len(d.token_ids)] = torch.from_numpy(d.loss_mask)
    with torch.no_grad():
        logits = model(ids[:, :-1]).logits
    keep = m[:, 1:] > 0
    want = F.cross_entropy(logits[keep], ids[:, 1:][keep]).item()
    want_acc = (logits[keep].argmax(-1) == ids[:, 1:][keep]).float().mean().item()
    curve = sft_train(model, demos, SftConfig(steps=1, batch_size=2, log_every=1, warmup_steps=1))
    assert curve[0]["loss"] == pytest.approx(want, abs=1e-4) and curve[0]["token_accuracy"] == round(want_acc, 4)
