"""``t1async status | stop | scale`` are light: they import neither torch nor Ray (issue 42 item 8:
``status`` took 10-40 s on a busy node because importing torch did).

Each command runs in its own interpreter against a live control socket (the real
:class:`~t1async.service.control.ControlServer`, bound by this test as a launch would, holding the run
directory's lock); the interpreter reports which heavy modules it imported and how long the command took.
The real launch's path is covered by tests/test_service_e2e.py; here only the client side is measured.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from t1async.service.control import ControlServer
from t1async.service.rundir import RunDirLock

REPO = Path(__file__).resolve().parents[3]
PROBE = """
import json, sys, time
t0 = time.perf_counter()
from t1async.cli import main
rc = main(sys.argv[1:])
print(json.dumps({"rc": rc, "s": time.perf_counter() - t0,
                  "heavy": [m for m in ("torch", "ray", "numpy", "transformers", "omegaconf", "yaml", "rich", "loguru",
                                        "t1async.config", "t1async.envs") if m in sys.modules]}))
"""


@pytest.fixture
def served(tmp_path):
    """A run directory held by this process, its control socket answering status, stop and scale."""
    calls: list[dict] = []

    def status(req):
        calls.append(req)
        return {"ok": True, "run_dir": str(tmp_path), "state": "running", "step": 3, "version": 1, "max_steps": 0,
                "actors": [{"id": 0, "state": "running", "version": 1, "episodes": 2}], "samplers": []}

    def stop(req):
        calls.append(req)
        return {"ok": True}

    def scale(req):
        calls.append(req)
        return {"ok": True, "applied": req["changes"]}

    lock = RunDirLock(tmp_path)
    server = ControlServer("127.0.0.1", {"status": status, "stop": stop, "scale": scale})
    lock.write(control=server.address)
    yield tmp_path, calls, lock
    server.close()
    lock.release()


def probe(*args: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "out": proc.stdout}


ALLOWED = {"status": {"rich"}, "status --json": set(), "scale": {"yaml"}}
"""What each command may import of the probe's list: the table's rich, scale's YAML values (issue 42
item 5: status took ~3 s at load 10-16 for the config, the environments, yaml, rich and loguru)."""


@pytest.mark.parametrize("args", [("status",), ("status", "--json"), ("scale", "rollout.num_actors=2")])
def test_status_and_scale_import_neither_torch_nor_ray(served, args):
    run_dir, calls, _ = served
    got = probe(args[0], str(run_dir), *args[1:])
    assert got["rc"] == 0, got
    assert set(got["heavy"]) <= ALLOWED[" ".join(a for a in args if not a.startswith("rollout"))], got
    assert calls and calls[-1]["cmd"] == args[0]  # it did reach the service
    print(f"t1async {' '.join(args)}: {got['s']:.2f} s in-process, imported {got['heavy']}")
    assert got["s"] < 10.0  # (under a second idle: docs/results/2026-12-07-operator.md; torch alone took 10-40 s)


def test_stop_imports_neither_torch_nor_ray(served):
    run_dir, calls, lock = served

    def release_soon():  # the launch writes its summary and gives up the directory once stopped; stop waits for that
        deadline = time.monotonic() + 60
        while not any(c["cmd"] == "stop" for c in calls) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        (run_dir / "summary.json").write_text(json.dumps({"run_dir": str(run_dir), "ended": "stopped", "learner": {}}))
        lock.release()

    import threading

    threading.Thread(target=release_soon, daemon=True).start()
    got = probe("stop", str(run_dir), "--now")
    assert got["rc"] == 0 and "stopped" in got["out"], got
    assert got["heavy"] == [], got
    assert calls[-1] == {"cmd": "stop", "now": True}


def test_stop_fails_in_one_line_when_the_service_ended_without_a_summary_or_with_an_error(served):
    """A launch killed while stopping writes no summary; one whose learner died writes ``error``: ``stop``
    said "stopped", rc 0, for both (issue 42, a fresh user: the final checkpoint's raw Ray traceback)."""
    import threading

    run_dir, calls, lock = served
    control = json.loads((run_dir / "service.json").read_text())["control"]

    def release_soon(holder, summary):
        deadline = time.monotonic() + 60
        while not any(c["cmd"] == "stop" for c in calls) and time.monotonic() < deadline:
            time.sleep(0.05)
        if summary is not None:
            (run_dir / "summary.json").write_text(json.dumps(summary))
        holder.release()

    def stop():
        return subprocess.run([sys.executable, "-m", "t1async.cli", "stop", str(run_dir)], capture_output=True,
                              text=True, timeout=120, cwd=REPO)

    threading.Thread(target=release_soon, args=(lock, None), daemon=True).start()
    proc = stop()
    assert proc.returncode == 1 and "t1async: error: the service ended without writing" in proc.stderr, proc
    calls.clear()
    again = RunDirLock(run_dir)  # held again (a resumed launch), ending with its learner dead
    again.write(control=control)
    threading.Thread(target=release_soon, args=(again, {"run_dir": str(run_dir), "ended": "learner_died", "error":
                                                        "the learner died while stopping (RuntimeError: x)"}),
                     daemon=True).start()
    proc = stop()
    assert proc.returncode == 1 and proc.stderr.strip() == (
        "t1async: error: stopped, but the learner died while stopping (RuntimeError: x)"), proc
