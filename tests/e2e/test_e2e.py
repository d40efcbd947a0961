"""End to end: the real ``t1async launch`` with Ray, ZeroMQ, bubblewrap and the gloo broadcast all real.

Runs of configs/local.yaml with a small step budget: one to completion (with an injected
rollout-actor crash that must be replaced) and one stopped with Ctrl-C (SIGINT to the process
group, as a terminal sends it), which must stop cleanly with a final checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from t1async.trajectory import decode
from tests.support import REPO

pytestmark = pytest.mark.slow
CLI = [sys.executable, "-m", "t1async.cli", "launch", str(REPO / "configs" / "local.yaml")]
MAX_STALENESS = 1


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_launch_runs_the_whole_loop(tmp_path):
    run_dir = tmp_path / "run"
    overrides = [f"run.dir={run_dir}", "learner.max_steps=6", "learner.publish_every=2", "learner.batch_size=2",
                 f"learner.max_staleness={MAX_STALENESS}", "learner.dump_trajectories=3", "sampler.num_samplers=2",
                 "rollout.num_actors=2", "rollout.crash_after_episodes=1", "env.max_turns=2",
                 "generation.max_new_tokens=16", "learner.checkpoint_every=0"]
    proc = subprocess.run(CLI + overrides, capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stderr[-3000:]

    summary = json.loads((run_dir / "summary.json").read_text())
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert summary["final_version"] == 3 and [r["version"] for r in rows] == [0, 1, 1, 2, 2, 3]
    # every sampler loaded the last published version
    assert [s["weight_version"] for s in summary["samplers"]] == [3, 3]
    # the staleness bound held at every step. Whatever the timing, trajectories of more than one version were
    # trained on: admission allows (0 + 1 + 1) x 2 x 2 = 8 rollouts under version 0, steps 1-4 can train at most
    # those, and steps 5-6 (learner at version 2, bound 1) must train version >= 1.
    assert all(r["staleness_max"] <= MAX_STALENESS for r in rows)
    assert set(rows[0]["versions_in_batch"]) == {0}
    assert min(v for r in rows[4:] for v in r["versions_in_batch"]) >= 1
    assert sum(r["trajectories"] for r in rows) == 12 and summary["learner"]["rejected"] == 0
    # the injected crash was logged and the actor replaced; the run still finished
    assert summary["controller"]["crashes"] >= 1
    assert "crashed" in (run_dir / "logs" / "controller.log").read_text()
    # the learner was started alongside the samplers, before they served (launch's start order)
    log = (run_dir / "logs" / "t1async.log").read_text()
    assert log.index("learner started alongside 2 sampler(s)") < log.index("samplers serving: http://"), log[-3000:]
    # trajectories crossed ZeroMQ intact, with routed experts [T-1, layers, top_k]
    dumped = sorted((run_dir / "trajectories").glob("*.traj"))
    assert len(dumped) == 3
    for f in dumped:
        t = decode(f.read_bytes())
        assert t.routed_experts.shape == (t.num_tokens - 1, 4, 2) and t.total >= 1
    ckpt = run_dir / "checkpoints" / "step_000006"
    assert (ckpt / "model.safetensors").exists() and json.loads((ckpt / "config.json").read_text())["model_type"] == "qwen3_moe"
    assert (run_dir / "config.yaml").read_text().count("max_steps: 6") == 1
    assert not (run_dir / "workspaces").exists()  # episode workspaces removed, even of the crashed actor


def _two_tool_call_steps(run_dir: Path, *overrides: str) -> list[dict]:
    """Launch 2 learner steps of 2 trajectories with the tool-call vocabulary; check they ran exact (drift 0)."""
    proc = subprocess.run(CLI + [f"run.dir={run_dir}", "model.vocab_size=4100", "learner.max_steps=2",
                                 "learner.batch_size=2", "learner.dump_trajectories=2", "env.max_turns=2",
                                 "learner.checkpoint_every=0", *overrides], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2] and sum(r["trajectories"] for r in rows) == 4
    assert all(r["drift_tokens"] == 0 for r in rows)
    return rows


def test_launch_with_tool_calls(tmp_path):
    """env.action_format=tool_call through the whole loop: trajectories flow, hold the tool tokens
    and stay exact (drift 0); tool-call errors are counted per step."""
    run_dir = tmp_path / "run"
    rows = _two_tool_call_steps(run_dir, "env.action_format=tool_call")
    assert all(set(r["tool_call_errors"]) == {"no_tool_call", "unbalanced", "bad_json", "unknown_tool",
                                              "bad_arguments", "multiple_calls"} for r in rows)
    for f in sorted((run_dir / "trajectories").glob("*.traj")):
        t = decode(f.read_bytes())
        prompt = t.token_ids[: t.turn_offsets[0][0]].tolist()
        assert prompt.count(4096) == 2 and t.drift_tokens == 0  # the bash tool declared with the <tool_call> id
        # every turn was either a tool-call error, cut, or run: each observation is a <tool_response> turn
        assert t.token_ids.tolist().count(4098) >= len(t.turn_offsets) - 1


def test_launch_with_an_external_agent(tmp_path):
    """rollout.agent={builtin: 1, external: 1} through the whole loop: each episode draws its agent (run.seed);
    tools/example_agent.py (the official openai client) drives the external ones through the recording
    endpoint; trajectories arrive exact (drift 0) and record their agent, and every metrics row splits the
    batch by agent. (run.seed=11: each actor's first two draws differ, so 4 trajectories from 2 actors
    hold both agents whatever the timing.)"""
    run_dir = tmp_path / "run"
    rows = _two_tool_call_steps(run_dir, "rollout.agent={builtin: 1, external: 1}", "run.seed=11",
                                f"rollout.agent_command=python {REPO / 'tools' / 'example_agent.py'}")
    # the example agent keeps its history append-only and stops after env.max_turns completions
    reasons = {k for r in rows for k in r["finish_reasons"]}
    assert "history_break" not in reasons
    assert all(sum(a["trajectories"] for a in r["by_agent"].values()) == r["trajectories"] for r in rows)
    assert {name for r in rows for name in r["by_agent"]} == {"builtin", "external"}
    for r in rows:
        for a in r["by_agent"].values():
            assert a["tokens"] > 0 and a["turns_mean"] >= 1 and a["history_breaks"] == 0
    dumped = sorted((run_dir / "trajectories").glob("*.traj"))
    assert len(dumped) == 2
    for f in dumped:
        t = decode(f.read_bytes())
        prompt = t.token_ids[: t.turn_offsets[0][0]].tolist()
        assert t.agent in ("builtin", "external") and t.drift_tokens == 0
        if t.agent == "external":  # the agent's bash tool declared with the <tool_call> id
            assert prompt.count(4096) == 2 and t.finish_reason in ("agent_exit", "end_signal", "max_turns")
        assert 1 <= len(t.turn_offsets) <= 2 and t.routed_experts.shape == (t.num_tokens - 1, 4, 2)


@pytest.mark.parametrize("inherited,sig", [("ignored", signal.SIGINT), ("default", signal.SIGHUP)],
                         ids=["sigint-ignored", "sighup"])
def test_ctrl_c_stops_cleanly_with_final_checkpoint(tmp_path, inherited, sig):
    """SIGINT to the process group stops the run with a final checkpoint, also when the launch
    inherited SIGINT ignored (a background job of a shell script, where Python leaves it ignored);
    SIGHUP (the terminal closed) stops it the same way. The launch installs its handlers whatever
    it inherited (t1async/service/service.py), so the inherited-ignored case covers a plain Ctrl-C."""
    run_dir = tmp_path / "run"
    overrides = [f"run.dir={run_dir}", "learner.max_steps=1000", "learner.batch_size=2", "env.max_turns=2",
                 "generation.max_new_tokens=16"]
    disposition = signal.SIG_IGN if inherited == "ignored" else signal.SIG_DFL
    proc = subprocess.Popen(CLI + overrides, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, disposition))
    try:
        deadline = time.monotonic() + 300
        while not _rows(run_dir) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(1)
        assert _rows(run_dir), "no learner step within 300 s"
        os.killpg(proc.pid, sig)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, out[-3000:]
    steps = len(_rows(run_dir))
    ckpts = sorted((run_dir / "checkpoints").glob("step_*"))
    assert ckpts and ckpts[-1].name == f"step_{steps:06d}" and (ckpts[-1] / "model.safetensors").exists()
    assert "Traceback" not in out


def test_sync_mode_trains_every_trajectory_at_staleness_zero(tmp_path):
    """``learner.max_staleness=0`` is synchronous RL through the real launch (the sync baseline of
    ``t1async bench async``): each step's batch was sampled on one version, the one the learner
    held, so every trajectory trained at staleness 0 and none was dropped; more actors than the
    batch do not break it (admission starts exactly one batch per version)."""
    run_dir = tmp_path / "run"
    overrides = [f"run.dir={run_dir}", "learner.max_steps=4", "learner.publish_every=1", "learner.batch_size=2",
                 "learner.max_staleness=0", "rollout.num_actors=3", "env.max_turns=2", "generation.max_new_tokens=16",
                 "learner.checkpoint_every=0", "learner.episodes_per_step=0"]
    proc = subprocess.run(CLI + overrides, capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:  # version is the one published after the step: the batch was sampled on the one before
        assert r["versions_in_batch"] == [r["version"] - 1] and r["staleness_counts"] == {"0": 2}
        assert r["batch_wait_s"] >= 0 and r["publish_s"] > 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["dropped_stale"] == 0 and summary["trajectories"] == 8
    assert all(s["busy_s"] > 0 for s in summary["samplers"])


def test_launch_with_the_megatron_learner_on_several_ranks(tmp_path):
    """``learner.backend=megatron`` with ``expert_parallel=2`` (2 ranks; tensor and pipeline
    parallelism go through the same launch path, their parity, gathers and checkpoints are
    tests/unit/learner/test_megatron.py's): the learner's backend is rank 0 and starts the other rank as a Ray
    actor (gloo on CPU); the run trains exactly (no drift, replayed routing used), publishes every
    step's weights (gathered from both ranks' experts) to the sampler, and checkpoints one HF model
    plus every rank's optimiser file."""
    pytest.importorskip("megatron.core")
    ep, tp, pp = 2, 1, 1
    run_dir = tmp_path / "run"
    sizes = [f"learner.megatron.expert_parallel={ep}", f"learner.megatron.tensor_parallel={tp}",
             f"learner.megatron.pipeline_parallel={pp}"]
    proc = subprocess.run(CLI + [f"run.dir={run_dir}", "learner.backend=megatron", *sizes,
                                 "learner.max_steps=3", "learner.batch_size=2", "learner.publish_every=1",
                                 "env.max_turns=2", "generation.max_new_tokens=16", "learner.checkpoint_every=0"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3] and [r["version"] for r in rows] == [1, 2, 3]
    assert all(r["drift_tokens"] == 0 and r["routing_diff_frac"] == 0 for r in rows)
    # trajectories of the version the learner held: the sampler's log-probs are the learner's
    assert all(r["logprob_diff_mean"] < 1e-4 for r in rows if r["staleness_max"] == 0)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [s["weight_version"] for s in summary["samplers"]] == [3]  # every publish reached the sampler
    world = ep * tp * pp
    assert (f"megatron ranks: {world} (tensor parallel {tp}, pipeline parallel {pp}, expert parallel {ep}; gloo"
            in (run_dir / "logs" / "learner.log").read_text())
    ckpt = run_dir / "checkpoints" / "step_000003"
    assert (ckpt / "optimizers.pt").exists() and all((ckpt / f"optimizers-rank{r}.pt").exists() for r in range(1, world))
    from safetensors import safe_open

    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        assert {int(k.split(".")[5]) for k in f.keys() if ".experts." in k} == set(range(8))  # every rank's experts
        assert {int(k.split(".")[2]) for k in f.keys() if k.startswith("model.layers.")} == set(range(4))  # every layer
