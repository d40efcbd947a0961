"""The service under its operators and its node (issue 42 items 1, 2, 4, 9), against real launches:
scaling bounded by what the Ray cluster holds (a tiny cluster given by ``ray.memory_mb``, so nothing
floods this shared machine), a scale-down that cancels actors at once, a resume that applies the
bound to its history and continues admission from the learner's position; Ray's memory monitor
killing roles (its threshold lowered for this launch's Ray only, a small allocation beside it)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from t1async.service.control import ControlError, request
from tests.support import REPO
from tests.support.service import CLI, SMALL, read_status, wait_progress

pytestmark = pytest.mark.slow
MEM = {"learner": 900, "controller": 300, "sampler": 400, "rollout": 300}  # the defaults of ray.role_memory_mb
TINY = [f"ray.memory_mb={MEM['learner'] + MEM['controller'] + MEM['sampler'] + 3 * MEM['rollout'] + 100}"]
"""A cluster that holds 3 rollout actors beside one sampler (and 2 samplers beside 2 actors)."""


def _launch(tmp_path, name: str, args: list[str], env: dict | None = None) -> subprocess.Popen:
    out = open(tmp_path / f"{name}.out", "w")
    return subprocess.Popen(CLI + args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, **(env or {})})


def _kill(*procs):
    for p in procs:
        if p is not None and p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def test_scaling_is_bounded_by_the_cluster_cancels_on_scale_down_and_a_resume_applies_the_bound(tmp_path):
    run_dir = tmp_path / "run"
    args = [f"run.dir={run_dir}", *SMALL, *TINY]
    a = _launch(tmp_path, "a", args)
    b = None
    try:
        st = wait_progress(lambda: (s := read_status(run_dir))["step"] >= 1 and s, run_dir, "the first step")
        assert st["controller"]["actors_detail"] == st["actors"] and len(st["actors"]) == 2  # (item 9)
        with pytest.raises(ControlError, match=r"^scale: rollout.num_actors=10000 is more than this Ray cluster can "
                                               r"hold: at most 3 \(2 CPUs, 2,600 MB;"):
            request(run_dir, {"cmd": "scale", "changes": {"rollout.num_actors": 10000}})
        with pytest.raises(ControlError, match=r"^scale: sampler.num_samplers=4 is more than this Ray cluster"):
            request(run_dir, {"cmd": "scale", "changes": {"sampler.num_samplers": 4}})
        with pytest.raises(ControlError, match=r'^scale: "changes" must be a non-empty JSON object'):  # (item 9)
            request(run_dir, {"cmd": "scale", "changes": ["rollout.num_actors", 4]})
        assert len(read_status(run_dir)["actors"]) == 2  # nothing of those applied
        assert not (run_dir / "config_history.jsonl").exists()

        assert request(run_dir, {"cmd": "scale", "changes": {"rollout.num_actors": 4}, "force": True})["applied"] == {
            "rollout.num_actors": 4}
        wait_progress(lambda: len(read_status(run_dir)["actors"]) == 4, run_dir, "4 actors (forced past the bound)")
        t0 = time.monotonic()
        request(run_dir, {"cmd": "scale", "changes": {"rollout.num_actors": 1}})
        wait_progress(lambda: len(read_status(run_dir)["actors"]) == 1, run_dir, "the scale-down to 1 actor")
        print(f"scale-down 4 -> 1 took {time.monotonic() - t0:.1f} s")
        request(run_dir, {"cmd": "scale", "changes": {"rollout.num_actors": 4}, "force": True})  # kept in the history
        wait_progress(lambda: list((run_dir / "checkpoints").glob("step_*")), run_dir, "a checkpoint")
        request(run_dir, {"cmd": "stop", "now": True})
        assert a.wait(timeout=300) == 0

        # the resume applies the history (4 actors, forced) within the bound: 3, said in one line
        b = _launch(tmp_path, "b", [*args, "learner.resume=true"])
        st = wait_progress(lambda: (s := read_status(run_dir))["resumed"] and s.get("actors") and s, run_dir,
                            "the resumed service")
        assert st["controller"]["target"] == 3
        # (item 4) its controller continues admission from the learner's position, not from 0
        assert st["controller"]["version"] >= st["resumed"]["timeline_version"]
        assert st["controller"]["started"] >= st["resumed"]["step"] * 2  # learner.batch_size=2 per step trained
        request(run_dir, {"cmd": "stop", "now": True})
        assert b.wait(timeout=300) == 0
    finally:
        _kill(a, b)
    out = (tmp_path / "b.out").read_text()
    assert "rollout.num_actors=4 lowered to 3, what this Ray cluster can hold" in out, out[-3000:]
    history = [json.loads(x) for x in (run_dir / "config_history.jsonl").read_text().splitlines()]
    assert [h["source"] for h in history] == ["t1async scale --force", "t1async scale", "t1async scale --force"]


def test_rays_memory_monitor_killing_roles_is_survived_with_a_back_off(tmp_path):
    """docs/operations.md's recipe, command for command: Ray's threshold set just above what this
    machine uses now plus the launch (``tools/allocate_memory.py threshold``, 3.5 GB of headroom),
    then ``tools/allocate_memory.py until-killed RUN_DIR`` takes 128 MB at a time until Ray kills a
    role (at most 6 GB, given back at once): the service restarts what was killed, says so, backs
    off, and trains on; ``t1async status`` names the role killed and that training resumed."""
    tool = [sys.executable, str(REPO / "tools" / "allocate_memory.py")]
    threshold = subprocess.run([*tool, "threshold", "--headroom-mb", "3500"], capture_output=True, text=True,
                               check=True).stdout.strip()
    run_dir = tmp_path / "run"
    a = _launch(tmp_path, "a", [f"run.dir={run_dir}", *SMALL, "run.learner_restarts=4"],
                env={"RAY_memory_usage_threshold": threshold, "RAY_memory_monitor_refresh_ms": "250"})
    hog = None
    try:
        wait_progress(lambda: (s := read_status(run_dir))["step"] >= 1 and s, run_dir, "the first step")
        hog = subprocess.Popen([*tool, "until-killed", str(run_dir)], stdout=subprocess.PIPE, text=True)
        wait_progress(lambda: hog.poll() is not None, run_dir, "Ray's memory monitor to kill a role", stall_s=120)
        t_kill = time.time()
        seen = json.loads(hog.stdout.read().strip().splitlines()[-1])
        assert hog.returncode == 0 and seen["killed"], seen
        print("after the kill:", json.dumps(seen))

        def trained_after_kill():  # steps the service trained after the kill (metrics rows written since)
            rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
            return len([r for r in rows if r["time"] > t_kill]) >= 2

        wait_progress(trained_after_kill, run_dir, "two steps trained after the kill")
        st = read_status(run_dir)
        print("recovered:", json.dumps({k: st.get(k) for k in ("state", "step", "restarts")}), st["memory"]["line"])
        if st["memory"]["memory_kills"]:  # (a role Ray's text names as killed for memory)
            assert "training resumed" in st["memory"]["line"] and st["memory"]["last_kill"]["role"], st["memory"]
        request(run_dir, {"cmd": "stop"})
        assert a.wait(timeout=300) == 0
    finally:
        if hog is not None and hog.poll() is None:
            hog.kill()
        _kill(a)
    out = (tmp_path / "a.out").read_text()
    assert "Ray's memory monitor killed" in out or "the learner died" in out or "sampler" in out, out[-3000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))  # one timeline: nothing trained twice
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["ended"] == "stopped", summary
