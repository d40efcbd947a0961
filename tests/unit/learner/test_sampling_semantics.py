"""The learner scores each sampled token as the run's sampler backend reports it.

SGLang 0.5.10.post1 (``python/sglang/srt/layers/sampler.py``; the pinned source's facts are checked
in tests/contracts/test_sglang_conformance.py) reports ``log softmax(logits / T)`` of the drawn token, never
renormalised over the set it drew from, and draws from a joint top-k / top-p set cut where the
mass before a token exceeds top_p. The reference below restates that in float64 numpy, one row at
a time, independently of t1async/models/logprobs.py.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from t1async.actors.learner import Learner
from t1async.config import (
    ConfigError,
    GenerationConfig,
    LearnerConfig,
    ModelConfig,
    TransportConfig,
    WeightSyncConfig,
    load_config,
)
from t1async.models.logprobs import (
    EMBEDDED,
    SGLANG,
    joint_kept_tokens,
    kept_tokens,
    sampling_semantics,
    token_logprobs,
)
from t1async.sampling.sglang_server import check_logprob_env
from t1async.service import launch
from t1async.trajectory import Trajectory

MODEL = ModelConfig(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                    head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


def sglang_reference(logits_row: np.ndarray, temperature: float, top_k: int, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """SGLang's sampler for one position, restated: (reported log-probs [V] float64, kept [V] bool).

    p = softmax(logits / T) over the whole vocabulary; the reported log-prob of any token is log p.
    Walking the tokens from most to least likely, a token may be drawn when fewer than top_k came
    before it and the mass before it is not above top_p.
    """
    z = logits_row.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    kept = np.zeros(p.shape, bool)
    before = 0.0
    for rank, tok in enumerate(np.argsort(-p, kind="stable")):
        kept[tok] = (top_k == -1 or rank < top_k) and not before > top_p
        before += p[tok]
    return np.log(p), kept


def sglang_sample(policy, prompt: list[int], n: int, temperature: float, top_k: int, top_p: float,
                  seed: int) -> tuple[list[int], list[float]]:
    """A fake SGLang server on the learner's own weights: ``n`` tokens drawn from the joint kept
    set (renormalised, as any sampler draws), each reported with SGLang's log-prob."""
    rng = np.random.default_rng(seed)
    ids, lps = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            row = policy(torch.tensor([ids])).logits[0, -1].double().numpy()
            logp, kept = sglang_reference(row, temperature, top_k, top_p)
            q = np.where(kept, np.exp(logp), 0.0)
            tok = int(rng.choice(len(q), p=q / q.sum()))
            ids.append(tok)
            lps.append(float(logp[tok]))
    return ids[len(prompt):], lps


def test_sglang_semantics_match_the_reference_formula():
    """Log-probs and kept sets of SGLANG equal the restated SGLang formula on random logits (the
    embedded semantics do not: they renormalise)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 64, generator=g) * 3
    tgt = torch.randint(0, 64, (3, 5), generator=g)
    for temperature, top_k, top_p in [(1.0, -1, 0.8), (0.7, -1, 0.95), (1.0, 20, 1.0), (1.3, 8, 0.6)]:
        lp, outside = token_logprobs(logits, tgt, temperature, top_k, top_p, semantics=SGLANG, return_outside=True)
        kept = joint_kept_tokens(logits / temperature, top_k, top_p)
        for b in range(3):
            for t in range(5):
                ref_lp, ref_kept = sglang_reference(logits[b, t].numpy(), temperature, top_k, top_p)
                assert lp[b, t].item() == pytest.approx(ref_lp[tgt[b, t]], abs=1e-5)
                assert kept[b, t].numpy().tolist() == ref_kept.tolist()
                assert bool(outside[b, t]) == (not ref_kept[tgt[b, t]])
        renorm = token_logprobs(logits, tgt, temperature, top_k, top_p, semantics=EMBEDDED)
        assert float((renorm - lp).min()) > 0  # renormalising adds -log Z_kept > 0 to every token


def test_top_p_cut_at_exactly_top_p_and_joint_top_k():
    """Tie at the cut: p = (8, 4, 2, 1, 1) / 16 at top_p 0.75 puts exactly 0.75 before the third
    token. SGLang cuts where the mass before EXCEEDS top_p and keeps it; the embedded engine cuts
    where it reaches top_p and drops it. And SGLang's top-k and top-p read one ranking of the full
    distribution (joint), where the embedded engine renormalises over top-k before top-p."""
    x = torch.log(torch.tensor([8.0, 4.0, 2.0, 1.0, 1.0]))
    assert torch.softmax(x, -1).tolist() == [0.5, 0.25, 0.125, 0.0625, 0.0625]  # exact in float32
    assert joint_kept_tokens(x, -1, 0.75).tolist() == [True, True, True, False, False]
    assert kept_tokens(x, -1, 0.75).tolist() == [True, True, False, False, False]
    tgt = torch.tensor([[2]])
    assert not token_logprobs(x[None, None], tgt, 1.0, -1, 0.75, semantics=SGLANG, return_outside=True)[1].item()
    assert token_logprobs(x[None, None], tgt, 1.0, -1, 0.75, semantics=EMBEDDED, return_outside=True)[1].item()
    # joint vs sequential: p = (.4, .3, .2, .1), top_k 2, top_p 0.5
    y = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    assert joint_kept_tokens(y, 2, 0.5).tolist() == [True, True, False, False]  # 0.4 before the 2nd <= 0.5
    assert kept_tokens(y, 2, 0.5).tolist() == [True, False, False, False]  # 4/7 before it after top-k


def test_sampling_semantics_come_from_sampler_backend():
    assert sampling_semantics("sglang") is SGLANG and sampling_semantics("embedded") is EMBEDDED
    with pytest.raises(ValueError, match="sampler.backend='vllm'.*embedded.*sglang"):
        sampling_semantics("vllm")
    logits = torch.randn(1, 4, 32)
    tgt = torch.randint(0, 32, (1, 4))
    # without truncation the two backends report one distribution
    assert torch.equal(token_logprobs(logits, tgt, 0.8, semantics=SGLANG), token_logprobs(logits, tgt, 0.8))


@pytest.mark.parametrize("top_k,top_p", [(-1, 0.8), (-1, 0.95), (20, 1.0)])
def test_learner_importance_weight_is_one_on_sglang_tokens_with_identical_weights(tmp_path, top_k, top_p):
    """Tokens drawn by an SGLang sampler (the reference above) on the learner's own weights: with
    ``sampler.backend: sglang`` the learner's proximal log-probs equal the reported behaviour
    log-probs, so every importance weight is 1 and the mismatch metrics are 0. Scored the embedded
    way (renormalised; what main did for every backend) the same tokens get weights of 1/Z_kept > 1."""
    gen = GenerationConfig(temperature=1.0, top_p=top_p, top_k=top_k)
    cfg = LearnerConfig(max_steps=1, batch_size=1, lr=1e-6, batch_timeout_s=30)
    learner = Learner(cfg, MODEL, TransportConfig(curve=False), WeightSyncConfig(), str(tmp_path), generation=gen, seed=0,
                      sampler_backend="sglang")
    try:
        prompt = [int(i) for i in np.random.default_rng(0).integers(4, 256, 8)]
        out, mu = sglang_sample(learner.policy, prompt, 16, gen.temperature, top_k, top_p, seed=1)
        P, N = len(prompt), len(out)
        T = P + N
        ids = torch.tensor([prompt + out])
        with torch.no_grad():
            routing = learner.policy(ids[:, :-1], return_routing=True).routed_experts[0]
        mask = np.r_[np.zeros(P, np.uint8), np.ones(N, np.uint8)]
        traj = Trajectory(
            task="sglang", actor_id=0, token_ids=ids[0].numpy().astype(np.uint32), loss_mask=mask,
            logprobs=np.r_[np.zeros(P), mu].astype(np.float32), versions=np.where(mask == 1, 0, -1).astype(np.int32),
            turn_offsets=np.array([[P, T]], np.int32), routed_experts=routing.numpy().astype(np.uint8),
            num_experts=MODEL.num_experts, reward=1.0, passed=1, total=1, resolved=True, finish_reason="length",
            tests=[("a", True)])
        with torch.no_grad():
            logits = learner.policy(ids[:, :-1], routed_experts=routing[None]).logits
        renorm = token_logprobs(logits, ids[:, 1:], gen.temperature, top_k, top_p)[0, P - 1:].double().numpy()
        assert math.exp(float(np.mean(renorm - np.asarray(mu)))) > 1.01  # the embedded way: not of SGLang's mu
        m = learner.loop._train_step([traj])
        assert abs(m["is_weight_mean"] - 1) < 1e-4 and abs(m["is_weight_max"] - 1) < 1e-4
        assert m["logprob_diff_mean"] < 1e-5 and m["kl_k3"] < 1e-8
    finally:
        learner.close()


def test_launch_refuses_untempered_sglang_logprobs_at_a_temperature_other_than_1():
    with pytest.raises(ConfigError, match="SGLANG_RETURN_ORIGINAL_LOGPROB=true.*temperature=0.7.*unset it"):
        check_logprob_env(0.7, {"SGLANG_RETURN_ORIGINAL_LOGPROB": "true"})
    check_logprob_env(1.0, {"SGLANG_RETURN_ORIGINAL_LOGPROB": "1"})  # untempered is tempered at T = 1
    check_logprob_env(0.7, {"SGLANG_RETURN_ORIGINAL_LOGPROB": "0"})
    check_logprob_env(0.7, {})


def test_launch_hands_sampler_backend_to_the_learner(monkeypatch, tmp_path):
    """``start_learner`` tells the learner which backend samples (the Ray edge faked: an actor
    factory that records the learner's arguments), so it scores under that backend's semantics."""
    seen = {}

    def actor(cls, name):
        def remote(*args, **kwargs):
            seen.update(kwargs, cls=cls)
            return SimpleNamespace(endpoint=SimpleNamespace(remote=lambda: "tcp://127.0.0.1:1"),
                                   connect_samplers=SimpleNamespace(remote=lambda urls: None))
        return SimpleNamespace(remote=remote)

    monkeypatch.setattr(launch.ray, "get", lambda ref: ref)
    cfg = load_config(None, ["sampler.backend=sglang", "sampler.urls=[http://127.0.0.1:30000]"])
    launch.start_learner(cfg, actor, tmp_path, ["http://127.0.0.1:30000"])
    assert seen["cls"] is Learner and seen["sampler_backend"] == "sglang"
