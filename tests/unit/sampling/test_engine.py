"""Embedded engine: log-probs and routing vs teacher forcing, stop/length, sampling filters."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from t1async.config import ModelConfig
from t1async.models.model import Qwen3MoeForCausalLM
from t1async.sampling.engine import Engine, SamplingParams, sample_token

CFG = ModelConfig(vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=48, max_position_embeddings=128)
L, K = CFG.num_hidden_layers, CFG.num_experts_per_tok


def _model(seed: int = 0) -> Qwen3MoeForCausalLM:
    """Random model with a decisive router (no near-ties that float noise could flip)."""
    torch.manual_seed(seed)
    m = Qwen3MoeForCausalLM(CFG).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
            elif not name.endswith("norm.weight"):
                p.normal_(0.0, 0.1)
    return m


PROMPT = [int(i) for i in torch.randint(4, CFG.vocab_size, (17,), generator=torch.Generator().manual_seed(0))]


@pytest.fixture(scope="module")
def model() -> Qwen3MoeForCausalLM:
    return _model()


def _teacher_forced(model, ids):
    with torch.no_grad():
        out = model(torch.tensor([ids]), return_routing=True)
    return torch.log_softmax(out.logits[0], -1), out.routed_experts[0]


def _reference(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Log-probs [V] of the processed distribution, written out in float64 numpy: scale, keep the
    top_k largest (ties kept), then, by descending probability, each token whose predecessors'
    mass is below top_p, renormalise."""
    x = logits.astype(np.float64) / temperature
    allowed = np.ones(x.size, bool)
    if 0 < top_k < x.size:
        allowed = x >= np.sort(x)[::-1][top_k - 1]
    probs = np.where(allowed, np.exp(x - x.max()), 0.0)
    probs /= probs.sum()
    kept = np.zeros(x.size, bool)
    mass = 0.0
    for i in np.argsort(-probs, kind="stable"):
        if not allowed[i] or (mass >= top_p and kept.any()):
            break
        kept[i] = True
        mass += probs[i]
    z = x[kept]
    out = np.full(x.size, -np.inf)
    out[kept] = z - (z.max() + np.log(np.exp(z - z.max()).sum()))
    return out


@pytest.mark.parametrize("params", [
    SamplingParams(max_new_tokens=12, temperature=1.0),
    SamplingParams(max_new_tokens=12, temperature=0.7, top_p=0.9, top_k=20),
    SamplingParams(max_new_tokens=12, temperature=0.5, top_p=0.9, top_k=40),
    SamplingParams(max_new_tokens=12, temperature=0.0),
])
def test_logprobs_and_routing_match_teacher_forcing(model, params):
    out = Engine(model, seed=1).generate(PROMPT, params)
    N, P = len(out.output_ids), len(PROMPT)
    assert N == 12 and out.finish_reason == {"type": "length", "length": 12}
    assert out.prompt_tokens == P
    with torch.no_grad():
        tf = model(torch.tensor([PROMPT + out.output_ids]), return_routing=True)
    routing, logits = tf.routed_experts[0], tf.logits[0, P - 1:P - 1 + N].float()
    if params.temperature == 0:  # greedy: a point mass on the argmax, reported as log-prob 0
        assert out.output_ids == logits.argmax(-1).tolist() and out.output_logprobs == [0.0] * N
    else:  # the log-prob of the distribution each token was drawn from, built here independently
        ref = np.stack([_reference(row, params.temperature, params.top_k, params.top_p) for row in logits.numpy()])
        np.testing.assert_allclose(np.exp(ref).sum(-1), 1.0, rtol=0, atol=1e-9)
        expected = ref[np.arange(N), out.output_ids]
        np.testing.assert_allclose(out.output_logprobs, expected, rtol=0, atol=1e-4)
        # the shared function the engine samples from gives the same whole distribution
        from t1async.models.logprobs import processed_logprobs

        mine = processed_logprobs(logits, params.temperature, params.top_k, params.top_p)
        assert mine.dtype == torch.float32
        np.testing.assert_array_equal(np.isfinite(mine.numpy()), np.isfinite(ref))
        np.testing.assert_allclose(mine.exp().sum(-1).numpy(), 1.0, rtol=0, atol=1e-5)
        np.testing.assert_allclose(np.where(np.isfinite(ref), mine.numpy(), 0), np.where(np.isfinite(ref), ref, 0),
                                   rtol=0, atol=1e-4)
    assert out.routed_experts.dtype == np.int32
    assert out.routed_experts.shape == (P + N - 1, L, K)
    np.testing.assert_array_equal(out.routed_experts, routing[:P + N - 1].numpy())


def test_routed_experts_start_len_slices_rows(model):
    params = SamplingParams(max_new_tokens=6)
    full = Engine(model, seed=3).generate(PROMPT, params)
    part = Engine(model, seed=3).generate(PROMPT, params, routed_experts_start_len=10)
    assert part.output_ids == full.output_ids
    assert part.routed_experts.shape == (len(PROMPT) + 6 - 1 - 10, L, K)
    np.testing.assert_array_equal(part.routed_experts, full.routed_experts[10:])
    whole = Engine(model, seed=3).generate(PROMPT, params, routed_experts_start_len=len(PROMPT))
    assert whole.routed_experts.shape == (5, L, K)


def test_stop_token_is_included_and_reported(model):
    greedy = SamplingParams(max_new_tokens=20, temperature=0.0)
    ref = Engine(model).generate(PROMPT, greedy).output_ids
    j = 3
    while ref[j] in ref[:j]:  # need the first occurrence of the stop id
        j += 1
    stop = [ref[j], next(t for t in range(CFG.vocab_size) if t not in ref)]  # a never-sampled one too
    out = Engine(model).generate(PROMPT, SamplingParams(max_new_tokens=20, temperature=0.0, stop_token_ids=stop))
    assert out.output_ids == ref[:j + 1]
    assert out.finish_reason == {"type": "stop", "matched": ref[j]}
    assert out.routed_experts.shape == (len(PROMPT) + j, L, K)
    assert len(out.output_logprobs) == j + 1


def test_stop_on_first_token(model):
    first = Engine(model).generate(PROMPT, SamplingParams(max_new_tokens=1, temperature=0)).output_ids[0]
    out = Engine(model).generate(PROMPT, SamplingParams(max_new_tokens=5, temperature=0, stop_token_ids=[first]))
    assert out.output_ids == [first] and out.finish_reason == {"type": "stop", "matched": first}
    assert out.routed_experts.shape == (len(PROMPT), L, K)  # the stop token is never fed back


def test_greedy_is_deterministic_and_seeds_reproduce(model):
    g = SamplingParams(max_new_tokens=10, temperature=0.0)
    e = Engine(model, seed=0)
    assert e.generate(PROMPT, g).output_ids == e.generate(PROMPT, g).output_ids == \
        Engine(model, seed=99).generate(PROMPT, g).output_ids
    s = SamplingParams(max_new_tokens=16, temperature=1.5)
    a = Engine(model, seed=7).generate(PROMPT, s).output_ids
    assert a == Engine(model, seed=7).generate(PROMPT, s).output_ids
    assert a != Engine(model, seed=8).generate(PROMPT, s).output_ids
    e = Engine(model, seed=7)
    assert e.generate(PROMPT, s).output_ids == a
    assert e.generate(PROMPT, s).output_ids != a  # the generator advances between requests


def test_top_k_one_and_tiny_top_p_are_greedy(model):
    greedy = Engine(model).generate(PROMPT, SamplingParams(max_new_tokens=8, temperature=0)).output_ids
    assert Engine(model, seed=5).generate(PROMPT, SamplingParams(max_new_tokens=8, top_k=1)).output_ids == greedy
    assert Engine(model, seed=5).generate(PROMPT, SamplingParams(max_new_tokens=8, top_p=1e-6)).output_ids == greedy


def test_sample_token_filters():
    logits = torch.tensor([0.0, 3.0, 2.9, 1.0, -1.0, 2.0])
    g = torch.Generator().manual_seed(0)
    draws = {sample_token(logits, SamplingParams(top_k=2), g) for _ in range(300)}
    assert draws == {1, 2}
    p = torch.softmax(logits, 0)  # sorted: 1, 2, 5, 3, 0, 4
    top_p = float(p[1] + p[2]) + 1e-3  # needs token 5 too
    draws = {sample_token(logits, SamplingParams(top_p=top_p), g) for _ in range(600)}
    assert draws == {1, 2, 5}
    draws = {sample_token(logits, SamplingParams(top_p=float(p[1] + p[2]) - 1e-3), g) for _ in range(300)}
    assert draws == {1, 2}
    assert sample_token(logits, SamplingParams(temperature=0), g) == 1


def test_sampled_frequencies_match_the_reported_logprobs():
    from t1async.sampling.engine import sample_with_logprob

    logits = torch.randn(40, generator=torch.Generator().manual_seed(3)) * 2.0
    params = SamplingParams(temperature=0.5, top_p=0.9, top_k=12)
    g = torch.Generator().manual_seed(0)
    n = 8000
    counts: dict[int, int] = {}
    reported: dict[int, float] = {}
    for _ in range(n):
        tok, lp = sample_with_logprob(logits, params, g)
        counts[tok] = counts.get(tok, 0) + 1
        assert reported.setdefault(tok, lp) == lp  # one fixed row: one log-prob per id
    assert len(counts) >= 2  # the test needs a real distribution, not a point mass
    for tok, c in counts.items():
        p = float(np.exp(reported[tok]))
        assert abs(c / n - p) < 4 * np.sqrt(p * (1 - p) / n) + 1e-3, (tok, c / n, p)
    # every token drawn carries probability mass, and nothing outside what was drawn is missing
    assert sum(np.exp(v) for v in reported.values()) == pytest.approx(1.0, abs=5e-3)


def test_weights_swapped_between_calls_are_used(model):
    m = _model(seed=0)
    e = Engine(m)
    g = SamplingParams(max_new_tokens=8, temperature=1.0)  # (greedy log-probs are all 0.0)
    before = e.generate(PROMPT, g)
    m.load_state_dict(_model(seed=11).state_dict())
    after = e.generate(PROMPT, g)
    assert before.output_logprobs != after.output_logprobs
    logp, _ = _teacher_forced(_model(seed=11), PROMPT + after.output_ids)
    assert abs(after.output_logprobs[0] - float(logp[len(PROMPT) - 1, after.output_ids[0]])) < 1e-4


def test_errors(model):
    e = Engine(model)
    with pytest.raises(ValueError, match="too long"):
        e.generate([5] * 121, SamplingParams(max_new_tokens=8))
    e.generate([5] * 120, SamplingParams(max_new_tokens=8))  # exactly at the limit is fine
    with pytest.raises(ValueError, match="empty"):
        e.generate([], SamplingParams())
    with pytest.raises(ValueError, match="vocab_size"):
        e.generate([1, CFG.vocab_size], SamplingParams())
    with pytest.raises(ValueError, match="routed_experts_start_len"):
        e.generate(PROMPT, SamplingParams(), routed_experts_start_len=len(PROMPT) + 1)
    for bad in (SamplingParams(max_new_tokens=0), SamplingParams(temperature=-1),
                SamplingParams(top_p=0.0), SamplingParams(top_k=-2)):
        with pytest.raises(ValueError):
            e.generate(PROMPT, bad)
