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


def _simulate(controller_cls, *, durations: dict[str, float], steps: int, batch: int, bound: int, actors: int):
    """Rollout actors and a learner as threads around a real Controller: each episode takes its
    task's duration and is sampled at the version admission saw; the learner takes trajectories in
    arrival order, drops those beyond the staleness bound (as actors/learner.py does), trains
    ``batch`` per step and publishes a version per step. Returns (started, trained, dropped) task lists."""
    import queue
    import threading
    import time
    import uuid

    c = controller_cls(RolloutConfig(num_actors=0), sorted(durations), rollouts_per_version=batch,
                       max_staleness=bound, make_rollout=None, seed=1)
    started, trained, dropped = [], [], []
    inbox: queue.Queue = queue.Queue()
    done = threading.Event()

    def actor(aid: int) -> None:
        while not done.is_set():
            name = c.acquire(aid)
            if name is None:
                return
            if name == "":
                continue
            version = c.status()["version"]  # the sampler holds at least the version admission saw
            started.append(name)
            time.sleep(durations[name])
            tid = uuid.uuid4().hex
            c.episode_finished(aid, tid)
            inbox.put((tid, name, version))

    threads = [threading.Thread(target=actor, args=(i,), daemon=True) for i in range(actors)]
    for t in threads:
        t.start()
    version = 0
    for _ in range(steps):
        got = []
        while len(got) < batch:
            tid, name, v = inbox.get(timeout=30)
            if version - v > bound:
                dropped.append(name)
                c.trajectory_discarded("stale", tid)
                continue
            got.append((tid, name))
        trained += [n for _, n in got]
        c.trajectories_consumed([tid for tid, _ in got])
        version += 1
        c.set_version(version)
    done.set()
    c._stopping = True  # end admission without Ray (Controller.stop kills Ray actors)
    for t in threads:
        t.join(timeout=5)
    return started, trained, dropped


def test_slow_tasks_keep_their_share_of_training():
    """3 fast tasks and one slow one (a long verifier), staleness bound 1: each task's share of the
    trajectories trained stays within 5 points of its share of the episodes started, with no
    stale drops (admission measured from the oldest unfinished episode)."""
    durations = {"fast-a": 0.002, "fast-b": 0.002, "fast-c": 0.002, "slow": 0.15}
    started, trained, dropped = _simulate(Controller, durations=durations, steps=60, batch=4, bound=1, actors=4)
    assert not dropped
    for name in durations:
        share_started = started.count(name) / len(started)
        share_trained = trained.count(name) / len(trained)
        assert abs(share_started - share_trained) <= 0.05, (name, share_started, share_trained)
