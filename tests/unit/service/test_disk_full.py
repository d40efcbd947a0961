"""A full or failing disk is a fault the service survives: every writer handles ENOSPC without
blocking, the learner pauses intake and training (no ACK: the actors keep their spools) and
resumes by itself once space is back, rollout actors back off instead of spinning; and against a
real launch on a small tmpfs, ``t1async status`` says ``degraded`` and stop still works."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

import t1async.fileio as fileio
import t1async.learner.checkpoints as checkpoints_mod
import t1async.learner.loop as learner_mod
import t1async.learner.metrics as metrics_mod
import t1async.transport.delivery as delivery
from t1async.actors.learner import Learner
from t1async.actors.rollout import RolloutActor
from t1async.config import LearnerConfig, TransportConfig, WeightSyncConfig
from t1async.fileio import DiskGuard, append_whole
from t1async.rollout.agent_mix import AgentMix
from t1async.transport.transport import SenderStats, ZmqSender
from tests.support.learner_fakes import MODEL, FakeController, send_trajectory, synthetic

ENOSPC = OSError(errno.ENOSPC, "No space left on device")


def wait_for(cond, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def test_append_whole_cuts_a_refused_write_back_off(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    append_whole(path, b'{"step": 1}\n')
    real = os.pwritev

    def short_then_full(fd, bufs, offset):  # the disk takes 5 bytes, then is full
        if offset == len(b'{"step": 1}\n'):
            return real(fd, [bytes(bufs[0])[:5]], offset)
        raise ENOSPC

    monkeypatch.setattr(os, "pwritev", short_then_full)
    with pytest.raises(OSError):
        append_whole(path, b'{"step": 2}\n')
    assert path.read_bytes() == b'{"step": 1}\n'  # no torn row for a reader (or a resume) to choke on


def test_replace_file_refused_by_the_disk_leaves_the_old_file_whole_and_no_temporary(tmp_path, monkeypatch):
    """summary.json on a full disk (a fault retrial left it 0 bytes), service.json, timeline.json, a
    resume's metrics.jsonl: replaced whole or not at all."""
    from t1async.fileio import replace_file

    path = tmp_path / "summary.json"
    replace_file(path, '{"steps": 1}')
    inode = path.stat().st_ino

    def full(src, dst):
        raise ENOSPC

    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(OSError):
        replace_file(path, '{"steps": 2}' * 1000, fsync=True)
    assert path.read_text() == '{"steps": 1}' and list(tmp_path.iterdir()) == [path]
    monkeypatch.undo()
    replace_file(path, b'{"steps": 3}')
    assert path.read_bytes() == b'{"steps": 3}' and path.stat().st_ino != inode and list(tmp_path.iterdir()) == [path]


def test_the_console_says_once_when_the_disk_pauses_the_service_and_once_when_it_is_back():
    from loguru import logger

    from t1async.service.service import DiskNotice

    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(str(m).strip()), level="INFO", format="{message}")
    notice = DiskNotice()
    try:
        for why in (None, "disk full at /r (8 MB free)", "disk full at /r (3 MB free)", "disk full at /r (0 MB free)",
                    None, None, "disk full at /r/checkpoints (60 MB free)", None):
            notice.update(why)
    finally:
        logger.remove(sink)
    assert [x.split(";")[0] for x in lines] == ["degraded: disk full at /r (8 MB free)", "disk space is back: intake "
                                                "and training resume", "degraded: disk full at /r/checkpoints (60 MB free)",
                                                "disk space is back: intake and training resume"]
    assert notice.pauses == 2 and notice.degraded is None


def test_disk_guard_pauses_below_its_floor_and_after_a_fault_and_clears_by_itself(tmp_path, monkeypatch):
    free = {"b": 10 << 20}
    monkeypatch.setattr(fileio, "free_bytes", lambda p: free["b"])
    guard = DiskGuard(tmp_path, floor_mb=64, retry_s=0.2)
    assert guard.floor_bytes() == 64 << 20  # (64 MiB is under 5 % of this filesystem)
    assert guard.check() == f"disk full at {tmp_path} (10 MB free, below the floor of 64 MB)"
    free["b"] = 100 << 20
    assert guard.check() is None
    assert guard.fault(ENOSPC, tmp_path / "metrics.jsonl") and not guard.fault(ValueError("a bug"), tmp_path)
    assert guard.check() == f"disk full at {tmp_path / 'metrics.jsonl'} (100 MB free)"
    time.sleep(0.25)
    assert guard.check() is None  # retried: space is there
    assert guard.fault(RuntimeError("safetensors: No space left on device (os error 28)"), tmp_path)
    stop = threading.Event()
    stop.set()
    assert guard.wait(stop) < 0.1  # stop ends a wait at once


def _learner(tmp_path, **kw) -> Learner:
    cfg = LearnerConfig(batch_size=1, batch_timeout_s=60, publish_every=100, **kw)
    return Learner(cfg, MODEL, TransportConfig(curve=False), WeightSyncConfig(), str(tmp_path), seed=0)


def test_writes_refused_by_a_full_disk_pause_the_learner_and_are_written_once_space_is_back(tmp_path, monkeypatch):
    """metrics.jsonl, transcripts and the checkpoint of step 1 are refused (ENOSPC): the learner
    neither crashes nor trains on, says why, and writes them once space is back (main: OSError
    out of run)."""
    full = threading.Event()
    full.set()

    def refused(real):
        def write(*a, **k):
            if full.is_set():
                raise ENOSPC
            return real(*a, **k)
        return write

    for mod, name in ((metrics_mod, "append_whole"), (learner_mod, "write_transcripts"), (checkpoints_mod, "commit")):
        monkeypatch.setattr(mod, name, refused(getattr(mod, name)))
    learner = _learner(tmp_path, max_steps=2, checkpoint_every=1)
    learner.disk.retry_s = 60.0
    tx = ZmqSender(learner.endpoint())
    result: dict = {}
    th = threading.Thread(target=lambda: result.update(learner.run(FakeController())))
    try:
        for seed in (1, 2):
            send_trajectory(tx, synthetic(version=0, seed=seed))
        th.start()
        why = wait_for(lambda: learner.status()["disk"], 30, "the learner to pause")
        assert why.startswith(f"disk full at {tmp_path}")
        time.sleep(1.0)
        assert learner.step == 1 and not (tmp_path / "metrics.jsonl").exists()
        assert not list((tmp_path / "checkpoints").glob(".step_*"))  # the refused checkpoint's staging is gone
        full.clear()  # space is back
        learner.disk.retry_s = 0.0
        th.join(timeout=30)
        assert not th.is_alive() and result["step"] == 2 and result["disk"] is None
        rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2]
        assert (tmp_path / "checkpoints" / "step_000002" / "trainer_state.json").exists()
        assert list((tmp_path / "episodes").glob("step_*.md"))
    finally:
        tx.close(flush_timeout_s=0)
        learner.close()


def test_below_the_free_space_floor_the_learner_stops_acking_and_resumes_by_itself(tmp_path, monkeypatch):
    free = {"b": 0}
    real = fileio.free_bytes
    monkeypatch.setattr(fileio, "free_bytes", lambda p: real(p) if free["b"] is None else free["b"])
    learner = _learner(tmp_path, max_steps=2, disk_floor_mb=1)
    tx = ZmqSender(learner.endpoint())
    result: dict = {}
    th = threading.Thread(target=lambda: result.update(learner.run(FakeController())))
    try:
        for seed in (1, 2):
            send_trajectory(tx, synthetic(version=0, seed=seed))
        th.start()
        time.sleep(1.5)
        st = learner.status()
        assert st["disk"] == f"disk full at {tmp_path} (0 MB free, below the floor of 1 MB)"
        assert st["step"] == 0 and tx.stats.acked == 0 and tx.unacknowledged() == 2  # kept in the actor's spool
        assert 0.5 <= st["disk_paused_s"] <= 3.0  # counted while the pause is under way (it said 0.0)
        free["b"] = None  # space is back
        th.join(timeout=30)
        assert result["step"] == 2 and tx.stats.acked == 2 and result["disk_paused_s"] >= 1.0
    finally:
        tx.close(flush_timeout_s=0)
        learner.close()


def test_receive_log_and_quarantine_refused_by_the_disk_leave_the_inbox_serving(tmp_path, monkeypatch):
    """A receive-log append refused (ENOSPC) is not ACKed (the actor resends it) and pauses the
    inbox; a rejected message whose quarantine copy is refused is still REJected (main: the
    quarantine's OSError killed the receive thread: no reply, ever, to anyone)."""
    full = threading.Event()
    full.set()
    real_pwrite, real_write_bytes = delivery.pwrite_all, Path.write_bytes

    def pwrite(*a, **k):
        if full.is_set():
            raise ENOSPC
        return real_pwrite(*a, **k)

    def write_bytes(self, data):
        if "quarantine" in str(self):
            raise ENOSPC
        return real_write_bytes(self, data)

    monkeypatch.setattr(delivery, "pwrite_all", pwrite)
    monkeypatch.setattr(Path, "write_bytes", write_bytes)
    learner = _learner(tmp_path, max_steps=1)
    learner.disk.retry_s = 0.3
    tx = ZmqSender(learner.endpoint(), ack_timeout_s=0.5)
    try:
        tx.send("garbage", b"\x93not a trajectory")
        wait_for(lambda: tx.stats.rejected == 1, 10, "the REJ of a message whose quarantine copy was refused")
        traj = synthetic(version=0, seed=1)
        send_trajectory(tx, traj)
        wait_for(lambda: learner.disk.faults >= 1, 10, "the refused append")
        assert tx.stats.acked == 0 and traj.trajectory_id not in learner.inbox.log
        full.clear()
        wait_for(lambda: tx.stats.acked == 1, 10, "the resent trajectory's ACK once space is back")
        assert traj.trajectory_id in learner.inbox.log and learner.counters["rejected"] == 1
    finally:
        tx.close(flush_timeout_s=0)
        learner.close()


class _Controller:
    def __init__(self, n: int):
        self.left, self.failures, self.agents = n, [], []

    def acquire(self, actor_id):
        self.left -= 1
        return "task" if self.left >= 0 else None

    def episode_failed(self, actor_id, reason, agent):
        self.failures.append(reason)
        self.agents.append(agent)


class _Sender:
    def __init__(self, refusals: int = 0):
        self.stats, self.refusals, self.sent = SenderStats(), refusals, []

    def send(self, key, frame):
        if self.refusals:
            self.refusals -= 1
            raise ENOSPC
        self.sent.append(key)

    def close(self):
        pass


def _actor(tmp_path) -> RolloutActor:
    actor = RolloutActor.__new__(RolloutActor)  # (the loop only: no sandbox, no sampler)
    actor.actor_id, actor.sender, actor.endpoint, actor.crash_after = 0, _Sender(), None, 0
    actor.episodes = actor.failed = actor._rejections_reported = 0
    actor._disk_backoff_s, actor._audit = 0.0, None
    actor.workdir = tmp_path / "work"
    actor.workdir.mkdir()
    actor.sampler = type("S", (), {"rerouted": 0})()
    actor.agents = AgentMix("builtin", 0, 0)
    return actor


def test_rollout_actor_backs_off_on_episodes_that_fail_on_the_disk_and_keeps_a_finished_trajectory(
        tmp_path, monkeypatch):
    import t1async.actors.rollout as rollout_mod

    sleeps: list[float] = []
    monkeypatch.setattr(rollout_mod.time, "sleep", sleeps.append)
    actor = _actor(tmp_path)

    def run_one(name, agent=None):
        raise OSError(errno.ENOSPC, "No space left on device", str(actor.workdir / "app"))

    actor.run_one = run_one
    ctl = _Controller(5)
    assert actor.run(ctl)["failed"] == 5
    assert sleeps == [1.0, 2.0, 4.0, 8.0, 16.0] and len(ctl.failures) == 5  # (main: no pause: 235 in 3 minutes)
    assert set(ctl.agents) == {"builtin"}

    sleeps.clear()
    actor = _actor(tmp_path / "again") if (tmp_path / "again").mkdir() is None else None
    actor.sender = _Sender(refusals=2)  # its spool refuses the finished trajectory twice
    traj = synthetic(version=0, seed=1)
    actor._send(traj)
    assert actor.sender.sent == [traj.trajectory_id] and sleeps == [1.0, 2.0]


def test_the_floor_keeps_room_for_the_next_checkpoint_by_its_measured_size(tmp_path, monkeypatch):
    """Issue 42: free space between the floor (15 MB) and one checkpoint (95 MB) made the service
    resume, fail its checkpoint and pause again every ~15 s. Once a checkpoint is written its size
    raises the floor: such free space pauses the learner steadily, naming the reason."""
    free = {"b": None}
    real = fileio.free_bytes
    monkeypatch.setattr(fileio, "free_bytes", lambda p: real(p) if free["b"] is None else free["b"])
    learner = _learner(tmp_path, max_steps=1, disk_floor_mb=0.25, checkpoint_every=1)
    tx = ZmqSender(learner.endpoint())
    try:
        assert learner.disk.floor_bytes() == 1 << 18  # nothing measured yet: the configured floor
        send_trajectory(tx, synthetic(version=0, seed=1))
        result = learner.run(FakeController())
        size = checkpoints_mod.checkpoint_bytes(tmp_path / "checkpoints" / "step_000001")
        assert result["step"] == 1 and result["checkpoint_failed"] is None and size > 1 << 19
        assert learner.disk.floor_bytes() == int(size * fileio.RESERVE_MARGIN)
        free["b"] = size // 2  # above the configured floor, below one checkpoint
        assert learner.disk.check() == (f"disk full at {tmp_path} ({size // 2 / (1 << 20):.0f} MB free, below the floor "
                                        f"of {int(size * 1.1) / (1 << 20):.0f} MB (room for the next checkpoint))")
    finally:
        tx.close(flush_timeout_s=0)
        learner.close()
    again = _learner(tmp_path, max_steps=1, disk_floor_mb=0.25, resume=True)  # a resume measures its checkpoint
    try:
        assert again.disk.floor_bytes() == int(size * fileio.RESERVE_MARGIN)
    finally:
        again.close()


def test_with_no_floor_of_its_own_the_guard_still_keeps_room_for_the_next_checkpoint(tmp_path, monkeypatch):
    """``learner.disk_floor_mb=0`` (a fresh operator's try): the guard has no floor until a
    checkpoint is measured, then pauses below 1.1 times it, steadily (main: floor 0 whatever was
    measured, so the service flapped every ~15 s and trained on while every checkpoint failed)."""
    free = {"b": 60 << 20}
    monkeypatch.setattr(fileio, "free_bytes", lambda p: free["b"])
    guard = fileio.DiskGuard(tmp_path, floor_mb=0)
    assert guard.floor_bytes() == 0 and guard.check() is None  # nothing measured: no floor
    guard.reserve(95 << 20)  # a checkpoint of 95 MB was written
    assert guard.floor_bytes() == int((95 << 20) * fileio.RESERVE_MARGIN)
    for _ in range(3):  # the same answer every time: paused, not flapping
        assert guard.check().startswith(f"disk full at {tmp_path} (60 MB free, below the floor of 104 MB")
    free["b"] = 200 << 20
    assert guard.check() is None  # room for the next checkpoint: writes go on


def test_a_final_checkpoint_that_does_not_fit_is_reported_in_the_status_and_the_exit_status(tmp_path, monkeypatch):
    """Issue 42: ``stop`` said "done" and exit status 0 although its final checkpoint failed."""
    import t1async.cli as cli
    from t1async.service.control import final_checkpoint_error

    def full(*a, **k):
        raise ENOSPC

    monkeypatch.setattr(checkpoints_mod, "commit", full)
    learner = _learner(tmp_path, max_steps=1, checkpoint_every=0)
    tx = ZmqSender(learner.endpoint())
    try:
        send_trajectory(tx, synthetic(version=0, seed=1))
        result = learner.run(FakeController())
    finally:
        tx.close(flush_timeout_s=0)
        learner.close()
    assert result["step"] == 1 and result["checkpoint_failed"].startswith("checkpoint of step 1 not written (")
    summary = {"run_dir": str(tmp_path), "ended": "stopped", "max_steps": 0, "steps": 1, "learner": result}
    assert final_checkpoint_error(summary).startswith("the final checkpoint did not fit: checkpoint of step 1 not")
    assert final_checkpoint_error({**summary, "learner": {**result, "checkpoint_failed": None}}) is None
    import t1async.service.launch as launch_mod

    for ended, rc in (("stopped", 1), ("done", 1), ("signal", 130)):
        monkeypatch.setattr(launch_mod, "launch", lambda *a, e=ended: {**summary, "ended": e, "max_steps": 1})
        assert cli.main(["launch", "configs/local.yaml"]) == rc


def _can_mount_tmpfs(where: Path) -> bool:
    where.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs", str(where)], capture_output=True)
    return r.returncode == 0


@pytest.mark.slow
def test_a_launch_on_a_full_disk_says_degraded_runs_no_step_resumes_when_freed_and_stops(tmp_path):
    """The real service on a 256 MiB tmpfs (room for its final checkpoint once freed): fill it, and
    ``t1async status`` says ``degraded: disk full at ...``, no step runs, rollout actors keep their
    trajectories; free it, and steps resume by themselves; ``t1async stop`` ends it with exit
    status 0 (main: the launch hangs)."""
    from t1async.service.control import ControlError, request
    from tests.support.service import CLI, SMALL

    mnt = tmp_path / "disk"
    if not _can_mount_tmpfs(mnt):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    run_dir, filler = mnt / "run", mnt / "filler"
    out = open(tmp_path / "launch.out", "w")
    p = subprocess.Popen(CLI + [f"run.dir={run_dir}", *SMALL, "learner.disk_floor_mb=8", "run.tensorboard=true",
                                "learner.checkpoint_every=0"],
                         stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def status():
        try:
            return request(run_dir, {"cmd": "status"})
        except ControlError:
            return None

    t0 = time.monotonic()
    try:
        wait_for(lambda: (s := status()) and s.get("step", 0) >= 1, 240, "the first step")
        print(f"first step after {time.monotonic() - t0:.0f} s")
        free = os.statvfs(mnt).f_bavail * os.statvfs(mnt).f_frsize
        with open(filler, "wb") as f:  # the disk fills: up to 2 MB short of full (below the 8 MB floor)
            f.write(b"\0" * max(0, free - (2 << 20)))
        st = wait_for(lambda: (s := status()) and s["state"].startswith("degraded") and s, 30, "degraded")
        assert st["state"].startswith(f"degraded: disk full at {run_dir}") and "MB free" in st["state"]
        time.sleep(2)  # (a step already under way when the disk filled may finish)
        step = status()["step"]
        time.sleep(3)
        assert status()["step"] == step and status()["state"].startswith("degraded")  # no step runs
        filler.unlink()  # space is back
        wait_for(lambda: (s := status()) and s.get("step", 0) > step and s["state"] == "running", 120,
              "a step after space came back")
        wait_for(lambda: "disk space is back" in (tmp_path / "launch.out").read_text(), 30, "the console's line")
        request(run_dir, {"cmd": "stop", "now": True})
        rc = p.wait(timeout=120)
        assert rc == 0, (tmp_path / "launch.out").read_text()[-4000:]
    finally:
        if p.poll() is None:
            os.killpg(p.pid, 9)
            p.wait()
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
    text = (tmp_path / "launch.out").read_text()
    assert "Traceback" not in text, text[-3000:]
    said = [x for x in text.splitlines() if "degraded: disk full at" in x or "disk space is back" in x]
    assert len(said) == 2 and f"degraded: disk full at {run_dir}" in said[0], said  # one line each way


@pytest.mark.slow
def test_a_stop_whose_final_checkpoint_does_not_fit_says_so_with_exit_status_1(tmp_path):
    """The real service on a 400 MiB tmpfs with ``learner.checkpoint_every=0`` (the final checkpoint
    only) and no free-space floor (``learner.disk_floor_mb=0``): the disk fills to 30 MB free, below
    one checkpoint (about 95 MB); training goes on; ``t1async stop`` then says the final checkpoint
    did not fit, on the launch's console and its own, both with exit status 1 (issue 42: "(final
    checkpoint follows)", "done", rc 0; then, with the floor off, torch's ``RuntimeError:
    basic_ios::clear: iostream error`` as a Ray traceback and "stopped", rc 0)."""
    from t1async.transport.delivery import ReceiveLog
    from tests.support.service import CLI, SMALL, read_status

    mnt = tmp_path / "disk"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=400m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    run_dir, filler = mnt / "run", mnt / "filler"
    out = open(tmp_path / "launch.out", "w")
    p = subprocess.Popen(CLI + [f"run.dir={run_dir}", *SMALL, "learner.disk_floor_mb=0", "learner.checkpoint_every=0"],
                         stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def status():
        try:
            return read_status(run_dir)
        except Exception:
            return None

    try:
        def first_step():
            assert p.poll() is None, (tmp_path / "launch.out").read_text()[-2000:]  # (Ray failed to start)
            return (s := status()) and s.get("step", 0) >= 1

        wait_for(first_step, 600, "the first step")
        free = os.statvfs(mnt).f_bavail * os.statvfs(mnt).f_frsize
        with open(filler, "wb") as f:  # 30 MB left: below one checkpoint
            f.write(b"\0" * max(0, free - (30 << 20)))
        time.sleep(3)
        assert status()["state"] == "running"  # above the floor: training goes on
        stop = subprocess.run([*CLI[:3], "stop", str(run_dir)], capture_output=True, text=True, timeout=600)
        rc = p.wait(timeout=120)
        summary = json.loads((run_dir / "summary.json").read_text())
        staged = list((run_dir / "checkpoints").glob(".step_*"))
        received = list(ReceiveLog(run_dir / "receive_log", fsync="never").keys())
    finally:
        if p.poll() is None:
            os.killpg(p.pid, 9)
            p.wait()
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
    text = (tmp_path / "launch.out").read_text()
    assert stop.returncode == 1 and "t1async: error: stopped, but the final checkpoint did not fit" in stop.stderr, stop
    assert rc == 1 and "t1async: error: stopped, but the final checkpoint did not fit" in text, text[-3000:]
    assert "Traceback" not in text and "disk full at" in stop.stderr and "MB free" in stop.stderr
    assert summary["ended"] == "stopped" and summary["learner"]["ended_mid_step"] is False  # (a plain stop)
    # nothing lost: no checkpoint was written (checkpoint_every=0), so every trajectory received is still in
    # the receive log for a resume to train; no half-written checkpoint for it to trip on
    assert not staged and len(received) >= summary["learner"]["step"] >= 1


def test_a_final_checkpoint_torch_cannot_write_is_classified_whatever_the_floor(tmp_path):
    """Issue 42 (a fresh user): with ``learner.disk_floor_mb=0`` on a full tmpfs, torch's writer
    raised ``RuntimeError: basic_ios::clear: iostream error`` (its ENOSPC) out of the final
    checkpoint: a raw Ray traceback, and ``t1async stop`` said "stopped", rc 0. Here a real tmpfs is
    filled so that the policy's safetensors fit and torch's optimizers.pt does not: the learner's run
    ends with ``checkpoint_failed`` naming a full disk, the path and the free space, and raises nothing."""
    from t1async.service.control import final_checkpoint_error

    mnt = tmp_path / "disk"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        learner = _learner(mnt, max_steps=2, checkpoint_every=1, disk_floor_mb=0)
        tx = ZmqSender(learner.endpoint())
        try:
            send_trajectory(tx, synthetic(version=0, seed=1))
            learner.loop.cfg.max_steps = 1
            assert learner.run(FakeController())["checkpoint_failed"] is None
            first = mnt / "checkpoints" / "step_000001"
            policy = sum(p.stat().st_size for p in first.glob("*.safetensors"))
            optim = (first / "optimizers.pt").stat().st_size
            free = os.statvfs(mnt).f_bavail * os.statvfs(mnt).f_frsize
            with open(mnt / "filler", "wb") as f:  # room for the policy's weights, not for optimizers.pt
                f.write(b"\0" * max(0, free - policy - optim // 3 - (64 << 10)))
            learner.loop.cfg.max_steps = 2
            learner.loop._stop.clear()
            learner.disk.reserve(0)  # no checkpoint measured yet (a run's first one on a full disk): the guard
            # does not pause, so the write is tried and fails in torch's writer
            send_trajectory(tx, synthetic(version=0, seed=2))
            result = learner.run(FakeController())  # (main: RuntimeError: ... iostream error / unexpected pos)
        finally:
            tx.close(flush_timeout_s=0)
            learner.close()
        why = result["checkpoint_failed"]
        assert result["step"] == 2 and why.startswith("checkpoint of step 2 not written (disk full writing .step_000002")
        assert "RuntimeError" in why and f"at {mnt / 'checkpoints'} (" in why and "MB free" in why, why
        assert final_checkpoint_error({"run_dir": str(mnt), "learner": result}).startswith(
            "the final checkpoint did not fit: checkpoint of step 2")
        assert not list((mnt / "checkpoints").glob(".step_*"))  # the staged folder is gone
        assert sorted(p.name for p in (mnt / "checkpoints").iterdir()) == ["step_000001"]  # a resume starts there
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_every_checkpoint_write_failure_is_a_disk_fault_full_or_io_error_and_a_bug_only_fails_the_final_one(
        tmp_path, monkeypatch):
    """A write failure the library does not call ENOSPC: on a disk with room it is an I/O error
    (the service pauses and retries, as for EIO); a bug (TypeError) in a periodic checkpoint still
    raises (the learner is restarted), in the final one it is reported, not raised."""
    free = {"b": 10 << 30}
    monkeypatch.setattr(fileio, "free_bytes", lambda p: free["b"])
    monkeypatch.setattr(checkpoints_mod, "free_bytes", lambda p: free["b"])
    guard = DiskGuard(tmp_path, floor_mb=0)
    assert guard.fault(RuntimeError("basic_ios::clear: iostream error"), tmp_path) is None  # (not a write)
    assert guard.fault(RuntimeError("[enforce fail at inline_container.cc:603] . unexpected pos 64 vs 0"),
                       tmp_path / "ckpt", writing=True) == "error"
    assert guard.check() == f"disk I/O error at {tmp_path / 'ckpt'} (10240 MB free)"
    free["b"] = 1 << 20
    assert guard.fault(RuntimeError("basic_ios::clear: iostream error"), tmp_path, writing=True) == "full"
    assert guard.fault(TypeError("a bug"), tmp_path, writing=True) is None
    free["b"] = 10 << 30

    def iostream(*a, **k):
        raise RuntimeError("basic_ios::clear: iostream error")

    monkeypatch.setattr(checkpoints_mod, "write_consumed", iostream)
    learner = _learner(tmp_path, max_steps=1, checkpoint_every=0, disk_floor_mb=0)
    tx = ZmqSender(learner.endpoint())
    try:
        send_trajectory(tx, synthetic(version=0, seed=1))
        result = learner.run(FakeController())
        assert result["checkpoint_failed"].startswith("checkpoint of step 1 not written (disk I/O error writing .step_")
        assert result["checkpoint_failed"].endswith(f"disk I/O error at {tmp_path / 'checkpoints'} (10240 MB free)")

        def bug(*a, **k):
            raise TypeError("a bug")

        monkeypatch.setattr(checkpoints_mod, "write_consumed", bug)
        with pytest.raises(TypeError):
            learner.loop._checkpoint()
        assert not learner.loop._checkpoint(final=True)
        assert learner.loop.checkpoint_failed == "checkpoint of step 1 not written (a bug): TypeError"
    finally:
        tx.close(flush_timeout_s=0)
        learner.close()
