"""The bound on rollout actors and samplers (t1async/service/capacity.py) and the controller's
scale-down (issue 42 item 1: one ``scale rollout.num_actors=10000`` flooded the node)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from t1async.config import RayConfig, RolloutConfig, load_config
from t1async.service.capacity import Capacity, clamp_counts, cluster_capacity, scale_refusal

MEM = {"learner": 1000, "controller": 100, "sampler": 500, "rollout": 200}


def test_the_bound_is_the_smaller_of_cpus_and_memory_and_at_least_one():
    cap = Capacity(cpus=2, memory_mb=1000 + 100 + 500 + 3 * 200 + 150, role_memory_mb=MEM, rollouts_per_cpu=8)
    assert cap.max_rollout_actors(num_samplers=1) == 3  # memory: 3 x 200 MB beside one sampler
    assert cap.max_rollout_actors(num_samplers=0) == 6  # (2,350 - 1,100) // 200
    assert Capacity(2, 10**6, MEM, 8).max_rollout_actors(1) == 16  # CPUs: 2 x 8
    assert Capacity(2, 10**6, MEM, 8).max_samplers(3) == 2  # a sampler computes: one per CPU
    assert Capacity(2, 100, MEM, 8).max_rollout_actors(1) == 1 and Capacity(2, 100, MEM, 8).max_samplers(1) == 1


def test_cluster_capacity_reads_rays_resources_or_the_configured_memory():
    cap = cluster_capacity(RayConfig(), {"CPU": 2.0, "memory": 15 * 2**30})
    assert cap.cpus == 2 and cap.memory_mb == 15 * 1024 and cap.role_memory_mb == RayConfig().role_memory_mb
    assert cluster_capacity(RayConfig(memory_mb=3000), {"CPU": 2.0, "memory": 15 * 2**30}).memory_mb == 3000


def test_scale_past_the_bound_is_refused_in_one_line_naming_the_most():
    cap = Capacity(cpus=2, memory_mb=2800, role_memory_mb=MEM, rollouts_per_cpu=8)
    why = scale_refusal(cap, 10000, 1, {"rollout.num_actors": 10000})
    assert why.startswith("scale: rollout.num_actors=10000 is more than this Ray cluster can hold: at most 6 ")
    assert why.endswith("add --force to scale past it") and "\n" not in why
    assert scale_refusal(cap, 6, 1, {"rollout.num_actors": 6}) is None
    assert scale_refusal(cap, 6, 3, {"sampler.num_samplers": 3}).startswith("scale: sampler.num_samplers=3 is more")
    assert scale_refusal(cap, 10000, 1, {"learner.lr": 1e-4}) is None  # (counts not changed by this request)


def test_a_launch_clamps_its_counts_with_a_note_each():
    cap = Capacity(cpus=2, memory_mb=2800, role_memory_mb=MEM, rollouts_per_cpu=8)
    assert clamp_counts(cap, 3, 1) == (3, 1, [])
    actors, samplers, notes = clamp_counts(cap, 10000, 5)
    assert (actors, samplers) == (3, 2) and len(notes) == 2  # 2 samplers (CPUs), 3 actors beside them
    assert notes[1].startswith("rollout.num_actors=10000 lowered to 3, what this Ray cluster can hold")


def test_the_service_refuses_a_scale_past_the_bound_unless_forced(tmp_path, monkeypatch):
    from t1async.service import service as service_mod

    calls = []
    controller = SimpleNamespace(scale=SimpleNamespace(remote=lambda n: calls.append(n)))
    monkeypatch.setattr(service_mod.ray, "get", lambda ref, timeout=None: ref)  # (no Ray)
    cfg = load_config(None, ["run.tensorboard=false"])
    cap = Capacity(cpus=2, memory_mb=2800, role_memory_mb=MEM, rollouts_per_cpu=8)
    service = service_mod.Service(cfg, tmp_path, {"controller": controller}, restart_learner=lambda: None,
                                  check_tasks=lambda names: None, capacity=cap)
    with pytest.raises(ValueError, match=r"^scale: rollout.num_actors=10000 is more than this Ray cluster can hold"):
        service.scale({"changes": {"rollout.num_actors": 10000}})
    assert calls == [] and not (tmp_path / "config_history.jsonl").exists()  # nothing applied or recorded
    assert service.scale({"changes": {"rollout.num_actors": 7}, "force": True})["applied"] == {"rollout.num_actors": 7}
    assert calls == [7] and '"source": "t1async scale --force"' in (tmp_path / "config_history.jsonl").read_text()


def test_scale_down_kills_actors_never_admitted_at_once_and_starts_few_per_tick(monkeypatch):
    """A scale-down left the actors a flood had queued in Ray pending; now those never admitted an
    episode are killed at once, one with an episode running finishes it; starts are spread over ticks."""
    import ray

    from t1async.actors.controller import Controller
    from t1async.rollout.fleet import START_PER_TICK

    killed = []
    monkeypatch.setattr(ray, "kill", lambda handle, no_restart=True: killed.append(handle.aid))

    def make(aid, crash):
        return SimpleNamespace(aid=aid, run=SimpleNamespace(remote=lambda me: f"ref{aid}"))

    c = Controller(RolloutConfig(num_actors=10), ["a", "b"], rollouts_per_version=1, max_staleness=0,
                   make_rollout=make, seed=0)
    c._reconcile(None)
    assert len(c._actors) == START_PER_TICK  # not 10 at once
    c._reconcile(None)
    c._reconcile(None)
    assert len(c._actors) == 10
    assert c.acquire(0)  # actor 0 runs an episode (the only one admission allows)
    c.scale(1)
    c._reconcile(None)
    assert sorted(killed) == list(range(1, 10)) and sorted(c._actors) == [0]  # cancelled at once, not pending
    c.scale(0)
    c._reconcile(None)
    assert 0 in c._actors and 0 in c._retired and killed.count(0) == 0  # finishes its episode first
    assert c.acquire(0) is None  # ...then is told to stop
