"""Advantage estimators (``learner.advantage``): a registry of one function each.

An estimator that works per episode returns, per trajectory of the batch, a ``(baseline, scale)``
pair or None; the update step (:func:`t1async.learner.update.train_step`) then gives every
sampled token of trajectory i the advantage ``(R_i - baseline) / scale`` (then scaled by the
batch's standard deviation with ``learner.normalize_advantages``, never re-centred: :func:`whiten`),
and None leaves that trajectory to the critic's GAE (:func:`t1async.learner.rl.gae`). ``gae`` has
no such function: GAE everywhere (whitened with re-centring).

Adding an estimator: write one function with the signature of :data:`EpisodeEstimator` (pure:
it reads the batch's tasks and rewards and the recent rewards per task, it changes nothing),
register it in :data:`ADVANTAGES` and add its name to the ``AdvantageName`` choice of ``learner.advantage``
(t1async/config/learner.py, with the field's rule text; ``tests/unit/learner/test_rl.py`` checks that the two agree).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from t1async.learner.rl import check_group_inputs, group_baselines, recent_rewards

GroupHistory = dict[str, list[tuple[int, float]]]
"""Task name -> ``[(learner step, reward)]`` of the trajectories of that task trained recently."""

EpisodeEstimator = Callable[[list[str], list[float], GroupHistory, int, int], list["tuple[float, float] | None"]]
"""``(tasks [B], rewards [B], history, step, window_steps) -> [B] (baseline, scale) or None``.

``step`` is the learner step the batch trains as; history rows with ``step - row_step >
window_steps`` do not count."""


def leave_one_out(tasks: list[str], rewards: list[float], history: GroupHistory, step: int,
                  window_steps: int) -> list[tuple[float, float] | None]:
    """``group``: baseline = the mean reward of the episode's peers (the other episodes of its task
    in this batch and in the last ``window_steps`` steps; RLOO, :func:`t1async.learner.rl.group_baselines`), scale 1."""
    return [None if b is None else (b, 1.0) for b in group_baselines(tasks, rewards, history, step, window_steps)]


GRPO_EPS = 1e-4
"""Added to the group's standard deviation before dividing (as TRL's GRPOTrainer does): a group
whose episodes all scored alike gives advantage 0, not a division by zero."""


def group_normalized(tasks: list[str], rewards: list[float], history: GroupHistory, step: int,
                     window_steps: int) -> list[tuple[float, float] | None]:
    """``grpo``: GRPO's group-relative advantage with its per-group standard deviation
    (Shao et al. 2024, "DeepSeekMath"): ``(R_i - mean(G)) / (std(G) + 1e-4)`` where the group G
    is the episode itself and its peers (the other episodes of its task in this batch and in the
    last ``window_steps`` steps, as ``group``), ``std`` the sample standard deviation (n - 1).

    Dividing by the group's std weights tasks of low reward variance (nearly always solved, or
    nearly never) up; ``group`` (Dr. GRPO's choice, Liu et al. 2025) does not. A trajectory with no
    peer (a group of one) gets None (the critic's GAE, or the batch baseline without a critic).

    Raises:
        ValueError: ``tasks`` and ``rewards`` differ in length, or ``window_steps`` < 0.
    """
    check_group_inputs(tasks, rewards, window_steps)
    out: list[tuple[float, float] | None] = []
    for task in tasks:
        group = [r for t, r in zip(tasks, rewards) if t == task]
        group += recent_rewards(history, task, step, window_steps)
        if len(group) < 2:
            out.append(None)
            continue
        mean = sum(group) / len(group)
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / (len(group) - 1))
        out.append((mean, std + GRPO_EPS))
    return out


WHITEN_MIN_STD = 1e-6
"""Floor of the batch's standard deviation in :func:`whiten` (a batch whose advantages are all
alike divides by this, not by zero)."""


def whiten(advantages: list[torch.Tensor], masks: list[torch.Tensor], *, recentre: bool) -> list[torch.Tensor]:
    """``learner.normalize_advantages``: the batch's advantages divided by their standard
    deviation over the policy-loss tokens, re-centred first (``recentre``) or not.

    ``recentre`` (GAE): ``(A - mean) / std``, the usual PPO whitening (Schulman et al. 2017's
    reference code, OpenAI baselines; Huang et al. 2022, "The 37 Implementation Details of PPO"):
    a critic's advantages have no exact zero to keep, and centring them lowers the variance.

    Not ``recentre`` (per-episode estimators: ``group``, ``grpo``): ``A / std``, the group's own
    baseline as the only centring and the batch's standard deviation as the only scale ("group-level
    mean, batch-level std", Liu et al. 2025, "Part I: Tricks or Traps? A Deep Dive into RL for LLM
    Reasoning"; TRL's ``scale_rewards="batch"``). Re-centring on the batch's mean would give every
    token of a group whose episodes all scored alike the advantage ``-mean / std``: a gradient from
    a task that carries no signal. So a zero advantage stays exactly zero, and every sign is kept.

    Args:
        advantages: per micro-batch, float ``[B, T]`` advantages (any value off the mask).
        masks: per micro-batch, float ``[B, T]`` 0/1, 1 on the tokens the policy trains (the
            statistics are over these tokens, each token counting once).
        recentre: subtract the mean over the masked tokens before dividing.

    Returns:
        Per micro-batch, float ``[B, T]`` whitened advantages, 0 off the mask. The standard
        deviation is the population one (n), floored at :data:`WHITEN_MIN_STD`.

    Raises:
        ValueError: ``advantages`` and ``masks`` differ in length or in a micro-batch's shape.
    """
    if len(advantages) != len(masks) or any(a.shape != m.shape for a, m in zip(advantages, masks)):
        raise ValueError(f"whiten needs one mask per advantage tensor of the same shape, got shapes "
                         f"{[tuple(a.shape) for a in advantages]} and {[tuple(m.shape) for m in masks]}")
    flat = torch.cat([a[m.bool()] for a, m in zip(advantages, masks)])
    if flat.numel() == 0:
        return [a * m for a, m in zip(advantages, masks)]
    mean = flat.mean() if recentre else torch.zeros((), dtype=flat.dtype, device=flat.device)
    std = flat.std(unbiased=False).clamp(min=WHITEN_MIN_STD)
    return [(a - mean) / std * m for a, m in zip(advantages, masks)]


@dataclass(frozen=True)
class Advantage:
    """One ``learner.advantage`` value."""

    per_episode: EpisodeEstimator | None
    """The per-episode estimator (None: GAE from the critic for every token). An estimator with
    one keeps the recent rewards per task (``learner.group_window_steps``) in the learner's
    checkpoints, and reports ``group_baselined_frac`` (the share of the batch it covered)."""
    recentre: bool
    """Whether ``learner.normalize_advantages`` subtracts the batch's mean (:func:`whiten`): True
    for GAE; False for a per-episode estimator, whose zero advantage (a group that scored alike)
    must stay zero. A batch's trajectories that fell back to GAE are then scaled, not re-centred."""


ADVANTAGES: dict[str, Advantage] = {
    "gae": Advantage(None, recentre=True),
    "group": Advantage(leave_one_out, recentre=False),
    "grpo": Advantage(group_normalized, recentre=False),
}
