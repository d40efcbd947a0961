"""Long episodes: the learner's chunked forward equals the plain one, and context overflow is a
recorded end (``finish_reason`` ``context_full``), never an accident.

Chunking (``learner.max_tokens_per_chunk``, t1async/learner/torch_backend.py) must change memory only:
log-probs, the kept-outside flags, routing (replayed and the routers' own), critic values and
every gradient are compared with a forward that does not chunk, on the same weights and batch.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from t1async.actors.rollout import tasks_dir
from t1async.config import AbnormalConfig, ConfigError, EnvConfig, GenerationConfig, LearnerConfig, ModelConfig, load_config
from t1async.envs.taskio.loading import discover_tasks
from t1async.envs.terminal import TerminalEnv
from t1async.learner.abnormal import drop_reason, finish_counts
from t1async.learner.rl import policy_loss
from t1async.learner.torch_backend import TorchBackend
from t1async.models.tokenizer import ChatTokenizer
from t1async.rollout.episode import EpisodeError, context_limit, run_episode
from t1async.sampling.sampler_client import SamplerResponse
from t1async.trajectory import decode, encode

MODEL = ModelConfig(vocab_size=512, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                    head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


def _backend(chunk: int, generation: GenerationConfig) -> TorchBackend:
    torch.manual_seed(0)
    return TorchBackend(LearnerConfig(max_tokens_per_chunk=chunk, kl_coef=0.1), MODEL, generation)


def _batch(T: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, MODEL.vocab_size, (1, T + 1), generator=g)
    replay = torch.rand(1, T, MODEL.num_hidden_layers, MODEL.num_experts, generator=g).argsort(-1)[..., :2]
    return ids[:, :-1], ids[:, 1:], replay, torch.randn(1, T, generator=g)


def _step(b: TorchBackend, inp, tgt, replay, adv, score=None):
    """Policy log-probs with routing, values, the learner's loss and its backward; returns
    everything the comparison needs (gradients by parameter name). ``score``: the positions scored
    (and the loss mask), else all."""
    b.zero_grad()
    out = b.policy_logprobs(inp, tgt, replay, grad=True, routing=True, score=score)
    mask = torch.ones_like(adv) if score is None else score.float()
    pl = policy_loss(out.logp, out.logp.detach() - 0.05, out.logp.detach() - 0.1, adv, mask, clip_eps=0.2, is_cap=2.0)
    v = b.values(inp, grad=True)
    ref = b.reference_logprobs(inp, tgt, score=score)
    b.backward(pl.loss + (v ** 2).mean())
    grads = {f"policy.{n}": p.grad.clone() for n, p in b.policy.named_parameters() if p.grad is not None}
    grads |= {f"critic.{n}": p.grad.clone() for n, p in b.critic.named_parameters() if p.grad is not None}
    return out, v.detach(), ref, grads


@pytest.mark.parametrize("generation", [GenerationConfig(), GenerationConfig(temperature=0.8, top_k=50, top_p=0.9)],
                         ids=["plain", "top_k_top_p"])
@pytest.mark.parametrize("replayed", [True, False], ids=["replay", "own_routing"])
def test_chunked_forward_equals_the_plain_one_in_logprobs_routing_values_and_gradients(generation, replayed):
    T = 150  # chunks of 64: two full and a ragged one
    inp, tgt, replay, adv = _batch(T)
    replay = replay if replayed else None
    plain, chunked = _backend(0, generation), _backend(64, generation)
    assert chunked._chunk(inp) == 64 and plain._chunk(inp) == 0
    o1, v1, r1, g1 = _step(plain, inp, tgt, replay, adv)
    o2, v2, r2, g2 = _step(chunked, inp, tgt, replay, adv)
    # bitwise: the decoder layers run over the whole sequence either way (checkpointed, not split),
    # and the LM head's row-padded matmuls (t1async/models/model.py padded_rows) treat each row alike
    assert torch.equal(o2.logp, o1.logp), (o2.logp - o1.logp).abs().max()
    assert torch.equal(o2.outside, o1.outside)
    assert torch.equal(o2.routed_experts, o1.routed_experts) and torch.equal(o2.router_experts, o1.router_experts)
    if replayed:  # routing replay stays exact in chunks: every layer used the recorded experts
        assert torch.equal(o2.routed_experts, replay)
    assert torch.equal(v2, v1) and torch.equal(r2, r1)
    assert g1.keys() == g2.keys() and len(g1) > 10
    for name in g1:
        torch.testing.assert_close(g2[name], g1[name], rtol=1e-4, atol=1e-6, msg=name)
    assert not chunked.policy.model.gradient_checkpointing and not chunked.critic.backbone.gradient_checkpointing


@pytest.mark.parametrize("chunk", [0, 64], ids=["one_pass", "chunked"])
def test_scoring_only_the_sampled_positions_gives_their_logprobs_and_the_same_gradients(chunk):
    """The learner scores the sampled tokens only (t1async/learner/torch_backend.py scored_logprobs): at those
    positions the log-probs and the outside flags are the full pass's, elsewhere 0 and False, and a loss over
    them has the full pass's gradients."""
    T = 150
    inp, tgt, replay, adv = _batch(T)
    gen = GenerationConfig(temperature=0.8, top_k=50, top_p=0.9)
    score = torch.zeros(1, T, dtype=torch.bool)
    score[0, 20:45] = score[0, 90:97] = score[0, 140:] = True  # three turns' sampled tokens
    o1, v1, r1, g1 = _step(_backend(chunk, gen), inp, tgt, replay, adv, score=None)
    o2, v2, r2, g2 = _step(_backend(chunk, gen), inp, tgt, replay, adv, score=score)
    torch.testing.assert_close(o2.logp[score], o1.logp[score], rtol=0, atol=1e-6)
    assert not o2.logp[~score].any() and not o2.outside[~score].any()
    assert torch.equal(o2.outside[score], o1.outside[score])
    torch.testing.assert_close(r2[score], r1[score], rtol=0, atol=1e-6)
    assert not r2[~score].any()
    assert torch.equal(o2.routed_experts, o1.routed_experts)  # the trunk still runs at every position
    # the loss of the full pass over the same mask
    b = _backend(chunk, gen)
    b.zero_grad()
    out = b.policy_logprobs(inp, tgt, replay, grad=True, routing=True)
    pl = policy_loss(out.logp, out.logp.detach() - 0.05, out.logp.detach() - 0.1, adv, score.float(), clip_eps=0.2,
                     is_cap=2.0)
    b.backward(pl.loss + (b.values(inp, grad=True) ** 2).mean())
    g3 = {f"policy.{n}": p.grad.clone() for n, p in b.policy.named_parameters() if p.grad is not None}
    assert g3.keys() <= g2.keys() and len(g3) > 10
    for name in g3:
        torch.testing.assert_close(g2[name], g3[name], rtol=1e-4, atol=1e-6, msg=name)


def test_chunked_forward_holds_no_graph_without_gradients_and_short_sequences_are_not_chunked():
    b = _backend(64, GenerationConfig())
    inp, tgt, replay, _ = _batch(150)
    out = b.policy_logprobs(inp, tgt, replay, grad=False, routing=False)
    assert not out.logp.requires_grad and out.logp.shape == (1, 150) and out.routed_experts is None
    assert b._chunk(inp[:, :64]) == 0  # a sequence of exactly one chunk takes the plain forward


def test_config_keys_are_checked():
    assert LearnerConfig().max_tokens_per_chunk > 0 and EnvConfig().max_context_tokens == 0  # safe defaults
    with pytest.raises(ConfigError, match="learner.max_tokens_per_chunk"):
        load_config(None, ["learner.max_tokens_per_chunk=-1"])
    with pytest.raises(ConfigError, match="env.max_context_tokens"):
        load_config(None, ["env.max_context_tokens=16", "generation.max_new_tokens=16"])
    assert context_limit(EnvConfig(), MODEL) == MODEL.max_position_embeddings
    assert context_limit(EnvConfig(max_context_tokens=300), MODEL) == 300
    assert context_limit(EnvConfig(max_context_tokens=10**9), MODEL) == MODEL.max_position_embeddings


class EchoSampler:
    """The sampler edge: every turn answers ``echo hi`` and <|im_end|>, with zero routing rows,
    and records the prompt lengths it was sent."""

    def __init__(self, tok: ChatTokenizer):
        self.ids = [*tok.encode("echo hi"), tok.im_end_id]
        self.prompts: list[int] = []

    def generate(self, input_ids, sampling_params, *, routed_experts_start_len=0):
        self.prompts.append(len(input_ids))
        rows = np.zeros((len(input_ids) + len(self.ids) - 1 - routed_experts_start_len, 2, 2), np.uint8)
        return SamplerResponse(output_ids=list(self.ids), logprobs=[-1.0] * len(self.ids), routed_experts=rows,
                               finish_reason="stop", weight_version=0)


def _episode(tmp_path, env_cfg: EnvConfig, gen: GenerationConfig):
    tok = ChatTokenizer.load()
    task = discover_tasks(tasks_dir(EnvConfig()), ["create-hello-file"])[0]
    env = TerminalEnv(task, root=tmp_path, command_timeout_s=5)
    sampler = EchoSampler(tok)
    try:
        return run_episode(task, env, sampler, tok, env_cfg, gen, MODEL, actor_id=0), sampler
    finally:
        env.close()


def test_an_episode_that_would_overflow_its_context_ends_as_context_full_and_is_trained_by_default(tmp_path):
    gen = GenerationConfig(max_new_tokens=16)
    limit = 220
    traj, sampler = _episode(tmp_path, EnvConfig(max_turns=50, max_context_tokens=limit), gen)
    assert traj.finish_reason == "context_full"
    assert 1 < len(traj.turn_offsets) < 50
    # every prompt left room for a whole turn, and the next one would not have
    assert all(p + gen.max_new_tokens <= limit for p in sampler.prompts)
    assert traj.num_tokens <= limit
    d = decode(encode(traj), num_experts=4, num_layers=2, top_k=2)  # a well-formed trajectory on the wire
    assert d.finish_reason == "context_full" and finish_counts([d]) == {"context_full": 1}
    assert drop_reason(d, AbnormalConfig()) is None  # the default: trained (the verifier's reward is real)
    assert drop_reason(d, dataclasses.replace(AbnormalConfig(), context_full="drop")) == "context_full"


def test_a_prompt_that_does_not_fit_the_context_is_a_clear_error_not_an_empty_trajectory(tmp_path):
    with pytest.raises(EpisodeError, match="before its first turn.*env.max_context_tokens"):
        _episode(tmp_path, EnvConfig(max_turns=3, max_context_tokens=40), GenerationConfig(max_new_tokens=16))
