"""Asynchronous against synchronous RL on long-tailed terminal episodes, side by side in one command.

Run: ``t1async bench async [--seeds 0] [--steps 10] [--batch 8] [--actors 8] [--bounds 1,2,4]
[--rules oldest_episode,learner_version,learner_wait] [--out DIR] [key=value ...]``. Prints ONE JSON object.

Workload: ``--tasks`` instances of the ``slow-build`` synth family (t1async/commands/synth.py: every
verifier sleeps a lognormal time drawn per task, median 1.5 s, p99 about 30 s, Terminal-Bench
scaled down about 30x), the same for every run. Each run is the real system, ``t1async launch
configs/local.yaml`` as a subprocess, with the same model, seed, task set, rollout actors,
batch and number of trajectories trained (``--steps`` x ``--batch``), differing only in:

* ``sync``: ``learner.max_staleness=0``, synchronous RL with the same roles (admission starts
  each version's batch on that version's weights and nothing more until the learner has trained
  it and published; t1async/actors/controller.py);
* ``async-<rule>-<bound>``: bounds ``--bounds`` under each admission rule in ``--rules``
  (``rollout.admission``: ``oldest_episode`` never drops a slow episode, the actors wait for it;
  ``learner_version``, AReaL's rule, lets fast episodes run ahead and drops what gets too stale;
  ``learner_wait``, the default, admits as AReaL does and has the learner, not the actors, wait
  for a slow episode before a publish that would make it too stale, training oldest first: no drops).

Per run, from RUN_DIR/metrics.jsonl, summary.json and the rollout logs: ``wall_s`` (from the
learner's start to its last step; ``launch_s`` is the whole command), ``speedup`` (sync's
``wall_s`` / this run's), ``trajectories_per_s`` (trained), ``episodes_per_s`` (finished by the
last step, trained or not: an async run ends with a backlog of up to (bound + 1) x batch),
``learner_idle_frac`` (time waiting for a batch / wall), ``sampler_idle_frac`` (1 - generation time / wall),
the staleness histogram of the
trajectories trained, dropped-stale count, ``final_reward`` (mean reward of the last
``--final-steps`` steps) and ``reward_mean`` (all steps), and ``time`` (where the time goes:
learner training/publishing/waiting seconds; actor-seconds spent in episodes, of which in the
tasks' drawn verifier sleeps, and waiting for admission). ``best`` names the fastest async run
at a bound <= 4 and whether it reached ``--target`` (3.0x) with a final reward no worse than
sync's minus the seed spread. With several ``--seeds``, each run is repeated per seed and the
figures per mode are averaged (``per_seed`` keeps each).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from t1async.cli import OneLineErrors, at_least_one

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "local.yaml"
SENT = re.compile(r"^(\S+ \S+) .*rollout \d+ sent (\S+): .*, ([\d.]+) s$")


def parse_args(argv: list[str] | None = None):
    p = OneLineErrors(prog="t1async bench async", description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="0", help="comma-separated run seeds (model init, sampling, task order)")
    p.add_argument("--steps", type=at_least_one, default=10, help="learner steps per run")
    p.add_argument("--batch", type=at_least_one, default=8, help="trajectories per learner step")
    p.add_argument("--actors", type=at_least_one, default=8, help="rollout actors (the same in every mode)")
    p.add_argument("--bounds", default="1,2,4", help="staleness bounds of the async runs")
    p.add_argument("--rules", default="oldest_episode,learner_version,learner_wait",
                   help="admission rules of the async runs (rollout.admission); all but oldest_episode run only "
                        "the largest bound")
    p.add_argument("--tasks", type=at_least_one, default=200, help="slow-build task instances")
    p.add_argument("--final-steps", type=at_least_one, default=4, help="steps averaged for final_reward")
    p.add_argument("--target", type=float, default=3.0, help="speedup target over sync")
    p.add_argument("--out", default="", help="output folder (default runs/bench-async-<time>)")
    p.add_argument("overrides", nargs="*", default=[], help="key=value overrides of configs/local.yaml for every run")
    args = p.parse_args(argv)
    try:
        args.seed_list = [int(s) for s in args.seeds.split(",") if s.strip()]
        args.bound_list = [int(b) for b in args.bounds.split(",") if b.strip()]
    except ValueError:
        p.error(f"--seeds and --bounds must be comma-separated integers, got {args.seeds!r} and {args.bounds!r}")
    args.rule_list = [r.strip() for r in args.rules.split(",") if r.strip()]
    if not args.seed_list or not args.bound_list or min(args.bound_list) < 1:
        p.error("--seeds needs a seed and --bounds integers >= 1 (bound 0 is the sync run)")
    bad = set(args.rule_list) - {"oldest_episode", "learner_version", "learner_wait"}
    if bad or not args.rule_list:
        p.error(f"--rules: unknown admission rule(s) {sorted(bad)}; use oldest_episode, learner_version and/or "
                "learner_wait")
    return args


def modes(args) -> list[tuple[str, int, str]]:
    """(name, staleness bound, admission rule) of every run of one seed, sync first."""
    out = [("sync", 0, "oldest_episode")]
    for rule in args.rule_list:
        bounds = args.bound_list if rule == "oldest_episode" else [max(args.bound_list)]
        out += [(f"async-{rule}-{b}", b, rule) for b in bounds]
    return out


def verifier_seconds(tasks_dir: Path) -> dict[str, float]:
    """Task name -> the verifier seconds drawn into it (its test file's ``time.sleep``)."""
    out = {}
    for task in tasks_dir.iterdir():
        m = re.search(r"time\.sleep\(([\d.]+)\)", (task / "tests" / "test_outputs.py").read_text())
        out[task.name] = float(m.group(1)) if m else 0.0
    return out


def run_one(run_dir: Path, tasks_dir: Path, seed: int, bound: int, rule: str, args) -> float:
    """One ``t1async launch``; returns its wall seconds. Raises RuntimeError when it fails."""
    overrides = [f"run.dir={run_dir}", f"run.seed={seed}", f"env.tasks_dir={tasks_dir}",
                 f"learner.max_steps={args.steps}", f"learner.batch_size={args.batch}", "learner.publish_every=1",
                 f"learner.max_staleness={bound}", f"rollout.admission={rule}", f"rollout.num_actors={args.actors}",
                 "learner.checkpoint_every=0", "learner.episodes_per_step=0", "env.max_turns=2",
                 "generation.max_new_tokens=16", *args.overrides]
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "t1async.cli", "launch", str(CONFIG), *overrides],
                          capture_output=True, text=True)
    if proc.returncode != 0 or not (run_dir / "metrics.jsonl").exists():
        raise RuntimeError(f"t1async launch failed (exit {proc.returncode}) in {run_dir}: {proc.stderr[-1500:]}")
    return time.time() - t0


def episodes(run_dir: Path) -> list[tuple[float, str, float]]:
    """(finish time, task, seconds) of every episode the rollout actors sent, from their logs."""
    out = []
    for log in (run_dir / "logs").glob("rollout*.log"):
        for line in log.read_text().splitlines():
            m = SENT.match(line)
            if m:
                when = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S.%f").timestamp()
                out.append((when, m.group(2), float(m.group(3))))
    return out


def measure(run_dir: Path, verifier_s: dict[str, float], args) -> dict[str, Any]:
    """The figures of one finished run (see the module docstring)."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    summary = json.loads((run_dir / "summary.json").read_text())
    start = rows[0]["time"] - rows[0]["step_s"] - rows[0]["batch_wait_s"]  # the learner began waiting
    end = rows[-1]["time"]
    wall = end - start
    stale: dict[str, int] = {}
    for r in rows:
        for s, n in r["staleness_counts"].items():
            stale[s] = stale.get(s, 0) + n
    eps = [e for e in episodes(run_dir) if e[0] <= end]  # those finished before the last step
    busy = sum(s.get("busy_s", 0.0) for s in summary.get("samplers", []) if isinstance(s, dict))
    trained = sum(r["trajectories"] for r in rows)
    waited, train = sum(r["batch_wait_s"] for r in rows), sum(r["step_s"] for r in rows)
    episode_s = sum(e[2] for e in eps)
    actor_s = args.actors * wall
    return {
        "wall_s": round(wall, 1),
        "trajectories": trained,
        "trajectories_per_s": round(trained / wall, 3),
        # finished by the last step, trained or not: the rollout rate, less the end of a short run
        # (an async run ends with up to (bound + 1) x batch episodes done and not yet trained)
        "episodes_per_s": round(len(eps) / wall, 3),
        "learner_idle_frac": round(waited / wall, 3),
        "sampler_idle_frac": round(1 - busy / wall, 3),
        "staleness_hist": dict(sorted(stale.items(), key=lambda kv: int(kv[0]))),
        "dropped_stale": rows[-1]["dropped_stale"],
        "versions_per_batch_max": max(len(r["versions_in_batch"]) for r in rows),
        "final_reward": round(sum(r["reward_mean"] for r in rows[-args.final_steps:]) / len(rows[-args.final_steps:]), 3),
        "reward_mean": round(sum(r["reward_mean"] * r["trajectories"] for r in rows) / trained, 3),
        "time": {
            "learner_train_s": round(train - sum(r["publish_s"] for r in rows), 1),
            "learner_publish_s": round(sum(r["publish_s"] for r in rows), 1),
            "learner_wait_s": round(waited, 1),
            "learner_hold_s": round(sum(r.get("hold_s", 0.0) for r in rows), 1),  # of wait: for a slow episode
            "sampler_busy_s": round(busy, 1),
            "actor_s": round(actor_s, 1),
            "episodes": len(eps),
            "episode_s": round(episode_s, 1),
            "verifier_sleep_s": round(sum(verifier_s.get(e[1], 0.0) for e in eps), 1),
            "actor_admission_wait_s": round(max(actor_s - episode_s, 0.0), 1),
            "episode_p50_s": round(sorted(e[2] for e in eps)[len(eps) // 2], 2) if eps else None,
            "episode_max_s": round(max(e[2] for e in eps), 2) if eps else None,
        },
    }


def mean_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean over seeds of the numeric figures (histograms summed); one run is returned as is."""
    if len(runs) == 1:
        return runs[0]
    out: dict[str, Any] = {}
    for key, value in runs[0].items():
        if isinstance(value, dict) and key == "staleness_hist":
            hist: dict[str, int] = {}
            for r in runs:
                for s, n in r[key].items():
                    hist[s] = hist.get(s, 0) + n
            out[key] = hist
        elif isinstance(value, dict):
            out[key] = mean_runs([r[key] for r in runs])
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = round(sum(r[key] for r in runs) / len(runs), 3)
        else:
            out[key] = value
    return out


def main(argv: list[str] | None = None) -> int:
    from t1async.commands.synth import synthesize

    args = parse_args(argv)
    out = Path(args.out or REPO / "runs" / f"bench-async-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}")
    out.mkdir(parents=True, exist_ok=True)
    tasks_dir = out / "tasks"
    if not tasks_dir.exists():
        synthesize("slow-build", args.tasks, tasks_dir, seed=0)
    verifier_s = verifier_seconds(tasks_dir)
    per_seed: dict[str, list[dict[str, Any]]] = {}
    for seed in args.seed_list:
        for name, bound, rule in modes(args):
            run_dir = out / f"{name}-seed{seed}"
            launch_s = run_one(run_dir, tasks_dir, seed, bound, rule, args)
            fig = {"seed": seed, "bound": bound, "admission": rule, **measure(run_dir, verifier_s, args),
                   "launch_s": round(launch_s, 1)}
            per_seed.setdefault(name, []).append(fig)
            print(json.dumps({"run": name, **fig}), file=sys.stderr, flush=True)
    result: dict[str, Any] = {"workload": {
        "family": "slow-build", "tasks": args.tasks, "steps": args.steps, "batch": args.batch, "actors": args.actors,
        "trajectories_per_run": args.steps * args.batch, "seeds": args.seed_list,
        "verifier_s_median": sorted(verifier_s.values())[len(verifier_s) // 2],
        "verifier_s_mean": round(sum(verifier_s.values()) / len(verifier_s), 2), "out": str(out)}}
    sync = mean_runs(per_seed["sync"])
    sync_rewards = [r["final_reward"] for r in per_seed["sync"]]
    noise = max(sync_rewards) - min(sync_rewards) if len(sync_rewards) > 1 else 0.0
    result["modes"] = {}
    for name, runs in per_seed.items():
        fig = mean_runs(runs)
        fig["speedup"] = round(sync["wall_s"] / fig["wall_s"], 2)
        fig["speedups_per_seed"] = [round(s["wall_s"] / r["wall_s"], 2) for s, r in zip(per_seed["sync"], runs)]
        if len(runs) > 1:
            fig["per_seed"] = runs
        result["modes"][name] = fig
    candidates = [(f["speedup"], n) for n, f in result["modes"].items() if n != "sync" and f["bound"] <= 4]
    result["best"] = None  # (no async run at a bound <= 4)
    if candidates:
        speedup, name = max(candidates)
        reward_ok = result["modes"][name]["final_reward"] >= sync["final_reward"] - noise
        result["best"] = {"mode": name, "speedup": speedup, "target": args.target,
                          "reached": speedup >= args.target and reward_ok, "final_reward_ok": reward_ok,
                          "sync_final_reward_spread": round(noise, 3)}
    (out / "result.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    from loguru import logger

    logger.remove()
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
