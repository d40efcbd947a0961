"""Rollout routing replay (R3) at its edges: bf16 sampler vs fp32 learner, prefix cache and chunked
prefill (no stale or shifted rows), padding, the learner's per-step metrics, a missing routing field."""

from __future__ import annotations

import base64
import dataclasses

import numpy as np
import pytest
import torch

from t1async.actors.learner import Learner
from t1async.actors.sampler import EmbeddedSampler
from t1async.config import LearnerConfig, ModelConfig, SamplerConfig, TransportConfig, WeightSyncConfig
from t1async.learner.rl import k3, routing_differs
from t1async.models.logprobs import token_logprobs
from t1async.models.model import Qwen3MoeForCausalLM
from t1async.sampling.engine import Engine, SamplingParams
from t1async.sampling.sampler_client import HttpSampler, SamplerError

# many experts, top-4, enough layers: default (small) init makes routers near-uniform, so near-ties abound
CFG = ModelConfig(vocab_size=512, hidden_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32,
                  max_position_embeddings=512)
PROMPT = [int(i) for i in torch.randint(4, 512, (40,), generator=torch.Generator().manual_seed(0))]


def _policy(seed=0, decisive=False) -> Qwen3MoeForCausalLM:
    torch.manual_seed(seed)
    m = Qwen3MoeForCausalLM(CFG).eval()
    if decisive:  # a router with wide gaps between experts: fp32 noise cannot flip it
        with torch.no_grad():
            for layer in m.model.layers:
                layer.mlp.gate.weight.normal_(0.0, 1.0)
    return m


def test_bf16_sampler_fp32_learner_replay_matches_every_layer_and_token():
    learner = _policy()
    sampler_model = _policy().to(torch.bfloat16)
    out = Engine(sampler_model, seed=1).generate(PROMPT, SamplingParams(max_new_tokens=40))
    ids = torch.tensor([PROMPT + out.output_ids])
    recorded = torch.from_numpy(out.routed_experts).unsqueeze(0)  # int32 [1, T-1, L, K]
    assert recorded.shape == (1, ids.shape[1] - 1, CFG.num_hidden_layers, CFG.num_experts_per_tok)
    with torch.no_grad():
        free = learner(ids[:, :-1], return_routing=True)
        rep = learner(ids[:, :-1], routed_experts=recorded, return_routing=True)
    # with replay: the learner's experts are the sampler's at every layer and token, bit for bit
    assert torch.equal(rep.routed_experts, recorded.long())
    assert not routing_differs(rep.routed_experts, recorded).any()
    # without replay: near-tie flips between bf16 and fp32 (reported beside it)
    frac_free = float(routing_differs(free.routed_experts, recorded).float().mean())
    frac_own = float(routing_differs(rep.router_experts, recorded).float().mean())
    print(f"routing_diff_frac: replay 0.0, no replay {frac_free:.3f} (router's own under replay {frac_own:.3f})")
    assert frac_free > 0 and frac_own > 0
    assert torch.equal(free.router_experts, free.routed_experts)  # without replay, own == used
    # expert 0 is an ordinary expert in the recorded rows (never a padding sentinel)
    assert (recorded == 0).any()
    lp_rep = token_logprobs(rep.logits, ids[:, 1:])[0, len(PROMPT) - 1:]
    assert torch.isfinite(lp_rep).all() and float(k3(lp_rep, torch.tensor(out.output_logprobs)).min()) >= 0


def test_chunked_prefill_gives_the_same_rows_and_logprobs():
    m = _policy(decisive=True)
    g = SamplingParams(max_new_tokens=10, temperature=0.0)
    one = Engine(m, prefix_cache=0).generate(PROMPT, g)
    for chunk in (1, 7, 16):
        ch = Engine(m, prefix_cache=0, prefill_chunk=chunk).generate(PROMPT, g, routed_experts_start_len=3)
        assert ch.output_ids == one.output_ids
        np.testing.assert_array_equal(ch.routed_experts, one.routed_experts[3:])  # none shifted or repeated
        np.testing.assert_allclose(ch.output_logprobs, one.output_logprobs, rtol=0, atol=1e-4)


def test_prefix_cache_reuses_rows_exactly_and_is_flushed_by_new_weights():
    m = _policy(decisive=True)
    s = SamplingParams(max_new_tokens=8, temperature=1.0)
    e, ref = Engine(m, seed=4), Engine(m, seed=4, prefix_cache=0)
    t1 = e.generate(PROMPT, s)
    assert e.cache_hits == 0
    other = e.generate([7, 8, 9, 10], s)  # another episode in between: the LRU keeps both
    prompt2 = PROMPT + t1.output_ids + [2, 11, 12, 13]
    fed = len(PROMPT) + len(t1.output_ids) - 1
    t2 = e.generate(prompt2, s)  # from row 0: the cached prefix's rows must be the recorded ones
    assert e.cache_hits == 1 and e.cached_tokens == fed
    np.testing.assert_array_equal(t2.routed_experts[:fed], t1.routed_experts)
    # the same request without any cache computes the same rows and log-probs (fp32, decisive router)
    ref.generate(PROMPT, s)
    ref.generate([7, 8, 9, 10], s)
    r2 = ref.generate(prompt2, s)
    assert r2.output_ids == t2.output_ids
    np.testing.assert_array_equal(r2.routed_experts, t2.routed_experts)
    np.testing.assert_allclose(r2.output_logprobs, t2.output_logprobs, rtol=0, atol=1e-4)
    assert e.generate([7, 8, 9, 10] + other.output_ids + [3], s).prompt_tokens and e.cache_hits == 2
    # new weights: the cache is flushed (nothing stale), answers follow the new weights
    with torch.no_grad():
        m.lm_head.weight.mul_(1.5)
    hits = e.cache_hits
    t3 = e.generate(prompt2 + t2.output_ids + [5], s)
    assert e.cache_hits == hits
    with torch.no_grad():
        logp = torch.log_softmax(m(torch.tensor([prompt2 + t2.output_ids + [5]])).logits[0, -1], -1)
    assert abs(t3.output_logprobs[0] - float(logp[t3.output_ids[0]])) < 1e-4


def test_bf16_multi_turn_rows_are_those_that_shaped_later_tokens():
    """In bf16 a re-prefilled prefix can route differently from the decode that first fed it; with
    the prefix cache the engine never recomputes it, so the rows it returns for turn 2 from row 0
    are exactly turn 1's rows."""
    e = Engine(_policy().to(torch.bfloat16), seed=2)
    s = SamplingParams(max_new_tokens=30)
    ids, rows = list(PROMPT), None
    for turn in range(3):
        out = e.generate(ids, s)
        if rows is not None:
            np.testing.assert_array_equal(out.routed_experts[:rows.shape[0]], rows)
        rows = out.routed_experts
        ids = ids + out.output_ids + [2, 100 + turn, 101]
    assert e.cache_hits == 2


def test_right_padding_with_replay_keeps_rows_aligned():
    m = _policy()
    a, b = torch.tensor([PROMPT[:30]]), torch.tensor([PROMPT[5:22]])
    with torch.no_grad():
        ra, rb = (m(x, return_routing=True).routed_experts for x in (a, b))
        rb_shifted = (rb + 3) % CFG.num_experts  # replay something the router would not pick
        pad = torch.zeros(1, 13, CFG.num_hidden_layers, CFG.num_experts_per_tok, dtype=torch.long)  # expert 0 rows
        batch = torch.cat([a, torch.cat([b, torch.zeros(1, 13, dtype=torch.long)], 1)], 0)
        routing = torch.cat([ra, torch.cat([rb_shifted, pad], 1)], 0)
        out = m(batch, routed_experts=routing, return_routing=True)
        single = m(b, routed_experts=rb_shifted)
    assert torch.equal(out.routed_experts[1, :17], rb_shifted[0]) and torch.equal(out.routed_experts[0], ra[0])
    torch.testing.assert_close(out.logits[1, :17], single.logits[0], rtol=0, atol=1e-5)


def test_router_gets_gradient_through_replayed_gates_only():
    m = _policy().train()
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        rec = m(ids, return_routing=True).routed_experts
    out = m(ids, routed_experts=rec)
    out.logits[0, -1].logsumexp(-1).backward()
    g = m.model.layers[0].mlp.gate.weight.grad
    assert g is not None and g.abs().sum() > 0
    # the gate rows of experts no token chose in layer 0 get no gradient (only gathered gates do)
    unused = sorted(set(range(CFG.num_experts)) - set(rec[0, :, 0].flatten().tolist()))
    for e in unused:
        assert g[e].abs().sum() == 0


def _traj(policy, T=60, seed=0, replay_noise=False):
    from t1async.trajectory import Trajectory

    rng = np.random.default_rng(seed)
    ids = rng.integers(4, 512, T)
    with torch.no_grad():
        out = policy(torch.from_numpy(ids[:-1]).unsqueeze(0), return_routing=True)
    rows = out.routed_experts[0].numpy()
    if replay_noise:  # recorded rows that differ from this router's choice at a known set of positions
        rows = rows.copy()
        rows[::4] = (rows[::4] + 1) % CFG.num_experts
    lp = token_logprobs(out.logits, torch.from_numpy(ids[1:]).unsqueeze(0))[0].numpy()
    mask = np.zeros(T, np.uint8)
    mask[20:40] = mask[45:] = 1
    logprobs = np.zeros(T, np.float32)
    logprobs[1:] = np.where(mask[1:] == 1, lp, 0.0)
    return Trajectory(task="x", actor_id=0, token_ids=ids.astype(np.uint32), loss_mask=mask, logprobs=logprobs,
                      versions=np.where(mask == 1, 0, -1).astype(np.int32), turn_offsets=np.array([[20, 40], [45, T]], np.int32),
                      routed_experts=rows.astype(np.uint8), num_experts=CFG.num_experts, reward=1.0, passed=1, total=1,
                      resolved=True, finish_reason="max_turns", drift_tokens=0, template_mismatches=2)


@pytest.mark.parametrize("replay", [True, False])
def test_learner_step_logs_routing_kl_drift_metrics(tmp_path, replay):
    cfg = LearnerConfig(max_steps=1, batch_size=2, batch_timeout_s=30, routing_replay=replay)
    learner = Learner(cfg, CFG, TransportConfig(curve=False), WeightSyncConfig(), str(tmp_path), seed=0)
    try:
        batch = [_traj(learner.policy, seed=1), _traj(learner.policy, seed=2, replay_noise=True)]
        m = learner.loop._train_step(batch)
    finally:
        learner.close()
    n_noisy = len(range(0, 59, 4))
    # the router's own top-k vs recorded: exactly the perturbed rows without replay; under replay at
    # least those (replaying other experts also moves the hidden states the later routers see)
    if replay:
        assert m["router_diff_frac"] >= n_noisy / (2 * 59)
    else:
        assert m["router_diff_frac"] == pytest.approx(n_noisy / (2 * 59))
    assert m["routing_diff_frac"] == (0.0 if replay else m["router_diff_frac"])  # the experts used vs recorded
    assert m["kl_k3"] >= 0 and m["drift_tokens"] == 0 and m["template_mismatches"] == 4
    if not replay:  # the behaviour log-probs are this very model's: only the noisy rows' replay would move them
        assert m["logprob_diff_mean"] < 1e-5 and m["kl_k3"] < 1e-9


def test_missing_routing_field_is_an_error_not_a_fallback():
    s = EmbeddedSampler(dataclasses.replace(CFG, num_hidden_layers=2), SamplerConfig(), seed=0)
    try:
        s.load_weights(Qwen3MoeForCausalLM(dataclasses.replace(CFG, num_hidden_layers=2)).state_dict(), 0)
        real = s.http.handle_generate

        def without_routing(body):  # an SGLang server started without --enable-return-routed-experts
            out = real(body)
            out["meta_info"].pop("routed_experts")
            return out

        client = HttpSampler(s.url(), num_layers=2, top_k=4)
        assert client.generate([5, 6], {"max_new_tokens": 2}).routed_experts.shape == (3, 2, 4)
        s.http.handle_generate = without_routing
        with pytest.raises(SamplerError, match="enable-return-routed-experts"):
            client.generate([5, 6], {"max_new_tokens": 2})
        s.http.handle_generate = lambda body: {**real(body), "meta_info": {**real(body)["meta_info"],
                                                                      "routed_experts": base64.b64encode(b"\0" * 8).decode()}}
        with pytest.raises(SamplerError, match="routed_experts"):
            client.generate([5, 6], {"max_new_tokens": 2})
    finally:
        s.shutdown()
