"""``t1async soak CONFIG --minutes N --kill-every S``: the chaos soak and its ledger.

Runs the service (``t1async launch CONFIG learner.max_steps=0 run.audit=true``, a child process)
for N minutes while killing a random role with SIGKILL every S seconds (a rollout actor 2 in 4, an
embedded sampler or the learner 1 in 4 each; ``--roles learner`` kills only the learner; found as
the launch's descendant processes titled ``ray::RolloutActor`` / ``ray::EmbeddedSampler`` /
``ray::Learner``),
scales the rollout actors up and down twice (``t1async scale``), then stops it (``t1async stop``)
and prints the ledger, counted from what the run left on disk:

- ``started``: episodes admitted by the controller (net of failed ones), ``failed_episodes``;
- ``sent``: trajectory ids the rollout actors spooled (``RUN_DIR/audit``, written after each spool);
- ``acked``: of those, the ones no spool holds any more (the learner acknowledged them);
- ``trained``: trajectories in the surviving timeline's steps (metrics.jsonl: a resume drops the rows
  of the steps it lost), ``dropped`` by reason (the final checkpoint's trainer state);
- ``duplicates_trained`` = trained + dropped - distinct ids in the final checkpoint's consumed-id
  ledger: an id trained twice would count twice on the left and once on the right;
- ``pending``: sent, not consumed, and still in a spool or in the receive log (a resume trains them);
- ``lost`` = sent ids neither consumed by the final checkpoint nor pending;
- ``staleness_max`` against the bound, and ``hang`` (no learner step for ``--hang-s`` seconds, or
  the service did not stop within 5 minutes).
- ``dropped_stale_restart``: of the stale drops, those of trajectories sampled (in part) by the
  weights of an earlier learner life, or by a publication that started a timeline segment (a
  resume's or a joining sampler's): the learner's counter, an upper bound on the drops a restart
  caused; t1async/learner/timeline.py says why it should be 0).

Progress goes to stderr as it runs (a line at each sample, every 30 s, and at each kill and scale);
the launch's own output to ``RUN_DIR/soak-launch.out``; the ledger, as JSON, to stdout at the end.
Exit status 0 when lost = 0, duplicates = 0, the bound held, no stale drop came from a restart and
nothing hung; 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from t1async.config import load_config
from t1async.learner.checkpoints import latest_checkpoint
from t1async.service.control import ControlError, request
from t1async.service.reaper import descendants
from t1async.service.rundir import is_held
from t1async.transport.delivery import ReceiveLog, read_consumed

LAUNCH_OUT = "soak-launch.out"
"""The launch's console output, in the run directory."""
ROLE_TITLES = {"rollout": b"ray::RolloutActor", "sampler": b"ray::EmbeddedSampler", "learner": b"ray::Learner"}


def role_pids(launch_pid: int, role: str) -> list[int]:
    """Pids of the launch's descendants whose process title starts with the role's Ray title."""
    out = []
    for pid in descendants(launch_pid):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(ROLE_TITLES[role]):
                out.append(pid)
        except OSError:
            continue
    return out


def ledger(run_dir: Path, max_staleness: int, last_status: dict[str, Any] | None = None) -> dict[str, Any]:
    """The soak's ledger of a stopped run (see the module docstring)."""
    sent: set[str] = set()
    for f in (run_dir / "audit").glob("sent-*.txt"):
        sent.update(x for x in f.read_text().split() if x)
    spooled = {p.name.split(".", 2)[2].rsplit(".", 1)[0] for p in (run_dir / "spool").glob("*/*.traj")}
    ckpt = latest_checkpoint(run_dir / "checkpoints")
    consumed = read_consumed(ckpt / "consumed.json") if ckpt else read_consumed(run_dir / "none")
    state = json.loads((ckpt / "trainer_state.json").read_text()) if ckpt else {}
    logged = set(ReceiveLog(run_dir / "receive_log", fsync="never").keys()) if (run_dir / "receive_log").exists() else set()
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()] \
        if (run_dir / "metrics.jsonl").exists() else []
    rows = [r for r in rows if r["step"] <= state.get("step", 0)]
    trained = sum(r["trajectories"] for r in rows)
    dropped = {k: v for k, v in state.get("dropped", {}).items() if v}
    consumed_sent = {t for t in sent if t in consumed}
    pending = {t for t in sent - consumed_sent if t in spooled or t in logged}
    lost = sent - consumed_sent - pending
    ctrl = (last_status or {}).get("controller", {})
    return {
        "started": ctrl.get("started"), "failed_episodes": ctrl.get("failed_episodes"),
        "sent": len(sent), "acked": len(sent - spooled), "trained": trained, "dropped": dropped,
        "dropped_stale_restart": state.get("dropped_stale_restart"),
        "consumed_distinct": len(consumed), "duplicates_trained": trained + sum(dropped.values()) - len(consumed),
        "consumed_without_sent_record": len(consumed) - len(consumed_sent), "pending": len(pending),
        "lost": len(lost), "lost_ids": sorted(lost)[:10], "steps": len(rows),
        "staleness_max": max((r["staleness_max"] for r in rows), default=0), "staleness_bound": max_staleness,
        "ledger_streams": len(consumed.marks), "ledger_holes": consumed.holes(),
    }


def tree_rss_bytes(root: int) -> int:
    """Resident memory of ``root`` and every descendant (``VmRSS`` of /proc/PID/status summed;
    pages shared between processes count once per process), bytes; processes gone meanwhile are skipped."""
    total = 0
    for pid in [root, *descendants(root)]:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
                    break
        except (OSError, ValueError):
            continue
    return total


def dir_bytes(root: Path) -> int:
    """Bytes of the regular files under ``root`` (files removed meanwhile are skipped)."""
    total = 0
    for f in root.rglob("*"):
        try:
            if f.is_file() and not f.is_symlink():
                total += f.stat().st_size
        except OSError:
            continue
    return total


def disk_by_part(run_dir: Path) -> dict[str, int]:
    """:func:`dir_bytes` of each top-level entry of ``run_dir`` (a file counts as its own part;
    symbolic links are skipped, as in :func:`dir_bytes`)."""
    out: dict[str, int] = {}
    try:
        entries = list(run_dir.iterdir())
    except OSError:
        return out
    for e in entries:
        try:
            if e.is_symlink():
                continue
            out[e.name] = dir_bytes(e) if e.is_dir() else e.stat().st_size
        except OSError:
            continue
    return out


def growth_per_10k(samples: list[dict[str, float]], key: str) -> float | None:
    """Least-squares slope of ``key`` against ``sent`` (trajectories spooled so far) over
    ``samples``, times 10,000: the growth of that resource per 10,000 trajectories. None with
    fewer than 3 samples or no spread in ``sent``."""
    pts = [(x["sent"], x[key]) for x in samples]
    if len(pts) < 3:
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    var = sum((p[0] - mx) ** 2 for p in pts)
    if var == 0:
        return None
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / var * 10_000


def resources(samples: list[dict[str, float]]) -> dict[str, Any]:
    """Summary of the soak's disk and memory samples (see :func:`soak`): first and last values, the
    peaks, and the growth per 10,000 trajectories of the samples after the first quarter of the
    soak (start-up, first checkpoints and caches filling are not growth), in all and per top-level
    part of the run directory (``parts``: checkpoints rotate, so their slope is noise around zero,
    while metrics.jsonl and TensorBoard events grow with every step)."""
    if not samples:
        return {"samples": 0}
    late = samples[len(samples) // 4:]
    parts = sorted({k for x in late for k in x.get("parts", {})})
    by_part = {p: growth_per_10k([{"sent": x["sent"], p: x.get("parts", {}).get(p, 0)} for x in late], p)
               for p in parts}
    return {"samples": len(samples), "sent_first": samples[0]["sent"], "sent_last": samples[-1]["sent"],
            "disk_bytes_first": samples[0]["disk"], "disk_bytes_last": samples[-1]["disk"],
            "disk_bytes_max": max(x["disk"] for x in samples),
            "rss_bytes_first": samples[0]["rss"], "rss_bytes_last": samples[-1]["rss"],
            "rss_bytes_max": max(x["rss"] for x in samples),
            "disk_growth_bytes_per_10k_trajectories": growth_per_10k(late, "disk"),
            "rss_growth_bytes_per_10k_trajectories": growth_per_10k(late, "rss"),
            "disk_growth_bytes_per_10k_trajectories_by_part": by_part,
            "disk_bytes_last_by_part": samples[-1].get("parts", {})}


def _sent_count(run_dir: Path) -> int:
    n = 0
    for f in (run_dir / "audit").glob("sent-*.txt"):
        try:
            n += f.read_bytes().count(b"\n")
        except OSError:
            continue
    return n


DEFAULT_VICTIMS = ("rollout", "rollout", "sampler", "learner")  # each kill draws one (a rollout actor 2 in 4)


def soak(config: str, minutes: float, kill_every: float, overrides: list[str], *, seed: int = 0,
         hang_s: float = 300.0, run_dir: Path | None = None, sample_every_s: float = 30.0,
         roles: tuple[str, ...] = DEFAULT_VICTIMS) -> dict[str, Any]:
    """Run the soak; returns the ledger plus ``kills``, ``scales``, ``hang``, ``run_dir`` and
    ``resources``: every ``sample_every_s`` seconds the run directory's bytes and the resident
    memory of the launch's process tree are sampled with the trajectories spooled so far
    (:func:`resources`). ``kill_every`` <= 0 kills nothing (a plain long run, to measure growth).
    ``roles``: each kill's victim is drawn from these (names of :data:`ROLE_TITLES`, repeats weigh).

    Raises:
        ValueError: a role in ``roles`` is not one of :data:`ROLE_TITLES`.
    """
    if not roles or set(roles) - set(ROLE_TITLES):
        raise ValueError(f"soak roles {list(roles)}: each must be one of {sorted(ROLE_TITLES)}")
    rng = random.Random(seed)
    run_dir = (run_dir or Path(f"runs/soak-{time.strftime('%Y%m%d-%H%M%S')}")).resolve()
    cfg = load_config(config, [*overrides, f"run.dir={run_dir}"])
    launch_args = [sys.executable, "-m", "t1async.cli", "launch", config, *overrides, f"run.dir={run_dir}",
                   "learner.max_steps=0", "run.audit=true", "run.learner_restarts=20"]
    run_dir.mkdir(parents=True, exist_ok=True)
    out = open(run_dir / LAUNCH_OUT, "w")  # noqa: SIM115  (inside the run directory, nothing beside it)
    proc = subprocess.Popen(launch_args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    say(f"launched the service in {run_dir} (its output: {out.name}); waiting for its first step")
    kills: dict[str, int] = {"rollout": 0, "sampler": 0, "learner": 0}
    scales: list[int] = []
    samples: list[dict[str, float]] = []
    last: dict[str, Any] | None = None
    hang = False
    try:
        deadline = time.monotonic() + 600
        while last is None or last.get("step", 0) < 1:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"the service did not make a first step; see {out.name}")
            time.sleep(2)
            last = _try_status(run_dir) or last
        t0 = time.monotonic()
        say(f"first step; soaking for {minutes:g} min, a kill every {kill_every:g} s" if kill_every > 0
            else f"first step; running for {minutes:g} min without kills")
        end = t0 + minutes * 60
        n = cfg.rollout.num_actors
        scale_at = [t0 + f * minutes * 60 for f in (0.2, 0.4, 0.6, 0.8)]
        next_kill = t0 + kill_every if kill_every > 0 else float("inf")
        next_sample = t0
        last_step, last_step_t = last.get("step", 0), time.monotonic()
        while time.monotonic() < end and proc.poll() is None:
            time.sleep(1)
            if time.monotonic() >= next_sample:
                next_sample += sample_every_s
                parts = disk_by_part(run_dir)
                samples.append({"minutes": round((time.monotonic() - t0) / 60, 2), "sent": _sent_count(run_dir),
                                "disk": sum(parts.values()), "parts": parts, "rss": tree_rss_bytes(proc.pid)})
                say(progress_line(samples[-1]["minutes"], minutes, last, kills, samples[-1]["sent"]))
            st = _try_status(run_dir)
            if st is not None:
                last = st
                if st.get("step", last_step) != last_step:  # (no step while the learner restarts)
                    last_step, last_step_t = st["step"], time.monotonic()
            if time.monotonic() - last_step_t > hang_s:
                hang = True
                break
            if scale_at and time.monotonic() >= scale_at[0]:
                scale_at.pop(0)
                target = n + 1 if len(scales) % 2 == 0 else n
                if _try(lambda: request(run_dir, {"cmd": "scale", "changes": {"rollout.num_actors": target}})):
                    scales.append(target)
                    say(f"scaled to rollout.num_actors={target}")
            if time.monotonic() >= next_kill:
                next_kill += kill_every
                role = rng.choice(roles)
                pids = role_pids(proc.pid, role)
                if pids:
                    victim = rng.choice(pids)
                    os.kill(victim, signal.SIGKILL)
                    kills[role] += 1
                    say(f"killed a {role} (pid {victim})")
        say("stopping the service (t1async stop) and counting the ledger")
        _try(lambda: request(run_dir, {"cmd": "stop"}))
        try:
            proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            hang = True
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        deadline = time.monotonic() + 30
        while is_held(run_dir) and time.monotonic() < deadline:
            time.sleep(0.5)
    result = ledger(run_dir, cfg.learner.max_staleness, last)
    result.update({"minutes": minutes, "kill_every_s": kill_every, "kills": kills, "scales": scales,
                   "learner_restarts": (last or {}).get("restarts", {}).get("learner"),
                   "sampler_restarts": (last or {}).get("restarts", {}).get("samplers"), "hang": hang,
                   "exit_status": proc.returncode, "run_dir": str(run_dir), "resources": resources(samples)})
    return result


def progress_line(elapsed_min: float, minutes: float, status: dict[str, Any] | None, kills: dict[str, int],
                  sent: int) -> str:
    """One line of a soak's progress: minutes done of ``minutes``, the learner's step, trajectories
    sent so far, kills by role, restarts (from the last ``status`` reply) and drops by reason."""
    st = status or {}
    restarts = " ".join(f"{k} {v}" for k, v in (st.get("restarts") or {}).items())
    dropped = json.dumps({k: v for k, v in (st.get("dropped") or {}).items() if v})
    return (f"{elapsed_min:.1f}/{minutes:g} min  step {st.get('step', '-')}  sent {sent}  "
            f"kills {' '.join(f'{k} {v}' for k, v in kills.items())}  restarts {restarts or '-'}  dropped {dropped}")


def say(line: str) -> None:
    """A progress line of the soak on stderr (the ledger alone goes to stdout, at the end)."""
    print(f"t1async soak: {line}", file=sys.stderr, flush=True)


def _try_status(run_dir: Path) -> dict[str, Any] | None:
    return _try(lambda: request(run_dir, {"cmd": "status"}, timeout_s=30))


def _try(fn: Any) -> Any:
    try:
        return fn()
    except (ControlError, OSError):
        return None


def register(sub: argparse._SubParsersAction) -> None:
    """``t1async soak CONFIG --minutes N --kill-every S [key=value ...]``."""
    p = sub.add_parser("soak", help="chaos soak: run the service, SIGKILL roles, scale, stop; print the ledger")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", default=[], help="key=value overrides of the config")
    p.add_argument("--minutes", type=float, default=20.0, help="soak duration (default 20)")
    p.add_argument("--kill-every", type=float, default=20.0, help="seconds between kills (default 20; 0: none)")
    p.add_argument("--seed", type=int, default=0, help="seed of the choice of victims")
    p.add_argument("--run-dir", default=None, help="run directory (default runs/soak-TIME)")
    p.add_argument("--roles", default=",".join(DEFAULT_VICTIMS),
                   help="comma list the victim of each kill is drawn from, repeats weigh (default "
                        f"{','.join(DEFAULT_VICTIMS)}; e.g. learner)")
    p.set_defaults(func=run_soak)


def run_soak(args: argparse.Namespace) -> int:
    try:
        roles = tuple(r.strip() for r in args.roles.split(",") if r.strip())
        r = soak(args.config, args.minutes, args.kill_every, args.overrides, seed=args.seed,
                 run_dir=Path(args.run_dir) if args.run_dir else None, roles=roles)
    except ValueError as e:
        print(f"t1async soak: {e}", file=sys.stderr)
        return 2
    print(json.dumps(r, indent=1))
    ok = (r["lost"] == 0 and r["duplicates_trained"] == 0 and r["staleness_max"] <= r["staleness_bound"]
          and not r["dropped_stale_restart"] and not r["hang"])
    return 0 if ok else 1
