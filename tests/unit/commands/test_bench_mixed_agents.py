"""tools/bench_mixed_agents.py: the summary of a mixed-harness run from its metrics.jsonl (no launch),
its --agents parsing and the skipping of a harness that is not installed."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from t1async.config import AbnormalConfig
from t1async.learner.metrics import batch_metrics
from tests.support.tools import load_tool
from tests.support.trajectories import make_traj

bench = load_tool("bench_mixed_agents")


def _traj(agent: str, reward: float, turns: int, finish: str, *, mismatches: int = 0, drift: int = 0):
    t = make_traj(T=12)
    t.agent, t.reward, t.finish_reason = agent, reward, finish
    t.template_mismatches, t.drift_tokens = mismatches, drift
    t.resolved = reward == 3
    t.turn_offsets = np.array([[4, 7], [9, 12]][:turns], dtype=np.int32)
    return t


def _row(step: int, batch: list, t: float) -> dict:
    """A metrics.jsonl row as the learner writes it (batch_metrics), with the step's own fields."""
    row = batch_metrics(batch, [0] * len(batch), AbnormalConfig(), step=step, version=step, timeline_version=step,
                        counters={"trained": 0, "dropped_stale": 0, "rejected": 0, "quarantine_evicted": 0},
                        dropped={}, rejected_by={}, queue_depth=0)
    return {**row, "time": t, "drift_tokens": int(sum(x.drift_tokens for x in batch))}


def test_the_summary_counts_episodes_rates_and_history_breaks_per_agent(tmp_path):
    start = 1000.0
    rows = [
        _row(1, [_traj("builtin", 3.0, 2, "verified"), _traj("codex", 0.0, 1, "history_break", mismatches=2)],
             start + 60),
        _row(2, [_traj("terminus", 0.0, 2, "max_turns"), _traj("codex", 0.0, 2, "history_break")], start + 120),
        _row(3, [_traj("codex", 3.0, 2, "agent_exit"), _traj("claude-code", 0.0, 1, "agent_exit")], start + 240),
    ]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "by_ag')  # a torn last line
    read = bench.read_rows(path)
    assert [r["step"] for r in read] == [1, 2, 3]

    out = bench.summarise(read, start, summary={"steps": 3}, load=[2.0, 4.0], cpus=2)
    assert out["minutes"] == 4.0 and out["steps"] == 3 and out["trajectories"] == 6
    assert sorted(out["agents"]) == ["builtin", "claude-code", "codex", "terminus"]
    codex = out["agents"]["codex"]
    assert codex["episodes"] == 3 and codex["episodes_per_min"] == 0.75
    assert codex["history_breaks"] == 2 and codex["template_mismatches"] == 2
    assert codex["reward_mean"] == pytest.approx(1.0) and codex["turns_mean"] == pytest.approx(5 / 3)
    assert out["agents"]["builtin"] == {"episodes": 1, "reward_mean": 3.0, "resolved_rate": 1.0, "turns_mean": 2.0,
                                        "tokens": 12, "history_breaks": 0, "template_mismatches": 0,
                                        "episodes_per_min": 0.25}
    assert out["finish_reasons"] == {"agent_exit": 2, "history_break": 2, "max_turns": 1, "verified": 1}
    assert out["drift_tokens"] == 0
    assert out["load_average"] == {"mean": 3.0, "max": 4.0, "samples": 2, "cpus": 2}
    assert out["summary"] == {"steps": 3}
    assert out["dropped"] == rows[-1]["dropped"]  # the learner's cumulative counts when no summary has them


def test_drift_is_summed_and_an_empty_run_summarises_to_zeros():
    rows = [_row(1, [_traj("builtin", 0.0, 1, "max_turns", drift=3)], 10.0)]
    assert bench.summarise(rows, 0.0)["drift_tokens"] == 3
    empty = bench.summarise([], 0.0)
    assert empty["steps"] == 0 and empty["agents"] == {} and empty["minutes"] == 0.0
    assert empty["load_average"]["mean"] is None


def test_agents_parse_and_a_harness_not_installed_is_skipped_naming_its_install(monkeypatch):
    assert bench.parse_agents("builtin=2,codex") == {"builtin": 2.0, "codex": 1.0}
    for bad in ("", "codex=0", "codex=x", "codex=1,codex=2"):
        with pytest.raises(argparse.ArgumentTypeError, match="--agents"):
            bench.parse_agents(bad)
    monkeypatch.setenv("PATH", "/nonexistent")  # no harness binary can be found
    keep, skipped = bench.installed_mix({"builtin": 1.0, "codex": 1.0, "terminus": 2.0})
    assert keep == {"builtin": 1.0}
    assert "npm install -g @openai/codex" in skipped["codex"]
    assert "tmux" in skipped["terminus"] and "install" in skipped["terminus"]


# lines as the rollout actors log them (t1async/actors/rollout.py, t1async/rollout/agent.py; loguru's format)
LOG = """\
2026-12-07 18:38:18.606 | INFO     | t1async.rollout.agent:run_agent_episode:142 - codex episode of lock-down-secrets: \
0 completions in 0 exact segments (0 history breaks), 0 sampler errors, ended context_full, agent exit status 1
2026-12-07 18:38:18.610 | ERROR    | t1async.actors.rollout:run:129 - rollout 0 episode of lock-down-secrets failed
2026-12-07 18:38:24.651 | INFO     | t1async.rollout.agent:run_agent_episode:142 - terminus episode of top-client-ips: \
3 completions in 1 exact segments (0 history breaks), 0 sampler errors, ended max_turns, agent exit status 0
2026-12-07 18:38:25.777 | INFO     | t1async.actors.rollout:run:143 - rollout 0 sent top-client-ips (terminus): \
829 tokens, 3 turns, 0/4 tests, versions [0], 3.22 s
2026-12-07 18:38:26.000 | INFO     | t1async.actors.rollout:run:143 - rollout 1 sent zip-find-token (builtin): \
300 tokens, 3 turns, 0/4 tests, versions [0], 2.00 s
"""


def test_episodes_that_sent_nothing_are_counted_per_agent_from_the_rollout_logs():
    rows = [_row(1, [_traj("terminus", 0.0, 2, "max_turns"), _traj("builtin", 0.0, 2, "max_turns")], 70.0)]
    out = bench.summarise(rows, 10.0, summary={"controller": {"failed_episodes": 1}, "dropped": {"aborted": 2}},
                          log_lines=LOG.splitlines(), end_time=130.0)
    assert out["failed_episodes"] == 1 and out["dropped"] == {"aborted": 2}
    assert out["agents"]["codex"] == {"episodes": 0, "episodes_per_min": 0.0, "sent": 0, "ended": {"context_full": 1},
                                      "failed": 1, "sent_per_min": 0.0}
    assert out["agents"]["builtin"]["sent_per_min"] == 0.5  # 1 sent in the 2 minutes to the stop
    assert out["agents"]["builtin"]["episodes_per_min"] == 1.0  # 1 trained in the minute to the last row
    assert out["agents"]["terminus"]["sent"] == 1 and out["agents"]["terminus"]["ended"] == {"max_turns": 1}
    assert out["agents"]["terminus"]["failed"] == 0 and out["agents"]["terminus"]["episodes"] == 1
    assert out["agents"]["builtin"]["sent"] == 1 and "ended" not in out["agents"]["builtin"]
