"""A learner actor that cannot start: the launch ends with one line naming the cause (never Ray's
traceback), the traceback in the learner's log; and the cause read from Ray's errors."""

from __future__ import annotations

import json
import subprocess
import sys
import traceback

import pytest

from tests.support import REPO

CLI = [sys.executable, "-m", "t1async.cli", "launch", str(REPO / "configs" / "local.yaml")]


def _raised(exc: BaseException) -> str:
    try:
        raise exc
    except BaseException:
        return traceback.format_exc()


def test_error_line_names_the_remote_cause_of_a_ray_error():
    from ray.exceptions import ActorDiedError, RayTaskError

    from t1async.actors import error_line

    task = RayTaskError("Learner.__init__", _raised(ValueError("bad checkpoint /x: invalid header\nmore")),
                        ValueError("bad checkpoint /x"))
    died = ActorDiedError(task)  # what ray.get raises for an actor whose __init__ raised
    assert len(str(died).splitlines()) > 3 and "\x1b[" in str(died)  # Ray's text: colours and a traceback
    assert error_line(died) == "ValueError: bad checkpoint /x: invalid header"
    assert error_line(task) == "ValueError: bad checkpoint /x: invalid header"
    nested = _raised(type("SafetensorError", (Exception,), {"__module__": "safetensors._rust"})("header"))
    assert error_line(RuntimeError(nested)) == "SafetensorError: header"
    assert error_line(RuntimeError("one\ntwo")) == "one" and error_line(RuntimeError("")) == "RuntimeError"
    assert len(error_line(RuntimeError("x" * 1000))) == 300


@pytest.mark.slow
def test_a_learner_that_cannot_start_ends_the_launch_with_one_line_naming_the_cause(tmp_path):
    """A warm start whose weights file is corrupt (present, so no early file check catches it)."""
    from t1async.config import load_config
    from t1async.models.model import Qwen3MoeForCausalLM

    bad = tmp_path / "bad"
    Qwen3MoeForCausalLM(load_config(str(REPO / "configs" / "local.yaml"), []).model).save_pretrained(bad)
    weights = bad / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    run_dir = tmp_path / "run"
    proc = subprocess.run(CLI + [f"run.dir={run_dir}", f"learner.init_checkpoint={bad}", "learner.max_steps=1",
                                 "rollout.num_actors=1"], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "File \"" not in proc.stderr, proc.stderr[-3000:]
    errors = [x for x in proc.stderr.splitlines() if x.startswith("t1async: error:")]
    assert errors == [proc.stderr.strip().splitlines()[-1]], proc.stderr[-3000:]
    assert errors[0].startswith(f"t1async: error: the learner failed to start: ModelFolderError: {weights} is "
                                "not a readable safetensors file"), errors
    assert f"{run_dir}/logs/learner.log" in errors[0]
    log = (run_dir / "logs" / "learner.log").read_text()
    assert "Learner failed to start" in log and "Traceback" in log and "load_weights" in log
    assert json.loads((run_dir / "summary.json").read_text())["ended"] == "learner_failed_to_start"
