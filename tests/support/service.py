"""Driving a real launch from a test: the command line, small overrides, waiting on progress, its status."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from t1async.service.control import ControlError, request
from tests.support import REPO

CLI = [sys.executable, "-m", "t1async.cli", "launch", str(REPO / "configs" / "local.yaml")]
SMALL = ["learner.max_steps=0", "learner.batch_size=2", "env.max_turns=2", "generation.max_new_tokens=16",
         "learner.checkpoint_every=1", "run.learner_restarts=2"]
def wait_for(cond, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            got = cond()
        except ControlError:
            got = None
        if got:
            return got
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
def read_status(run_dir: Path) -> dict:
    return request(run_dir, {"cmd": "status"})


STALL_S = 300.0
"""How long :func:`wait_progress` waits while nothing in the service advances (a loaded machine
slows every role alike; a wedged one stops them all)."""
CAP_S = 3600.0
"""The most :func:`wait_progress` waits in all, however the service advances."""


def progress(run_dir: Path) -> tuple:
    """What advances while a service starts and runs: its logs' sizes and, once it answers, the
    learner's step and intake, the episodes drawn and the samplers' requests."""
    logs = sum(p.stat().st_size for p in (run_dir / "logs").glob("*.log")) if (run_dir / "logs").is_dir() else 0
    try:
        st = read_status(run_dir)
    except ControlError:
        return (logs,)
    return (logs, st.get("step"), st.get("received"), (st.get("controller") or {}).get("tasks_drawn"),
            sum(s.get("requests") or 0 for s in st.get("samplers") or []))


def wait_progress(cond, run_dir: Path, what: str, stall_s: float = STALL_S, cap_s: float = CAP_S):
    """Wait for ``cond()`` to be truthy while the service advances (:func:`progress`): fail when
    nothing advanced for ``stall_s`` seconds, or after ``cap_s`` in all; not after a fixed wall
    time (under a load of 100 the first step alone took over 300 s)."""
    start = last_change = time.monotonic()
    seen = None
    while True:
        try:
            got = cond()
        except ControlError:
            got = None
        if got:
            return got
        now = time.monotonic()
        p = progress(run_dir)
        if p != seen:
            seen, last_change = p, now
        if now - last_change > stall_s:
            raise AssertionError(f"nothing advanced for {stall_s:.0f} s waiting for {what} (last progress {seen})")
        if now - start > cap_s:
            raise AssertionError(f"timed out after {cap_s:.0f} s waiting for {what} though the service advanced")
        time.sleep(1.0)
