"""Samplers of a running service end to end (real Ray, embedded samplers, gloo weight group,
ZeroMQ, bubblewrap): scaled 1 -> 2 -> 1 live and killed with SIGKILL while trajectories keep
flowing. A new or restarted sampler serves its first request only once it holds the learner's
current version; a drained one leaves routing and the weight group; nothing is lost, drift stays 0."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from t1async.commands.soak import ledger
from t1async.service.control import request
from tests.support import REPO
from tests.support.service import read_status, wait_for

pytestmark = pytest.mark.slow
CLI = [sys.executable, "-m", "t1async.cli", "launch", str(REPO / "configs" / "local.yaml")]
SMALL = ["learner.max_steps=0", "learner.batch_size=2", "env.max_turns=2", "generation.max_new_tokens=16",
         "sampler.num_samplers=1", "rollout.num_actors=2", "run.audit=true", "learner.checkpoint_every=0"]


def _sampler(st: dict, name: str) -> dict | None:
    return next((s for s in st["samplers"] if s["name"] == name), None)


def _serving_with_first_request(run_dir: Path, name: str, restarts: int = 0):
    st = read_status(run_dir)
    s = _sampler(st, name)
    return s if s and s["state"] == "serving" and s["restarts"] == restarts and s.get("first_request") else None


def _joined_current(s: dict) -> None:
    """It entered routing holding the learner's version, was never sent a request before, and its
    first answer came from that version or a later one."""
    assert s["not_ready"] == 0, s  # no /generate reached it before it held weights
    assert s["joined"]["weight_version"] == s["joined"]["learner_version"], s
    assert s["first_request"]["weight_version"] >= s["joined"]["weight_version"], s


def test_samplers_scale_1_2_1_and_a_killed_one_is_restarted_while_trajectories_flow(tmp_path):
    run_dir = tmp_path / "run"
    out = open(tmp_path / "launch.out", "w")
    proc = subprocess.Popen(CLI + [f"run.dir={run_dir}", *SMALL], stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        wait_for(lambda: read_status(run_dir)["step"] >= 1, 300, "the first step")

        # 1 -> 2: the new sampler serves once it holds the current weights
        t_scale = time.time()
        assert request(run_dir, {"cmd": "scale", "changes": {"sampler.num_samplers": 2}})["applied"] == {
            "sampler.num_samplers": 2}
        s1 = wait_for(lambda: _serving_with_first_request(run_dir, "sampler1"), 180, "sampler1's first request")
        _joined_current(s1)
        print(f"scale -> sampler1 holds v{s1['joined']['weight_version']}: {s1['serving_at'] - t_scale:.1f} s, "
              f"first request: {s1['first_request']['at'] - t_scale:.1f} s")

        # SIGKILL sampler0 (Ray sees its actor die): restarted after the back-off, rejoins, serves the current version
        st = read_status(run_dir)
        os.kill(_sampler(st, "sampler0")["pid"], signal.SIGKILL)
        s0 = wait_for(lambda: _serving_with_first_request(run_dir, "sampler0", restarts=1), 180,
                   "the restarted sampler0's first request")
        _joined_current(s0)
        assert s0["pid"] != _sampler(st, "sampler0")["pid"]
        st = read_status(run_dir)
        assert st["restarts"]["samplers"] == 1
        step = st["step"]
        wait_for(lambda: read_status(run_dir)["step"] >= step + 2, 180, "two steps with the restarted sampler")

        # 2 -> 1: sampler1 drains, leaves routing and the weight group; no publish waits for it
        request(run_dir, {"cmd": "scale", "changes": {"sampler.num_samplers": 1}})
        wait_for(lambda: [s["name"] for s in read_status(run_dir)["samplers"]] == ["sampler0"], 60, "sampler1 removed")
        step = read_status(run_dir)["step"]
        last = wait_for(lambda: (s := read_status(run_dir))["step"] >= step + 2 and s, 180, "two steps after scaling down")
        assert last["samplers"][0]["state"] == "serving"

        request(run_dir, {"cmd": "stop"})
        assert proc.wait(timeout=180) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    log = (tmp_path / "launch.out").read_text()
    assert "Traceback" not in log, log[-3000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(r["drift_tokens"] == 0 for r in rows) and all(r["staleness_max"] <= 2 for r in rows)
    # the first publish after a membership change re-formed the group before pausing anyone
    assert any(r.get("publish_form_s", 0) > 0 for r in rows)
    led = ledger(run_dir, 2, last)
    assert led["lost"] == 0 and led["duplicates_trained"] == 0 and led["sent"] > 0, led
    failures = last.get("episode_failures") or {}
    assert not failures.get("SamplerUnavailable"), failures  # requests to the dead sampler went to another
    hist = [json.loads(x) for x in (run_dir / "config_history.jsonl").read_text().splitlines()]
    assert [h["changes"]["sampler.num_samplers"] for h in hist] == [2, 1]  # a resume keeps the last
