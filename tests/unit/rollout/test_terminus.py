"""The terminus harness (``rollout.agent=terminus``, t1async/rollout/terminus.py): keystrokes into tmux.

Real: tmux, the program itself (run as a process, as the sandbox runs it), the endpoint and its
recorder, the shipped tokenizer, the rollout actor, the bubblewrap sandbox, a shipped task and its
verifier, the embedded sampler on a tiny random model. Faked: the policy where a resolved episode is
the point (tests/support/oracle_policy.py ``TerminusPolicy``: the task's oracle commands as this
harness's JSON replies; the tiny models on CPU emit noise).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from t1async.actors.rollout import RolloutActor
from t1async.config import EnvConfig, GenerationConfig, ModelConfig, RolloutConfig, TransportConfig
from t1async.models.tokenizer import ChatTokenizer
from t1async.rollout import harnesses, terminus
from t1async.rollout.endpoint import AgentEndpoint, SessionLimits
from t1async.rollout.endpoint.agent import segment_builder
from t1async.rollout.terminus import ReplyError, parse_reply, truncate
from t1async.trajectory import TOOL_CALL_CODES, TURN_STATUS, decode, encode
from tests.support.oracle_policy import E, TerminusPolicy, TextReplies, oracle_commands

REPO = Path(__file__).resolve().parents[3]
TOK = ChatTokenizer.load()
MODEL = ModelConfig(vocab_size=4100, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                    head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
TASK = "make-project-skeleton"
PARAMS = {"max_new_tokens": 256, "temperature": 1.0, "top_p": 1.0, "top_k": -1}
PROGRAM = REPO / "t1async" / "rollout" / "terminus.py"
needs_tmux = pytest.mark.skipif(shutil.which("tmux") is None, reason=f"tmux is not installed: {terminus.TMUX_INSTALL}")


# ---------------------------------------------------------------- the reply format

def test_a_reply_is_one_json_object_with_its_fields():
    r = parse_reply('Here it is:\n```json\n{"analysis": "a", "plan": "p", "commands": [{"keystrokes": "ls\\n", '
                    '"duration": 0.5}, {"keystrokes": "C-c"}], "task_complete": false}\n```')
    assert [(c.keystrokes, c.duration) for c in r.commands] == [("ls\n", 0.5), ("C-c", 1.0)]
    assert (r.analysis, r.plan, r.task_complete) == ("a", "p", False)
    assert parse_reply('{"analysis": "", "plan": "", "commands": [], "task_complete": true}').task_complete


@pytest.mark.parametrize("text,reason,words", [
    ("ls -la", "no_tool_call", "no JSON object"),
    ('{"analysis": "a", "plan": ', "bad_json", "does not parse"),
    ('{"analysis": "a" "plan": "p"}', "bad_json", "does not parse"),
    ('{"plan": "p", "commands": []}', "bad_arguments", '"analysis"'),
    ('{"analysis": "a", "plan": "p"}', "bad_arguments", '"commands"'),
    ('{"analysis": "a", "plan": "p", "commands": ["ls"]}', "bad_arguments", "commands[0]"),
    ('{"analysis": "a", "plan": "p", "commands": [{"keystrokes": "ls", "duration": -1}]}', "bad_arguments",
     "commands[0].duration"),
    ('{"analysis": "a", "plan": "p", "commands": [], "task_complete": "yes"}', "bad_arguments", "task_complete"),
])
def test_an_unusable_reply_names_its_reason(text, reason, words):
    with pytest.raises(ReplyError, match=r"\S") as e:
        parse_reply(text)
    assert e.value.reason == reason and words in str(e.value) and reason in TOOL_CALL_CODES
    assert terminus.turn_problem(text) == reason


def test_a_long_observation_keeps_head_and_tail_with_a_marker():
    text = "".join(f"{i:05d}\n" for i in range(2000))  # 12000 characters
    cut = truncate(text, 1000)
    assert cut.startswith("00000\n") and cut.endswith("01999\n")
    assert "[... 11000 characters left out ...]" in cut and len(cut) < 1100
    assert truncate("short", 1000) == "short"


# ---------------------------------------------------------------- the program against the endpoint

@pytest.fixture(scope="module")
def endpoint():
    ep = AgentEndpoint(TOK)
    yield ep
    ep.shutdown()


def _run_program(endpoint, sampler, tmp_path, *flags, max_turns=10, timeout=60):
    s = endpoint.open(sampler, lambda c: None, SessionLimits(dict(PARAMS), max_turns, 1 << 16))
    argv = [sys.executable, str(PROGRAM), "--base-url", f"{endpoint.url}/s/{s.token}/v1", "--socket",
            f"t1async-test-{s.token[:8]}", *flags, "Do the task."]
    out = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, "OPENAI_API_KEY": s.token, "SHELL": "/bin/bash"})
    return s, out


def _reply(keystrokes=None, complete=False, duration=0.2):
    cmds = [] if keystrokes is None else [{"keystrokes": keystrokes, "duration": duration}]
    return json.dumps({"analysis": "a", "plan": "p", "commands": cmds, "task_complete": complete})


@needs_tmux
@pytest.mark.parametrize("stream", [pytest.param(False, marks=pytest.mark.slow), True])  # (the fast suite: one)
def test_keystrokes_run_in_tmux_and_the_model_sees_the_new_output_only(endpoint, tmp_path, stream):
    """Each reply's keystrokes are typed into the pane; the next prompt shows what appeared since the
    last look (not the earlier output again); a claim of completion is confirmed before the episode
    ends; every request continues the sampled ids (no history break)."""
    policy = TerminusPolicy(TOK, ["echo first-$((40+2))", "echo second-$((50+1)) > out.txt; cat out.txt"], duration=1.0)
    s, out = _run_program(endpoint, policy, tmp_path, *(["--stream"] if stream else []))
    assert out.returncode == 0, out.stdout + out.stderr
    assert (tmp_path / "out.txt").read_text() == "second-51\n"
    summary = terminus.outcome(out.stdout)
    assert summary["ended"] == "end_signal" and summary["turns"] == 4 and summary["commands"] == 2
    assert summary["task_complete_asked"] == 1 and summary["parse_errors"] == {} and policy.completes == 2
    assert s.recorder.history_breaks == 0 and len(s.recorder.records) == 4
    recs = s.recorder.records
    for a, b in zip(recs, recs[1:]):
        assert b.prompt_ids[:len(a.prompt_ids) + len(a.output_ids)] == a.prompt_ids + a.output_ids
    new = [TOK.decode(b.prompt_ids[len(a.prompt_ids) + len(a.output_ids):]) for a, b in zip(recs, recs[1:])]
    assert "first-42" in new[0] and "New terminal output" in new[1]
    assert "second-51" in new[1] and "first-42" not in new[1]  # incremental: the earlier output is not sent again
    assert "confirm" not in new[1] and "reply again" in new[2]  # the claim asked for a confirmation


@needs_tmux
def test_an_unusable_reply_is_an_error_observation_and_the_episode_goes_on(endpoint, tmp_path):
    sampler = TextReplies(TOK, ["I will run ls.", '{"analysis": "a", "plan": "p", "commands": [{"keystrokes": 5}]}',
                       _reply("touch made\n"), _reply(complete=True), _reply(complete=True)])
    s, out = _run_program(endpoint, sampler, tmp_path)
    summary = terminus.outcome(out.stdout)
    assert summary["ended"] == "end_signal" and summary["parse_errors"] == {"no_tool_call": 1, "bad_arguments": 1}
    assert (tmp_path / "made").exists() and s.recorder.history_breaks == 0
    told = TOK.decode(s.recorder.records[1].prompt_ids[-120:])
    assert "could not be used: the reply holds no JSON object" in told
    # the trajectory marks those turns with the tool-call error codes (metrics' tool_call_errors count them)
    [segment] = s.recorder.segments()
    traj = segment_builder(segment, TOK, terminus.turn_problem).finish(
        task="t", actor_id=0, num_experts=E, reward=0.0, passed=0, total=1, resolved=False, finish_reason="x")
    assert traj.turn_status.tolist() == [TOOL_CALL_CODES["no_tool_call"], TOOL_CALL_CODES["bad_arguments"], 0, 0, 0]
    assert traj.drift_tokens == 0


@pytest.mark.slow
@needs_tmux
def test_a_key_name_presses_that_key_and_a_cleared_screen_is_shown_whole(endpoint, tmp_path):
    sampler = TextReplies(TOK, [_reply("sleep 30\n", duration=0.5), _reply("C-c", duration=0.5),
                                _reply("clear; echo after-clear\n", duration=1.5), _reply(complete=True),
                                _reply(complete=True)])
    started = time.time()
    s, out = _run_program(endpoint, sampler, tmp_path)
    assert terminus.outcome(out.stdout)["ended"] == "end_signal" and time.time() - started < 25
    r = s.recorder.records
    seen = [TOK.decode(b.prompt_ids[len(a.prompt_ids) + len(a.output_ids):]) for a, b in zip(r, r[1:])]
    assert "^C" in seen[1]  # the interrupt reached the sleep
    assert seen[2].split("\n")[2:4] == ["Current terminal screen:", "after-clear"]  # (after the role line)


@pytest.mark.slow
@needs_tmux
def test_a_shell_that_exits_is_replaced_and_the_model_told(endpoint, tmp_path):
    sampler = TextReplies(TOK, [_reply("exit\n", duration=0.5), _reply("echo back-$((1+1))\n", duration=1.0),
                                _reply(complete=True), _reply(complete=True)])
    s, out = _run_program(endpoint, sampler, tmp_path)
    summary = terminus.outcome(out.stdout)
    assert out.returncode == 0 and summary["ended"] == "end_signal" and summary["shell_restarts"] == 1, out.stdout
    r = s.recorder.records
    seen = [TOK.decode(b.prompt_ids[len(a.prompt_ids) + len(a.output_ids):]) for a, b in zip(r, r[1:])]
    assert "a new shell was started" in seen[0] and "back-2" in seen[1]


@needs_tmux
@pytest.mark.slow  # (three programs, ~10 s)
def test_a_claim_not_confirmed_in_the_next_reply_goes_on_and_the_turn_budget_ends_it(endpoint, tmp_path):
    sampler = TextReplies(TOK, [_reply(complete=True), _reply("echo again\n"), _reply("echo more\n")])
    s, out = _run_program(endpoint, sampler, tmp_path, "--max-turns", "3")
    summary = terminus.outcome(out.stdout)
    assert summary == {**summary, "ended": "max_turns", "turns": 3, "task_complete_asked": 1}
    sampler = TextReplies(TOK, [_reply("echo x\n")])  # the endpoint's own turn limit: a refused request ends it
    s, out = _run_program(endpoint, sampler, tmp_path, max_turns=2)
    summary = terminus.outcome(out.stdout)
    assert summary["ended"] == "episode_over" and summary["turns"] == 2 and s.ended == "max_turns"
    sampler = TextReplies(TOK, [_reply("echo x\n", duration=30)])  # its own time budget ends a long wait
    started = time.time()
    s, out = _run_program(endpoint, sampler, tmp_path, "--time-budget", "2")
    assert terminus.outcome(out.stdout)["ended"] == "timeout" and time.time() - started < 15


@pytest.mark.slow
@needs_tmux
def test_a_long_output_is_cut_with_a_marker(endpoint, tmp_path):
    sampler = TextReplies(TOK, [_reply("seq 1 5000\n", duration=1.5), _reply(complete=True), _reply(complete=True)])
    s, out = _run_program(endpoint, sampler, tmp_path, "--max-observation-chars", "2000")
    assert terminus.outcome(out.stdout)["observations_cut"] == 1
    seen = TOK.decode(s.recorder.records[1].prompt_ids[len(s.recorder.records[0].prompt_ids):])
    assert "characters left out ...]" in seen and "\n5000" in seen and "\n2500\n" not in seen


def test_tmux_missing_is_one_line_naming_its_install(tmp_path):
    """In a sandbox without tmux the program says so in one line and exits 127; on the host,
    harness('terminus') refuses the same way before any episode."""
    out = subprocess.run([sys.executable, str(PROGRAM), "--base-url", "http://127.0.0.1:9/v1", "x"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=30, env={"PATH": str(tmp_path)})
    assert out.returncode == 127
    assert out.stdout.strip().splitlines() == ["terminus: tmux is not installed in the sandbox; install it with: "
                                               "apt-get install tmux"]


def test_the_harness_is_listed_and_a_missing_tmux_is_refused_in_one_line(monkeypatch):
    from t1async.config import load_config

    assert load_config(None, ["rollout.agent=terminus"]).rollout.agent == "terminus"
    with pytest.raises(ValueError, match="the harnesses are .*terminus"):
        harnesses.harness("aider")
    monkeypatch.setattr(harnesses.shutil, "which", lambda name: None)
    with pytest.raises(ValueError, match=r"^rollout.agent=terminus: tmux is not installed; install it with: "
                                         r"apt-get install tmux$"):
        harnesses.harness("terminus")
    line = harnesses.HARNESSES["terminus"].command("http://127.0.0.1:1/s/tok", "tok", "it's done")
    assert "--base-url http://127.0.0.1:1/s/tok/v1" in line and "'it'\"'\"'s done'" in line
    assert PROGRAM.read_text() in line  # the program travels in the command: the sandbox needs no t1async


# ---------------------------------------------------------------- episodes inside the sandbox

def _actor(tmp_path, **env):
    cfg = EnvConfig(**{"max_turns": 10, "tasks": [TASK], "network": "on", **env})
    return RolloutActor(0, cfg, GenerationConfig(max_new_tokens=256), MODEL, TransportConfig(curve=False),
                        ["http://127.0.0.1:9"], "tcp://127.0.0.1:9", rollout_cfg=RolloutConfig(agent="terminus"),
                        work_root=str(tmp_path / "work"))


@pytest.mark.slow
@needs_tmux
def test_terminus_resolves_a_shipped_task_through_tmux_keystrokes(tmp_path):
    """rollout.agent=terminus: the program runs inside the episode's bubblewrap sandbox, types the task's
    oracle commands into tmux (the scripted policy), confirms completion, and the task's verifier
    resolves it; the one trajectory has drift 0 against the sampled ids."""
    commands = oracle_commands(REPO / "t1async" / "envs" / "tasks" / TASK)
    actor = _actor(tmp_path)
    policy = actor.sampler = TerminusPolicy(TOK, commands)
    try:
        [traj] = actor.run_one(TASK)
    finally:
        actor.endpoint.shutdown()
        actor.sender.close()
    traj = decode(encode(traj), num_experts=E, num_layers=2, top_k=2)
    assert traj.resolved and traj.passed == traj.total >= 1 and traj.finish_reason == "end_signal"
    assert traj.agent == "terminus"  # (metrics.jsonl by_agent splits by it)
    assert traj.drift_tokens == 0 and len(traj.turn_offsets) == len(commands) + 2 == len(policy.outputs)
    assert traj.token_ids.tolist() == policy.calls[-1] + policy.outputs[-1]
    for (s, e), sampled in zip(traj.turn_offsets.tolist(), policy.outputs):
        assert traj.token_ids[s:e].tolist() == sampled
    assert traj.turn_status is None or not traj.turn_status.any()
    assert np.array_equal(traj.routed_experts[:, 0, 0], np.arange(traj.num_tokens - 1) % E)


def _processes_with(marker: str) -> list[int]:
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                out.append(int(pid))
        except OSError:
            pass
    return out


@needs_tmux
@pytest.mark.slow
def test_a_hanging_harness_is_ended_by_the_episode_timeout_and_the_sandbox_cleaned(tmp_path, monkeypatch):
    """The policy asks for a command that never returns and a 600 s wait: the episode's time budget
    kills the harness, its tmux server and the command (every process of the sandbox), the episode ends
    ``timeout`` with its one turn trained and the verifier's verdict, and the actor runs the next episode."""
    actor = _actor(tmp_path, episode_timeout_s=8)
    actor.sampler = TextReplies(TOK, [_reply("sleep 600\n", duration=600)])
    seen: list[int] = []
    original = harnesses.HARNESSES["terminus"].command

    def spy(url, token, instruction):
        threading.Thread(target=lambda: (time.sleep(5), seen.extend(_processes_with(f"t1async-{token[:16]}"))),
                         daemon=True).start()
        return original(url, token, instruction)

    monkeypatch.setitem(harnesses.HARNESSES, "terminus", harnesses.Harness(
        **{**harnesses.HARNESSES["terminus"].__dict__, "command": spy}))
    started = time.time()
    try:
        [traj] = actor.run_one(TASK)
        assert time.time() - started < 30
        assert traj.finish_reason == "timeout" and not traj.resolved and len(traj.turn_offsets) == 1
        assert traj.drift_tokens == 0
        assert seen and not any(Path(f"/proc/{p}").exists() for p in seen)  # tmux ran; it is gone
        assert not _processes_with("sleep 600")
        actor.sampler = TerminusPolicy(TOK, oracle_commands(REPO / "t1async" / "envs" / "tasks" / TASK))
        [traj] = actor.run_one(TASK)  # the next episode runs
        assert traj.resolved
    finally:
        actor.endpoint.shutdown()
        actor.sender.close()


@needs_tmux
@pytest.mark.slow
def test_the_ordinary_sampler_on_a_tiny_model_runs_the_episode_to_its_turn_budget(tmp_path):
    """The embedded sampler (real engine, HTTP, random tiny weights) behind the same harness: its noise is
    no JSON reply, each turn becomes an error observation counted in the trajectory's turn status
    (metrics' tool_call_* counters), the endpoint's turn budget ends the episode, and the trajectory is exact."""
    import torch

    from t1async.models.families import build_model
    from t1async.sampling.embedded_http import SamplerHttp
    from t1async.sampling.engine import Engine

    torch.manual_seed(0)
    engine = Engine(build_model(MODEL).eval(), seed=0)
    engine.weight_version = 0
    engine.start()
    http = SamplerHttp(engine, MODEL, "127.0.0.1")
    actor = RolloutActor(0, EnvConfig(max_turns=2, tasks=[TASK], network="on"), GenerationConfig(max_new_tokens=16),
                         MODEL, TransportConfig(curve=False), [http.url()], "tcp://127.0.0.1:9",
                         rollout_cfg=RolloutConfig(agent="terminus"), work_root=str(tmp_path / "work"))
    try:
        [traj] = actor.run_one(TASK)
    finally:
        actor.endpoint.shutdown()
        actor.sender.close()
        http.shutdown()
        engine.stop()
    traj = decode(encode(traj), num_experts=MODEL.num_experts, num_layers=2, top_k=2)
    assert traj.finish_reason == "max_turns" and len(traj.turn_offsets) == 2 and traj.drift_tokens == 0
    assert not traj.resolved
    # every turn is an unusable reply: cut at max_new_tokens, or marked with the reason the harness told the model
    names = [TURN_STATUS[int(c)] for c in traj.turn_status]
    assert all(n == "length_cut" or n.startswith("tool_call_") for n in names), names
    summary = terminus.outcome((actor.workdir / "agent-logs" / "agent-0.log").read_text())
    assert summary["ended"] == "episode_over" and summary["turns"] == 2 == sum(summary["parse_errors"].values())
