"""The service end to end (real Ray, ZeroMQ, bubblewrap): run until stopped, controlled by run
directory, scaled live, killed with SIGKILL (nothing left behind), resumed with its live changes,
self-healing after its learner is killed, stopped with a final checkpoint."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from t1async.service.control import ControlError, request
from t1async.service.reaper import descendants
from tests.support.service import CLI, SMALL, read_status, wait_for, wait_progress

pytestmark = pytest.mark.slow


def _running(pid: int) -> bool:
    """Alive and not a zombie (a killed child its parent has not reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def _mounts_under(path: Path) -> list[str]:
    return [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines() if str(path) in line]


def _main_error(capsys, argv: list[str]) -> str:
    from t1async.cli import main

    assert main(argv) == 2
    return capsys.readouterr().err.strip()


def _poison_control_socket(run_dir: Path) -> None:
    """Send the control socket a two-frame request and a non-JSON one; each must be answered with an error."""
    import zmq

    from t1async.service.rundir import read_service

    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.REQ_RELAXED, 1)
    sock.connect(read_service(run_dir)["control"])
    try:
        for frames in ([b'{"cmd": "status"}', b"x"], [b"\x00garbage"]):
            sock.send_multipart(frames)
            assert sock.poll(15_000), f"no reply to {frames!r}"
            assert json.loads(sock.recv())["ok"] is False
    finally:
        sock.close()


def test_service_lifecycle(tmp_path, capsys):
    run_dir = tmp_path / "run"
    out_a = open(tmp_path / "a.out", "w")
    a = subprocess.Popen(CLI + [f"run.dir={run_dir}", *SMALL], stdout=out_a, stderr=subprocess.STDOUT,
                         start_new_session=True)
    b = None
    try:
        st = wait_progress(lambda: (s := read_status(run_dir))["step"] >= 1 and s, run_dir, "the first step")
        assert st["max_steps"] == 0 and len(st["actors"]) == 2 and st["samplers"][0]["state"] == "serving"
        assert f"in use by t1async launch pid {a.pid}" in _main_error(capsys, ["launch", *CLI[4:], f"run.dir={run_dir}"])

        from t1async.service.rundir import read_service

        assert read_service(run_dir)["trajectories"].startswith("tcp://")  # the learner's socket, documented
        ray_sessions = [Path(read_service(run_dir)["ray_session"])]
        # a malformed message (two frames, then garbage) gets an error reply; the socket keeps serving
        _poison_control_socket(run_dir)
        assert read_status(run_dir)["step"] >= 1

        # scale up live: a new actor runs an episode; a key that cannot change live is refused with why
        assert request(run_dir, {"cmd": "scale", "changes": {"rollout.num_actors": 3}})["applied"] == {
            "rollout.num_actors": 3}
        new = wait_progress(lambda: [x for x in read_status(run_dir)["actors"] if x["id"] == 2 and x["first_episode_at"]],
                            run_dir, "the new actor's first episode")
        print(f"scale -> first episode of the new actor: {new[0]['first_episode_at'] - new[0]['started_at']:.1f} s")
        with pytest.raises(ControlError, match="cannot change live"):
            request(run_dir, {"cmd": "scale", "changes": {"env.max_turns": 3}})
        with pytest.raises(ControlError, match="rollout.num_actors=-1 is invalid"):
            request(run_dir, {"cmd": "scale", "changes": {"rollout.num_actors": -1}})

        # kill -9 of the launch: its reaper kills what it started and detaches the sandboxes' mounts
        wait_progress(lambda: list((run_dir / "checkpoints").glob("step_*")), run_dir, "a checkpoint to resume from")
        tree = descendants(a.pid)
        os.kill(a.pid, signal.SIGKILL)
        a.wait()
        wait_for(lambda: (run_dir / "logs" / "reaper.log").exists(), 30, "the reaper")
        time.sleep(1)
        alive = [p for p in tree if _running(p) and b"t1async.service.reaper" not in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert alive == [] and _mounts_under(run_dir) == [] and not (run_dir / "workspaces").exists()
        assert not ray_sessions[0].exists()  # the reaper removed the Ray session folder from the temp dir
        assert "earlier run" in _main_error(capsys, ["launch", *CLI[4:], f"run.dir={run_dir}"])

        # resume: says what it restored, keeps the live change (3 actors)
        out_b = open(tmp_path / "b.out", "w")
        b = subprocess.Popen(CLI + [f"run.dir={run_dir}", "learner.resume=true", *SMALL], stdout=out_b,
                             stderr=subprocess.STDOUT, start_new_session=True)
        st = wait_progress(lambda: (s := read_status(run_dir))["resumed"] and len(s.get("actors", ())) == 3 and s, run_dir,
                           "the resumed service with its 3 actors")
        assert st["resumed"]["step"] >= 1
        # ...and the task order where its checkpoint left it, not from the head again
        continued = re.findall(r"task order continued after episode (\d+)", (run_dir / "logs" / "controller.log").read_text())
        assert len(continued) == 1 and 0 < int(continued[0]) <= st["controller"]["tasks_drawn"]
        first = st["step"]
        ray_sessions.append(Path(read_service(run_dir)["ray_session"]))

        # self-healing: kill the learner process; the service restarts it from its checkpoint
        learner = [p for p in descendants(b.pid) if Path(f"/proc/{p}/cmdline").read_bytes().startswith(b"ray::Learner")]
        assert len(learner) == 1
        os.kill(learner[0], signal.SIGKILL)
        st = wait_progress(lambda: (s := read_status(run_dir))["restarts"]["learner"] == 1 and s.get("step", -1) > first
                           and s, run_dir, "a step of the restarted learner")

        request(run_dir, {"cmd": "stop"})
        assert b.wait(timeout=180) == 0
    finally:
        for p in (a, b):
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    out = (tmp_path / "b.out").read_text()
    assert "resumed from step_" in out and "Traceback" not in out, out[-3000:]
    assert "the learner died" in out and "restart 1 of 2 in a row" in out
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    ckpts = sorted((run_dir / "checkpoints").glob("step_*"))
    assert ckpts[-1].name == f"step_{rows[-1]['step']:06d}" and len(ckpts) <= 3  # final checkpoint; rotated
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))  # one timeline despite two deaths
    assert all(r["staleness_max"] <= 2 for r in rows)
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*")) and list((run_dir / "episodes").glob("*.md"))
    assert not (run_dir / "service.json").exists()
    assert not ray_sessions[1].exists() and (run_dir / "logs" / "ray").is_dir()  # Ray's logs kept in the run dir
    restarts = json.loads((run_dir / "summary.json").read_text())["restarts"]
    assert restarts["learner"] == 1 and "samplers" in restarts, restarts  # sampler restarts counted too
    with pytest.raises(ControlError, match="not running"):
        read_status(run_dir)
