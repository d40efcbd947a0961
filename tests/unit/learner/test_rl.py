"""Learner mathematics against hand-computed references."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from t1async.learner.rl import gae, group_baselines, policy_loss, value_loss
from t1async.models.logprobs import token_logprobs


def test_gae_matches_direct_definition():
    rng = np.random.default_rng(0)
    r, v = rng.normal(size=7).astype(np.float32), rng.normal(size=7).astype(np.float32)
    gamma, lam = 0.9, 0.8
    adv, ret = gae(r, v, gamma, lam)
    nv = np.append(v[1:], 0.0)
    deltas = r + gamma * nv - v
    ref = np.array([sum((gamma * lam) ** k * deltas[t + k] for k in range(7 - t)) for t in range(7)])
    np.testing.assert_allclose(adv, ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ret, ref + v, rtol=1e-5, atol=1e-6)


def test_gae_lambda_one_gamma_one_is_return_minus_value():
    r = np.array([0, 0, 3.0], dtype=np.float32)
    v = np.array([1.0, 2.0, 0.5], dtype=np.float32)
    adv, _ = gae(r, v, 1.0, 1.0)
    np.testing.assert_allclose(adv, 3.0 - v)


def test_token_logprobs_gathers_log_softmax():
    logits = torch.randn(2, 5, 11)
    tgt = torch.randint(0, 11, (2, 5))
    lp = token_logprobs(logits, tgt)
    ref = torch.log_softmax(logits, -1)[torch.arange(2)[:, None], torch.arange(5)[None], tgt]
    torch.testing.assert_close(lp, ref)


def test_policy_loss_on_policy_equals_negative_mean_advantage_and_gradient():
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    adv = torch.tensor([[1.0, -1.0, 2.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    out = policy_loss(logp, logp.detach(), logp.detach(), adv, mask, clip_eps=0.2, is_cap=2.0)
    assert abs(float(out.loss.detach()) - (-(1.0 - 1.0) / 2)) < 1e-6
    out.loss.backward()
    # d/dlogp of -w*r*A/n at r=1, w=1 is -A/n on loss tokens, 0 elsewhere
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.5, 0.5, 0.0]]))
    assert out.is_weight_mean == 1.0 and out.clip_frac == 0.0


def test_behaviour_weight_is_truncated_and_ratio_uses_proximal():
    logp = torch.tensor([[0.0, 0.0]])
    prox = torch.tensor([[0.0, 0.0]])
    mu = torch.tensor([[-3.0, 0.0]])  # token 0: pi_prox / mu = e^3 > cap
    adv = torch.tensor([[1.0, 1.0]])
    mask = torch.ones(1, 2)
    out = policy_loss(logp, prox, mu, adv, mask, clip_eps=0.2, is_cap=2.0)
    # w = [2 (capped), 1]; r = 1 -> loss = -(2 + 1) / 2
    assert abs(float(out.loss) + 1.5) < 1e-6
    assert out.is_truncated_frac == 0.5 and out.is_weight_max > 20


def test_ppo_clip_stops_gradient_beyond_trust_region():
    logp = torch.tensor([[0.5]], requires_grad=True)  # r = e^0.5 > 1.2 with positive advantage
    out = policy_loss(logp, torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), clip_eps=0.2, is_cap=2.0)
    out.loss.backward()
    assert float(logp.grad) == 0.0 and out.clip_frac == 1.0


def test_value_loss_clipped_takes_the_larger_error():
    v = torch.tensor([[2.0]], requires_grad=True)
    loss = value_loss(v, torch.tensor([[0.0]]), torch.tensor([[1.0]]), torch.ones(1, 1), clip=0.5)
    # unclipped (2-1)^2 = 1, clipped (0.5-1)^2 = 0.25 -> 0.5 * 1
    assert abs(float(loss.detach()) - 0.5) < 1e-6


def test_token_logprobs_keeps_the_target_outside_the_nucleus_and_counts_it():
    # at temperature 1: probabilities ~ [0.64, 0.24, 0.09, 0.03]; top_p 0.7 keeps ids 0 and 1
    logits = torch.tensor([[[3.0, 2.0, 1.0, 0.0], [3.0, 2.0, 1.0, 0.0]]], requires_grad=True)
    tgt = torch.tensor([[1, 3]])
    lp, outside = token_logprobs(logits, tgt, 1.0, -1, 0.7, return_outside=True)
    assert outside.tolist() == [[False, True]]
    x = logits.detach()[0, 0]
    torch.testing.assert_close(lp[0, 0], x[1] - torch.logsumexp(x[:2], 0))  # renormalised over {0, 1}
    torch.testing.assert_close(lp[0, 1], x[3] - torch.logsumexp(x[[0, 1, 3]], 0))  # {0, 1} plus the target
    lp.sum().backward()
    g = logits.grad[0]
    assert g[0, 2] == 0 and g[0, 3] == 0 and g[1, 2] == 0  # no gradient into dropped logits
    assert (g[0, :2] != 0).all() and (g[1, [0, 1, 3]] != 0).all()


def test_token_logprobs_temperature_and_top_k():
    logits = torch.randn(1, 6, 50, generator=torch.Generator().manual_seed(0))
    tgt = logits.argsort(-1, descending=True)[..., 2]  # third most likely: inside top-5
    lp = token_logprobs(logits, tgt, 0.5, 5, 1.0)
    top = logits.topk(5, -1).values / 0.5
    ref = (logits / 0.5).gather(-1, tgt[..., None])[..., 0] - torch.logsumexp(top, -1)
    torch.testing.assert_close(lp, ref)
    for bad in ({"temperature": 0.0}, {"top_k": 0}, {"top_p": 1.5}):
        args = {"temperature": 1.0, "top_k": -1, "top_p": 1.0, **bad}
        with pytest.raises(ValueError, match=next(iter(bad))):
            token_logprobs(logits, tgt, **args)


def test_group_baselines_leave_one_out_within_the_batch_and_the_window():
    # task a: 3 episodes in this batch; b: 1 here and 1 trained 2 steps ago; c: alone; d: only an
    # episode too old to count
    tasks = ["a", "a", "a", "b", "c", "d"]
    rewards = [4.0, 2.0, 0.0, 3.0, 1.0, 2.0]
    history = {"b": [(8, 1.0)], "d": [(6, 4.0)], "a": [(9, 1.0)]}
    got = group_baselines(tasks, rewards, history, step=10, window_steps=2)
    assert got[:3] == [(2 + 0 + 1) / 3, (4 + 0 + 1) / 3, (4 + 2 + 1) / 3]  # never itself
    assert got[3] == 1.0 and got[4] is None and got[5] is None
    assert group_baselines(["a"], [1.0], {"a": [(9, 3.0)]}, step=10, window_steps=0) == [None]
    with pytest.raises(ValueError, match="window_steps"):
        group_baselines(["a"], [1.0], {}, step=1, window_steps=-1)
    with pytest.raises(ValueError, match="2 task names for 1 rewards"):
        group_baselines(["a", "b"], [1.0], {}, step=1, window_steps=0)


def test_grpo_divides_by_the_groups_sample_std_and_leaves_lone_episodes_to_the_critic():
    """``learner.advantage: grpo`` (t1async/learner/advantages.py): (R - mean(G)) / (std(G) + 1e-4)
    over the episode and its peers (this batch and the window), std with n - 1."""
    from t1async.learner.advantages import GRPO_EPS, group_normalized

    tasks, rewards = ["a", "a", "a", "b"], [3.0, 1.0, 2.0, 5.0]
    est = group_normalized(tasks, rewards, {"b": [(4, 1.0), (1, 9.0)]}, step=5, window_steps=2)
    assert est[3] == (3.0, math.sqrt(8.0) + GRPO_EPS)  # "b" and its peer one step back; step 1 is out of the window
    for i in range(3):
        base, scale = est[i]
        assert base == 2.0 and scale == 1.0 + GRPO_EPS
    advantages = [(r - b) / s for r, (b, s) in zip(rewards, est)]
    assert advantages[:3] == pytest.approx([1 / (1 + GRPO_EPS), -1 / (1 + GRPO_EPS), 0.0])
    assert group_normalized(["a", "b"], [1.0, 2.0], {}, 0, 0) == [None, None]  # no peer: the critic's GAE
    assert group_normalized(["a", "a"], [2.0, 2.0], {}, 0, 0) == [(2.0, GRPO_EPS)] * 2  # alike: advantage 0
    with pytest.raises(ValueError):
        group_normalized(["a"], [1.0, 2.0], {}, 0, 0)
    with pytest.raises(ValueError):
        group_normalized(["a"], [1.0], {}, 0, -1)


def test_leave_one_out_is_group_baselines_with_scale_one():
    from t1async.learner.advantages import leave_one_out

    tasks, rewards, history = ["a", "a", "b"], [2.0, 0.0, 1.0], {"a": [(1, 4.0)]}
    assert leave_one_out(tasks, rewards, history, 2, 1) == [
        None if b is None else (b, 1.0) for b in group_baselines(tasks, rewards, history, 2, 1)]


def test_every_registered_estimator_and_loss_is_a_config_value_and_back():
    from t1async.config import ADVANTAGE_NAMES, POLICY_LOSS_NAMES, ConfigError, load_config
    from t1async.learner.advantages import ADVANTAGES
    from t1async.learner.losses import POLICY_LOSSES

    assert set(ADVANTAGES) == set(ADVANTAGE_NAMES) and set(POLICY_LOSSES) == set(POLICY_LOSS_NAMES)
    for name in ADVANTAGES:
        assert load_config(None, [f"learner.advantage={name}"]).learner.advantage == name
    for name in POLICY_LOSSES:
        assert load_config(None, [f"learner.policy_loss={name}"]).learner.policy_loss == name
    with pytest.raises(ConfigError, match="learner.advantage"):
        load_config(None, ["learner.advantage=nope"])
    with pytest.raises(ConfigError, match="learner.policy_loss"):
        load_config(None, ["learner.policy_loss=nope"])


def test_whiten_recentres_gae_only_and_keeps_a_zero_advantage_zero():
    """learner.normalize_advantages (t1async/learner/advantages.py ``whiten``): re-centred,
    (A - mean) / std over the masked tokens; not re-centred, A / std (0 stays 0, signs kept); the
    registry re-centres GAE only; masks of the wrong shape are refused."""
    from t1async.learner.advantages import ADVANTAGES, whiten

    a = [torch.tensor([[2.0, 2.0, 9.0], [0.0, 0.0, 0.0]]), torch.tensor([[-1.0, 5.0]])]
    m = [torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]]), torch.tensor([[1.0, 0.0]])]
    flat = torch.tensor([2.0, 2.0, 0.0, 0.0, -1.0])
    mean, std = flat.mean(), flat.std(unbiased=False)
    centred = whiten(a, m, recentre=True)
    torch.testing.assert_close(centred[0], (a[0] - mean) / std * m[0])
    torch.testing.assert_close(centred[1], (a[1] - mean) / std * m[1])
    scaled = whiten(a, m, recentre=False)
    torch.testing.assert_close(scaled[0], a[0] / std * m[0])
    assert bool((scaled[0][1] == 0).all()) and float(scaled[1][0, 0]) < 0
    assert [name for name, adv in ADVANTAGES.items() if adv.recentre] == ["gae"]
    assert whiten([torch.zeros(1, 2)], [torch.ones(1, 2)], recentre=False)[0].abs().max() == 0  # all alike: 0, no nan
    with pytest.raises(ValueError, match="one mask per advantage"):
        whiten(a, m[:1], recentre=True)


def test_kl_penalty_gradient_is_the_documented_kl_s_on_and_off_policy_and_k3_s_is_the_other_direction():
    """learner.kl_coef (t1async/learner/rl.py ``kl_penalty``) on a categorical of 7 tokens, the
    expectation over the sampler's tokens taken exactly (a sum over the vocabulary, weighted by
    mu): its gradient is that of KL(pi_theta || pi_ref) on-policy, with a behaviour policy other
    than pi_theta, and with a proximal policy other than both (a later PPO epoch); its value is
    that KL. Differentiating k3 instead (main's penalty) gives the gradient of KL(pi_ref || pi_theta)."""
    from t1async.learner.rl import k3, kl_penalty

    g = torch.Generator().manual_seed(0)
    V = 7
    theta = torch.randn(V, dtype=torch.float64, generator=g, requires_grad=True)
    ref, mu_off, prox_off = (torch.randn(V, dtype=torch.float64, generator=g).log_softmax(-1) for _ in range(3))
    lp = theta.log_softmax(-1)
    kl = (lp.exp() * (lp - ref)).sum()
    want = torch.autograd.grad(kl, theta, retain_graph=True)[0]
    reverse = torch.autograd.grad((ref.exp() * (ref - lp)).sum(), theta, retain_graph=True)[0]
    one = torch.ones(1, 1, dtype=torch.float64)

    def expected(mu: torch.Tensor, prox: torch.Tensor) -> tuple[torch.Tensor, float]:
        loss, value = 0.0, 0.0
        for x in range(V):  # the token x, drawn with probability mu(x)
            out = kl_penalty(lp[x].view(1, 1), ref[x].view(1, 1), prox[x].view(1, 1), mu[x].view(1, 1), one,
                             is_cap=float("inf"))
            loss = loss + mu[x].exp() * out.loss
            value += float(mu[x].exp() * out.value)
        return torch.autograd.grad(loss, theta, retain_graph=True)[0], value

    on = lp.detach()
    for mu, prox in ((on, on), (mu_off, on), (mu_off, prox_off)):
        grad, value = expected(mu, prox)
        torch.testing.assert_close(grad, want, rtol=1e-10, atol=1e-12)
        assert value == pytest.approx(float(kl.detach()), rel=1e-10)
    k3_loss = sum(on[x].exp() * k3(ref[x], lp[x]) for x in range(V))  # on-policy, k3 as the loss
    k3_grad = torch.autograd.grad(k3_loss, theta)[0]
    torch.testing.assert_close(k3_grad, reverse, rtol=1e-10, atol=1e-12)
    assert float((k3_grad - want).abs().max()) > 0.05
    # a behaviour weight above the cap is truncated as the policy loss truncates it
    capped = kl_penalty(torch.zeros(1, 1), torch.full((1, 1), -1.0), torch.zeros(1, 1), torch.full((1, 1), -3.0),
                        torch.ones(1, 1), is_cap=2.0)
    assert float(capped.loss) == pytest.approx(2.0 * 0.5)
