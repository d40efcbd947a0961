"""Backing off under memory pressure (t1async/service/memory.py; issue 42 item 2)."""

from __future__ import annotations

from t1async.actors import killed_for_memory
from t1async.service.memory import MemoryBackoff, node_memory_used, ray_memory_threshold


def test_a_memory_kill_halves_the_rollout_actors_once_and_calm_memory_restores_them():
    b = MemoryBackoff(threshold=0.95, margin=0.03, calm_s=60)
    assert b.update(0.50, 8, now=0) == (None, None)
    b.role_killed("learner", now=1)
    target, line = b.update(0.50, 8, now=2)
    assert target == 4 and line.startswith("memory short (Ray's memory monitor killed the learner): rollout actors 8 -> 4")
    assert b.update(0.50, 8, now=20) == (None, None)  # one kill, one cut
    assert b.status()["short"] and b.status()["rollout_actors_reduced_to"] == 4 and b.status()["memory_kills"] == 1
    assert b.update(0.50, 8, now=61) == (None, None)  # not calm for 60 s yet
    assert b.update(0.50, 8, now=63) == (8, "memory is back: rollout actors back to 8")
    assert not b.status()["short"]


def test_memory_that_stays_short_keeps_halving_down_to_one_and_in_between_is_not_calm():
    b = MemoryBackoff(threshold=0.95, margin=0.03, calm_s=60)
    assert b.update(0.93, 8, now=0)[0] == 4  # at threshold - margin: short
    assert b.update(0.93, 8, now=10) == (None, None)  # (a quarter of calm_s between cuts)
    assert b.update(0.94, 8, now=15)[0] == 2
    assert b.update(0.94, 8, now=30)[0] == 1
    assert b.update(0.94, 8, now=45) == (None, None)  # at least one
    assert b.update(0.91, 8, now=200) == (None, None)  # between the marks: not yet back
    assert b.update(0.80, 8, now=230) == (None, None)  # back, but not calm for 60 s since
    assert b.update(0.80, 8, now=300)[0] == 8


def test_rays_threshold_node_memory_and_its_kill_messages():
    assert ray_memory_threshold({}) == 0.95 and ray_memory_threshold({"RAY_memory_usage_threshold": "0.4"}) == 0.4
    assert ray_memory_threshold({"RAY_memory_usage_threshold": "lots"}) == 0.95
    used = node_memory_used()
    assert used is not None and 0 < used < 1
    assert killed_for_memory("Task was killed due to the node running low on memory. Memory on the node ...")
    assert not killed_for_memory("The actor died because its node died")
    # Ray's text for a kill -9 names the OOM killer among its possible causes: not a memory kill
    assert not killed_for_memory("Worker unexpectedly exits with a connection error code 2. End of file. Some common "
                                 "causes include: (1) the process was killed by the OOM killer due to high memory "
                                 "usage, (2) ray stop --force was called, or (3) the worker crashed unexpectedly")


def test_status_says_which_role_rays_memory_monitor_killed_at_which_step_and_that_training_resumed():
    from t1async.service.memory import memory_line

    b = MemoryBackoff(threshold=0.9, margin=0.03, calm_s=60)
    assert memory_line(b.status(), 3, 4) == "no role killed by Ray's memory monitor (threshold 90%)"
    b.role_killed("learner", now=1, step=5)
    b.update(0.5, 4, now=2)
    st = b.status()
    assert st["last_kill"]["role"] == "learner" and st["last_kill"]["step"] == 5
    assert memory_line(st, 5, 4) == ("1 role(s) killed by Ray's memory monitor (threshold 90%): last the learner at step 5, "
                                     "restarted; no step trained since yet; backing off: rollout actors 2 of 4")
    assert memory_line(st, 4, 4).endswith("no step trained since yet; backing off: rollout actors 2 of 4")  # (a learner
    # back on its step-4 checkpoint after the kill at step 5: a fresh operator saw "training resumed (-1 steps since)")
    assert memory_line(st, 8, 4) == ("1 role(s) killed by Ray's memory monitor (threshold 90%): last the learner at step 5, "
                                     "restarted; training resumed (3 steps since); backing off: rollout actors 2 of 4")
    b.update(0.5, 4, now=100)  # calm: the operator's count is back
    assert memory_line(b.status(), 9, 4).endswith("training resumed (4 steps since)")
