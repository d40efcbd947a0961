"""``t1async plot RUN_DIR [--out FILE.png]``: one PNG of a run's ``metrics.jsonl`` (matplotlib).

Panels, each against learner step (left column) and wall-clock minutes since the first step
(right column): reward and resolved rate; staleness (max, mean); train-inference mismatch
(mean |log pi - log mu|, k3 KL); throughput (trajectories/s between steps, tokens/s of the
update); trajectories dropped so far, by reason. Works on a running service (it only reads).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from t1async import require_extra
from t1async.service.control import ControlError

PANELS: list[tuple[str, list[str]]] = [
    ("reward / resolved", ["reward_mean", "resolved_rate"]),
    ("staleness (versions)", ["staleness_max", "staleness_mean"]),
    ("train-inference mismatch", ["logprob_diff_mean", "kl_k3"]),
    ("throughput", ["trajectories_per_s", "tokens_per_s"]),
    ("dropped (cumulative)", ["dropped"]),
]


def read_rows(run_dir: Path) -> list[dict[str, Any]]:
    """The rows of ``RUN_DIR/metrics.jsonl`` with ``trajectories_per_s`` added (between steps).

    Raises:
        ControlError: no such folder, or no metrics written yet.
    """
    path = Path(run_dir) / "metrics.jsonl"
    if not Path(run_dir).is_dir():
        raise ControlError(f"no run directory {run_dir}")
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    if not rows:
        raise ControlError(f"{path} has no learner steps yet; plot again after the first step")
    for prev, row in zip([None, *rows], rows):
        dt = row["time"] - prev["time"] if prev else 0.0
        row["trajectories_per_s"] = row["trajectories"] / dt if dt > 0 else None
    return rows


def plot(run_dir: Path, out: Path) -> Path:
    """Write the PNG; returns its path."""
    matplotlib = require_extra("matplotlib", "plot", "t1async plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # (matplotlib, as above)

    rows = read_rows(run_dir)
    steps = [r["step"] for r in rows]
    minutes = [(r["time"] - rows[0]["time"]) / 60 for r in rows]
    fig, axes = plt.subplots(len(PANELS), 2, figsize=(12, 2.6 * len(PANELS)), squeeze=False)
    for i, (title, keys) in enumerate(PANELS):
        series: dict[str, list[Any]] = {}
        for key in keys:
            if key == "dropped":
                reasons = sorted({k for r in rows for k, v in (r.get("dropped") or {}).items() if v})
                for reason in reasons or ["stale"]:
                    series[reason] = [(r.get("dropped") or {}).get(reason, 0) for r in rows]
            elif any(r.get(key) is not None for r in rows):
                series[key] = [r.get(key) for r in rows]
        for j, xs in enumerate((steps, minutes)):
            ax = axes[i][j]
            for name, ys in series.items():
                pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
                if pts:
                    ax.plot(*zip(*pts), label=name, marker="." if len(pts) < 50 else None)
            ax.set_title(title, fontsize=9)
            ax.set_xlabel("learner step" if j == 0 else "wall minutes")
            ax.grid(alpha=0.3)
            if series:
                ax.legend(fontsize=7)
    fig.suptitle(f"{Path(run_dir).resolve().name}: {len(rows)} steps, {sum(r['trajectories'] for r in rows)} "
                 f"trajectories in {minutes[-1]:.1f} min")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def register(sub: argparse._SubParsersAction) -> None:
    """``t1async plot RUN_DIR [--out FILE.png]``."""
    p = sub.add_parser("plot", help="write a PNG of a run's metrics (reward, staleness, mismatch, throughput, drops)")
    p.add_argument("run_dir")
    p.add_argument("--out", default=None, help="PNG path (default RUN_DIR/metrics.png)")
    p.set_defaults(func=run_plot)


def run_plot(args: argparse.Namespace) -> int:
    out = plot(Path(args.run_dir), Path(args.out) if args.out else Path(args.run_dir) / "metrics.png")
    print(f"wrote {out}")
    return 0
