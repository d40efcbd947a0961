"""Does admission starve slow tasks? Each task's share of training against its share of episodes started.

Run: ``t1async bench admission [--slow-s 0.15] [--steps 60] [--bound 1]``. Prints ONE JSON object.

Rollout actors and a learner run as threads around a real :class:`~t1async.actors.controller.Controller`:
3 fast tasks and one slow one (``--slow-s`` per episode, standing in for a long verifier), batch 4,
one weight version per step, staleness bound ``--bound``. Each episode is sampled at the version
admission saw; the learner takes trajectories in arrival order and drops those beyond the bound,
as t1async/actors/learner.py does. Three admission rules side by side, same workload:

* ``learner_version``: AReaL's rule, ``started < (learner version + bound + 1) x R``;
* ``oldest_episode``: the same with the admission version of the oldest episode not yet consumed
  (t1async/actors/controller.py; ``rollout.admission`` picks the rule);
* ``learner_wait``: AReaL's admission, and the learner trains oldest first and holds a publish
  that would make an episode it does not hold yet too stale (``Controller.publish_allowed``), as
  t1async/actors/learner.py does under that rule.

Per rule: the slow task's share of episodes started and of trajectories trained, the largest gap
between the two shares over all tasks (in points), trajectories dropped as stale, and seconds.
"""

from __future__ import annotations

import json
import queue
import threading
import time
import uuid
from typing import Any

from t1async.actors.controller import Controller
from t1async.cli import OneLineErrors, at_least_one
from t1async.config import RolloutConfig


def simulate(admission: str, *, durations: dict[str, float], steps: int, batch: int, bound: int,
             actors: int, seed: int = 1) -> tuple[list[str], list[str], list[str]]:
    """Run the workload; returns the task names of episodes (started, trained, dropped as stale)."""
    c = Controller(RolloutConfig(num_actors=0, admission=admission), sorted(durations), rollouts_per_version=batch,
                       max_staleness=bound, make_rollout=None, seed=seed)
    started: list[str] = []
    trained: list[str] = []
    dropped: list[str] = []
    inbox: queue.Queue = queue.Queue()
    done = threading.Event()

    def actor(aid: int) -> None:
        while not done.is_set():
            name = c.acquire(aid)
            if name is None:
                return
            if name == "":
                continue
            version = c.status()["version"]  # the sampler holds at least the version admission saw
            started.append(name)
            time.sleep(durations[name])
            tid = uuid.uuid4().hex
            c.episode_finished(aid, tid)
            inbox.put((tid, name, version))

    threads = [threading.Thread(target=actor, args=(i,), daemon=True) for i in range(actors)]
    for t in threads:
        t.start()
    version = 0
    held: list[tuple[str, str, int]] = []  # received, not yet trained: (id, task, version)
    hold = admission == "learner_wait"
    for _ in range(steps):
        while True:
            if len(held) >= batch:
                if not hold:
                    break
                held.sort(key=lambda x: x[2])  # oldest first, as t1async/actors/learner.py under learner_wait
                if c.publish_allowed(version + 1, [tid for tid, _, _ in held]):
                    break
            try:
                tid, name, v = inbox.get(timeout=0.01 if len(held) >= batch else 60)
            except queue.Empty:
                continue
            if version - v > bound:
                dropped.append(name)
                c.trajectory_discarded("stale", tid)
                continue
            held.append((tid, name, v))
        got, held = held[:batch], held[batch:]
        trained += [n for _, n, _ in got]
        c.trajectories_consumed([tid for tid, _, _ in got])
        version += 1
        c.set_version(version)
    done.set()
    c._stopping = True  # end admission without Ray (Controller.stop also kills Ray actors)
    for t in threads:
        t.join(timeout=5)
    return started, trained, dropped


def shares(started: list[str], trained: list[str], dropped: list[str], slow: str) -> dict[str, Any]:
    """Shares of the slow task and the largest started-vs-trained gap over all tasks (points)."""
    names = sorted(set(started))
    gap = max(abs(started.count(n) / len(started) - trained.count(n) / len(trained)) for n in names)
    return {"slow_share_started": round(started.count(slow) / len(started), 3),
            "slow_share_trained": round(trained.count(slow) / len(trained), 3),
            "max_share_gap_points": round(100 * gap, 1), "dropped_stale": len(dropped),
            "started": len(started), "trained": len(trained)}


def main(argv: list[str] | None = None) -> int:
    p = OneLineErrors(prog="t1async bench admission", description=__doc__.splitlines()[0])
    p.add_argument("--slow-s", type=float, default=0.15, help="seconds per episode of the slow task")
    p.add_argument("--steps", type=at_least_one, default=60, help="learner steps per rule")
    p.add_argument("--bound", type=int, default=1, help="staleness bound (>= 0)")
    args = p.parse_args(argv)
    if args.slow_s <= 0 or args.bound < 0:
        p.error("--slow-s must be positive and --bound >= 0")
    durations = {"fast-a": 0.002, "fast-b": 0.002, "fast-c": 0.002, "slow": args.slow_s}
    out: dict[str, Any] = {"slow_s": args.slow_s, "bound": args.bound, "steps": args.steps, "batch": 4}
    for name in ("learner_version", "oldest_episode", "learner_wait"):
        t0 = time.perf_counter()
        s, t, d = simulate(name, durations=durations, steps=args.steps, batch=4, bound=args.bound, actors=4)
        out[name] = {**shares(s, t, d, "slow"), "seconds": round(time.perf_counter() - t0, 2)}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    import sys

    from loguru import logger

    logger.remove()
    sys.exit(main())
