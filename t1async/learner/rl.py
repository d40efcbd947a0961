"""The learner's mathematics: GAE over sampled tokens, decoupled PPO, clipped value loss, KL, routing.

Token log-probs under the sampler's processing live in t1async/models/logprobs.py (shared with the sampler).

Notation per loss token i: behaviour log-prob log mu_i (the sampler's), proximal log-prob
log pi_prox_i (the learner's weights before this update, no gradient), current log pi_theta_i.

    r_i = exp(log pi_theta_i - log pi_prox_i)
    w_i = min(exp(log pi_prox_i - log mu_i), C)
    L_policy = - sum_i w_i * min(r_i A_i, clip(r_i, 1 - eps, 1 + eps) A_i) / n
    L_KL     = sum_i sg(w_i r_i) * (log pi_theta_i - log pi_ref_i)^2 / 2 / n     (kl_penalty)

Sources: decoupled PPO (Hilton et al. 2021, "Batch size-invariance for policy optimization");
AReaL (Fu et al. 2025); truncated importance sampling as in IMPALA / V-trace (Espeholt et al.
2018); GAE (Schulman et al. 2016); PPO value clipping (Schulman et al. 2017, OpenAI baselines).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


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


def check_group_inputs(tasks: list[str], rewards: list[float], window_steps: int) -> None:
    """Raise ValueError unless ``tasks`` and ``rewards`` have one entry per trajectory and
    ``window_steps`` >= 0 (the inputs of the per-task group estimators)."""
    if len(tasks) != len(rewards):
        raise ValueError(f"{len(tasks)} task names for {len(rewards)} rewards")
    if window_steps < 0:
        raise ValueError(f"window_steps must be >= 0, got {window_steps}")


def recent_rewards(history: dict[str, list[tuple[int, float]]], task: str, step: int, window_steps: int) -> list[float]:
    """The rewards of ``task`` trained in the last ``window_steps`` learner steps before ``step``
    (``history``: task -> [(step, reward), ...])."""
    return [r for s, r in history.get(task, ()) if step - s <= window_steps]


def group_baselines(tasks: list[str], rewards: list[float], history: dict[str, list[tuple[int, float]]], step: int,
                    window_steps: int) -> list[float | None]:
    """Leave-one-out baseline of each trajectory from the other episodes of its task (RLOO).

    The baseline of trajectory i is the mean reward of its peers: the other trajectories of the
    same task in this batch, plus those of that task trained in the last ``window_steps`` learner
    steps (``history``). The advantage ``R_i - baseline`` then compares episodes of one task
    instance against each other, so the task's difficulty cancels out and a task every episode
    resolves (or every episode fails) gives no gradient. Sources: REINFORCE leave-one-out
    (Kool et al. 2019, "Buy 4 REINFORCE Samples, Get a Baseline for Free!"; Ahmadian et al. 2024,
    "Back to Basics"); GRPO's group-relative advantage (Shao et al. 2024, DeepSeekMath) without
    its per-group standard deviation (Liu et al. 2025, "Understanding R1-Zero-Like Training").
    The window admits group members that landed in an earlier batch: with ``rollout.group_size``
    episodes of a task admitted back to back, they finish within a few steps of each other.

    Args:
        tasks: ``[B]`` task name of each trajectory in the batch.
        rewards: ``[B]`` episode rewards (same order).
        history: task -> ``[(step, reward)]`` of trajectories trained earlier; read, not changed.
        step: the learner step this batch trains as; history entries with
            ``step - entry_step > window_steps`` are ignored.
        window_steps: >= 0.

    Returns:
        ``[B]`` baselines (float), None where a trajectory has no peer (the caller falls back to
        the critic).

    Raises:
        ValueError: ``tasks`` and ``rewards`` differ in length, or ``window_steps`` < 0.
    """
    check_group_inputs(tasks, rewards, window_steps)
    out: list[float | None] = []
    for i, task in enumerate(tasks):
        peers = [r for j, (t, r) in enumerate(zip(tasks, rewards)) if t == task and j != i]
        peers += recent_rewards(history, task, step, window_steps)
        out.append(sum(peers) / len(peers) if peers else None)
    return out


def micro_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Group sequences into micro-batches for one padded forward each.

    Sequences are taken longest first (so each micro-batch holds similar lengths and little
    padding) and a micro-batch grows while ``count x longest`` stays within ``max_tokens``; a
    sequence longer than ``max_tokens`` gets a micro-batch of its own. Right padding leaves every
    real position's result unchanged: attention is causal (a position never sees the padding
    after it) and MoE routing is per token without a capacity limit, so only the float
    summation order of batched matmuls differs from one forward per sequence.

    Args:
        lengths: ``[N]`` positions of each sequence (>= 1).
        max_tokens: padded positions per micro-batch; 0 puts every sequence alone.

    Returns:
        Lists of indices into ``lengths``, each list longest first; every index exactly once.

    Raises:
        ValueError: ``max_tokens`` < 0.
    """
    if max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0 (0: one sequence per micro-batch), got {max_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    if max_tokens == 0:
        return [[i] for i in order]
    out: list[list[int]] = []
    for i in order:  # longest first: a micro-batch's first sequence is its longest
        if out and (len(out[-1]) + 1) * lengths[out[-1][0]] <= max_tokens:
            out[-1].append(i)
        else:
            out.append([i])
    return out


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

    Unbiased for KL(mu || pi) when the tokens were drawn from mu and both log-probs are of the same
    processing (temperature, top-k, top-p: :func:`processed_logprobs`, as the engine reports and
    the learner scores), and never negative.

    A value to report, not a penalty to differentiate: as the KL penalty it would be
    ``k3(log pi_ref, log pi_theta)`` on tokens of pi_theta (an estimate of KL(pi_theta || pi_ref)),
    and its gradient ``(1 - pi_ref / pi_theta) grad log pi_theta`` has expectation
    ``sum_x (pi_theta - pi_ref) grad log pi_theta = grad KL(pi_ref || pi_theta)``: the other
    direction, since autograd does not see that the tokens' distribution depends on theta (Tang &
    Munos 2025, "On a few pitfalls in KL divergence gradient estimation for RL"). The penalty's
    estimator: :func:`kl_penalty`.

    Args:
        logp: float ``[...]`` learner log-probs log pi of the sampled tokens.
        logp_behavior: float, same shape, the sampler's log mu of the same tokens.

    Returns:
        float ``[...]``, >= 0 (mask and average it yourself).
    """
    log_r = (logp - logp_behavior).double()
    return (torch.expm1(log_r) - log_r).to(logp.dtype)


@dataclass
class KLPenaltyOutput:
    """The KL penalty of a micro-batch (:func:`kl_penalty`)."""

    loss: torch.Tensor
    """Scalar to differentiate: its gradient estimates that of KL(pi_theta || pi_ref) per token."""
    value: torch.Tensor
    """Scalar, no gradient: the importance-weighted k3 estimate of KL(pi_theta || pi_ref) per token
    (same normalisation as ``loss``); ``kl_ref`` in metrics.jsonl."""


def kl_penalty(logp: torch.Tensor, logp_ref: torch.Tensor, logp_prox: torch.Tensor, logp_behavior: torch.Tensor,
               mask: torch.Tensor, *, is_cap: float, denom: float | None = None) -> KLPenaltyOutput:
    """The KL penalty to the reference, ``learner.kl_coef``: a surrogate whose gradient estimates
    that of KL(pi_theta || pi_ref) at each loss token's state, from tokens sampled by the behaviour
    policy mu (the sampler's, possibly stale).

    Derivation, per state s, with k1 = log pi_theta(x) - log pi_ref(x) (Schulman 2020,
    "Approximating KL divergence", for k1 / k2 / k3)::

        grad KL = grad sum_x pi_theta(x) k1(x) = sum_x (grad pi_theta(x)) k1(x) + sum_x grad pi_theta(x)
                = E_{x ~ pi_theta}[k1(x) grad log pi_theta(x)]            (sum_x grad pi_theta = grad 1 = 0)
                = E_{x ~ mu}[rho(x) k1(x) grad log pi_theta(x)],          rho = pi_theta / mu

    and ``sg(rho) * k1^2 / 2`` ("k2" with a stop-gradient importance weight) has exactly
    ``rho k1 grad log pi_theta`` as gradient. On-policy (rho = 1) this is k2 as a loss, whose
    gradient is unbiased for the reverse KL's (Tang & Munos 2025, "On a few pitfalls in KL divergence
    gradient estimation for RL"; Liu et al. 2025, "Rethinking KL Regularization in RLHF"); k3 as
    a loss is not (:func:`k3`). ``rho`` is split as the policy loss splits it (decoupled PPO):
    ``min(pi_prox / mu, C) * pi_theta / pi_prox``, the behaviour part truncated at C =
    ``learner.is_cap`` (biased only on the tokens it truncates), the proximal part exact.

    What it optimises: the sum over loss tokens of the per-state KL(pi_theta(.|s_t) || pi_ref(.|s_t))
    at the states the episodes visited; theta's effect on which states are visited (the later
    tokens' share of the sequence-level KL) is not differentiated, the "partial gradient" of Tang &
    Munos 2025 that every per-token KL loss takes.

    Args:
        logp: float ``[B, T]`` log pi_theta of the sampled tokens, with gradient.
        logp_ref, logp_prox, logp_behavior: float ``[B, T]`` the reference's, the proximal
            policy's and the sampler's log-probs of the same tokens, under the same processing
            (no gradient taken through them).
        mask: float ``[B, T]`` of 0/1, 1 on the tokens the policy trains.
        is_cap: C, the cap of the behaviour weight (> 0; ``float("inf")``: none).
        denom: divide the token sums by this (default: the loss tokens in ``mask``), so
            micro-batches accumulate into one batch mean.

    Returns:
        :class:`KLPenaltyOutput`: ``loss`` (differentiate it) and ``value`` (``sum(rho k3) / denom``
        with k3 = ``k3(logp_ref, logp)``, unbiased for KL(pi_theta || pi_ref) where no weight is
        truncated, never negative).
    """
    logp_ref, logp_prox, logp_behavior = logp_ref.detach(), logp_prox.detach(), logp_behavior.detach()
    with torch.no_grad():
        behaviour = torch.exp((logp_prox - logp_behavior).double()).clamp(max=is_cap)
        rho = (behaviour * torch.exp((logp.detach() - logp_prox).double())).to(logp.dtype)
    log_ratio = logp - logp_ref
    d = denom if denom is not None else mask.sum().clamp(min=1.0)
    loss = (rho * 0.5 * log_ratio ** 2 * mask).sum() / d
    value = ((rho * k3(logp_ref, logp.detach())) * mask).sum() / d
    return KLPenaltyOutput(loss=loss, value=value.detach())


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


def padding_routes(n: int, top_k: int, num_experts: int, expert_parallel: int = 1) -> torch.Tensor:
    """Replayed experts for ``n`` padded positions, spread evenly over the experts and the
    expert-parallel ranks (a padded position's output is masked, but it still takes a token slot
    on the experts it is sent to).

    Slot j of row r is s = r K + j, and goes to expert
    ``e(s) = (s mod P) E/P + (s div P) mod (E/P)`` (P = ``expert_parallel``; rank p holds experts
    [p E/P, (p+1) E/P), as Megatron places them). ``e`` maps any E consecutive slots onto the E
    experts one-to-one and consecutive slots alternate over the ranks, so: the K ids of a row are
    distinct (K <= E consecutive slots), each expert gets floor(nK/E) or ceil(nK/E) of the n K
    assignments, and each rank floor(nK/P) or ceil(nK/P). Deterministic.

    Returns:
        int64 ``[n, top_k]``.

    Raises:
        ValueError: ``top_k`` > ``num_experts``, or ``expert_parallel`` not dividing ``num_experts``.
    """
    K, E, P = top_k, num_experts, expert_parallel
    if not 1 <= K <= E or P < 1 or E % P:
        raise ValueError(f"padding_routes needs 1 <= top_k <= num_experts and expert_parallel dividing "
                         f"num_experts, got top_k={K}, num_experts={E}, expert_parallel={P}")
    s = torch.arange(n * K, dtype=torch.int64).view(n, K)
    return (s % P) * (E // P) + (s // P) % (E // P)


def fill_padding_routes(routed: torch.Tensor, pad: torch.Tensor, num_experts: int,
                        expert_parallel: int = 1) -> torch.Tensor:
    """``routed`` with its padded positions' rows replaced by :func:`padding_routes` (the i-th
    padded position in row-major order takes row i, the same in every layer).

    Args:
        routed: integer ``[B, T, L, K]`` expert ids. pad: bool ``[B, T]``, True at padding.
        num_experts, expert_parallel: as :func:`padding_routes`.

    Returns:
        int64 ``[B, T, L, K]`` (a new tensor on ``routed``'s device).
    """
    out = routed.long().clone()
    pad = pad.to(out.device)
    n, L, K = int(pad.sum()), out.shape[2], out.shape[3]
    out[pad] = padding_routes(n, K, num_experts, expert_parallel).to(out.device)[:, None, :].expand(n, L, K)
    return out


def load_balancing_loss(gate_logits: list[torch.Tensor], num_experts: int, top_k: int) -> torch.Tensor:
    """Switch Transformer load-balancing loss averaged over MoE layers (Fedus et al. 2021).

    Args:
        gate_logits: per layer, router logits ``[N, E]`` (any float dtype) of the N tokens routed.
        num_experts, top_k: E and K.

    Returns:
        float32 scalar ``mean_layers E * sum_e f_e * P_e``, with f_e the fraction of the N*K
        routing slots sent to expert e and P_e the mean router probability of e; 1.0 at balance.
    """
    total = torch.zeros((), dtype=torch.float32)
    for logits in gate_logits:
        probs = logits.float().softmax(-1)
        chosen = F.one_hot(probs.topk(top_k, -1).indices, num_experts).sum(-2).float()
        total = total + num_experts * (chosen.mean(0) / top_k * probs.mean(0)).sum()
    return total / max(len(gate_logits), 1)
