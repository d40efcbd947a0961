"""``t1async bench mixed-agents``: a timed mixed-harness run on the shipped tasks, per harness.

Run: ``t1async bench mixed-agents [--minutes 20] [--agents builtin=1,codex=1,claude-code=1,terminus=1]
[--out DIR] [key=value ...]``. Prints ONE JSON object.

Launches the real service, ``t1async launch configs/local.yaml`` as a subprocess, with
``rollout.agent={NAME: WEIGHT, ...}`` (each episode draws its agent; docs/environments.md, "Mixing
agents in one run"), ``env.network=on`` (the harnesses reach the rollout's endpoint over loopback),
``model.vocab_size=4100`` (the tool-call vocabulary the harness dialects need),
``model.max_position_embeddings=65536`` (Claude Code's first request is about 27k tokens and Codex's
about 9k: at the default 8192 every such episode ends ``context_full`` before its first completion and
sends nothing) and ``learner.max_steps=0`` (run until stopped); extra ``key=value`` arguments are passed on. After
``--minutes`` minutes (counted from the launch) it stops the service with ``t1async stop --now RUN_DIR``
(running episodes are not waited for: a harness episode on a loaded CPU can take minutes; nothing
finished is lost) and summarises what the run left on disk (:func:`summarise`):

- per agent, from the ``by_agent`` part of every ``metrics.jsonl`` row (t1async/learner/metrics.py):
  ``episodes`` (trajectories trained), ``episodes_per_min`` (over the minutes from the launch to the
  last row), ``history_breaks``, ``template_mismatches``, ``turns_mean``, ``tokens``, ``reward_mean``,
  ``resolved_rate``, and ``finish_reasons`` when the rows split them by agent;
- over the run: ``steps``, ``trajectories``, ``finish_reasons`` and ``tool_call_errors`` (summed over
  rows), ``drift_tokens`` (must be 0: the trajectory is the sampled stream), ``summary`` (the run's
  ``summary.json`` when written) and ``load_average`` (``os.getloadavg`` 1-minute figure sampled every
  10 s while the service ran: mean and max, with the machine's CPU count; the machine may be shared).

An agent of ``--agents`` whose binary is missing is left out of the mix with one line on stderr that
names the command installing it (t1async/rollout/harnesses.py knows it); it is listed in ``skipped``.
The launch's own output goes to ``RUN_DIR/launch.out``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from t1async.cli import OneLineErrors
from t1async.learner.metrics import merge_agent_splits
from t1async.rollout.harnesses import HARNESSES, harness

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "local.yaml"
DEFAULT_AGENTS = "builtin=1,codex=1,claude-code=1,terminus=1"
# t1async/actors/rollout.py: "rollout 0 sent TASK (AGENT): ..."; t1async/rollout/agent.py, one line per harness
# episode: "AGENT episode of TASK: N completions in ... ended REASON, agent exit status S"
SENT = re.compile(r"rollout \d+ sent \S+ \(([^)]+)\):")
ENDED = re.compile(r" - (\S+) episode of \S+: .* ended (\S+), agent exit status")


def parse_agents(text: str) -> dict[str, float]:
    """``NAME=WEIGHT,...`` as a mapping (a bare ``NAME`` weighs 1).

    Raises:
        argparse.ArgumentTypeError: an empty list, a weight that is not a number > 0, or a name twice.
    """
    out: dict[str, float] = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, _, w = part.partition("=")
        try:
            weight = float(w) if w else 1.0
        except ValueError:
            weight = -1.0
        if weight <= 0 or not name or name in out:
            raise argparse.ArgumentTypeError(f"--agents {part!r}: each item is NAME=WEIGHT with a weight > 0, "
                                             f"each name once (e.g. {DEFAULT_AGENTS})")
        out[name] = weight
    if not out:
        raise argparse.ArgumentTypeError(f"--agents is empty; give e.g. {DEFAULT_AGENTS}")
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = OneLineErrors(prog="t1async bench mixed-agents", description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=20.0, help="minutes the service runs, from the launch")
    p.add_argument("--agents", type=parse_agents, default=parse_agents(DEFAULT_AGENTS),
                   help=f"the mix, NAME=WEIGHT comma-separated (default {DEFAULT_AGENTS})")
    p.add_argument("--out", type=Path, default=None, help="run directory (default runs/mixed-agents-<time>)")
    p.add_argument("overrides", nargs="*", help="extra key=value config overrides for the launch")
    args = p.parse_args(argv)
    if args.minutes <= 0:
        p.error(f"--minutes {args.minutes:g}: give a number of minutes > 0")
    return args


def installed_mix(agents: dict[str, float]) -> tuple[dict[str, float], dict[str, str]]:
    """Split ``agents`` into those that can run and those skipped (name -> the one line saying why,
    naming the install command). ``builtin`` and ``external`` need no binary; an unknown name is kept
    (the launch refuses it in its own line, listing the agents)."""
    keep: dict[str, float] = {}
    skipped: dict[str, str] = {}
    for name, w in agents.items():
        if name in HARNESSES:
            try:
                harness(name)
            except ValueError as e:
                skipped[name] = str(e)
                continue
        keep[name] = w
    return keep, skipped


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a ``metrics.jsonl`` (none when it is absent); a torn last line is skipped."""
    rows: list[dict[str, Any]] = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def episode_lines(lines: list[str]) -> dict[str, dict[str, Any]]:
    """Per agent, from the rollout actors' log lines: ``sent`` (trajectories sent to the learner) and,
    for a harness, ``ended`` (its episodes by the reason they ended, sent or not: an episode whose
    agent asked for no completion fails and sends nothing) and ``failed`` (ended minus sent)."""
    out: dict[str, dict[str, Any]] = {}
    for line in lines:
        if m := SENT.search(line):
            out.setdefault(m[1], {"sent": 0})["sent"] += 1
        elif m := ENDED.search(line):
            ended = out.setdefault(m[1], {"sent": 0}).setdefault("ended", {})
            ended[m[2]] = ended.get(m[2], 0) + 1
    for a in out.values():
        if "ended" in a:
            a["ended"] = dict(sorted(a["ended"].items()))
            a["failed"] = max(sum(a["ended"].values()) - a["sent"], 0)
    return dict(sorted(out.items()))


def _add(into: dict[str, int], counts: dict[str, Any] | None) -> None:
    for k, v in (counts or {}).items():
        if isinstance(v, (int, float)):
            into[k] = into.get(k, 0) + v


def summarise(rows: list[dict[str, Any]], start_time: float, summary: dict[str, Any] | None = None,
              load: list[float] | None = None, cpus: int | None = None,
              log_lines: list[str] | None = None, end_time: float | None = None) -> dict[str, Any]:
    """The bench's figures from a run's ``metrics.jsonl`` rows.

    Args:
        rows: the rows in file order (each a learner step; ``by_agent``, ``finish_reasons``,
            ``tool_call_errors``, ``drift_tokens``, ``time`` in Unix seconds are read where present).
        start_time: the launch's start, Unix seconds: episodes per minute count from it to the last row's
            ``time``.
        summary: the run's ``summary.json`` (passed through), or None.
        load: 1-minute load averages sampled during the run.
        cpus: the machine's CPU count (reported beside the load).
        log_lines: the rollout actors' log lines (:func:`episode_lines`: ``sent``, ``ended``, ``failed``
            join each agent's figures; ``failed_episodes`` counts them all, from ``summary``).
        end_time: when the service was stopped, Unix seconds: ``sent_per_min`` counts from ``start_time`` to
            it (None: to the last row's ``time``). A learner slower than the rollouts trains fewer than are sent.

    Returns:
        ``minutes`` (launch to last row), ``steps``, ``trajectories``, ``agents`` (per agent:
        :func:`~t1async.learner.metrics.merge_agent_splits`'s keys with ``trajectories`` named
        ``episodes``, plus ``episodes_per_min`` and ``finish_reasons`` when rows split them per agent),
        ``finish_reasons``, ``tool_call_errors``, ``drift_tokens``, ``dropped`` (trajectories the learner
        dropped, by reason: the last row's cumulative counts, or ``summary``'s), ``failed_episodes``,
        ``load_average``, ``summary``.
    """
    times = [r["time"] for r in rows if isinstance(r.get("time"), (int, float))]
    minutes = max((max(times) - start_time) / 60.0, 0.0) if times else 0.0
    agents: dict[str, dict[str, Any]] = {}
    for name, m in merge_agent_splits(rows).items():
        a = {"episodes": m.pop("trajectories"), **m}
        a["episodes_per_min"] = round(a["episodes"] / minutes, 3) if minutes else 0.0
        agents[name] = a
    wall = max(((end_time if end_time is not None else start_time + minutes * 60) - start_time) / 60.0, 0.0)
    for name, e in episode_lines(log_lines or []).items():
        a = agents.setdefault(name, {"episodes": 0, "episodes_per_min": 0.0})
        a.update(e, sent_per_min=round(e["sent"] / wall, 3) if wall else 0.0)
    for row in rows:  # a per-agent finish split, when the rows carry one
        for name, part in (row.get("by_agent") or {}).items():
            if isinstance(part.get("finish_reasons"), dict):
                _add(agents[name].setdefault("finish_reasons", {}), part["finish_reasons"])
    finish: dict[str, int] = {}
    tool_errors: dict[str, int] = {}
    for row in rows:
        _add(finish, row.get("finish_reasons"))
        _add(tool_errors, row.get("tool_call_errors"))
    return {
        "minutes": round(minutes, 2),
        "steps": max((int(r.get("step", 0)) for r in rows), default=0),
        "trajectories": sum(int(r.get("trajectories", 0)) for r in rows),
        "agents": dict(sorted(agents.items())),
        "finish_reasons": dict(sorted(finish.items())),
        "tool_call_errors": dict(sorted(tool_errors.items())),
        "drift_tokens": sum(int(r.get("drift_tokens", 0)) for r in rows),
        "dropped": (summary or {}).get("dropped") or (rows[-1].get("dropped") if rows else None),
        "failed_episodes": ((summary or {}).get("controller") or {}).get("failed_episodes"),
        "load_average": {"mean": round(sum(load) / len(load), 2) if load else None,
                         "max": round(max(load), 2) if load else None, "samples": len(load or []), "cpus": cpus},
        "summary": summary,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Launch, wait ``args.minutes``, stop with ``t1async stop``, and :func:`summarise`."""
    mix, skipped = installed_mix(args.agents)
    for line in skipped.values():
        print(f"bench mixed-agents: skipping: {line}", file=sys.stderr)
    if not mix:
        print("bench mixed-agents: no agent of --agents is installed; install one with the commands above", file=sys.stderr)
        raise SystemExit(1)
    run_dir = (args.out or REPO / "runs" / f"mixed-agents-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    agent = "{" + ", ".join(f"{k}: {v:g}" for k, v in mix.items()) + "}"
    cmd = [sys.executable, "-m", "t1async.cli", "launch", str(CONFIG), f"rollout.agent={agent}", "env.network=on",
           "model.vocab_size=4100", "model.max_position_embeddings=65536", "learner.max_steps=0", f"run.dir={run_dir}",
           *args.overrides]
    print(f"bench mixed-agents: launching {' '.join(cmd[2:])} for {args.minutes:g} min", file=sys.stderr)
    start = time.time()
    load: list[float] = []
    stopped: float | None = None
    with open(run_dir / "launch.out", "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
        try:
            end = time.monotonic() + args.minutes * 60
            while time.monotonic() < end and proc.poll() is None:
                load.append(os.getloadavg()[0])
                time.sleep(min(10.0, max(end - time.monotonic(), 0.0)))
            stopped = time.time()
            if proc.poll() is not None:
                print(f"bench mixed-agents: the service ended early (exit {proc.returncode}); see "
                      f"{run_dir / 'launch.out'}", file=sys.stderr)
            else:
                print("bench mixed-agents: stopping (t1async stop --now)", file=sys.stderr)
                subprocess.run([sys.executable, "-m", "t1async.cli", "stop", "--now", str(run_dir)], cwd=REPO,
                               stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, timeout=120, check=False)
                proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            print("bench mixed-agents: the service did not stop within 5 minutes; killing it", file=sys.stderr)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    lines = [x for log in sorted((run_dir / "logs").glob("rollout*.log")) for x in log.read_text().splitlines()]
    result = summarise(read_rows(run_dir / "metrics.jsonl"), start, summary, load, os.cpu_count(), lines, stopped)
    return {"minutes_asked": args.minutes, "mix": mix, "skipped": sorted(skipped), "run_dir": str(run_dir),
            "exit_status": proc.returncode, **result}


def main(argv: list[str] | None = None) -> int:
    print(json.dumps(run(parse_args(argv)), default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
