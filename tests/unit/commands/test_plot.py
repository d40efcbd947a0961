"""``t1async plot``: tokens/s on an axis of its own, no line across the service's downtime (issue 42 item 9)."""

from __future__ import annotations

import json
import math

import pytest

from t1async.commands.plot import PANELS, figure, plot, read_rows

pytest.importorskip("matplotlib")


def _rows(tmp_path):
    """Ten steps 10 s apart, a 20-minute downtime (a kill and its resume), ten more."""
    rows, t = [], 1000.0
    for step in range(1, 21):
        t += 10.0 if step != 11 else 1200.0
        rows.append({"step": step, "version": step // 2, "time": t, "trajectories": 4, "tokens_per_s": 900.0 + step,
                     "reward_mean": 0.5, "resolved_rate": 0.25, "staleness_max": 1, "staleness_mean": 0.5,
                     "dropped": {"stale": 0}})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return read_rows(tmp_path)


def test_throughput_draws_tokens_per_s_on_its_own_axis_and_breaks_lines_across_downtime(tmp_path):
    import matplotlib.pyplot as plt

    rows = _rows(tmp_path)
    assert rows[10]["trajectories_per_s"] is None  # no rate over the 20 minutes the service was down
    assert rows[11]["trajectories_per_s"] == pytest.approx(0.4)
    fig = figure(rows, "run")
    panel = [title for title, _ in PANELS].index("throughput")
    for ax in fig.axes:
        lines = {line.get_label(): line for line in ax.get_lines()}
        if "tokens_per_s" in lines:  # never on the axis of trajectories/s (0.4 against 900)
            assert "trajectories_per_s" not in lines
    minutes_ax = [ax for ax in fig.axes if ax.get_title() == "throughput" and ax.get_xlabel() == "wall minutes"][0]
    tokens = [line for ax in fig.axes for line in ax.get_lines() if line.get_label() == "tokens_per_s"]
    assert len(tokens) == 2 and all(line.axes is not minutes_ax for line in tokens)
    reward = [line for line in fig.axes[2 * 0 + 1].get_lines() if line.get_label() == "reward_mean"][0]
    xs = list(reward.get_xdata())
    assert len(xs) == 21 and math.isnan(xs[10]) and xs[11] > xs[9] + 19  # one break, at the downtime
    assert panel == 3
    plt.close(fig)
    assert plot(tmp_path, tmp_path / "m.png").stat().st_size > 10_000
