"""A real episode: shipped task, bubblewrap sandbox, embedded sampler over HTTP, shipped tokenizer.

Checks TITO (the stream is exactly prompt + sampled ids + repair + observations, nothing
re-tokenized), alignment of every per-token field, routing rows, and the wire round trip.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from t1async.actors.rollout import RolloutActor, tasks_dir
from t1async.config import EnvConfig, GenerationConfig, ModelConfig, TransportConfig
from t1async.envs.protocol import CommandResult
from t1async.envs.taskio.loading import discover_tasks
from t1async.envs.terminal import TerminalEnv
from t1async.models.tokenizer import ChatTokenizer
from t1async.rollout.episode import CUT_NOTE, run_episode
from t1async.sampling.sampler_client import HttpSampler, SamplerResponse
from t1async.trajectory import (
    TURN_ABORTED,
    TURN_COMMAND_TIMEOUT,
    TURN_CUT_NOT_RUN,
    TURN_LENGTH_CUT,
    TURN_SANDBOX_REFUSED,
    decode,
    encode,
)
from t1async.transport.transport import ZmqReceiver
from tests.support.policies import serve_random_policy

MODEL = ModelConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)


class RecordingSampler:
    """Passes every request to the real HTTP sampler and keeps what it answered."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def generate(self, input_ids, sampling_params, *, routed_experts_start_len=0):
        r = self.inner.generate(input_ids, sampling_params, routed_experts_start_len=routed_experts_start_len)
        self.calls.append((list(input_ids), r))
        return r


@pytest.fixture(scope="module")
def sampler_url():
    yield from serve_random_policy(MODEL)


def test_episode_stream_is_exact_and_aligned(sampler_url, tmp_path):
    tok = ChatTokenizer.load()
    task = discover_tasks(tasks_dir(EnvConfig()), ["create-hello-file"])[0]
    env_cfg = EnvConfig(max_turns=3, command_timeout_s=5)
    gen = GenerationConfig(max_new_tokens=12)
    sampler = RecordingSampler(HttpSampler(sampler_url, num_layers=2, top_k=2))
    env = TerminalEnv(task, root=tmp_path, command_timeout_s=5)
    try:
        traj = run_episode(task, env, sampler, tok, env_cfg, gen, MODEL, actor_id=7)
    finally:
        env.close()

    T = traj.num_tokens
    ids = traj.token_ids.tolist()
    prompt = tok.render_prompt(env_cfg.system_prompt, task.instruction)
    assert ids[:len(prompt)] == prompt
    assert len(sampler.calls) == len(traj.turn_offsets) >= 1
    for (req_ids, resp), (s, e) in zip(sampler.calls, traj.turn_offsets):
        assert req_ids == ids[:s]  # each turn's prompt is exactly the stream so far
        assert ids[s:e] == resp.output_ids  # sampled ids kept bit for bit (TITO)
        np.testing.assert_allclose(traj.logprobs[s:e], resp.logprobs, rtol=0, atol=0)
        assert set(traj.versions[s:e].tolist()) == {resp.weight_version}
    mask = traj.loss_mask.astype(bool)
    assert mask.sum() == sum(e - s for s, e in traj.turn_offsets)
    # between turns: repair (only when the turn did not end with <|im_end|>) then the observation
    for k in range(len(traj.turn_offsets) - 1):
        e, s_next = traj.turn_offsets[k][1], traj.turn_offsets[k + 1][0]
        between = ids[e:s_next]
        ended = ids[e - 1] == tok.im_end_id
        obs_start = 0 if ended else len(tok.end_of_turn_ids)
        if not ended:
            assert between[:obs_start] == tok.end_of_turn_ids
        assert between[obs_start:obs_start + 4] == tok.render_observation("")[:4]  # "\n<|im_start|>tool\n"
        assert between[-3:] == tok.render_observation("")[-3:]  # "...<|im_start|>assistant\n"
    assert traj.routed_experts.shape == (T - 1, 2, 2)
    assert traj.total >= 1 and traj.reward == traj.passed and traj.resolved == (traj.passed == traj.total)
    d = decode(encode(traj), num_experts=4, num_layers=2, top_k=2, max_version=0)
    assert d.token_ids.tolist() == ids and d.actor_id == 7


@pytest.mark.slow
def test_rollout_actor_streams_over_zeromq(sampler_url, tmp_path):
    rx = ZmqReceiver("tcp://127.0.0.1:*")

    class Admission:
        def __init__(self):
            self.left = 3
            self.discarded: list[str] = []

        def acquire(self, actor_id):
            self.left -= 1
            return "create-hello-file" if self.left >= 0 else None

        def episode_failed(self, actor_id, reason, agent):
            raise AssertionError(f"{agent}: {reason}")

        def trajectory_discarded(self, reason, trajectory_id):
            self.discarded.append(reason)

        def episode_finished(self, actor_id, trajectory_id):
            pass

    got, stop = [], threading.Event()

    def learner_side():  # rejects the first trajectory, twice (a resend); acknowledges the others
        while not stop.is_set():
            d = rx.recv(0.1)
            if d is not None:
                got.append(decode(bytes(d.frame), num_experts=4))
                if len(got) == 1:
                    rx.ack(d, False, "invalid for this test")
                    rx.ack(d, False, "invalid for this test")
                else:
                    rx.ack(d, True)

    th = threading.Thread(target=learner_side)
    th.start()
    actor = RolloutActor(0, EnvConfig(max_turns=2, tasks=["create-hello-file"]), GenerationConfig(max_new_tokens=8),
                         MODEL, TransportConfig(curve=False), [sampler_url], rx.endpoint)
    admission = Admission()
    assert actor.run(admission) == {"episodes": 3, "failed": 0, "rerouted": 0}
    assert actor.sender.unacknowledged() == 0  # run() flushed: every trajectory was acknowledged or rejected
    stop.set()
    th.join()
    assert admission.discarded == ["rejected: invalid for this test"]  # one slot back for one rejected trajectory
    got = got[1:]
    assert len(got) == 2
    assert {g.task for g in got} == {"create-hello-file"} and got[0].trajectory_id != got[1].trajectory_id
    rx.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root, as the sandbox's disk limit does")
def test_a_dead_actors_workspace_is_unmounted_and_removed_and_a_live_one_is_kept(tmp_path):
    from t1async.actors.rollout import claim_workdir
    from t1async.envs.sandboxes.limits import _mount_points

    script = ("import sys, time; from t1async.actors.rollout import claim_workdir; from t1async.envs.sandboxes.limits import "
              "_mount_tmpfs; d, _ = claim_workdir(sys.argv[1], 9); (d / 'app').mkdir(); "
              "assert _mount_tmpfs(d / 'app', 8, 65534, 65534); (d / 'app' / 'f').write_text('x'); "
              "print(d, flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    dead = Path(proc.stdout.readline().strip())
    live, fd = claim_workdir(tmp_path, 1)  # while the other actor lives, its folder is left alone
    assert dead.is_dir() and dead / "app" in _mount_points()
    proc.kill()  # SIGKILL: no cleanup of its own
    proc.wait()
    assert dead / "app" in _mount_points()
    again, fd2 = claim_workdir(tmp_path, 2)  # a replacement actor reclaims it
    assert not dead.exists() and dead / "app" not in _mount_points()
    assert live.is_dir() and again.is_dir()  # the live actor's folder (lock held by fd) is kept
    os.close(fd)
    os.close(fd2)


class FinishSampler:
    """The sampler edge: scripted turns, each with the finish_reason an SGLang server would give
    (``abort`` included, which the embedded engine never returns); zero routing rows."""

    def __init__(self, turns):
        self.turns = list(turns)

    def generate(self, input_ids, sampling_params, *, routed_experts_start_len=0):
        ids, reason = self.turns.pop(0)
        rows = np.zeros((len(input_ids) + len(ids) - 1 - routed_experts_start_len, 2, 2), np.uint8)
        return SamplerResponse(output_ids=ids, logprobs=[-1.0] * len(ids), routed_experts=rows, finish_reason=reason,
                               weight_version=0)


def _scripted_episode(tmp_path, turns, **env_kw):
    """One episode of create-hello-file in a real local sandbox (1 s command timeout) with scripted
    turns; returns the trajectory and the names of the files the commands left in /app."""
    tok = ChatTokenizer.load()
    task = discover_tasks(tasks_dir(EnvConfig()), ["create-hello-file"])[0]
    env_cfg = EnvConfig(max_turns=len(turns), command_timeout_s=1, **env_kw)
    env = TerminalEnv(task, root=tmp_path, command_timeout_s=1)
    try:
        traj = run_episode(task, env, FinishSampler(turns), tok, env_cfg, GenerationConfig(max_new_tokens=16), MODEL,
                           actor_id=0)
        files = sorted(p.name for p in env.workspace.iterdir())
    finally:
        env.close()
    return traj, files


def test_cut_and_aborted_commands_are_not_run_and_every_abnormal_turn_is_marked(tmp_path):
    tok = ChatTokenizer.load()
    end = tok.im_end_id
    turns = [
        (tok.encode("touch /app/cut.txt"), "length"),  # cut at the token limit: not run by default
        (tok.encode("touch /app/aborted.txt"), "abort"),  # aborted by the sampler: not run
        ([*tok.encode("touch /app/whole.txt"), end], "stop"),
        ([*tok.encode("sleep 5"), end], "stop"),  # overruns the 1 s command timeout
        (tok.encode("exit"), "length"),  # a cut "exit" is not the end signal
        ([*tok.encode("exit"), end], "stop"),
    ]
    traj, files = _scripted_episode(tmp_path, turns)
    assert "whole.txt" in files and "cut.txt" not in files and "aborted.txt" not in files
    assert traj.turn_status.tolist() == [TURN_CUT_NOT_RUN, TURN_ABORTED, 0, TURN_COMMAND_TIMEOUT, TURN_CUT_NOT_RUN, 0]
    assert traj.finish_reason == "end_signal"
    # the observation after the cut turn says it was cut and not run (after the <|im_end|> repair)
    e, s_next = traj.turn_offsets[0][1], traj.turn_offsets[1][0]
    assert traj.token_ids[e:s_next].tolist() == [*tok.end_of_turn_ids, *tok.render_observation(CUT_NOTE.format(n=16))]
    d = decode(encode(traj), num_experts=4, num_layers=2, top_k=2)
    assert d.turn_status.tolist() == traj.turn_status.tolist()


def test_run_cut_commands_runs_the_cut_command_and_still_marks_the_turn(tmp_path):
    tok = ChatTokenizer.load()
    turns = [(tok.encode("touch /app/cut.txt"), "length"), ([*tok.encode("exit"), tok.im_end_id], "stop")]
    traj, files = _scripted_episode(tmp_path, turns, run_cut_commands=True)
    assert "cut.txt" in files and traj.turn_status.tolist() == [TURN_LENGTH_CUT, 0]


def test_a_command_the_sandbox_refused_is_marked_refused_even_when_it_also_timed_out():
    from types import SimpleNamespace

    tok = ChatTokenizer.load()

    class RefusingEnv:  # the sandbox edge: a fork bomb hits the process limit and then times out
        def reset(self):
            return "do it"

        def step(self, command):
            return CommandResult("[refused: process limit]", 124, True, False, 1.0, ("processes",))

        def verify(self):
            return SimpleNamespace(reward=0.0, passed=0, total=1, resolved=False, tests=[], error=None, output="")

    turns = [([*tok.encode(":(){ :|:& };:"), tok.im_end_id], "stop")]
    traj = run_episode(SimpleNamespace(name="t", agent_timeout_s=60.0), RefusingEnv(), FinishSampler(turns), tok,
                       EnvConfig(max_turns=1), GenerationConfig(max_new_tokens=16), MODEL, actor_id=0)
    assert traj.turn_status.tolist() == [TURN_SANDBOX_REFUSED]
