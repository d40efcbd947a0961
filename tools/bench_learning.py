"""Does RL make the policy better? Warm start, then RL, measured on held-out tasks.

Run: ``t1async bench learning [--minutes 60] [--reward dense|binary|both] [--seeds 0,1] [--out DIR]``
(``--warm-start-only``: steps 1-3 alone, to rank template settings in minutes).

One command, in this order (everything through the product's own commands and code paths):

1. **Tasks.** ``t1async synth`` families (all whose oracle commands fit
   ``generation.max_new_tokens``, or ``--families``): ``--train-per-family`` training instances
   (synth seed 1000) and up to ``--heldout-per-family`` held-out instances (synth seed 2000)
   whose instruction, oracle commands and files all differ from every training instance's (so
   no held-out task is solved by replaying a command seen in training; families with too few
   parameter values get fewer or none, reported). ``t1async decontam``'s n-gram report of
   training against held-out is included as measured (see ``split`` in the output).
2. **Warm start** per seed: ``t1async sft`` on the first ``--sft-demos-per-family``
   demonstrations of each family (``sft.steps`` in the config: enough passes for the policy to
   copy names from the instruction into commands, and still clearly imperfect on held-out tasks).
3. **Held-out resolved rate** of the warm start: ``t1async eval --agent policy:CKPT``'s path,
   ``--eval-samples`` episodes per held-out task at the training temperature.
4. **RL**: ``t1async launch configs/learning.yaml`` from that checkpoint on the training tasks
   that were not demonstrations, of the families with held-out instances (``--rl-families
   measured``; ``all``: every family), for ``--minutes`` of wall clock (then SIGTERM: the learner finishes
   its step and writes a final
   checkpoint), once per reward (``learner.reward=dense``: tests passed, the reference's choice;
   ``binary``: 1 if resolved else 0), same seed and budget. The policy is snapshotted every
   ``--eval-every`` minutes (the latest checkpoint's weights).
5. **Held-out curve**: every snapshot evaluated as in 3, after the run (so evaluation never
   takes CPU from training).

Prints ONE JSON object: ``warm_start_resolved``, ``final_resolved``, ``delta_points`` (mean over
seeds, of the first reward mode), ``warm_start_pass_at_k`` (held-out tasks any of the
``--eval-samples`` episodes resolves: about the ceiling of sharpening the warm start),
``minutes``, ``trajectories``, ``steps``, and ``runs``: per seed and reward the held-out
``curve`` ([minutes, resolved rate]), per-family resolved rates at the start and the end,
training reward per step, trajectories, steps; ``spread``: min/max ``delta_points`` over seeds
per reward. Writes ``learning.png`` (matplotlib): held-out resolved rate against minutes, and training reward.
Everything lands under ``--out`` (default ``runs/bench-learning-<time>``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from loguru import logger

from t1async.cli import OneLineErrors, at_least_one
from t1async.config import Config, load_config

REPO = Path(__file__).resolve().parents[1]
RL_CONFIG = REPO / "configs" / "learning.yaml"


def parse_args(argv: list[str] | None = None):
    import argparse

    p = OneLineErrors(prog="t1async bench learning", description=__doc__.splitlines()[0],
                      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--minutes", type=float, default=60.0, help="RL wall-clock budget per run, minutes")
    p.add_argument("--reward", choices=("dense", "binary", "both"), default="both",
                   help="reward of the RL runs: dense (tests passed), binary (resolved), or both (ablation)")
    p.add_argument("--seeds", default="0,1", help="comma-separated seeds (SFT order, model init, sampling)")
    p.add_argument("--families", default="", help="comma-separated synth families (default: every family that fits)")
    p.add_argument("--train-per-family", type=at_least_one, default=150, help="training instances per family")
    p.add_argument("--heldout-per-family", type=at_least_one, default=8, help="held-out instances per family")
    p.add_argument("--sft-demos-per-family", type=at_least_one, default=100, help="SFT demonstrations per family")
    p.add_argument("--rl-families", choices=("measured", "all"), default="measured",
                   help="families RL trains on: measured (those with held-out instances) or all; SFT always "
                        "demonstrates every family")
    p.add_argument("--eval-samples", type=at_least_one, default=2, help="episodes per held-out task per evaluation")
    p.add_argument("--eval-every", type=float, default=10.0, help="minutes between policy snapshots for the curve")
    p.add_argument("--config", default=str(RL_CONFIG), help="config of the RL runs (and of SFT's model/env/generation)")
    p.add_argument("--warm-start", default="",
                   help="checkpoint folder to start RL from instead of running SFT (e.g. OUT/seed0/sft-checkpoint "
                        "of an earlier run of the same split and config; '{seed}' in it is replaced by each seed, "
                        "e.g. OUT/seed{seed}/sft-checkpoint); the warm start is still evaluated")
    p.add_argument("--warm-start-only", action="store_true",
                   help="stop after the warm start's held-out evaluation (no RL): ranks template settings "
                        "(model.chat_template_kwargs, env.action_format, model.path) in minutes")
    p.add_argument("--out", default="", help="output folder (default runs/bench-learning-<time>)")
    p.add_argument("overrides", nargs="*", default=[], help="key=value overrides of --config, e.g. sft.steps=200")
    args = p.parse_args(argv)
    try:
        args.seed_list = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        p.error(f"--seeds must be comma-separated integers, got {args.seeds!r}")
    if not args.seed_list:
        p.error("--seeds names no seed")
    if args.sft_demos_per_family >= args.train_per_family:
        p.error("--sft-demos-per-family must be less than --train-per-family: RL trains on the training tasks "
                "that were not demonstrations")
    if args.minutes <= 0 or args.eval_every <= 0:
        p.error("--minutes and --eval-every must be positive")
    for seed in args.seed_list if args.warm_start else []:
        folder = Path(args.warm_start.replace("{seed}", str(seed)))
        if not ((folder / "config.json").is_file() and any((folder / f).is_file() for f in
                                                            ("model.safetensors", "model.safetensors.index.json"))):
            p.error(f"--warm-start {folder}: no config.json + model.safetensors (or its shard index) there (a checkpoint folder, "
                    "e.g. OUT/seed0/sft-checkpoint of an earlier run)")
    return args


# ----------------------------------------------------------------------------- tasks

def instance_hash(task_dir: Path) -> str:
    """sha256 over a task's instruction, environment files and tests (not its name)."""
    h = hashlib.sha256()
    for sub in ("instruction.md", "environment", "tests"):
        root = task_dir / sub
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        for f in files:
            h.update(str(f.relative_to(task_dir)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def fitting_families(cfg: Config) -> list[str]:
    """Synth families whose demonstrated turns all fit ``generation.max_new_tokens`` (checked on 8 instances),
    less the timing families (:data:`~t1async.commands.synth.TIMING_FAMILIES`). A turn is measured as
    ``t1async sft`` writes it (:func:`~t1async.commands.sft.demonstration_turns`: with a model's own template,
    its generation-prompt remainder and, with ``env.action_format`` tool_call, the call's layout), so no family
    is kept whose demonstrations SFT would skip as too long."""
    import random

    from t1async.commands.sft import demonstration_turns
    from t1async.commands.synth import FAMILIES, TIMING_FAMILIES, oracle_commands
    from t1async.models.families import load_renderer

    tok = load_renderer(cfg.model)  # model.path's tokenizer, or the shipped one
    out = []
    for name, make in FAMILIES.items():
        if name in TIMING_FAMILIES:
            continue
        longest = 0
        for i in range(8):
            spec = make(random.Random(f"fit/{name}/{i}"))
            turns = demonstration_turns(tok, cfg.env, spec.instruction, oracle_commands(spec.solution))
            longest = max([longest, *(len(t) for t in turns)])
        if longest <= cfg.generation.max_new_tokens:
            out.append(name)
        else:
            logger.info("bench learning: family {} left out: a demonstrated turn takes {} tokens > {}", name, longest,
                        cfg.generation.max_new_tokens)
    return out


def prompt_tokens(cfg: Config, tasks: Path) -> dict[str, float]:
    """Mean and longest episode prompt (system, instruction, generation prompt: tokens) over the task folders in
    ``tasks``, as the rollout loop renders them (:func:`~t1async.rollout.conversation.start_conversation`)."""
    from t1async.models.families import load_renderer
    from t1async.rollout.conversation import start_conversation

    r = load_renderer(cfg.model)
    n = [len(start_conversation(r, cfg.env, (p / "instruction.md").read_text()).prompt) for p in sorted(tasks.iterdir())]
    return {"mean": round(sum(n) / len(n), 1), "max": max(n)} if n else {"mean": 0.0, "max": 0}


def _signature(task_dir: Path) -> tuple[str, tuple[str, ...]]:
    """(instruction text, oracle commands) of a synthesized task."""
    from t1async.commands.synth import oracle_commands

    return ((task_dir / "instruction.md").read_text().strip(),
            tuple(oracle_commands((task_dir / "solution" / "solve.sh").read_text())))


def make_split(root: Path, families: list[str], n_train: int, n_heldout: int, n_demos: int, cfg: Config,
               rl_families: str = "all") -> dict[str, Any]:
    """Write train/, heldout/, sft/ (the first ``n_demos`` training instances per family) and rl/
    (the other training instances) under ``root``.

    RL trains on rl/, not on the demonstrations: a policy that has memorised its demonstrations
    resolves them all (measured: 100 % over 23 steps), so their advantages are zero and RL on them
    learns nothing. With ``rl_families="measured"`` rl/ holds only the families that have held-out
    instances (the families the bench measures); the others are demonstrated but not trained on
    by RL. Measured (stop 22, ``tools/training_by_family.py``): the warm start resolves the four
    families without held-out instances at 0.86-1.0 during RL, so their groups of episodes mostly
    share one reward (group advantage 0) and take about 44 % of the rollouts while teaching nothing.

    Held-out instances are new in what a policy could memorise: each is kept only if its
    instruction, its oracle command sequence and its files all differ from every training
    instance's (candidates drawn from synth seed 2000, up to 20 per wanted instance). A family
    whose parameters are too few to give such instances (the same command solves many of its
    tasks) gets fewer or none, and is reported. ``t1async decontam``'s n-gram report is included as
    measured: instances of one family share its instruction templates and command shapes.
    """
    from t1async.commands.decontam import decontaminate
    from t1async.commands.sft import synth_family
    from t1async.commands.synth import synthesize

    train, heldout, sft, pool = root / "train", root / "heldout", root / "sft", root / "pool"
    rl = root / "rl"
    for d in (train, heldout, sft, pool, rl):
        shutil.rmtree(d, ignore_errors=True)
    heldout.mkdir(parents=True)
    kept: dict[str, int] = {}
    for fam in families:
        seen_text, seen_cmds, seen_files = set(), set(), set()
        for p in synthesize(fam, n_train, train, seed=1000):
            text, cmds = _signature(p)
            seen_text.add(text)
            seen_cmds.add(cmds)
            seen_files.add(instance_hash(p))
            shutil.copytree(p, (sft if int(p.name.rsplit("-", 1)[1]) < n_demos else rl) / p.name)
        kept[fam] = 0
        for p in synthesize(fam, 20 * n_heldout, pool, seed=2000):
            text, cmds = _signature(p)
            if kept[fam] < n_heldout and text not in seen_text and cmds not in seen_cmds and instance_hash(p) not in seen_files:
                shutil.move(str(p), heldout / p.name)
                kept[fam] += 1
        shutil.rmtree(pool, ignore_errors=True)
    if rl_families not in ("measured", "all"):
        raise ValueError(f"rl_families={rl_families!r}: use 'measured' or 'all'")
    unmeasured = {f for f, k in kept.items() if k == 0} if rl_families == "measured" else set()
    for p in list(rl.iterdir()) if rl.is_dir() else []:
        if synth_family(p.name) in unmeasured:
            shutil.rmtree(p)
    rows = decontaminate(train, heldout, n=cfg.env.decontam_ngram, threshold=cfg.env.decontam_threshold)
    flagged = [r for r in rows if r.flagged]
    return {"families": families, "train": len(list(train.iterdir())), "heldout": len(list(heldout.iterdir())),
            "heldout_per_family": kept, "families_without_heldout": [f for f, k in kept.items() if k == 0],
            "sft_demonstrations": len(list(sft.iterdir())),
            "rl_tasks": len(list(rl.iterdir())) if rl.is_dir() else 0,
            "rl_families": sorted({synth_family(p.name) for p in rl.iterdir()}) if rl.is_dir() else [],
            "heldout_sharing_instruction_commands_or_files_with_train": 0,
            "decontam_flagged": len(flagged), "decontam_checked": len(rows),
            "decontam_note": "t1async decontam (word n-grams) of training against held-out: instances of one family "
                             "share its instruction templates and command shapes, so same-family pairs overlap by "
                             "construction; no held-out instance repeats a training instruction, command sequence "
                             "or file set (checked exactly).",
            "dirs": {"train": str(train), "heldout": str(heldout), "sft": str(sft), "rl": str(rl)}}


# ----------------------------------------------------------------------------- runs

def rl_run(run_dir: Path, ckpt: Path, tasks: Path, seed: int, reward: str, minutes: float, eval_every: float,
           config: str, overrides: list[str]) -> dict[str, Any]:
    """``t1async launch`` for ``minutes``, snapshotting the policy every ``eval_every`` minutes.

    Returns ``{"snapshots": [[minutes, folder]], "metrics": [rows], "rc": exit status}``.
    """
    snaps_dir = run_dir.parent / f"{run_dir.name}-snapshots"
    shutil.rmtree(snaps_dir, ignore_errors=True)
    shutil.rmtree(run_dir, ignore_errors=True)
    snaps_dir.mkdir(parents=True)
    cmd = [sys.executable, "-m", "t1async.cli", "launch", config, *overrides, f"run.dir={run_dir}",
           f"run.seed={seed}", f"learner.init_checkpoint={ckpt}", f"env.tasks_dir={tasks}", "env.tasks=[]",
           f"learner.reward={reward}", "learner.max_steps=1000000"]
    logger.info("bench learning: {}", " ".join(cmd))
    log = open(run_dir.parent / f"{run_dir.name}.launch.log", "w")
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    snapshots: list[list[Any]] = [[0.0, str(ckpt)]]
    next_snap = eval_every
    try:
        while proc.poll() is None:
            elapsed = (time.monotonic() - t0) / 60
            if elapsed >= minutes:
                proc.send_signal(signal.SIGTERM)  # the learner finishes its step, then the final checkpoint
                break
            if elapsed >= next_snap:
                snap = _snapshot(run_dir, snaps_dir, elapsed)
                if snap:
                    snapshots.append([round(elapsed, 2), snap])
                next_snap += eval_every
            time.sleep(2.0)
        rc = proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    final = _snapshot(run_dir, snaps_dir, minutes, keep_all=True)
    if final:
        snapshots.append([round(min(minutes, (time.monotonic() - t0) / 60), 2), final])
    metrics_path = run_dir / "metrics.jsonl"
    rows = [json.loads(x) for x in metrics_path.read_text().splitlines() if x.strip()] if metrics_path.exists() else []
    return {"snapshots": snapshots, "metrics": rows, "rc": rc}


def _snapshot(run_dir: Path, snaps_dir: Path, minutes: float, keep_all: bool = False) -> str | None:
    """Copy the latest checkpoint's policy (a Hugging Face folder: config.json, the weights or their shards
    and index, generation_config.json and the tokenizer files) to ``snaps_dir``; remove older checkpoint
    folders (the bench needs only the snapshots) unless ``keep_all``."""
    from t1async.learner.checkpoints import latest_checkpoint
    from t1async.models.hf_folder import CONFIG, TOKENIZER_FILES

    latest = latest_checkpoint(run_dir / "checkpoints")
    if latest is None:
        return None
    dest = snaps_dir / f"{latest.name}-min{minutes:06.2f}"
    dest.mkdir(parents=True, exist_ok=True)
    policy = {CONFIG, "generation_config.json", *TOKENIZER_FILES}
    for f in latest.iterdir():
        if f.is_file() and (f.name in policy or (f.name.startswith("model") and ".safetensors" in f.name)):
            shutil.copy2(f, dest / f.name)
    if not keep_all:
        for old in (run_dir / "checkpoints").glob("step_*"):
            if old != latest:
                shutil.rmtree(old, ignore_errors=True)
    return str(dest)


def plot(path: Path, runs: dict[str, Any]) -> None:
    """learning.png: held-out resolved rate against minutes (left), training reward per step (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for key, r in runs.items():
        xs, ys = zip(*[(m, v) for m, v in r["curve"]])
        a.plot(xs, [100 * y for y in ys], marker="o", label=key)
        rows = r["train_reward"]
        if rows:
            b.plot([m for m, _ in rows], [v for _, v in rows], alpha=0.8, label=key)
    a.set_xlabel("minutes of RL")
    a.set_ylabel("held-out resolved rate (%)")
    a.set_title("held-out tasks")
    a.grid(alpha=0.3)
    a.legend(fontsize=8)
    b.set_xlabel("minutes of RL")
    b.set_ylabel("training reward (tests passed, mean of 10 steps)")
    b.set_title("training reward")
    b.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _smoothed_reward(rows: list[dict[str, Any]], t0: float | None) -> list[list[float]]:
    """[minutes since the first step, mean reward_mean of the last 10 steps] per step."""
    out, window = [], []
    start = t0 if t0 is not None else (rows[0].get("time", 0.0) - rows[0].get("step_s", 0.0) if rows else 0.0)
    for r in rows:
        window = (window + [r["reward_mean"]])[-10:]
        out.append([round((r.get("time", start) - start) / 60, 3), round(sum(window) / len(window), 4)])
    return out


def main(argv: list[str] | None = None) -> int:
    from t1async.commands.sft import evaluate_policy, run_sft

    args = parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    now = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    out = Path(args.out or REPO / "runs" / f"bench-learning-{now}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    logger.remove()
    logger.add(sys.stderr, level="INFO", format="{time:HH:mm:ss} {message}")
    logger.add(out / "bench.log", level="DEBUG")
    families = [f for f in args.families.split(",") if f] or fitting_families(cfg)
    split = make_split(out / "tasks", families, args.train_per_family, args.heldout_per_family,
                       args.sft_demos_per_family, cfg, rl_families=args.rl_families)
    split["prompt_tokens"] = prompt_tokens(cfg, Path(split["dirs"]["heldout"]))
    logger.info("bench learning: split {}", json.dumps({k: v for k, v in split.items() if k != "decontam_note"}))
    rewards = [] if args.warm_start_only else ["dense", "binary"] if args.reward == "both" else [args.reward]
    runs: dict[str, Any] = {}
    warm: dict[int, Any] = {}
    for seed in args.seed_list:
        seed_cfg = load_config(args.config, [*args.overrides, f"run.seed={seed}", f"sft.seed={seed}"])
        if args.warm_start:
            sft_dir = Path(args.warm_start.replace("{seed}", str(seed))).resolve()
            sft = {"demonstrations": None, "skipped_by_reason": None, "curve": None, "seconds": 0.0,
                   "reused_checkpoint": str(sft_dir)}
        else:
            sft_dir = out / f"seed{seed}" / "sft-checkpoint"
            sft = run_sft(seed_cfg, split["dirs"]["sft"], sft_dir)
        warm_eval = evaluate_policy(sft_dir, split["dirs"]["heldout"], seed_cfg, samples=args.eval_samples)
        warm[seed] = {"sft": {k: sft[k] for k in ("demonstrations", "stopped_early", "resolved_demonstrations",
                                                   "skipped_by_reason", "curve", "seconds", "reused_checkpoint")
                              if k in sft},
                      "heldout": warm_eval}
        logger.info("bench learning: seed {} warm start resolves {:.1%} of held-out episodes", seed,
                    warm_eval["resolved_rate"])
        for reward in rewards:
            key = f"{reward}/seed{seed}"
            r = rl_run(out / f"seed{seed}" / f"rl-{reward}", sft_dir, Path(split["dirs"]["rl"]), seed, reward,
                       args.minutes, args.eval_every, args.config, args.overrides)
            curve = [[0.0, warm_eval["resolved_rate"]]]
            evals = []
            for minutes, snap in r["snapshots"][1:]:
                e = evaluate_policy(snap, split["dirs"]["heldout"], seed_cfg, samples=args.eval_samples)
                curve.append([minutes, e["resolved_rate"]])
                evals.append({"minutes": minutes, "snapshot": snap, **e})
                logger.info("bench learning: {} at {:.1f} min resolves {:.1%}", key, minutes, e["resolved_rate"])
            rows = r["metrics"]
            t0 = rows[0]["time"] - rows[0]["step_s"] if rows and "time" in rows[0] else None
            runs[key] = {"seed": seed, "reward": reward, "curve": curve, "evals": evals, "rc": r["rc"],
                         "steps": rows[-1]["step"] if rows else 0,
                         "trajectories": sum(x["trajectories"] for x in rows),
                         "dropped_stale": rows[-1]["dropped_stale"] if rows else 0,
                         "train_reward": _smoothed_reward(rows, t0),
                         "warm_start_resolved": warm_eval["resolved_rate"], "final_resolved": curve[-1][1],
                         "delta_points": round(100 * (curve[-1][1] - warm_eval["resolved_rate"]), 1),
                         "warm_start_pass_at_k": warm_eval["pass_at_k"],
                         "final_pass_at_k": evals[-1]["pass_at_k"] if evals else warm_eval["pass_at_k"],
                         "warm_start_per_family": warm_eval["per_family"],
                         "final_per_family": evals[-1]["per_family"] if evals else warm_eval["per_family"]}
            (out / "result.partial.json").write_text(json.dumps(runs, indent=1))
    mean = lambda xs: round(sum(xs) / len(xs), 4) if xs else 0.0  # noqa: E731
    if not rewards:  # --warm-start-only
        result = {"warm_start_resolved": mean([w["heldout"]["resolved_rate"] for w in warm.values()]),
                  "warm_start_pass_at_k": mean([w["heldout"]["pass_at_k"] for w in warm.values()]),
                  "sft_token_accuracy": mean([w["sft"]["curve"][-1]["token_accuracy"] for w in warm.values()
                                              if w["sft"].get("curve")]),
                  "seeds": args.seed_list, "split": {k: v for k, v in split.items() if k != "dirs"}, "warm_start": warm,
                  "settings": {"config": args.config, "overrides": args.overrides, "warm_start_only": True},
                  "out": str(out)}
        (out / "result.json").write_text(json.dumps(result, indent=1))
        print(json.dumps(result))
        return 0
    first = [r for r in runs.values() if r["reward"] == rewards[0]]
    result = {
        "warm_start_resolved": mean([r["warm_start_resolved"] for r in first]),
        "final_resolved": mean([r["final_resolved"] for r in first]),
        "delta_points": round(mean([r["delta_points"] for r in first]), 1),
        # the share of held-out tasks any of --eval-samples episodes resolves: about the most that
        # sharpening the warm start toward its own best samples can reach
        "warm_start_pass_at_k": mean([r["warm_start_pass_at_k"] for r in first]),
        "reward": rewards[0], "minutes": args.minutes, "seeds": args.seed_list,
        "trajectories": mean([r["trajectories"] for r in first]), "steps": mean([r["steps"] for r in first]),
        "spread": {rw: {"delta_points_min": min(r["delta_points"] for r in runs.values() if r["reward"] == rw),
                        "delta_points_max": max(r["delta_points"] for r in runs.values() if r["reward"] == rw),
                        "delta_points_mean": round(mean([r["delta_points"] for r in runs.values() if r["reward"] == rw]), 1)}
                   for rw in rewards},
        "split": {k: v for k, v in split.items() if k != "dirs"},
        "warm_start": warm, "runs": {k: {kk: vv for kk, vv in r.items() if kk != "train_reward"} for k, r in runs.items()},
        "settings": {"config": args.config, "overrides": args.overrides, "train_per_family": args.train_per_family,
                     "heldout_per_family": args.heldout_per_family,
                     "sft_demos_per_family": args.sft_demos_per_family, "eval_samples": args.eval_samples,
                     "rl_families": args.rl_families,
                     "temperature": cfg.generation.temperature, "sft_steps": cfg.sft.steps,
                     "sft_early_stop_frac": cfg.sft.early_stop_frac},
        "out": str(out),
    }
    plot(out / "learning.png", runs)
    result["plot"] = str(out / "learning.png")
    (out / "result.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
