"""Whether the learner trains a received trajectory or drops it: staleness, then abnormal ends (pure).

A trajectory is dropped when its staleness (the learner's timeline version less that of its
oldest sampled token, t1async/learner/timeline.py) exceeds ``learner.max_staleness``, or when
``learner.abnormal`` says to drop its end (t1async/learner/abnormal.py :func:`drop_reason`).
The learner (t1async/learner/loop.py) counts and reports what this decides; nothing here reads
a clock, a socket or the learner's state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np

from t1async.config import AbnormalConfig
from t1async.learner.abnormal import drop_detail, drop_reason
from t1async.trajectory import Trajectory


@dataclass(frozen=True)
class Drop:
    """A trajectory the learner must not train.

    Attributes:
        reason: a key of :data:`t1async.learner.abnormal.DROP_REASONS` (``stale`` first).
        detail: one line saying why (logs, the controller).
        restart: a stale drop of a trajectory sampled (in part) by the weights of an earlier
            learner life, or by a publication that started a new timeline segment (counted in
            ``dropped_stale_restart`` too).
    """

    reason: str
    detail: str
    restart: bool = False


def keep_or_drop(traj: Trajectory, *, staleness: int, max_staleness: int, timeline_version: int,
                 earlier_lives_version: int, segment_starts: Iterable[int], abnormal: AbnormalConfig) -> Drop | None:
    """None to train ``traj``, else the :class:`Drop` that says why not.

    Args:
        traj: the received trajectory (``versions``: int [T] weight version per token;
            ``loss_mask``: [T], 1 on sampled tokens).
        staleness: its staleness in timeline versions (negative: sampled on a lost life's branch).
        max_staleness: ``learner.max_staleness``, the bound (inclusive).
        timeline_version: the learner's timeline version now (for the detail line).
        earlier_lives_version: weight versions up to this one were published by earlier learner
            lives (-1: never resumed).
        segment_starts: weight versions at which the timeline started a new segment (a resume's
            or a joining sampler's publication; ``VersionTimeline.starts``).
        abnormal: ``learner.abnormal``, what to do with each kind of abnormal end.
    """
    if staleness > max_staleness:
        sampled = traj.versions[traj.loss_mask.astype(bool)]
        restart = traj.min_version <= earlier_lives_version or bool(np.isin(sampled, list(segment_starts)).any())
        return Drop("stale", f"{staleness} > {max_staleness}: oldest sampled token at timeline version "
                             f"{timeline_version - staleness} (weight versions {traj.min_version}.."
                             f"{int(traj.versions.max())}), learner at {timeline_version}", restart)
    reason = drop_reason(traj, abnormal)
    if reason is not None:
        return Drop(reason, drop_detail(traj, reason))
    return None
