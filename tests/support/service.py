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
