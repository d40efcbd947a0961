"""The learner's mathematics: token log-probs, GAE over sampled tokens, decoupled PPO, clipped value loss.

Notation per loss token i: behaviour log-prob log mu_i (the sampler's), proximal log-prob
log pi_prox_i (the learner's weights before this update, no gradient), current log pi_theta_i.

    r_i = exp(log pi_theta_i - log pi_prox_i)
    w_i = min(exp(log pi_prox_i - log mu_i), C)
    L_policy = - sum_i w_i * min(r_i A_i, clip(r_i, 1 - eps, 1 + eps) A_i) / n

Sources: decoupled PPO (Hilton et al. 2021, "Batch size-invariance for policy optimization");
AReaL (Fu et al. 2025); truncated importance sampling as in IMPALA / V-trace (Espeholt et al.
2018); GAE (Schulman et al. 2016); PPO value clipping (Schulman et al. 2017, OpenAI baselines).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Log-prob of each target id.

    Args:
        logits: float ``[B, T, V]`` (position t predicts ``targets[:, t]``).
        targets: int64 ``[B, T]``.

    Returns:
        float32 ``[B, T]``: ``log_softmax(logits)[b, t, targets[b, t]]``.
    """
    logp = F.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def gae(rewards: np.ndarray, values: np.ndarray, gamma: float, lam: float) -> tuple[np.ndarray, np.ndarray]:
    """Generalised advantage estimation over one trajectory's sampled tokens, in order.

    Observation and repair tokens are not steps: the caller passes only the sampled tokens'
    rewards and values. The value after the last token is 0 (the episode is over).

    Args:
        rewards: float ``[n]`` per sampled token (the dense reward sits on the last one).
        values: float ``[n]`` critic values of the state before each sampled token.
        gamma, lam: discount and GAE lambda.

    Returns:
        ``(advantages [n], returns [n])`` float32, returns = advantages + values.
    """
    n = rewards.shape[0]
    adv = np.zeros(n, dtype=np.float64)
    last = 0.0
    for t in range(n - 1, -1, -1):
        next_v = values[t + 1] if t + 1 < n else 0.0
        delta = rewards[t] + gamma * next_v - values[t]
        last = delta + gamma * lam * last
        adv[t] = last
    adv32 = adv.astype(np.float32)
    return adv32, (adv + values).astype(np.float32)


@dataclass
class PolicyLossOutput:
    """Policy loss and its diagnostics (all scalars, over loss tokens)."""

    loss: torch.Tensor
    clip_frac: float
    is_weight_mean: float
    is_weight_max: float
    is_truncated_frac: float


def policy_loss(logp: torch.Tensor, logp_prox: torch.Tensor, logp_behavior: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, *, clip_eps: float, is_cap: float, denom: float | None = None) -> PolicyLossOutput:
    """Decoupled PPO loss with a truncated behaviour importance weight (formula in the module docstring).

    Args:
        logp, logp_prox, logp_behavior, advantages: float ``[B, T]`` (prox and behaviour carry no gradient).
        mask: float ``[B, T]`` of 0/1, 1 on sampled tokens.
        clip_eps: PPO clip epsilon on the ratio against the proximal policy.
        is_cap: C, the cap of the behaviour weight.
        denom: divide the token sum by this (default: the number of loss tokens in ``mask``), so
            micro-batches can be accumulated into one batch mean.
    """
    logp_prox, logp_behavior, advantages = logp_prox.detach(), logp_behavior.detach(), advantages.detach()
    ratio = torch.exp(logp - logp_prox)
    w_raw = torch.exp(logp_prox - logp_behavior)
    w = torch.clamp(w_raw, max=is_cap)
    surr = torch.minimum(ratio * advantages, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * advantages)
    n = mask.sum().clamp(min=1.0)
    d = denom if denom is not None else n
    loss = -(w * surr * mask).sum() / d
    with torch.no_grad():
        m = mask.bool()
        clipped = ((ratio - 1).abs() > clip_eps) & m
        wm = w_raw[m]
    return PolicyLossOutput(
        loss=loss,
        clip_frac=float(clipped.sum() / n),
        is_weight_mean=float(wm.mean()) if wm.numel() else 1.0,
        is_weight_max=float(wm.max()) if wm.numel() else 1.0,
        is_truncated_frac=float((wm > is_cap).float().mean()) if wm.numel() else 0.0,
    )


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, *,
               clip: float, denom: float | None = None) -> torch.Tensor:
    """Clipped squared-error value loss: 0.5 * max((v - R)^2, (v_old + clip(v - v_old, -c, c) - R)^2).

    Args:
        values: float ``[B, T]`` current critic values; old_values, returns: same shape, no gradient.
        mask: float ``[B, T]``, 1 on sampled tokens.
        clip: c, the clip range around the old values.
        denom: divide the token sum by this (default: loss tokens in ``mask``).
    """
    old_values, returns = old_values.detach(), returns.detach()
    v_clip = old_values + torch.clamp(values - old_values, -clip, clip)
    err = torch.maximum((values - returns) ** 2, (v_clip - returns) ** 2)
    d = denom if denom is not None else mask.sum().clamp(min=1.0)
    return 0.5 * (err * mask).sum() / d


def k3(logp: torch.Tensor, logp_behavior: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(mu || pi) from tokens sampled from mu (Schulman 2020,
    "Approximating KL divergence"): with log r = log pi - log mu, ``k3 = (r - 1) - log r``.

    Unbiased for KL(mu || pi) when the tokens were drawn from mu (temperature 1, no top-k/top-p
    truncation), and never negative.

    Args:
        logp: float ``[...]`` learner log-probs log pi of the sampled tokens.
        logp_behavior: float, same shape, the sampler's log mu of the same tokens.

    Returns:
        float ``[...]``, >= 0 (mask and average it yourself).
    """
    log_r = (logp - logp_behavior).double()
    return (torch.expm1(log_r) - log_r).to(logp.dtype)


def routing_differs(experts: torch.Tensor, recorded: torch.Tensor) -> torch.Tensor:
    """Which positions route to a different expert set than recorded, in any layer.

    Args:
        experts, recorded: integer ``[..., L, K]`` expert ids (e.g. ``[B, T, L, K]``); the order
            within the K chosen experts does not matter (the MoE output depends on the set).

    Returns:
        bool ``[...]`` (e.g. ``[B, T]``): True where some layer's set of K experts differs.
    """
    a = experts.long().sort(dim=-1).values
    b = recorded.long().sort(dim=-1).values
    return (a != b).any(dim=-1).any(dim=-1)
