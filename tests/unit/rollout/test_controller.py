"""Admission control follows AReaL's staleness rule and returns slots of failed episodes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from t1async.actors.controller import Controller
from t1async.config import RolloutConfig
from tests.support import REPO


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
    assert c.acquire(0) and c.ledger.failed_episodes == 1


def test_failed_episodes_are_counted_by_reason_key():
    c = make(batch=10, eta=0)
    for reason in ("SandboxError: the sandbox could not start", "TaskError: RUN step failed: x: y",
                   "SandboxError: sandbox is not running"):
        assert c.acquire(0)
        c.episode_failed(0, reason)
    st = c.status()
    assert st["failed_episodes"] == 3 and st["episode_failures"] == {"SandboxError": 2, "TaskError": 1}
    assert st["started"] == 0  # every slot returned
    assert st["episode_failures_by_agent"] == {"builtin": 3}  # (a caller that names no agent: the builtin loop)


def test_failed_episodes_are_counted_by_the_agent_drawn_for_them():
    """A harness episode that fails before its first completion (context_full, a harness that exits) sends
    no trajectory, so no metrics row's ``by_agent`` counts it: the controller does, per agent."""
    c = make(batch=10, eta=0)
    for agent in ("codex", "claude-code", "codex"):
        assert c.acquire(0)
        c.episode_failed(0, "AgentError: the harness's first request does not fit the context", agent)
    assert c.status()["episode_failures_by_agent"] == {"codex": 2, "claude-code": 1}


def test_discarded_trajectory_returns_its_slot():
    c = make(batch=1, eta=0)
    assert c.acquire(0)
    assert c.acquire(0) == ""
    c.trajectory_discarded("stale")
    assert c.acquire(0) and c.ledger.discarded == 1


def test_tasks_are_drawn_round_robin_over_shuffles():
    c = make(batch=100, eta=0)
    first = [c.acquire(0) for _ in range(3)]
    assert sorted(first) == ["a", "b", "c"]


def test_group_size_admits_each_task_that_many_times_in_a_row():
    c = Controller(RolloutConfig(num_actors=1, group_size=3), ["a", "b", "c"], rollouts_per_version=100,
                   max_staleness=0, make_rollout=lambda aid, crash: None, seed=0)
    got = [c.acquire(0) for _ in range(9)]
    assert [got[i:i + 3] for i in range(0, 9, 3)] == [[t] * 3 for t in got[::3]]
    assert sorted(got[::3]) == ["a", "b", "c"]  # still one pass over the shuffled tasks


def test_stop_and_retire_answer_none():
    c = make()
    c._retired.add(3)
    assert c.acquire(3) is None
    c._stopping = True
    assert c.acquire(0) is None


@pytest.fixture(scope="module")
def admission_bench() -> dict:
    """``t1async bench admission`` at its defaults (3 fast tasks and one slow one of 0.15 s, 60 steps,
    batch 4, bound 1, 4 actors; each rule run around a real Controller): its JSON, per rule."""
    out = subprocess.run([sys.executable, str(REPO / "tools" / "bench_admission.py")], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


@pytest.mark.slow
def test_slow_tasks_keep_their_share_of_training(admission_bench):
    """3 fast tasks and one slow one (a long verifier), staleness bound 1: each task's share of the
    trajectories trained stays within 5 points of its share of the episodes started, with no
    stale drops (admission measured from the oldest unfinished episode). The workload is
    ``t1async bench admission``'s, which shows AReaL's rule beside it."""
    rule = admission_bench["oldest_episode"]
    assert rule["dropped_stale"] == 0 and rule["trained"] > 0
    assert rule["max_share_gap_points"] <= 5.0  # the largest gap over every task


def test_bound_zero_is_synchronous_rl():
    """``learner.max_staleness=0`` is the synchronous mode: each version's batch is started on that
    version only, the learner waits for all of it, and nothing starts between its last episode
    and the next publication, so every trajectory trains at staleness 0. Real controller, actors
    and a learner loop as threads (as in ``t1async bench admission``), episodes of random length."""
    import queue
    import random
    import threading
    import time
    import uuid

    batch, steps = 4, 6
    c = make(batch=batch, eta=0)
    inbox: queue.Queue = queue.Queue()
    started_at: list[int] = []  # admission version of every episode started

    def actor(aid: int) -> None:
        rng = random.Random(aid)
        while True:
            name = c.acquire(aid)
            if name is None:
                return
            if name == "":
                continue
            version = c.ledger.version
            started_at.append(version)
            time.sleep(rng.choice((0.001, 0.005, 0.03)))  # a long tail within each batch
            tid = uuid.uuid4().hex
            c.episode_finished(aid, tid)
            inbox.put((tid, version))

    threads = [threading.Thread(target=actor, args=(i,), daemon=True) for i in range(2 * batch)]
    for t in threads:
        t.start()
    try:
        for version in range(steps):
            got = [inbox.get(timeout=10) for _ in range(batch)]
            assert {v for _, v in got} == {version}  # one version per batch, the learner's: staleness 0
            c.trajectories_consumed([tid for tid, _ in got])
            time.sleep(0.05)  # training: admission must stay shut until the publication
            assert len(started_at) == (version + 1) * batch and inbox.empty() and c.status()["running"] == 0
            c.set_version(version + 1)
    finally:
        c._stopping = True  # end admission without Ray (Controller.stop also kills Ray actors)
        for t in threads:
            t.join(timeout=5)
    assert started_at[: steps * batch] == sorted(started_at[: steps * batch])


def test_learner_version_rule_lets_fast_episodes_overtake_a_slow_one():
    """``rollout.admission: learner_version`` (AReaL's rule): an unfinished episode of version 0 does
    not hold admission back once the learner publishes; under the default rule it does."""
    for rule, opens in (("learner_version", True), ("oldest_episode", False)):
        c = Controller(RolloutConfig(num_actors=1, admission=rule), ["a"], rollouts_per_version=1, max_staleness=1,
                       make_rollout=lambda aid, crash: None, seed=0)
        assert c.acquire(0)  # the slow episode, still running on version 0
        assert c.acquire(1)  # rollout 1's episode ...
        c.episode_finished(1, "t1")
        c.trajectories_consumed(["t1"])  # ... trained, and version 1 published
        c.set_version(1)
        assert bool(c.acquire(1)) is opens, rule


def test_extra_segments_of_an_episode_take_and_return_their_own_slots():
    """An external agent's episode split into 3 exact segments is 3 trajectories for the learner: they take
    3 slots, hold admission at their version until consumed, and a discarded one returns only its own
    (``oldest_episode``, the rule under which pending trajectories hold admission)."""
    c = Controller(RolloutConfig(num_actors=1, admission="oldest_episode"), ["a", "b", "c"], rollouts_per_version=2,
                   max_staleness=0, make_rollout=lambda aid, crash: None, seed=0)
    assert c.acquire(0)
    c.episode_finished(0, "last", ["seg0", "seg1"])
    assert c.ledger.started == 3 and c.acquire(0) == ""  # (0 + 0 + 1) x 2 = 2 slots, 3 taken
    c.trajectory_discarded("stale", "seg0")
    assert c.ledger.started == 2 and c.acquire(0) == ""
    c.set_version(1)
    assert c.oldest_version() == 0  # seg1 and last are still pending at version 0
    c.trajectories_consumed(["seg1", "last"])
    assert c.oldest_version() == 1 and c.acquire(0)


def test_learner_wait_admits_as_areal_and_allows_a_publish_only_within_every_unheld_episodes_bound():
    """``learner_wait``: admission follows the learner's version (a slow episode does not hold it),
    and :meth:`publish_allowed` refuses a version that would leave an episode the learner does not
    hold yet (running, or sent and on its way) more than ``max_staleness`` versions behind; the
    other rules never hold a publish."""
    c = Controller(RolloutConfig(num_actors=1, admission="learner_wait"), ["a"], rollouts_per_version=1,
                   max_staleness=1, make_rollout=lambda aid, crash: None, seed=0)
    assert c.holds_publish()
    assert c.acquire(0) and c.acquire(1)  # the slow one (actor 0) and a fast one, version 0
    c.episode_finished(1, "f1")
    assert c.publish_allowed(1, ["f1"])  # the slow one would be 1 behind: allowed
    c.trajectories_consumed(["f1"])
    c.set_version(1)
    assert c.acquire(1)  # admission follows the learner, not the slow episode
    c.episode_finished(1, "f2")
    assert not c.publish_allowed(2, ["f2"])  # the slow one, still running, would be 2 behind
    c.episode_finished(0, "slow")
    assert not c.publish_allowed(2, ["f2"])  # sent, not yet held by the learner
    assert c.publish_allowed(2, ["f2", "slow"])  # held: the learner judges it by its own versions
    for rule in ("oldest_episode", "learner_version"):
        o = Controller(RolloutConfig(num_actors=1, admission=rule), ["a"], rollouts_per_version=1, max_staleness=0,
                       make_rollout=lambda aid, crash: None, seed=0)
        assert o.acquire(0) and not o.holds_publish() and o.publish_allowed(5, [])


def test_a_timeline_that_goes_back_lowers_the_admission_of_unconsumed_episodes():
    """A resumed learner reports its checkpoint's (lower) timeline version; its samplers may then sample at
    that version, so an episode admitted later and not yet consumed counts from it: learner_wait refuses
    the publish that would leave it more than max_staleness behind (which it allowed before the resume)."""
    c = Controller(RolloutConfig(num_actors=1, admission="learner_wait"), ["a"], rollouts_per_version=1,
                   max_staleness=2, make_rollout=lambda aid, crash: None, seed=0)
    c.set_version(3)
    assert c.acquire(0) and c.acquire(1)  # admitted at 3
    c.episode_finished(1, "done")  # on its way to the learner
    assert c.publish_allowed(5, [])  # 5 - 3 <= 2
    c.set_version(2)  # the learner resumed from a checkpoint at timeline version 2
    assert c.oldest_version() == 2
    assert not c.publish_allowed(5, [])  # 5 - 2 > 2: hold until they arrive
    assert not c.publish_allowed(5, ["done"])  # the running one still holds it
    c.episode_finished(0, "late")
    assert c.publish_allowed(5, ["done", "late"]) and c.publish_allowed(4, [])
    c.set_version(4)  # going forward changes no admission version
    assert not c.publish_allowed(5, [])


def test_learner_wait_keeps_slow_tasks_share_of_training_without_drops(admission_bench):
    """The workload of test_slow_tasks_keep_their_share_of_training under ``learner_wait``: the
    actors run ahead of the slow episodes, the learner waits for them instead of dropping them,
    so each task's share of training stays within 5 points of its share of episodes started."""
    rule = admission_bench["learner_wait"]
    assert rule["dropped_stale"] == 0 and rule["trained"] > 0
    assert rule["max_share_gap_points"] <= 5.0  # the largest gap over every task


def test_admission_rules_are_pure_functions_of_the_counts():
    """The rules of t1async/rollout/admission.py, without a controller: the window, the base
    version each rule counts it from, and the learner-side publish hold."""
    from t1async.rollout.admission import ADMISSION_RULES, may_start, publish_allowed

    assert may_start(7, 0, 1, 4) and not may_start(8, 0, 1, 4)  # (0 + 1 + 1) x 4 = 8 slots
    assert ADMISSION_RULES["oldest_episode"].base_version(5, [3, 4]) == 3
    assert ADMISSION_RULES["oldest_episode"].base_version(5, []) == 5
    assert ADMISSION_RULES["learner_version"].base_version(5, [3]) == 5
    assert [n for n, r in ADMISSION_RULES.items() if r.holds_publish] == ["learner_wait"]
    assert publish_allowed(4, [], 1) and publish_allowed(4, [3, 5], 1) and not publish_allowed(4, [2], 1)


def test_every_admission_rule_is_a_config_value():
    from t1async.config import ConfigError, load_config
    from t1async.rollout.admission import ADMISSION_RULES

    for name in ADMISSION_RULES:
        assert load_config(None, [f"rollout.admission={name}"]).rollout.admission == name
    with pytest.raises(ConfigError):
        load_config(None, ["rollout.admission=nope"])


@pytest.mark.slow
def test_a_controller_of_a_resumed_run_admits_only_the_bound_past_the_learners_position():
    """Issue 42 item 4: a resumed launch's new controller counted admissions from 0 while the learner
    resumed at timeline version 17, so (17 + 2 + 1) x R episodes were admitted at once at the old
    version, and most were dropped as stale once the learner re-trained its backlog."""
    from t1async.rollout.admission import resumed_admissions

    r, eta = 8, 2
    resumed = {"timeline_version": 17, "trained": 17 * r + 4, "to_replay": 5}  # mid-version, a receive-log backlog
    c = Controller(RolloutConfig(num_actors=1), ["a", "b", "c"], rollouts_per_version=r, max_staleness=eta,
                   make_rollout=lambda aid, crash: None, seed=0, resumed=resumed)
    admitted = 0
    while c.acquire(admitted):
        assert c.status()["version"] == 17 and c.ledger.running[admitted] == 17  # admitted at the resumed version
        admitted += 1
    assert admitted == (17 + eta + 1) * r - resumed_admissions(17 * r + 4, 5) == 15  # not (17 + 2 + 1) x 8 = 160
    c.set_version(18)  # the learner trained the backlog and one more version: R more
    assert sum(bool(c.acquire(100 + i)) for i in range(2 * r)) == r
    assert resumed_admissions(-1, 3) == 3  # (an absent counter never widens the window past a new run's)
