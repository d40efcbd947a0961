"""One learner update as a pure function of a batch, a backend and the ``learner`` section.

    batch --micro-batches (right-padded, learner.micro_batch_tokens)--> critic values (old),
    GAE over sampled tokens (or the per-episode estimate of ``learner.advantage``,
    t1async/learner/advantages.py) --> whitening (re-centred for GAE only) --> ``ppo_epochs`` x
    (policy log-probs under routing replay; proximal = the first epoch's; policy loss
    ``learner.policy_loss``, t1async/learner/losses.py; importance-weighted KL penalty to the
    reference, :func:`t1async.learner.rl.kl_penalty`; clipped value loss) --> one optimiser
    step per epoch --> the step's metrics.

The training loop (t1async/learner/loop.py) collects the batch, calls :func:`train_step`, then publishes
and checkpoints; nothing here touches a socket, a file or Ray.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from t1async.config import LearnerConfig
from t1async.learner.abnormal import policy_mask
from t1async.learner.advantages import ADVANTAGES, whiten
from t1async.learner.backend import LearnerBackend, chunk_size
from t1async.learner.losses import POLICY_LOSSES
from t1async.learner.rl import fill_padding_routes, gae, k3, kl_penalty, micro_batches, routing_differs, value_loss
from t1async.trajectory import Trajectory


def episode_reward(traj: Trajectory, kind: str) -> float:
    """The episode's reward: ``dense`` = tests passed (``traj.reward``), ``binary`` = 1.0 if resolved else 0.0."""
    return float(traj.reward) if kind == "dense" else float(traj.resolved)


def advantage_estimates(batch: list[Trajectory], cfg: LearnerConfig, task_rewards: dict[str, list[tuple[int, float]]],
                        step: int) -> tuple[list[tuple[float, float] | None] | None, dict[str, list[tuple[int, float]]]]:
    """The per-episode estimates of ``cfg.advantage`` for ``batch`` trained as ``step``
    (t1async/learner/advantages.py), and the window of recent rewards per task to keep.

    Args:
        batch: the step's trajectories.
        cfg: the ``learner`` section (``advantage``, ``reward``, ``group_window_steps``).
        task_rewards: task -> ``(step, reward)`` of its recent episodes (``batch``'s are appended).
        step: the step that trains ``batch`` (the learner's steps done + 1).

    Returns:
        ``(estimates, task_rewards)``: estimates per trajectory (None under ``gae``), and the
        window with ``batch``'s rewards added and what is older than ``group_window_steps``
        steps forgotten (under ``gae``: ``task_rewards`` unchanged).
    """
    estimate = ADVANTAGES[cfg.advantage].per_episode
    if estimate is None:
        return None, task_rewards
    window = cfg.group_window_steps
    rewards = [episode_reward(t, cfg.reward) for t in batch]
    out = estimate([t.task for t in batch], rewards, task_rewards, step, window)
    for t, r in zip(batch, rewards):
        task_rewards.setdefault(t.task, []).append((step, r))
    return out, {k: kept for k, v in task_rewards.items() if (kept := [(s, r) for s, r in v if step + 1 - s <= window])}


def policy_lr(cfg: LearnerConfig, step: int) -> float:
    """The policy's learning rate for the update after ``step`` updates: a linear warm-up over
    its first ``lr_warmup_steps`` updates (counted after critic warm-up): Adam's first updates
    are about ``lr`` per parameter whatever the gradient's size, which on small batches is
    mostly noise."""
    k = step - cfg.critic_warmup_steps + 1
    scale = min(1.0, k / cfg.lr_warmup_steps) if cfg.lr_warmup_steps > 0 else 1.0
    return cfg.lr * scale


def explained_variance(values: torch.Tensor, returns: torch.Tensor) -> float | None:
    """``1 - Var(returns - values) / Var(returns)`` over loss tokens (1: perfect critic, 0: no
    better than a constant, < 0: worse); None when the returns do not vary.

    Args:
        values, returns: float ``[n]`` critic values (before the update) and GAE returns.
    """
    var = float(returns.var(unbiased=False)) if returns.numel() else 0.0
    if var == 0.0:
        return None
    return 1.0 - float((returns - values).var(unbiased=False)) / var


def train_step(batch: list[Trajectory], backend: LearnerBackend, cfg: LearnerConfig, *, num_experts: int, step: int,
               policy_lr: float, estimates: list[tuple[float, float] | None] | None = None) -> dict[str, Any]:
    """One actor-critic update of ``backend`` on ``batch``, accumulated over micro-batches of
    trajectories (``learner.micro_batch_tokens``; right-padded, the padding masked out of every sum).

    Args:
        batch: the trajectories to train on (kept by the learner's staleness and abnormal-end filter).
        backend: the models and optimisers (t1async/learner/backend.py); changed in place.
        cfg: the ``learner`` section (advantage, PPO, KL and critic constants).
        num_experts: ``model.num_experts`` (padding of the routed-expert rows).
        step: learner steps done before this one (critic warm-up: the policy trains from
            ``critic_warmup_steps`` on).
        policy_lr: the policy's learning rate for this step.
        estimates: per trajectory, ``(baseline, scale)`` of the per-episode advantage estimator
            (``learner.advantage``, t1async/learner/advantages.py) or None (GAE from the critic);
            None: GAE for all.

    Returns:
        The step's metrics (losses, importance-weight and routing statistics, ...; the
        metrics.jsonl names), ``trained_tokens`` among them.

    Two masks per trajectory: ``vmask`` (every sampled token) and ``mask``, the policy's
    (:func:`t1async.learner.abnormal.policy_mask`: ``vmask`` less the turns set to ``mask_turn``).
    GAE runs over every sampled token, so the raw advantages of the tokens kept are those
    without masking; the masked tokens leave the policy loss and the advantage whitening. The
    critic still trains on them: their states were really visited and their returns really
    observed, and earlier tokens' advantages bootstrap through their values.
    """
    items = []
    dev = backend.device  # the batch's tensors live where the backend computes (cpu: no copy)
    baselines = list(estimates) if estimates is not None else [None] * len(batch)
    n_peered = sum(b is not None for b in baselines)
    rewards_all = [episode_reward(t, cfg.reward) for t in batch]
    if not cfg.critic:  # no peer of its task: the mean reward of the rest of the batch (itself if alone)
        total = sum(rewards_all)
        others = [(total - r) / (len(batch) - 1) if len(batch) > 1 else r for r in rewards_all]
        baselines = [b if b is not None else (o, 1.0) for b, o in zip(baselines, others)]
    lengths = [t.num_tokens - 1 for t in batch]  # positions: inputs ids[:-1], targets ids[1:]
    for group in micro_batches(lengths, cfg.micro_batch_tokens):
        it = micro_batch([batch[i] for i in group], dev, cfg, num_experts)
        old_v = backend.values(it["inp"], grad=False) if cfg.critic else torch.zeros_like(it["vmask"])
        adv, ret = torch.zeros_like(it["vmask"]), torch.zeros_like(it["vmask"])
        for row, i in enumerate(group):
            idx = it["vmask"][row].nonzero().squeeze(-1)
            rewards = np.zeros(idx.numel(), dtype=np.float32)
            rewards[-1] = rewards_all[i]
            adv_s, ret_s = gae(rewards, old_v[row, idx].cpu().numpy(), cfg.gamma, cfg.lam)
            if baselines[i] is not None:  # a per-episode advantage for every token; the critic still learns ret_s
                base, scale = baselines[i]
                adv_s = np.full_like(adv_s, (rewards[-1] - base) / scale)
            adv[row, idx], ret[row, idx] = torch.from_numpy(adv_s).to(dev), torch.from_numpy(ret_s).to(dev)
        items.append({**it, "old_v": old_v, "adv": adv, "ret": ret})
    n_tokens = float(sum(it["mask"].sum() for it in items))  # policy-loss tokens
    n_value = float(sum(it["vmask"].sum() for it in items))  # every sampled token
    ev = explained_variance(torch.cat([it["old_v"][it["vmask"].bool()] for it in items]),
                            torch.cat([it["ret"][it["vmask"].bool()] for it in items])) if cfg.critic else None
    if cfg.normalize_advantages:  # GAE: (A - mean) / std; per-episode estimators: A / std (a zero stays zero)
        whitened = whiten([it["adv"] for it in items], [it["mask"] for it in items],
                          recentre=ADVANTAGES[cfg.advantage].recentre)
        for it, adv in zip(items, whitened):
            it["adv"] = adv
    if cfg.negative_advantage_weight != 1.0:
        for it in items:
            it["adv"] = torch.where(it["adv"] < 0, it["adv"] * cfg.negative_advantage_weight, it["adv"])
    train_policy = step >= cfg.critic_warmup_steps
    loss_fn = POLICY_LOSSES[cfg.policy_loss]
    sums = {"policy_loss": 0.0, "value_loss": 0.0, "clip_frac": 0.0, "is_weight_mean": 0.0, "is_truncated_frac": 0.0}
    diff_sum, is_max = 0.0, 0.0
    k3_sum, routed_pos, used_diff, own_diff, boundary = 0.0, 0, 0, 0, 0
    for epoch in range(cfg.ppo_epochs):
        backend.zero_grad()
        for it in items:
            # scored under the sampler's processing (temperature, top-k, top-p); a sampled id
            # just outside this model's own nucleus is kept in it (counted below)
            # scored at the sampled tokens only (every loss and figure below reads them alone)
            out = backend.policy_logprobs(it["inp"], it["tgt"], it["replay"], grad=train_policy, routing=epoch == 0,
                                          score=it["vmask"] > 0)
            # padding's log-probs set to 0: no extreme value there can turn into inf * 0 = nan in a masked sum
            logp, outside = torch.where(it["valid"], out.logp, 0.0), out.outside
            if epoch == 0:
                boundary += int((outside & it["mask"].bool()).sum())
                it["prox"] = logp.detach()  # proximal policy = the weights before this update
                diff_sum += float(((it["prox"] - it["mu"]).abs() * it["vmask"]).sum())
                k3_sum += float((k3(it["prox"], it["mu"]) * it["vmask"]).sum())
                # routing vs the sampler's rows: the experts used (0 under replay) and the
                # router's own top-k from this same forward (what no replay would use)
                routed_pos += int(it["valid"].sum())
                used_diff += int((routing_differs(out.routed_experts, it["recorded"]) & it["valid"]).sum())
                own_diff += int((routing_differs(out.router_experts, it["recorded"]) & it["valid"]).sum())
            pl = loss_fn(logp, it["prox"], it["mu"], it["adv"], it["mask"], clip_eps=cfg.clip_eps,
                             is_cap=cfg.is_cap, denom=n_tokens)
            kl_term: torch.Tensor | float = 0.0
            if cfg.kl_coef > 0 and train_policy:
                if epoch == 0:
                    it["ref"] = torch.where(it["valid"], backend.reference_logprobs(it["inp"], it["tgt"],
                                                                                     score=it["vmask"] > 0), 0.0)
                # gradient of KL(pi_theta || pi_ref) from the behaviour policy's tokens (importance-weighted)
                kl = kl_penalty(logp, it["ref"], it["prox"], it["mu"], it["mask"], is_cap=cfg.is_cap, denom=n_tokens)
                kl_term = cfg.kl_coef * kl.loss
                if epoch == cfg.ppo_epochs - 1:
                    sums["kl_ref"] = sums.get("kl_ref", 0.0) + float(kl.value)
            vl = value_loss(backend.values(it["inp"], grad=True), it["old_v"], it["ret"], it["vmask"], clip=cfg.value_clip,
                            denom=n_value) if cfg.critic else torch.zeros(())
            loss = cfg.value_coef * vl + (pl.loss + kl_term if train_policy else 0.0)
            backend.backward(loss)
            if epoch == cfg.ppo_epochs - 1:
                w = float(it["mask"].sum()) / n_tokens
                sums["policy_loss"] += float(pl.loss.detach())
                sums["value_loss"] += float(vl.detach())
                for k in ("clip_frac", "is_weight_mean", "is_truncated_frac"):
                    sums[k] += getattr(pl, k) * w
                is_max = max(is_max, pl.is_weight_max)
        gn = backend.step(policy=train_policy, policy_lr=policy_lr)
        if train_policy:
            sums["grad_norm"] = gn
    if not cfg.critic:
        del sums["value_loss"]
    return {**sums, "is_weight_max": is_max, "logprob_diff_mean": diff_sum / max(n_value, 1.0),
            "kl_k3": k3_sum / max(n_value, 1.0), "nucleus_boundary_tokens": boundary,
            "routing_diff_frac": used_diff / max(routed_pos, 1), "router_diff_frac": own_diff / max(routed_pos, 1),
            "drift_tokens": int(sum(t.drift_tokens for t in batch)),
            "chunked_micro_batches": sum(bool(chunk_size(cfg.max_tokens_per_chunk, it["inp"].shape[1])) for it in items),
            "template_mismatches": int(sum(t.template_mismatches for t in batch)),
            "train_policy": train_policy, "phase": "rl" if train_policy else "critic_warmup",
            **({"explained_variance": ev} if cfg.critic else {}), "trained_tokens": n_value,
            **({"group_baselined_frac": n_peered / len(batch)}
               if ADVANTAGES[cfg.advantage].per_episode is not None else {})}


def probe(traj: Trajectory, backend: LearnerBackend, cfg: LearnerConfig, *, num_experts: int) -> None:
    """Run the forward passes of a :func:`train_step` on ``traj`` alone, without gradient and
    without changing ``backend``: the critic's values (``learner.critic``), the policy's log-probs
    with its routed experts (replayed under ``learner.routing_replay``) and the reference's
    (``learner.kl_coef`` > 0). The learner calls it on each trajectory of a step that raised, to
    find the one to quarantine (t1async/learner/step_guard.py).

    Raises:
        Exception: whatever the step would raise on this trajectory (e.g. ``IndexError`` for a
            token id past the embedding).
    """
    it = micro_batch([traj], backend.device, cfg, num_experts)
    with torch.no_grad():
        if cfg.critic:
            backend.values(it["inp"], grad=False)
        backend.policy_logprobs(it["inp"], it["tgt"], it["replay"], grad=False, routing=True, score=it["vmask"] > 0)
        if cfg.kl_coef > 0:
            backend.reference_logprobs(it["inp"], it["tgt"], score=it["vmask"] > 0)


def micro_batch(trajs: list[Trajectory], dev: torch.device, cfg: LearnerConfig,
                num_experts: int) -> dict[str, torch.Tensor]:
    """Trajectories right-padded to the longest into ``[B, T]`` tensors (``T`` = its positions).

    Returns ``inp``, ``tgt`` (int64; padding id 0), ``valid`` (bool: a real position),
    ``vmask`` (float: every sampled token), ``mask`` (float: the policy's,
    :func:`t1async.learner.abnormal.policy_mask`), ``mu`` (float32 sampler log-probs, 0 on padding),
    ``recorded`` (int64 ``[B, T, L, K]`` routed experts; padding holds K distinct ids per row,
    as Megatron's replay needs, spread evenly over the experts and the expert-parallel ranks:
    :func:`t1async.learner.rl.fill_padding_routes`) and ``replay`` (``recorded`` under
    ``learner.routing_replay``, else None), all on ``dev``.
    """
    T = max(t.num_tokens for t in trajs) - 1
    B = len(trajs)
    L, K = trajs[0].routed_experts.shape[1:]
    E = num_experts
    ids = torch.zeros(B, T + 1, dtype=torch.int64)
    valid = torch.zeros(B, T, dtype=torch.bool)
    vmask, mask, mu = (torch.zeros(B, T, dtype=torch.float32) for _ in range(3))
    recorded = torch.zeros(B, T, L, K, dtype=torch.int64)
    for b, traj in enumerate(trajs):
        n = traj.num_tokens - 1
        ids[b, :n + 1] = torch.from_numpy(traj.token_ids.astype(np.int64))
        valid[b, :n] = True
        vmask[b, :n] = torch.from_numpy(traj.loss_mask[1:].astype(np.float32))
        mask[b, :n] = torch.from_numpy(policy_mask(traj, cfg.abnormal)[1:].astype(np.float32))
        mu[b, :n] = torch.from_numpy(traj.logprobs[1:].astype(np.float32))
        recorded[b, :n] = torch.from_numpy(traj.routed_experts.astype(np.int64))
    ep = cfg.megatron.expert_parallel if cfg.backend == "megatron" else 1
    recorded = fill_padding_routes(recorded, ~valid, E, ep)
    out = {"inp": ids[:, :-1], "tgt": ids[:, 1:], "valid": valid, "vmask": vmask, "mask": mask, "mu": mu,
           "recorded": recorded}
    out = {k: v.to(dev) for k, v in out.items()}
    out["replay"] = out["recorded"] if cfg.routing_replay else None
    return out
