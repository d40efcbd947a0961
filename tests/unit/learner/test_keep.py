"""The learner's keep-or-drop decision of a received trajectory (t1async/learner/keep.py): pure, no sockets."""

from __future__ import annotations

import numpy as np

from t1async.config import AbnormalConfig
from t1async.learner.keep import Drop, keep_or_drop
from t1async.trajectory import TURN_ABORTED, Trajectory


def trajectory(versions: tuple[int, int] = (3, 4), T: int = 12, **kw) -> Trajectory:
    """Two assistant turns, [2, 5) sampled at weight version ``versions[0]``, [8, 12) at ``versions[1]``."""
    mask = np.zeros(T, np.uint8)
    mask[2:5] = mask[8:12] = 1
    v = np.full(T, -1, np.int32)
    v[2:5], v[8:12] = versions
    rng = np.random.default_rng(0)
    return Trajectory(task="t", actor_id=0, token_ids=rng.integers(0, 64, T).astype(np.uint32), loss_mask=mask,
                      logprobs=np.where(mask == 1, -1.0, 0.0).astype(np.float32), versions=v,
                      turn_offsets=np.array([[2, 5], [8, 12]], np.int32),
                      routed_experts=np.zeros((T - 1, 1, 1), np.uint8), num_experts=2, reward=1.0, passed=1, total=1,
                      resolved=True, finish_reason="exit", tests=[("a", True)], **kw)


def decide(traj: Trajectory, staleness: int, **kw) -> Drop | None:
    args = dict(staleness=staleness, max_staleness=2, timeline_version=7, earlier_lives_version=-1,
                segment_starts=[0], abnormal=AbnormalConfig())
    return keep_or_drop(traj, **{**args, **kw})


def test_the_staleness_bound_is_inclusive_and_a_stale_drop_says_by_how_much():
    assert decide(trajectory(), staleness=2) is None
    assert decide(trajectory(), staleness=-1) is None  # sampled on a lost life's branch: not stale
    drop = decide(trajectory(), staleness=3)
    assert drop is not None and drop.reason == "stale" and not drop.restart
    assert "3 > 2" in drop.detail and "timeline version 4" in drop.detail and "weight versions 3..4" in drop.detail


def test_a_stale_drop_sampled_by_an_earlier_life_or_at_a_new_timeline_segment_counts_as_a_restart_drop():
    assert decide(trajectory(), staleness=3, earlier_lives_version=3).restart  # its oldest token: an earlier life's
    assert not decide(trajectory(), staleness=3, earlier_lives_version=2).restart
    assert decide(trajectory(), staleness=3, segment_starts=[0, 4]).restart  # a turn sampled at a segment start
    assert not decide(trajectory(), staleness=3, segment_starts=[0, 5]).restart


def test_abnormal_ends_are_judged_after_staleness():
    broken = trajectory(verifier_error="verifier timed out after 60 s")
    drop = decide(broken, staleness=0)
    assert drop == Drop("verifier_error", "verifier timed out after 60 s")
    assert decide(broken, staleness=3).reason == "stale"  # (counted once, as stale)
    aborted = trajectory(turn_status=np.array([0, TURN_ABORTED], np.uint8))  # learner.abnormal.aborted: drop
    assert decide(aborted, staleness=0).reason == "aborted"
    assert decide(aborted, staleness=0, abnormal=AbnormalConfig(aborted="train")) is None
