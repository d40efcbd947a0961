"""``rollout.agent`` as a weighted mix of agents drawn per episode (t1async/rollout/agent_mix.py): the
config's shape and its one-line refusals, and the seeded draw. The split of the metrics by agent is tested
in tests/unit/learner/test_metrics_sinks.py and tests/unit/service/test_control_socket.py."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from t1async.config import ConfigError, load_config
from t1async.rollout import harnesses
from t1async.rollout.agent_mix import AgentMix


def test_a_weighted_mix_is_a_mapping_of_known_agents_with_weights_above_zero():
    cfg = load_config(None, ["rollout.agent={builtin: 2, codex: 1, mini-swe-agent: 0.5}"])
    assert cfg.rollout.agent == {"builtin": 2, "codex": 1, "mini-swe-agent": 0.5}
    assert load_config(None, ["rollout.agent=mini-swe-agent"]).rollout.agent == "mini-swe-agent"
    for bad in ("{builtin: 1, aider: 1}", "{builtin: 0}", "{builtin: -1}", "{builtin: true}", "{}", "aider",
                "{builtin: .nan}", "[builtin, codex]"):
        with pytest.raises(ConfigError) as e:
            load_config(None, [f"rollout.agent={bad}"])
        msg = str(e.value)
        assert "\n" not in msg and "rollout.agent=" in msg, msg
        assert "'builtin'" in msg and "'codex', 'claude-code', 'mini-swe-agent' or 'terminus'" in msg and "weight > 0" in msg, msg
    with pytest.raises(ConfigError, match="rollout.agent_command=''"):  # external in a mix needs its program
        load_config(None, ["rollout.agent={builtin: 1, external: 1}"])


def test_the_draw_follows_the_weights_and_repeats_with_the_seed():
    mix = AgentMix({"builtin": 2, "codex": 1}, seed=7, actor_id=0)
    seq = [mix.draw() for _ in range(3000)]
    counts = Counter(seq)
    assert set(counts) == {"builtin", "codex"} and abs(counts["codex"] / 3000 - 1 / 3) < 0.04
    again = AgentMix({"builtin": 2, "codex": 1}, seed=7, actor_id=0)
    assert [again.draw() for _ in range(3000)] == seq  # reproducible per (seed, actor)
    other_actor = AgentMix({"builtin": 2, "codex": 1}, seed=7, actor_id=1)
    other_seed = AgentMix({"builtin": 2, "codex": 1}, seed=8, actor_id=0)
    assert [other_actor.draw() for _ in range(100)] != seq[:100]
    assert [other_seed.draw() for _ in range(100)] != seq[:100]
    assert AgentMix("codex", seed=7, actor_id=0).draw() == "codex"


def test_a_mix_with_an_agent_beside_builtin_needs_the_tool_call_vocabulary_at_launch(monkeypatch):
    """Preflight: every agent but builtin talks to the endpoint in tool calls (ids 4096..4099), so a mix
    that holds one is refused on the default 4096-id model, naming the agents; builtin alone is not."""
    from t1async.service.preflight import check_inputs
    from tests.support import REPO

    local = str(REPO / "configs" / "local.yaml")
    with pytest.raises(ConfigError, match=r"model.vocab_size \(rollout.agent codex\)"):
        check_inputs(load_config(local, ["rollout.agent={builtin: 3, codex: 1}"]))
    with pytest.raises(ConfigError, match=r"model.vocab_size \(rollout.agent claude-code\)"):  # (a harness alone too)
        check_inputs(load_config(local, ["rollout.agent=claude-code"]))
    assert check_inputs(load_config(local, ["rollout.agent={builtin: 3}", "env.tasks=[extract-tarball]"]))
    monkeypatch.setattr(harnesses.shutil, "which", lambda name: f"/usr/bin/{name}")  # (installed or not here)
    assert check_inputs(load_config(local, ["rollout.agent={builtin: 3, codex: 1}", "model.vocab_size=4100",
                                            "env.network=on", "env.tasks=[extract-tarball]"]))


def test_a_harness_that_could_not_run_an_episode_is_refused_at_launch_in_one_line(monkeypatch):
    """Issue 43, tried as a new user: a harness with env.sandbox=modal made every rollout actor fail its start
    and be restarted without end (27 restarts in 3 minutes, nothing on the console); one in a bubblewrap
    sandbox without network failed 227 episodes in 2 minutes with "connection refused". Both, and a harness
    not installed, are now refused before any process starts."""
    from t1async.service.preflight import check_harnesses

    installed = {"codex"}
    monkeypatch.setattr(harnesses.shutil, "which", lambda name: f"/usr/bin/{name}" if name in installed else None)
    for names, sandbox, network, expected in (
            (["codex"], "modal", "on", "cannot run in env.sandbox=modal"),
            (["codex"], "local", "task", "add env.network=on"),
            (["codex"], "local", "off", "add env.network=on"),
            (["claude-code"], "local", "on", "claude is not installed; install it with: npm install -g")):
        with pytest.raises(ConfigError, match=re.escape(expected)) as e:
            check_harnesses(names, sandbox, network)
        assert "\n" not in str(e.value) and names[0] in str(e.value)
    assert check_harnesses(["codex"], "local", "on") == []  # installed, with the host's loopback: runs
    check_harnesses([], "local", "off")  # builtin and external need neither
    # at the CPU default context (8,192) every codex episode ended context_full (a fresh user: 7 of 7): warned
    [line] = check_harnesses(["codex"], "local", "on", context=8192)
    assert "context_full" in line and "8,192" in line and "model.max_position_embeddings" in line
    assert check_harnesses(["codex"], "local", "on", context=65536) == []
