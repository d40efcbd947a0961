"""``t1async bench sampler-join``: what ``t1async scale RUN_DIR sampler.num_samplers=2`` costs a running service.

Prints ONE JSON object. Runs the service (``t1async launch CONFIG`` with one embedded sampler, a
child process), waits for ``--steps-before`` learner steps, asks ``scale sampler.num_samplers=2``
and polls ``t1async status`` every 0.2 s until the new sampler answered its first request. Then it
waits for ``--publishes-after`` more publishes and stops the service. Reported:

- ``scale_to_serving_s``: from the scale request to the new sampler entering routing (it holds
  weights); ``scale_to_first_request_s``: to its first answer served; ``first_request_version``
  and ``learner_version_at_join`` (equal: it served the learner's current version);
  ``start_s``: of that, the Ray actor's start (model built, HTTP up);
- ``pause_normal_s``: median seconds the samplers in service were paused per publish before the
  scale (metrics.jsonl ``publish_pause_s``); ``pause_join_s``: the pause at the first publish
  after the join (the one that re-formed the weight group, ``form_join_s`` seconds, before
  pausing anyone) and ``pause_ratio`` = ``pause_join_s / pause_normal_s``;
- ``not_ready``: /generate requests the new sampler refused for want of weights (0: rollout
  actors were never routed to it early).

Usage: ``t1async bench sampler-join [--config configs/local.yaml] [--steps-before 4] [--publishes-after 3] [key=value ...]``.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from t1async.cli import OneLineErrors, at_least_one
from t1async.service.control import ControlError, request

REPO = Path(__file__).resolve().parents[1]


def _status(run_dir: Path) -> dict | None:
    try:
        return request(run_dir, {"cmd": "status"}, timeout_s=30)
    except ControlError:
        return None


def _wait(fn, timeout_s: float, what: str, every_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = fn()
        if got:
            return got
        time.sleep(every_s)
    raise SystemExit(f"t1async bench sampler-join: timed out waiting for {what}")


def main(argv: list[str] | None = None) -> int:
    ap = OneLineErrors(prog="t1async bench sampler-join", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(REPO / "configs" / "local.yaml"))
    ap.add_argument("--steps-before", type=at_least_one, default=4)
    ap.add_argument("--publishes-after", type=at_least_one, default=3)
    ap.add_argument("overrides", nargs="*", default=[])
    a = ap.parse_args(argv)
    run_dir = Path(tempfile.mkdtemp(prefix="bench-sampler-join-")) / "run"
    cmd = [sys.executable, "-m", "t1async.cli", "launch", a.config, f"run.dir={run_dir}", "learner.max_steps=0",
           "sampler.num_samplers=1", *a.overrides]
    out = open(run_dir.parent / "launch.out", "w")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait(lambda: (s := _status(run_dir)) and s.get("step", 0) >= a.steps_before, 600, "the first steps")
        t_scale = time.time()
        request(run_dir, {"cmd": "scale", "changes": {"sampler.num_samplers": 2}})
        new = _wait(lambda: (s := _status(run_dir)) and next(
            (x for x in s["samplers"] if x["name"] == "sampler1" and x.get("first_request")), None), 600,
            "the new sampler's first request", every_s=0.2)
        version_at_join = _status(run_dir)["version"]
        _wait(lambda: (s := _status(run_dir)) and s.get("version", 0) >= version_at_join + a.publishes_after, 900,
              "the publishes after the join")
        request(run_dir, {"cmd": "stop"})
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    pubs = [r for r in rows if "publish_pause_s" in r]
    before = [r["publish_pause_s"] for r in pubs if r["time"] < t_scale]
    join = next((r for r in pubs if r["time"] > t_scale and r.get("publish_form_s", 0) > 0), None)
    med = statistics.median(before) if before else None
    res = {
        "bench": "sampler-join",
        "scale_to_serving_s": round(new["serving_at"] - t_scale, 2),
        "scale_to_first_request_s": round(new["first_request"]["at"] - t_scale, 2),
        "start_s": new["joined"]["after_s"],
        "first_request_version": new["first_request"]["weight_version"],
        "joined_version": new["joined"]["weight_version"],
        "learner_version_at_join": new["joined"]["learner_version"],
        "not_ready": new["not_ready"],
        "pause_normal_s": round(med, 4) if med is not None else None,
        "pause_join_s": round(join["publish_pause_s"], 4) if join else None,
        "form_join_s": round(join["publish_form_s"], 4) if join else None,
        "pause_ratio": round(join["publish_pause_s"] / med, 2) if join and med else None,
        "publishes_before": len(before), "steps": rows[-1]["step"] if rows else 0,
        "drift_tokens": sum(r["drift_tokens"] for r in rows), "run_dir": str(run_dir),
    }
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
