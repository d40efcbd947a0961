"""Admission control follows AReaL's staleness rule and returns slots of failed episodes."""

from __future__ import annotations

from t1async.actors.controller import Controller
from t1async.config import RolloutConfig


def make(batch=2, eta=1):
    return Controller(RolloutConfig(num_actors=1), ["a", "b", "c"], rollouts_per_version=batch, max_staleness=eta,
                      make_rollout=lambda aid, crash: None, seed=0)


def test_admission_bound_is_version_plus_eta_plus_one_times_batch():
    c = make(batch=2, eta=1)
    got = [c.acquire(0) for _ in range(4)]
    assert all(g in {"a", "b", "c"} for g in got)  # (0 + 1 + 1) * 2 = 4 admitted
    assert c.acquire(0) == ""  # the fifth waits
    c.set_version(1)
    assert c.acquire(0) in {"a", "b", "c"} and c.acquire(0) in {"a", "b", "c"}
    assert c.acquire(0) == ""


def test_failed_episode_returns_its_slot():
    c = make(batch=1, eta=0)
    assert c.acquire(0)
    assert c.acquire(0) == ""
    c.episode_failed(0, "sandbox died")
    assert c.acquire(0) and c.failed_episodes == 1


def test_failed_episodes_are_counted_by_reason_key():
    c = make(batch=10, eta=0)
    for reason in ("SandboxError: the sandbox could not start", "TaskError: RUN step failed: x: y",
                   "SandboxError: sandbox is not running"):
        assert c.acquire(0)
        c.episode_failed(0, reason)
    st = c.status()
    assert st["failed_episodes"] == 3 and st["episode_failures"] == {"SandboxError": 2, "TaskError": 1}
    assert st["started"] == 0  # every slot returned


def test_discarded_trajectory_returns_its_slot():
    c = make(batch=1, eta=0)
    assert c.acquire(0)
    assert c.acquire(0) == ""
    c.trajectory_discarded("stale")
    assert c.acquire(0) and c.discarded == 1


def test_tasks_are_drawn_round_robin_over_shuffles():
    c = make(batch=100, eta=0)
    first = [c.acquire(0) for _ in range(3)]
    assert sorted(first) == ["a", "b", "c"]


def test_stop_and_retire_answer_none():
    c = make()
    c._retired.add(3)
    assert c.acquire(3) is None
    c._stopping = True
    assert c.acquire(0) is None
