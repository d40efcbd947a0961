"""TITO: the learner's ids in the loss region are the sampled ids, bit for bit; turn boundaries are
repaired case by case; template re-rendering differences are counted; naive re-encoding is not exact.

The scripted-sampler tests fake only the edges (sampler answers, the shell); the last test runs real
sampled turns through the embedded sampler over HTTP and a bubblewrap sandbox.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from t1async.actors.rollout import tasks_dir
from t1async.actors.sampler import EmbeddedSampler
from t1async.commands.mismatch import _byte_groups, exact_view, naive_view, token_bytes
from t1async.config import EnvConfig, GenerationConfig, SamplerConfig
from t1async.envs.taskio.loading import discover_tasks
from t1async.envs.terminal import TerminalEnv
from t1async.models.model import Qwen3MoeForCausalLM
from t1async.models.tokenizer import ChatTokenizer
from t1async.rollout.conversation import template_renders_differently
from t1async.rollout.episode import EpisodeBuilder, run_episode
from tests.support.episode_fakes import MODEL, E, FakeEnv, K, L, ScriptedSampler

TOK = ChatTokenizer.load()


def _episode(turns):
    sampler, env = ScriptedSampler(turns), FakeEnv()
    task = SimpleNamespace(name="t", agent_timeout_s=60.0)
    traj = run_episode(task, env, sampler, TOK, EnvConfig(max_turns=len(turns)), GenerationConfig(max_new_tokens=16),
                       MODEL, actor_id=0)
    return traj, sampler, env


def test_turn_boundaries_every_case_keep_sampled_ids_and_repair():
    im_end, eos, im_start = TOK.im_end_id, TOK.eos_id, TOK.im_start_id
    turns = [
        [*TOK.encode("ls -la"), im_end],  # ended with <|im_end|>: no repair
        TOK.encode("echo hi there and on"),  # length limit: repair
        [*TOK.encode("pwd"), eos],  # stopped on eos: kept, repaired
        [*TOK.encode("  "), im_end],  # empty command: not run
        [*TOK.encode("cat a"), im_start, *TOK.encode("user"), im_end],  # the model ran on into a new turn
        [*TOK.encode("exit"), im_end],
    ]
    traj, sampler, env = _episode(turns)
    ids = traj.token_ids.tolist()
    assert env.commands == ["ls -la", "echo hi there and on", "pwd", "cat a<|im_start|>user"]
    assert traj.finish_reason == "end_signal" and len(traj.turn_offsets) == 6
    for k, ((s, e), sampled) in enumerate(zip(traj.turn_offsets.tolist(), turns)):
        assert ids[s:e] == sampled  # bit for bit
        assert sampler.calls[k] == ids[:s]  # the next prompt is exactly the stream so far
        assert traj.loss_mask[s:e].all() and set(traj.versions[s:e].tolist()) == {3}
    assert traj.drift_tokens == 0
    mask = traj.loss_mask.astype(bool)
    assert mask.sum() == sum(len(t) for t in turns)
    ends = [e for _, e in traj.turn_offsets.tolist()]
    # repair exactly where the turn did not end with <|im_end|>, with loss mask 0
    outputs = [f"ran {c}" for c in env.commands]
    outputs.insert(3, "")  # the empty command was not run
    for k, e in enumerate(ends[:-1]):
        repaired = turns[k][-1] != im_end
        assert (ids[e] == im_end and not mask[e]) if repaired else ids[e] != im_end
        obs = TOK.render_observation(outputs[k])
        start = e + repaired
        assert ids[start:start + len(obs)] == obs and not mask[start:start + len(obs)].any()
    assert ids[-1] == im_end and traj.num_tokens == ends[-1]  # trimmed after the last sampled token
    # routing: one row per fed position, never shifted, the last token has none
    assert traj.routed_experts.shape == (traj.num_tokens - 1, L, K)
    np.testing.assert_array_equal(traj.routed_experts[:, 0, 0], np.arange(traj.num_tokens - 1) % E)
    # the template would render the eos turn and the ran-on turn differently; the stream won
    assert traj.template_mismatches >= 2
    assert template_renders_differently(TOK, turns[2]) and template_renders_differently(TOK, turns[4])


def test_template_mismatch_detection():
    assert not template_renders_differently(TOK, [*TOK.encode("ls -la"), TOK.im_end_id])
    assert not template_renders_differently(TOK, TOK.encode("ls -la"))  # repaired, same ids
    a, b = TOK.encode("a"), TOK.encode("b")
    assert TOK.encode("ab") != a + b  # BPE merges "ab": the split form is not canonical
    assert template_renders_differently(TOK, [*a, *b, TOK.im_end_id])


def test_builder_refuses_stale_or_shifted_routing_rows():
    ep = EpisodeBuilder([5, 6, 7])
    ep.add_sampled([8, 9], [-1.0, -1.0], 0, np.zeros((4, L, K), np.int32))  # positions 0..3
    ep.add_context([2, 10])
    with pytest.raises(ValueError, match="expected 3"):  # must cover positions 4..6 (9, 2, 10) + new - 1
        ep.add_sampled([11], [-1.0], 0, np.zeros((2, L, K), np.int32))
    with pytest.raises(ValueError, match="log-probs"):
        ep.add_sampled([11], [], 0, np.zeros((3, L, K), np.int32))
    ep.add_sampled([11], [-1.0], 0, np.zeros((3, L, K), np.int32))
    assert ep.finish(task="t", actor_id=0, num_experts=E, reward=0.0, passed=0, total=0, resolved=False,
                     finish_reason="max_turns").drift_tokens == 0
    ep.ids[3] = 99  # corrupt a sampled id: drift is measured, not assumed
    assert ep.drift_tokens() == 1


def test_token_bytes_and_byte_alignment():
    tb = token_bytes(TOK)
    text = "grep -c ERROR /app/server.log | tee out.txt  # é"
    assert b"".join(tb[i] for i in TOK.encode(text)) == text.encode()
    a, b = TOK.encode("a") + TOK.encode("b"), TOK.encode("ab")
    assert _byte_groups(a + TOK.encode(" x"), b + TOK.encode(" x"), tb) == [(0, 2, 0, 1), (2, 3, 1, 2)]
    half = [next(i for i in range(TOK.vocab_size) if tb[i] == "é".encode()[:1])]  # a split UTF-8 character
    re = TOK.encode(TOK.decode(half))  # decodes to U+FFFD: other bytes
    assert b"".join(tb[i] for i in re) != b"".join(tb[i] for i in half)
    assert _byte_groups(half, re, tb) == [(0, 1, 0, len(re))]


@pytest.fixture(scope="module")
def real_trajectory(tmp_path_factory):
    s = EmbeddedSampler(MODEL, SamplerConfig(dtype="bfloat16"), seed=0)
    torch.manual_seed(0)
    s.load_weights(Qwen3MoeForCausalLM(MODEL).state_dict(), 0)
    from t1async.sampling.sampler_client import HttpSampler

    task = discover_tasks(tasks_dir(EnvConfig()), ["create-hello-file"])[0]
    env = TerminalEnv(task, root=tmp_path_factory.mktemp("ep"), command_timeout_s=5)
    try:
        traj = run_episode(task, env, HttpSampler(s.url(), num_layers=L, top_k=K), TOK, EnvConfig(max_turns=3),
                           GenerationConfig(max_new_tokens=24), MODEL, actor_id=0)
    finally:
        env.close()
        s.shutdown()
    return traj


def test_real_turns_naive_reencoding_changes_ids_tito_keeps_them(real_trajectory):
    traj = real_trajectory
    assert traj.drift_tokens == 0
    exact, naive = exact_view(traj), naive_view(traj, TOK)
    assert np.array_equal(exact.ids, traj.token_ids) and exact.drift == 0
    changed = 0
    for s, e in traj.turn_offsets.tolist():
        sampled = traj.token_ids[s:e].tolist()
        body = sampled[:-1] if sampled[-1] in (TOK.im_end_id, TOK.eos_id) else sampled
        re = TOK.encode(TOK.decode(body))
        changed += re != body
    assert changed >= 1 and naive.drift > 0 and not np.array_equal(naive.ids, exact.ids)
    assert traj.template_mismatches >= changed
    # the naive view still covers every sampled token exactly once in its loss groups
    assert sum(n for _, _, n in naive.groups) == int(traj.loss_mask.sum())
    assert naive.rows.shape == (naive.ids.size - 1, L, K) and naive.aligned.shape == (naive.ids.size - 1,)
