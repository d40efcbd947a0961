"""Per task family: how a run's training episodes went early and late.

Run: ``.venv/bin/python tools/learning_report.py RUN_DIR [--window N]``. Prints ONE JSON object:
for the first and the last ``--window`` episodes the rollout actors sent (by time), per family
(the task name without its ``-<seed>-<i>`` suffix, as ``t1async synth`` names tasks): episodes,
fraction of verifier tests passed, resolved rate and mean turns. Read from the rollout actors'
logs (``RUN_DIR/logs/rollout*.log``, one ``sent`` line per trajectory).
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from pathlib import Path

from t1async.cli import OneLineErrors, at_least_one

SENT = re.compile(r"^(\S+ \S+) .* sent (\S+): (\d+) tokens, (\d+) turns, (\d+)/(\d+) tests")


def episodes(run_dir: Path) -> list[tuple[str, str, int, int, int]]:
    """(time, family, turns, passed, total) of every trajectory sent, sorted by time."""
    rows = []
    for log in sorted((run_dir / "logs").glob("rollout*.log")):
        for line in log.read_text(errors="replace").splitlines():
            m = SENT.search(line)
            if m:
                family = re.sub(r"-\d+-\d+$", "", m.group(2))
                rows.append((m.group(1), family, int(m.group(4)), int(m.group(5)), int(m.group(6))))
    return sorted(rows)


def table(rows: list[tuple[str, str, int, int, int]]) -> dict[str, dict[str, float]]:
    by: dict[str, list] = defaultdict(list)
    for r in rows:
        by[r[1]].append(r)
    return {fam: {"episodes": len(v), "tests_passed": round(sum(x[3] for x in v) / max(sum(x[4] for x in v), 1), 3),
                  "resolved": round(sum(x[3] == x[4] and x[4] > 0 for x in v) / len(v), 3),
                  "turns": round(sum(x[2] for x in v) / len(v), 2)} for fam, v in sorted(by.items())}


def main(argv: list[str] | None = None) -> int:
    p = OneLineErrors(prog="tools/learning_report.py", description=__doc__.splitlines()[0])
    p.add_argument("run_dir", help="a t1async launch run directory")
    p.add_argument("--window", type=at_least_one, default=300, help="episodes in each of the two windows")
    args = p.parse_args(argv)
    rows = episodes(Path(args.run_dir))
    if not rows:
        p.error(f"no rollout log lines under {args.run_dir}/logs; pass a run directory of t1async launch")
    n = min(args.window, len(rows) // 2)
    print(json.dumps({"episodes": len(rows), "window": n, "first": table(rows[:n]), "last": table(rows[-n:])}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
