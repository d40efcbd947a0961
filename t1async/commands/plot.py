"""``t1async plot RUN_DIR [--out FILE.png]``: one PNG of a run's ``metrics.jsonl`` (matplotlib).

Panels, each against learner step (left column) and wall-clock minutes since the first step
(right column): reward and resolved rate; staleness (max, mean); train-inference mismatch
(mean |log pi - log mu|, k3 KL); throughput (trajectories/s between steps on the left axis,
tokens/s of the update on a right axis of its own: they differ by orders of magnitude);
trajectories dropped so far, by reason. Lines break where the service was down (a gap between
two steps longer than :data:`DOWNTIME_FACTOR` x the median step interval and at least
:data:`DOWNTIME_MIN_S`: a kill and its resume), and no rate is drawn across the gap. Works on a
running service (it only reads).
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
RIGHT_AXIS = {"tokens_per_s"}
"""Series drawn on a right-hand axis of their own (another unit or scale than the panel's first)."""
DOWNTIME_FACTOR, DOWNTIME_MIN_S = 5.0, 60.0


def downtime_after(rows: list[dict[str, Any]]) -> set[int]:
    """Indices i of rows that follow downtime: ``time[i] - time[i-1]`` is over ``DOWNTIME_FACTOR``
    x the median step interval and over ``DOWNTIME_MIN_S`` seconds (the service was stopped or
    dead in between, e.g. killed and resumed). Lines are broken before them."""
    gaps = [b["time"] - a["time"] for a, b in zip(rows, rows[1:])]
    if not gaps:
        return set()
    median = sorted(gaps)[len(gaps) // 2]
    return {i + 1 for i, g in enumerate(gaps) if g > max(DOWNTIME_FACTOR * median, DOWNTIME_MIN_S)}


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
    down = downtime_after(rows)
    for i, (prev, row) in enumerate(zip([None, *rows], rows)):
        dt = row["time"] - prev["time"] if prev else 0.0
        row["trajectories_per_s"] = row["trajectories"] / dt if dt > 0 and i not in down else None
    return rows


def broken_line(xs: list[Any], ys: list[Any], breaks: set[int]) -> tuple[list[float], list[float]]:
    """The points of one series (None values left out) with a NaN point inserted before each index
    in ``breaks``, so matplotlib draws no segment across downtime."""
    px: list[float] = []
    py: list[float] = []
    for i, (x, y) in enumerate(zip(xs, ys)):
        if i in breaks and px:
            px.append(float("nan"))
            py.append(float("nan"))
        if y is not None:
            px.append(x)
            py.append(y)
    return px, py


def plot(run_dir: Path, out: Path) -> Path:
    """Write the PNG; returns its path."""
    matplotlib = require_extra("matplotlib", "plot", "t1async plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # (matplotlib, as above)

    fig = figure(read_rows(run_dir), Path(run_dir).resolve().name)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def figure(rows: list[dict[str, Any]], name: str) -> Any:
    """The matplotlib figure of ``rows`` (:func:`read_rows`): one row of two axes per panel of
    :data:`PANELS` (against step, against wall minutes), titled ``name``."""
    import matplotlib.pyplot as plt  # (matplotlib: the plot extra, checked by plot())

    down = downtime_after(rows)
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
            right = ax.twinx() if RIGHT_AXIS & set(series) else None
            for k, (label, ys) in enumerate(series.items()):
                px, py = broken_line(xs, ys, down)
                if px:
                    on = right if label in RIGHT_AXIS else ax
                    on.plot(px, py, label=label, color=f"C{k}", marker="." if len(px) < 50 else None)
                    if on is right:
                        right.set_ylabel(label, fontsize=7)
            ax.set_title(title, fontsize=9)
            ax.set_xlabel("learner step" if j == 0 else "wall minutes")
            ax.grid(alpha=0.3)
            handles = [h for a in (ax, right) if a is not None for h in a.get_lines() if not h.get_label().startswith("_")]
            if handles:
                ax.legend(handles=handles, fontsize=7)
    fig.suptitle(f"{name}: {len(rows)} steps, {sum(r['trajectories'] for r in rows)} "
                 f"trajectories in {minutes[-1]:.1f} min")
    fig.tight_layout()
    return fig


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
