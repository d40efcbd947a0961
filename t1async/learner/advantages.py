"""Advantage estimators (``learner.advantage``): a registry of one function each.

An estimator that works per episode returns, per trajectory of the batch, a ``(baseline, scale)``
pair or None; the update step (:func:`t1async.learner.update.train_step`) then gives every
sampled token of trajectory i the advantage ``(R_i - baseline) / scale`` (still whitened over the
batch with ``learner.normalize_advantages``), and None leaves that trajectory to the critic's GAE
(:func:`t1async.learner.rl.gae`). ``gae`` has no such function: GAE everywhere.

Adding an estimator: write one function with the signature of :data:`EpisodeEstimator` (pure:
it reads the batch's tasks and rewards and the recent rewards per task, it changes nothing),
register it in :data:`ADVANTAGES` and add its name to the value check of ``learner.advantage``
in ``t1async/config.py`` (``tests/test_rl.py`` checks that the two agree).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

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


@dataclass(frozen=True)
class Advantage:
    """One ``learner.advantage`` value."""

    per_episode: EpisodeEstimator | None
    """The per-episode estimator (None: GAE from the critic for every token). An estimator with
    one keeps the recent rewards per task (``learner.group_window_steps``) in the learner's
    checkpoints, and reports ``group_baselined_frac`` (the share of the batch it covered)."""


ADVANTAGES: dict[str, Advantage] = {
    "gae": Advantage(None),
    "group": Advantage(leave_one_out),
    "grpo": Advantage(group_normalized),
}
