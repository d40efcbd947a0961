"""More than one machine: role placement by Ray node resources (``ray.placement``), soft after a node
loss, and the three-node Ray cluster on this machine that loses a worker node mid-run
(``t1async bench multinode``, slow)."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys

import pytest

from t1async.config import ConfigError, load_config
from tests.support import REPO


def _id(name: str) -> str:
    """A node id (56 hex digits, as Ray's) that sorts as ``name`` does."""
    return name.encode().hex().ljust(56, "0")


def _node(name: str, alive: bool, **resources: float) -> dict:
    return {"NodeID": _id(name), "Alive": alive, "Resources": {"CPU": 1.0, **resources}}


def test_multinode_config_places_the_learner_apart_from_samplers_and_rollout_actors():
    cfg = load_config(REPO / "configs" / "multinode.yaml")
    assert cfg.ray.placement == {"learner": "learner_node", "controller": "learner_node",
                                 "sampler": "rollout_node", "rollout": "rollout_node"}
    assert load_config(REPO / "configs" / "local.yaml").ray.placement == {}


@pytest.mark.parametrize("bad", ["ray.placement={lerner: learner_node}", "ray.placement={learner: CPU}",
                                 "ray.placement={rollout: ''}"])
def test_a_placement_of_an_unknown_role_or_a_builtin_resource_is_refused_in_one_line(bad):
    with pytest.raises(ConfigError, match=r"ray\.placement=.* is invalid: use a mapping of roles \(learner, "
                                          r"controller, sampler, rollout\) to custom Ray resource names"):
        load_config(None, [bad])


def test_placement_takes_the_live_nodes_marked_for_the_role_in_turn_and_falls_back_to_any_when_none_is_left():
    from t1async.service.launch import PLACEMENT_SHARE, placement_options

    nodes = [_node("h", True, learner_node=1), _node("w2", True, rollout_node=1), _node("w1", True, rollout_node=1),
             _node("w0", False, rollout_node=1)]
    up = {"h", "w1", "w2"}

    def where(role, resource, turn):
        opts = placement_options(role, resource, nodes, turn, reachable=lambda n: n["NodeID"] in map(_id, up))
        if not opts:
            return None
        assert opts["resources"] == {resource: PLACEMENT_SHARE} and opts["scheduling_strategy"].soft
        return bytes.fromhex(opts["scheduling_strategy"].node_id.rstrip("0")).decode()

    assert [where("rollout", "rollout_node", t) for t in range(4)] == ["w1", "w2", "w1", "w2"]  # in turn, not w0
    assert PLACEMENT_SHARE * 1000 <= 1  # a node marked 1 holds 1,000 actors of the role: a mark, not a capacity
    up.discard("w2")  # lost, not yet marked dead by Ray: its raylet does not answer, so no new actor goes there
    assert [where("rollout", "rollout_node", t) for t in range(2)] == ["w1", "w1"]
    nodes[2]["Alive"] = False  # the last rollout node is lost: anywhere (soft), not pending for ever
    assert where("rollout", "rollout_node", 0) is None
    assert where("learner", "learner_node", 5) == "h"


def test_raylet_reachable_is_false_for_a_port_nobody_listens_on():
    import socket

    from t1async.service.launch import raylet_reachable

    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        port = srv.getsockname()[1]
        assert raylet_reachable({"NodeManagerAddress": "127.0.0.1", "NodeManagerPort": port})
    assert not raylet_reachable({"NodeManagerAddress": "127.0.0.1", "NodeManagerPort": port})
    assert not raylet_reachable({})


class _FakeActorClass:
    def __init__(self):
        self.started: list[tuple[dict, tuple]] = []

    def options(self, **options):
        return type("Opts", (), {"remote": lambda _, *args: self.started.append((options, args)) or len(self.started)})()


def test_each_start_of_a_placed_role_reads_the_node_table_again(monkeypatch):
    """A restart after a node loss sees the nodes left (the table is read at each start, also in the
    controller's process, which gets the placed class pickled)."""
    import ray

    from t1async.service import launch

    table = [_node("w1", True, rollout_node=1)]
    monkeypatch.setattr(ray, "nodes", lambda: table)
    monkeypatch.setattr(launch, "raylet_reachable", lambda n: True)
    placed = pickle.loads(pickle.dumps(launch.PlacedActor(_FakeActorClass(), "rollout", "rollout_node")))
    placed.remote(0)
    table[0]["Alive"] = False
    placed.remote(1)
    (first, a0), (second, a1) = placed.actor_class.started
    assert first["resources"] == {"rollout_node": 0.001} and first["scheduling_strategy"].node_id == _id("w1")
    assert a0 == (0,) and second == {} and a1 == (1,)


def test_only_the_roles_named_in_ray_placement_are_placed(tmp_path):
    from t1async.actors.learner import Learner
    from t1async.actors.rollout import RolloutActor
    from t1async.config import RayConfig, RunConfig
    from t1async.service.launch import PlacedActor, _actor_factory

    actor = _actor_factory(tmp_path, RunConfig(), RayConfig(placement={"rollout": "rollout_node"}))
    rollout, learner = actor(RolloutActor, "rollout"), actor(Learner, "learner")
    assert isinstance(rollout, PlacedActor) and (rollout.role, rollout.resource) == ("rollout", "rollout_node")
    assert not isinstance(learner, PlacedActor) and hasattr(learner, "options")
    assert actor(RolloutActor, "rollout1").turns is rollout.turns  # one count per role: each start takes the next node


def test_samplers_started_one_class_each_still_take_the_nodes_in_turn(monkeypatch):
    import ray

    from t1async.service import launch

    monkeypatch.setattr(ray, "nodes", lambda: [_node("w1", True, rollout_node=1), _node("w2", True, rollout_node=1)])
    monkeypatch.setattr(launch, "raylet_reachable", lambda n: True)
    turns: dict[str, int] = {}
    fakes = [_FakeActorClass() for _ in range(3)]
    for fake in fakes:  # as start_sampler does: a placed class per sampler
        launch.PlacedActor(fake, "sampler", "rollout_node", turns).remote()
    assert [f.started[0][0]["scheduling_strategy"].node_id for f in fakes] == [_id("w1"), _id("w2"), _id("w1")]


@pytest.mark.slow
def test_three_ray_nodes_lose_a_worker_node_mid_run_and_its_roles_come_back_with_nothing_lost(tmp_path):
    """A head (learner_node: learner, controller) and two workers (rollout_node: samplers, rollout
    actors) started with ``ray start``; tcp + CurveZMQ, gloo weight sync across node processes. The
    worker holding the most roles is SIGKILLed whole; its roles come back on the worker left, the run
    trains on, and the ledger shows 0 lost and 0 trained twice."""
    proc = subprocess.run([sys.executable, "-m", "t1async.cli", "bench", "multinode", "--out", str(tmp_path),
                           "--timeout-s", "240"], capture_output=True, text=True, timeout=900, cwd=REPO)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    print(json.dumps(res, indent=1))
    before, after, victim = res["placement_before"], res["placement_after"], res["victim"]
    assert before["learner"] == ["head"] and before["controller"] == ["head"]
    assert before["sampler"] == before["rollout"] == ["worker1", "worker2"]  # on the workers, one of each per node
    assert res["victim_roles"] and res["victim_processes_killed"] > 0
    assert victim not in sum(after.values(), [])  # nothing left on the lost node ...
    assert len(after["sampler"]) == len(before["sampler"]) and len(after["rollout"]) == len(before["rollout"])
    survivor = ({"worker1", "worker2"} - {victim}).pop()
    assert set(after["sampler"] + after["rollout"]) == {survivor}  # ... it came back on the worker left
    assert after["learner"] == ["head"]
    led = res["ledger"]
    assert led["lost"] == 0 and led["duplicates_trained"] == 0 and led["sent"] > 0 and led["trained"] > 0, led
    assert res["launch_rc"] == 0 and res["restarts"]["samplers"] >= res["victim_roles"].get("sampler", 0)
