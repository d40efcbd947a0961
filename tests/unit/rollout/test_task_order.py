"""The task order continues across a resume: saved with each checkpoint, restored by the resumed
controller, so a resumed run never replays the stream's head (t1async/rollout/task_order.py)."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import textwrap
import time
from dataclasses import asdict
from pathlib import Path

import pytest

from t1async.actors.controller import Controller
from t1async.actors.learner import Learner
from t1async.config import LearnerConfig, RolloutConfig, TransportConfig, WeightSyncConfig
from t1async.rollout.task_order import TaskOrder, read_task_order, write_task_order
from t1async.trajectory import encode
from t1async.transport.transport import ZmqSender
from tests.support import REPO
from tests.support.delivery_fakes import MODEL, synthetic

TASKS = [f"task-{i}" for i in range(8)]


def stream(n: int, tasks=TASKS, group_size: int = 1, seed: int = 0) -> list[str]:
    order = TaskOrder(tasks, group_size, seed)
    return [order.draw() for _ in range(n)]


@pytest.mark.parametrize("group_size", [1, 3])
def test_an_order_restored_at_any_position_continues_the_uninterrupted_stream(group_size, tmp_path):
    n = 3 * len(TASKS) * group_size  # three passes
    whole = stream(n, group_size=group_size)
    for p in range(n + 1):
        first = TaskOrder(TASKS, group_size, seed=0)
        head = [first.draw() for _ in range(p)]
        write_task_order(tmp_path, first.state())  # through the file a checkpoint holds
        second = TaskOrder(TASKS, group_size, seed=0)
        assert second.restore(read_task_order(tmp_path)) is None
        assert head + [second.draw() for _ in range(n - p)] == whole, p
        assert second.drawn == n and second.passes == 3
    # (p inside a group: the group's remaining episodes come first, as in the uninterrupted stream)
    assert whole[:group_size] == [whole[0]] * group_size


def test_the_state_stays_small_and_a_live_task_change_is_continued_too(tmp_path):
    many = [f"t{i}" for i in range(5000)]
    order = TaskOrder(many, 8, seed=3)
    for _ in range(100):
        order.draw()
    assert len(json.dumps(order.state())) < 16_000  # the pass is dealt again, not stored
    order = TaskOrder(TASKS, 1, seed=0)
    [order.draw() for _ in range(3)]
    order.set_tasks(TASKS[:4])  # t1async scale env.tasks=[...]: the pass in progress is dropped
    state = order.state()
    after = [order.draw() for _ in range(9)]
    again = TaskOrder(TASKS[:4], 1, seed=0)  # a resume applies the live change before its controller starts
    assert again.restore(state) is None and [again.draw() for _ in range(9)] == after


def test_other_tasks_drop_the_saved_pass_but_never_restart_the_head():
    order = TaskOrder(TASKS, 1, seed=0)
    [order.draw() for _ in range(11)]
    other = TASKS[:7]
    resumed = TaskOrder(other, 1, seed=0)
    note = resumed.restore(order.state())
    assert note and "differ" in note and "8 tasks" in note
    got = [resumed.draw() for _ in range(7)]
    assert sorted(got) == sorted(other) and got != stream(7, tasks=other)
    assert resumed.drawn == 18


def test_a_bad_state_is_refused_naming_what_is_wrong_and_the_controller_starts_over(tmp_path):
    with pytest.raises(ValueError, match="not a task-order state.*pass_rng"):
        TaskOrder(TASKS).restore({"format": 1, "drawn": 3})
    with pytest.raises(ValueError, match="format 7"):
        TaskOrder(TASKS).restore({"format": 7})
    (tmp_path / "task_order.json").write_text("{not json")
    with pytest.raises(ValueError, match="task_order.json.*delete it"):
        read_task_order(tmp_path)
    assert read_task_order(tmp_path / "nothing") is None and read_task_order(None) is None
    c = Controller(RolloutConfig(num_actors=1), TASKS, rollouts_per_version=100, max_staleness=0,
                   make_rollout=lambda aid, crash: None, seed=0, task_order={"format": 1})
    assert [c.acquire(0) for _ in range(4)] == stream(4)


def test_a_controller_given_a_saved_order_continues_it_instead_of_replaying_the_head():
    def make(**kw):
        return Controller(RolloutConfig(num_actors=1, group_size=2), TASKS, rollouts_per_version=100,
                          max_staleness=0, make_rollout=lambda aid, crash: None, seed=0, **kw)

    first = make()
    head = [first.acquire(0) for _ in range(12)]
    saved = first.task_order_state()
    rest = [first.acquire(0) for _ in range(12)]
    second = make(task_order=json.loads(json.dumps(saved)))
    got = [second.acquire(0) for _ in range(12)]
    assert got == rest and got != head
    assert second.status()["tasks_drawn"] == 24


def test_each_checkpoint_holds_the_controllers_task_order_of_that_step(tmp_path):
    ctl = Controller(RolloutConfig(num_actors=1, group_size=2), TASKS, rollouts_per_version=100, max_staleness=0,
                     make_rollout=lambda aid, crash: None, seed=0)
    drawn = [ctl.acquire(0) for _ in range(5)]
    cfg = LearnerConfig(max_steps=1, batch_size=1, publish_every=1000, checkpoint_every=1, batch_timeout_s=60)
    learner = Learner(cfg, MODEL, TransportConfig(curve=False), WeightSyncConfig(), str(tmp_path), seed=0)
    try:
        tx = ZmqSender(learner.endpoint())
        tx.send("traj-00001", encode(synthetic(1)))
        assert learner.run(ctl)["step"] == 1
        tx.close()
    finally:
        learner.close()
    saved = read_task_order(tmp_path / "checkpoints" / "step_000001")
    assert saved == ctl.task_order_state() and saved["drawn"] == 5 and saved["pass_taken"] == 5
    again = Controller(RolloutConfig(num_actors=1, group_size=2), TASKS, rollouts_per_version=100, max_staleness=0,
                       make_rollout=lambda aid, crash: None, seed=0, task_order=saved)
    assert drawn + [again.acquire(0) for _ in range(5)] == stream(10, group_size=2)


# ---- across a real SIGKILL and resume --------------------------------------------------------

LIFE = textwrap.dedent("""
    import dataclasses, json, os, sys, threading, time
    from t1async.actors.controller import Controller
    from t1async.actors.learner import Learner
    from t1async.config import LearnerConfig, ModelConfig, RolloutConfig, TransportConfig, WeightSyncConfig
    from t1async.service.launch import saved_task_order
    from t1async.trajectory import encode
    from t1async.transport.transport import ZmqSender
    from tests.support.delivery_fakes import synthetic

    run_dir, port, life, tasks, model = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4]), \\
        ModelConfig(**json.loads(sys.argv[5]))
    sys.stdin.readline()  # (imported while the first life runs; go)
    cfg = LearnerConfig(max_steps=0, batch_size=2, publish_every=1000, checkpoint_every=2,
                        resume=life > 1, batch_timeout_s=120, lr=1e-3)
    learner = Learner(cfg, model, TransportConfig(curve=False, port=port, log_fsync="never"), WeightSyncConfig(), run_dir)
    resumed = learner.status()["resumed"]
    # as t1async launch does: the controller continues the order saved in the checkpoint resumed from
    ctl = Controller(RolloutConfig(num_actors=1, group_size=2), tasks, rollouts_per_version=2, max_staleness=29,
                     make_rollout=lambda aid, crash: None, seed=0,
                     task_order=saved_task_order(resumed["checkpoint"] if resumed else None))

    def rollout():  # one rollout actor: admission -> (no episode) -> a trajectory of that task
        tx = ZmqSender(f"tcp://127.0.0.1:{port}", spool_dir=f"{run_dir}/spool", window_messages=4)
        for i in range(10_000):
            name = ctl.acquire(0)
            if not name:
                continue
            with open(f"{run_dir}/draws-{life}.txt", "a") as f:
                f.write(name + "\\n")
            traj = dataclasses.replace(synthetic(life * 1000 + i), task=name)
            ctl.episode_finished(0, traj.trajectory_id)
            tx.send(traj.trajectory_id, encode(traj))
            time.sleep(0.05)

    threading.Thread(target=rollout, daemon=True).start()
    print(json.dumps(learner.run(ctl)), flush=True)
    os._exit(0)
""")


def _life(run_dir: Path, port: int, life: int) -> subprocess.Popen:
    log = open(run_dir.parent / f"life-{life}.log", "w")  # noqa: SIM115 (closed with the process)
    return subprocess.Popen([sys.executable, "-c", LIFE, str(run_dir), str(port), str(life), json.dumps(TASKS),
                             json.dumps(asdict(MODEL))], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                            text=True, cwd=REPO)


def _go(proc: subprocess.Popen) -> None:
    proc.stdin.write("go\n")
    proc.stdin.flush()


def _wait(cond, timeout_s: float, what: str, proc: subprocess.Popen, log: Path):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        assert proc.poll() is None, f"{what}: the process ended: {log.read_text()[-3000:]}"
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}: {log.read_text()[-3000:]}")


def _draws(run_dir: Path, life: int) -> list[str]:
    path = run_dir / f"draws-{life}.txt"
    return path.read_text().split() if path.exists() else []


def _steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x)["step"] for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


@pytest.mark.slow
def test_a_resumed_run_after_sigkill_continues_the_task_order_from_its_checkpoint(tmp_path):
    """Learner + controller + one rollout in a process, SIGKILLed after step 3 (checkpoint at
    step 2), resumed with ``learner.resume`` (killed too once it drew six tasks): its first tasks
    are the uninterrupted stream's from the checkpoint's position on, not the first life's head."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    first, second = _life(run_dir, port, 1), _life(run_dir, port, 2)  # (the second imports meanwhile)
    _go(first)
    try:
        _wait(lambda: 3 in _steps(run_dir), 120, "step 3 of the first life", first, tmp_path / "life-1.log")
        first.send_signal(signal.SIGKILL)
        first.wait()
        ckpt = run_dir / "checkpoints" / "step_000002"
        assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == [ckpt.name]
        saved = read_task_order(ckpt)
        assert saved is not None, "the checkpoint holds no task order"
        p = saved["drawn"]
        assert p >= 4  # at least the episodes step 2 trained
        _go(second)
        _wait(lambda: len(_draws(run_dir, 2)) >= 6 and (run_dir / "checkpoints" / "step_000004").exists(), 120,
              "six draws and the step-4 checkpoint of the second life", second, tmp_path / "life-2.log")
    finally:
        for proc in (first, second):
            if proc.poll() is None:
                proc.kill()
    one, two = _draws(run_dir, 1), _draws(run_dir, 2)
    whole = stream(max(len(one), p + len(two)), group_size=2)
    assert one == whole[:len(one)] and len(one) >= p  # the first life drew the stream from its head
    assert two[:6] != whole[:6], "the second life replayed the first life's head"
    assert two == whole[p:]  # the stream continued from the checkpoint's position
