"""``t1async bench role-memory``: the memory each role of a running service takes (the figures
behind ``ray.role_memory_mb``, which bounds ``t1async scale``: t1async/service/capacity.py).

Prints ONE JSON object. Runs the service (``t1async launch CONFIG learner.max_steps=N``, a child
process) and every 2 s reads, for each Ray worker process of the launch (``ray::Learner``,
``ray::Controller``, ``ray::EmbeddedSampler``, ``ray::RolloutActor``; found by their command line
among the launch's descendants), its proportional set size (PSS, ``/proc/PID/smaps_rollup``: shared
pages such as torch's libraries split between the processes that map them, so the roles' figures
add up to what the node gives them) and its resident set size (RSS). The launch process itself
and Ray's own daemons are reported as ``launch`` and ``ray_daemons``.

Reported per role: ``pss_mb_max`` and ``rss_mb_max`` (the largest one process of that role reached
over the run), ``processes`` (how many of that role were seen at once, at most); and
``samples``, ``steps``, ``wall_s``.

Usage: ``t1async bench role-memory [--config configs/local.yaml] [--steps 6] [key=value ...]``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROLES = {"ray::Learner": "learner", "ray::Controller": "controller", "ray::EmbeddedSampler": "sampler",
         "ray::RolloutActor": "rollout"}


def _children() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                raw = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(raw[raw.rindex(")") + 2:].split()[1])
            out.setdefault(ppid, []).append(int(entry))
    return out


def _tree(root: int) -> list[int]:
    kids, found, frontier = _children(), [], [root]
    while frontier:
        for child in kids.get(frontier.pop(), []):
            found.append(child)
            frontier.append(child)
    return found


def _memory_mb(pid: int) -> tuple[float, float] | None:
    """(PSS, RSS) of ``pid`` in MB, or None when it is gone."""
    try:
        pss = rss = 0
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                pss = int(line.split()[1])
            elif line.startswith("Rss:"):
                rss = int(line.split()[1])
        return pss / 1024, rss / 1024
    except (OSError, ValueError, IndexError):
        return None


def sample(launch_pid: int) -> dict[str, list[tuple[float, float]]]:
    """``{role: [(pss_mb, rss_mb) per process]}`` of the launch's process tree now."""
    out: dict[str, list[tuple[float, float]]] = {}
    for pid in [launch_pid, *_tree(launch_pid)]:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        role = "launch" if pid == launch_pid else next((r for p, r in ROLES.items() if cmd.startswith(p)), None)
        if role is None:
            role = "ray_daemons" if "ray" in cmd else "other"
        mem = _memory_mb(pid)
        if mem is not None:
            out.setdefault(role, []).append(mem)
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="t1async bench role-memory")
    ap.add_argument("--config", default=str(REPO / "configs" / "local.yaml"))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    run_dir = Path(tempfile.mkdtemp(prefix="t1async-role-memory-")) / "run"
    cmd = [sys.executable, "-m", "t1async.cli", "launch", args.config, f"run.dir={run_dir}",
           f"learner.max_steps={args.steps}", *args.overrides]
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    peak: dict[str, dict[str, float]] = {}
    samples = 0
    try:
        while proc.poll() is None:
            for role, mems in sample(proc.pid).items():
                p = peak.setdefault(role, {"pss_mb_max": 0.0, "rss_mb_max": 0.0, "processes": 0})
                p["pss_mb_max"] = max(p["pss_mb_max"], *(m[0] for m in mems))
                p["rss_mb_max"] = max(p["rss_mb_max"], *(m[1] for m in mems))
                p["processes"] = max(p["processes"], len(mems))
            samples += 1
            time.sleep(2.0)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    metrics = run_dir / "metrics.jsonl"
    steps = len(metrics.read_text().splitlines()) if metrics.exists() else 0
    print(json.dumps({"roles": {r: {k: round(v, 1) for k, v in p.items()} for r, p in sorted(peak.items())},
                      "samples": samples, "steps": steps, "wall_s": round(time.time() - t0, 1),
                      "returncode": proc.returncode, "command": " ".join(cmd[2:])}, indent=2))
    return 0 if proc.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
