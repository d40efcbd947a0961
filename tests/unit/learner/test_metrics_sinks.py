"""Where each learner step's scalars go: TensorBoard across the lives of a run (one point per
step), a disk that refuses the events, and the optional Weights & Biases sink (offline)."""

from __future__ import annotations

import errno
import json
import struct
import time
from pathlib import Path

import numpy as np
import pytest
import tensorboardX.proto.event_pb2  # noqa: F401 (tensorboardX imports torch: at collection, not in a test's time)

from t1async.config import AbnormalConfig
from t1async.learner.metrics import batch_metrics, merge_agent_splits
from t1async.service.service import MetricsTail
from tests.support.trajectories import make_traj


def _rows(steps, t0: float) -> list[dict]:
    return [{"step": s, "version": s, "trajectories": 2, "reward_mean": 0.1 * s, "resolved_rate": 0.0,
             "staleness_max": 0, "dropped": {"stale": 0}, "time": t0 + s} for s in steps]


def _write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _shown(folder: Path, tag: str = "reward_mean") -> tuple[dict[int, float], int]:
    """What TensorBoard shows of ``tag`` ({step: value}: a SessionLog START at step s hides the
    earlier points at steps >= s, files in name order) and how many points the files hold."""
    from tensorboardX.proto.event_pb2 import Event, SessionLog

    shown: dict[int, float] = {}
    raw = 0
    for f in sorted(folder.glob("events.out.tfevents.*")):
        data, pos = f.read_bytes(), 0
        while pos < len(data):
            (n,) = struct.unpack("<Q", data[pos:pos + 8])
            ev = Event.FromString(data[pos + 12:pos + 12 + n])
            pos += 12 + n + 4
            if ev.HasField("session_log") and ev.session_log.status == SessionLog.START:
                shown = {s: v for s, v in shown.items() if s < ev.step}
            for v in ev.summary.value:
                if v.tag == tag:
                    shown[ev.step] = v.simple_value
                    raw += 1
    return shown, raw


def _life(path: Path, rows: list[dict]) -> None:
    """One launch of the service: metrics.jsonl as the learner left it, tailed to its end."""
    _write(path, rows)
    tail = MetricsTail(path, tensorboard=True)
    tail.poll()
    tail.close()


def test_tensorboard_appends_across_lives_one_point_per_step(tmp_path):
    path, t0 = tmp_path / "metrics.jsonl", time.time() - 1000
    rows: list[dict] = []
    for life in range(5):  # five lives of 10 steps, each ended by a clean stop (final checkpoint)
        rows += _rows(range(10 * life + 1, 10 * life + 11), t0)
        _life(path, rows)
    shown, raw = _shown(tmp_path / "tensorboard")
    assert sorted(shown) == list(range(1, 51)) and raw == 50  # (main: 10 + 20 + ... + 50 = 150 points)
    assert shown[50] == pytest.approx(5.0)


def test_steps_trained_again_after_a_resume_replace_the_lost_lifes_points(tmp_path):
    path, t0 = tmp_path / "metrics.jsonl", time.time() - 1000
    first = _rows(range(1, 11), t0)
    _life(path, first)
    # killed at step 10 with its last checkpoint at step 8: the resumed learner drops rows 9-10
    # (t1async/learner/loop.py ``TrainingLoop.resume``) and trains steps 9, 10, 11 again, later and with other values
    again = [{**r, "reward_mean": 7.0 + r["step"], "time": t0 + 100 + r["step"]} for r in _rows(range(9, 12), t0)]
    tail = MetricsTail(path, tensorboard=True)
    _write(path, first[:8])
    tail.poll()
    with open(path, "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in again))
    tail.poll()
    tail.close()
    shown, raw = _shown(tmp_path / "tensorboard")
    assert sorted(shown) == list(range(1, 12))
    assert shown[8] == pytest.approx(0.8) and shown[9] == pytest.approx(16.0) and shown[11] == pytest.approx(18.0)
    assert raw == 10 + 3  # steps 1-8 are not written again (main: 10 + 8 + 3)
    _life(path, first[:8] + again)  # and a later life adds nothing
    shown, raw = _shown(tmp_path / "tensorboard")
    assert sorted(shown) == list(range(1, 12)) and raw == 13


def test_a_resume_trim_while_the_tail_lags_never_reads_half_a_row(tmp_path):
    """The launch tails metrics.jsonl while a resumed learner trims it to its checkpoint's step and
    trains on: when the tail next reads, the file is already longer than where it stopped. (A 20-minute
    soak at 91b4b10 ended so: the launch seeked into the middle of a rewritten row, JSONDecodeError.)"""
    from t1async.fileio import DiskGuard
    from t1async.learner.metrics import MetricsFile

    path, t0 = tmp_path / "metrics.jsonl", time.time() - 1000
    _write(path, _rows(range(1, 11), t0))
    tail = MetricsTail(path, tensorboard=True)
    assert [r["step"] for r in tail.poll()] == list(range(1, 11))
    lagged = tail.pos
    MetricsFile(path, DiskGuard(tmp_path, floor_mb=0)).trim(5)
    again = [{**r, "note": "trained again " * 3, "time": t0 + 100 + r["step"]} for r in _rows(range(6, 21), t0)]
    with open(path, "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in again))
    data = path.read_bytes()
    assert len(data) > lagged and data[lagged - 1:lagged] != b"\n"  # the old offset is mid-row now
    assert [r["step"] for r in tail.poll()] == list(range(1, 21))
    assert tail.bad_lines == 0 and [r["step"] for r in tail.rows] == list(range(1, 21))
    tail.close()
    shown, raw = _shown(tmp_path / "tensorboard")
    assert sorted(shown) == list(range(1, 21)) and raw == 10 + 15  # steps 1-5 are not written twice


def test_a_line_that_is_not_a_metrics_row_is_skipped_and_counted(tmp_path):
    path, t0 = tmp_path / "metrics.jsonl", time.time() - 1000
    rows = _rows(range(1, 4), t0)
    path.write_text(json.dumps(rows[0]) + "\n" + '"step": 2, "half a row"}\n' + "[1, 2]\n" + '{"no": "step"}\n'
                    + "".join(json.dumps(r) + "\n" for r in rows[1:]))
    tail = MetricsTail(path, tensorboard=False)
    assert [r["step"] for r in tail.poll()] == [1, 2, 3] and tail.bad_lines == 3
    from t1async.fileio import DiskGuard
    from t1async.learner.metrics import MetricsFile

    MetricsFile(path, DiskGuard(tmp_path, floor_mb=0)).trim(2)  # keeps what it cannot read, drops step 3
    lines = path.read_text().splitlines()
    assert len(lines) == 5 and json.loads(lines[-1])["step"] == 2


def test_a_disk_that_refuses_tensorboard_events_never_blocks_and_loses_none(tmp_path, monkeypatch):
    import t1async.service.sinks as sinks
    from t1async.fileio import DiskGuard

    path, t0 = tmp_path / "metrics.jsonl", time.time() - 1000
    disk = DiskGuard(tmp_path, floor_mb=0)
    tail = MetricsTail(path, tensorboard=True, disk=disk)
    real = sinks.append_whole

    def full(p, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sinks, "append_whole", full)
    rows = _rows(range(1, 4), t0)
    for i in range(1, 4):  # (main: tensorboardX's writer thread dies; after 10 events every call blocks)
        _write(path, rows[:i])
        t = time.monotonic()
        assert [r["step"] for r in tail.poll()] == [i] and time.monotonic() - t < 1
    assert disk.check().startswith(f"disk full at {tmp_path / 'tensorboard'}")
    monkeypatch.setattr(sinks, "append_whole", real)  # space is back
    _write(path, _rows(range(1, 5), t0))
    tail.poll()
    tail.close()
    shown, raw = _shown(tmp_path / "tensorboard")
    assert sorted(shown) == [1, 2, 3, 4] and raw == 4


@pytest.mark.slow  # (wandb starts its service process per launch: about 6 s each here)
def test_wandb_offline_writes_a_run_folder_and_a_resumed_launch_appends(tmp_path):
    import wandb  # noqa: F401  (the test extra has it, so tools/setup.sh installs it: a missing wandb fails, never skips)

    from t1async.config import MetricsConfig

    path, t0 = tmp_path / "metrics.jsonl", time.time() - 1000
    cfg = MetricsConfig(wandb=True, wandb_project="t1async-test", wandb_mode="offline")
    for life in range(2):
        _write(path, _rows(range(1, 4 + 3 * life), t0))
        tail = MetricsTail(path, tensorboard=False, metrics=cfg)
        tail.poll()
        tail.close()
    runs = list((tmp_path / "wandb" / "wandb").glob("offline-run-*"))
    state = json.loads((tmp_path / "wandb" / "t1async.json").read_text())
    assert runs and all(list(r.glob("*.wandb")) for r in runs) and state["step"] == 6
    assert all(r.name.endswith(state["run_id"]) for r in runs)  # one wandb run across both lives


def _traj(agent: str, reward: float, turns: int, *, finish: str = "agent_exit", mismatches: int = 0):
    t = make_traj(T=12)
    t.agent, t.reward, t.finish_reason, t.template_mismatches = agent, reward, finish, mismatches
    t.passed = t.total = 3 if reward == 3 else 0
    t.resolved = reward == 3
    t.turn_offsets = np.array([[4, 7], [9, 12]][:turns], dtype=np.int32)
    return t


def test_every_metrics_row_splits_the_batch_by_agent_and_tensorboard_gets_it(tmp_path):
    """metrics.jsonl ``by_agent``: reward, resolved, turns, tokens, history breaks and template mismatches
    per agent that drove the batch's episodes; merged over rows for the status; in TensorBoard as
    ``by_agent/NAME/KEY``."""
    batch = [_traj("builtin", 3.0, 2), _traj("builtin", 0.0, 1, mismatches=2), _traj("codex", 3.0, 2),
             _traj("codex", 0.0, 2, finish="history_break")]
    row = batch_metrics(batch, [0] * 4, AbnormalConfig(), step=1, version=1, timeline_version=1,
                        counters={"trained": 4, "dropped_stale": 0, "rejected": 0, "quarantine_evicted": 0},
                        dropped={}, rejected_by={}, queue_depth=0)
    assert row["by_agent"] == {
        "builtin": {"trajectories": 2, "reward_mean": 1.5, "resolved_rate": 0.5, "turns_mean": 1.5, "tokens": 24,
                    "history_breaks": 0, "template_mismatches": 2},
        "codex": {"trajectories": 2, "reward_mean": 1.5, "resolved_rate": 0.5, "turns_mean": 2.0, "tokens": 24,
                  "history_breaks": 1, "template_mismatches": 0}}
    # several rows merged (the status's last 10 steps): means weighted by each row's trajectories
    later = {"by_agent": {"codex": {"trajectories": 1, "reward_mean": 0.0, "resolved_rate": 0.0, "turns_mean": 5.0,
                                    "tokens": 10, "history_breaks": 2, "template_mismatches": 1}}}
    merged = merge_agent_splits([row, later, {"step": 0}])  # (a row written before by_agent existed: skipped)
    assert merged["builtin"] == row["by_agent"]["builtin"]
    assert merged["codex"] == {"trajectories": 3, "reward_mean": pytest.approx(1.0),
                               "resolved_rate": pytest.approx(1 / 3), "turns_mean": pytest.approx(3.0), "tokens": 34,
                               "history_breaks": 3, "template_mismatches": 1}
    path = tmp_path / "metrics.jsonl"
    rows = [{**row, "step": s, "time": time.time() - 10 + s, "logprob_diff_mean": 0.0, "tokens_per_s": 1.0}
            for s in (1, 2)]
    _write(path, rows)
    tail = MetricsTail(path, tensorboard=True)
    tail.poll()
    tail.close()
    assert _shown(tmp_path / "tensorboard", "by_agent/codex/history_breaks")[0] == {1: 1.0, 2: 1.0}
    assert _shown(tmp_path / "tensorboard", "dropped_stale")[0] == {1: 0.0, 2: 0.0}
