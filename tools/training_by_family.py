"""Training episodes of a run, per synth family and per part of the run: resolved rate and turns.

Run: ``python tools/training_by_family.py RUN_DIR [--parts 3]``

Reads every trajectory in ``RUN_DIR/receive_log`` (what the learner received; segments a learner
recycled after consuming them are gone, so run it on a run of one learner life, as
``t1async bench learning``'s), orders them by the time their episode finished, splits them into
``--parts`` equal parts, and prints one JSON line per part: ``{"part", "episodes", "families":
{family: {"episodes", "resolved_rate", "turns_mean"}}}`` (family: :func:`t1async.commands.sft.synth_family`);
``turns_mean`` counts every assistant turn, the end signal included.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from t1async.commands.sft import synth_family
from t1async.trajectory import decode
from t1async.transport.delivery import ReceiveLog


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="training_by_family", description=__doc__.splitlines()[0])
    p.add_argument("run_dir")
    p.add_argument("--parts", type=int, default=3)
    args = p.parse_args(argv)
    folder = Path(args.run_dir) / "receive_log"
    if not folder.is_dir():
        p.error(f"{folder} does not exist: pass a run directory")
    if args.parts < 1:
        p.error("--parts must be >= 1")
    log = ReceiveLog(folder, fsync="never")
    trajs = sorted((decode(log.read(k)) for k in log.keys()), key=lambda t: t.finished_at)
    n = len(trajs)
    for i in range(args.parts):
        part = trajs[i * n // args.parts:(i + 1) * n // args.parts]
        fams: dict[str, list[tuple[bool, int]]] = {}
        for t in part:
            fams.setdefault(synth_family(t.task), []).append((bool(t.resolved), len(t.turn_offsets)))
        print(json.dumps({"part": i + 1, "episodes": len(part), "families": {
            f: {"episodes": len(v), "resolved_rate": round(sum(r for r, _ in v) / len(v), 3),
                "turns_mean": round(sum(k for _, k in v) / len(v), 2)} for f, v in sorted(fams.items())}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
