"""A service that runs for weeks: bounded ledger, rotated checkpoints, an owned run directory,
the live-change history, the control channel, and what a person looks at (TensorBoard, plot,
transcripts). No Ray here: the parts are tested one by one (tests/e2e/test_service_e2e.py runs them together)."""

from __future__ import annotations

import json
import os
import random
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from t1async.config import ConfigError, load_config
from t1async.learner.checkpoints import rotate_checkpoints
from t1async.service.control import ControlError, ControlServer, parse_changes, request
from t1async.service.rundir import (
    RunDirLock,
    append_history,
    check_reuse,
    history_overrides,
    is_held,
    read_service,
    resolve_run_dir,
)
from t1async.trajectory import new_trajectory_id
from t1async.transport.delivery import ConsumedLedger, read_consumed, write_consumed


# ---- bounded consumed-id ledger -------------------------------------------------------------
def test_ledger_answers_exactly_and_stays_small_whatever_the_order(tmp_path):
    rng = random.Random(0)
    streams = [f"{i:016x}" for i in range(1, 4)]
    ids = [f"{s}-{n}" for s in streams for n in range(4000)]
    never = {ids[17], ids[5000], ids[11999]}  # rejected / lost before spooling: holes for ever
    arriving = [t for t in ids if t not in never]
    # consumed out of order within a window of 50 (queued, replayed), as the learner sees it
    order = sorted(range(len(arriving)), key=lambda i: i + rng.uniform(0, 50))
    led = ConsumedLedger(window=100)
    for k, i in enumerate(order):
        led[arriving[i]] = k
        led[arriving[i]] = -7  # a second report of the same id changes nothing
    assert all(t in led for t in arriving) and not any(t in led for t in never)
    assert "0000000000000009-0" not in led and "not-a-stream-id" not in led
    # two holes below their stream's high-water mark; the third id never seen is above its mark
    assert len(led) == len(arriving) and led.holes() == 2 and len(led.recent) == 100
    write_consumed(tmp_path / "c.json", led)
    size = (tmp_path / "c.json").stat().st_size
    assert size < 10_000  # 11,997 ids; a plain {id: step} map would be about 360 kB
    back = read_consumed(tmp_path / "c.json")
    assert all(t in back for t in arriving) and not any(t in back for t in never) and len(back) == len(arriving)
    assert back[arriving[order[-1]]] == len(order) - 1  # the newest keep their step


def test_ledger_reads_the_old_format_and_keeps_other_ids(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps({"a" * 32: 1, "b" * 32: -1}))
    led = read_consumed(tmp_path / "c.json")
    assert "a" * 32 in led and led["b" * 32] == -1 and "c" * 32 not in led and len(led) == 2


def test_trajectory_ids_are_one_stream_per_process_counting_up():
    a, b = new_trajectory_id(), new_trajectory_id()
    assert a.split("-")[0] == b.split("-")[0] and int(b.split("-")[1]) == int(a.split("-")[1]) + 1
    other = subprocess.run([sys.executable, "-c", "from t1async.trajectory import new_trajectory_id as n; print(n())"],
                           capture_output=True, text=True, check=True).stdout.strip()
    assert other.split("-")[0] != a.split("-")[0]


# ---- checkpoint rotation --------------------------------------------------------------------
def test_checkpoint_rotation_keeps_the_newest_and_every_nth(tmp_path):
    for step in range(1, 26):
        (tmp_path / f"step_{step:06d}").mkdir()
    (tmp_path / ".step_000026.tmp-deadbeef").mkdir()  # a crash while staging
    rotate_checkpoints(tmp_path, keep_last=3, keep_every=10)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000010", "step_000020", "step_000023",
                                                          "step_000024", "step_000025"]


# ---- the run directory is owned -------------------------------------------------------------
def test_a_held_run_dir_is_refused_naming_the_holder_and_taken_over_after_its_death(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path; from t1async.service.rundir import RunDirLock\n"
        f"lock = RunDirLock(Path({str(tmp_path)!r})); lock.write(control='tcp://x:1'); print('held', flush=True)\n"
        "time.sleep(60)")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert is_held(tmp_path)
        with pytest.raises(ConfigError, match=f"in use by t1async launch pid {holder.pid} on host"):
            RunDirLock(tmp_path)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert not is_held(tmp_path)
    lock = RunDirLock(tmp_path)  # a holder killed with SIGKILL: taken over, and what it left is known
    assert lock.previous["pid"] == holder.pid
    lock.write()
    assert read_service(tmp_path)["pid"] == os.getpid() and is_held(tmp_path)
    lock.release()
    assert read_service(tmp_path) is None and not is_held(tmp_path)


def test_reuse_of_an_earlier_run_is_refused_unless_resumed_or_overwritten(tmp_path):
    check_reuse(tmp_path, resume=False, overwrite=False)  # an empty folder is fine
    (tmp_path / "metrics.jsonl").write_text('{"step": 7}\n')
    (tmp_path / "checkpoints" / "step_000007").mkdir(parents=True)
    (tmp_path / "spool" / "x").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"holds an earlier run \(metrics to step 7, 1 checkpoints\).*run.overwrite=true"):
        check_reuse(tmp_path, resume=False, overwrite=False)
    check_reuse(tmp_path, resume=True, overwrite=False)
    assert (tmp_path / "metrics.jsonl").exists()
    check_reuse(tmp_path, resume=False, overwrite=True)
    assert not any((tmp_path / n).exists() for n in ("metrics.jsonl", "checkpoints", "spool"))


def test_run_dir_placeholders_other_than_now_are_refused():
    assert "{" not in str(resolve_run_dir("/tmp/r-{now}"))
    for bad in ("/tmp/r-{date}", "/tmp/r-{now", "/tmp/r}"):
        with pytest.raises(ConfigError, match="only placeholder is {now}"):
            resolve_run_dir(bad)


def test_live_changes_are_kept_by_a_resume(tmp_path):
    append_history(tmp_path, {"rollout.num_actors": 5, "env.tasks": ["a-task", "b-task"]}, "t1async scale")
    append_history(tmp_path, {"rollout.num_actors": 3, "learner.lr": 2e-4}, "t1async scale")
    cfg = load_config("configs/local.yaml", [*history_overrides(tmp_path), "learner.max_steps=2"])
    assert cfg.rollout.num_actors == 3 and cfg.env.tasks == ["a-task", "b-task"] and cfg.learner.lr == 2e-4
    assert cfg.learner.max_steps == 2


# ---- control channel ------------------------------------------------------------------------
def test_only_live_keys_can_be_scaled_and_the_refusal_says_why():
    assert parse_changes(["rollout.num_actors=4", "env.tasks=[a, b]"]) == {"rollout.num_actors": 4,
                                                                          "env.tasks": ["a", "b"]}
    with pytest.raises(ControlError, match="model.hidden_size cannot change live: the weights' shapes"):
        parse_changes(["model.hidden_size=64"])
    with pytest.raises(ControlError, match="not key=value"):
        parse_changes(["rollout.num_actors"])
    with pytest.raises(ControlError, match="at least one"):
        parse_changes([])


def test_control_round_trip_and_its_one_line_errors(tmp_path):
    with pytest.raises(ControlError, match="no run directory"):
        request(tmp_path / "nope", {"cmd": "status"})
    with pytest.raises(ControlError, match="is not running"):
        request(tmp_path, {"cmd": "status"})  # a folder no service holds (a stopped run)

    def boom(req):
        raise ValueError("learner.max_staleness=-1 is invalid\nsecond line")

    server = ControlServer("127.0.0.1", {"status": lambda req: {"ok": True, "step": 3}, "scale": boom})
    lock = RunDirLock(tmp_path)
    lock.write(control=server.address)
    try:
        assert request(tmp_path, {"cmd": "status"})["step"] == 3
        with pytest.raises(ControlError, match="^learner.max_staleness=-1 is invalid$"):
            request(tmp_path, {"cmd": "scale"})
        with pytest.raises(ControlError, match="unknown command"):
            request(tmp_path, {"cmd": "dance"})
    finally:
        server.close()
        lock.release()


# ---- look inside ----------------------------------------------------------------------------
def _metrics_rows(n: int) -> list[dict]:
    t0 = time.time() - 60
    return [{"step": i, "version": i // 2, "trajectories": 4, "reward_mean": 0.1 * i, "resolved_rate": 0.05 * i,
             "staleness_max": i % 3, "staleness_mean": 0.5, "logprob_diff_mean": 0.01, "kl_k3": 0.001,
             "tokens_per_s": 900.0, "queue_depth": 1, "dropped": {"stale": i // 4, "aborted": 0},
             "time": t0 + 5 * i, "phase": "rl"} for i in range(1, n + 1)]


def _tb_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Scalars of TensorBoard event files (TFRecord framing: length, crc, Event proto, crc)."""
    from tensorboardX.proto.event_pb2 import Event

    out: dict[str, list[tuple[int, float]]] = {}
    for f in folder.glob("events.out.tfevents.*"):
        data, pos = f.read_bytes(), 0
        while pos < len(data):
            (n,) = struct.unpack("<Q", data[pos:pos + 8])
            ev = Event.FromString(data[pos + 12:pos + 12 + n])
            pos += 12 + n + 4
            for v in ev.summary.value:
                out.setdefault(v.tag, []).append((ev.step, v.simple_value))
    return out


def test_metrics_become_tensorboard_events_and_a_plot(tmp_path):
    from t1async.commands.plot import plot
    from t1async.service.service import MetricsTail, trends

    rows = _metrics_rows(12)
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[:10]) + json.dumps(rows[10])[:20])  # a torn last row
    tail = MetricsTail(path, tensorboard=True)
    assert [r["step"] for r in tail.poll()] == list(range(1, 11))
    with open(path, "a") as f:
        f.write(json.dumps(rows[10])[20:] + "\n")
    assert [r["step"] for r in tail.poll()] == [11]
    tail.close()
    scalars = _tb_scalars(tmp_path / "tensorboard")
    assert scalars["reward_mean"][-1] == (11, pytest.approx(1.1)) and len(scalars["reward_mean"]) == 11
    assert scalars["dropped/stale"][-1] == (11, 2.0) and "phase" not in scalars
    t = trends(tail.rows)
    assert t["trajectories_per_s"] == pytest.approx(4 / 5) and t["reward_recent"] == pytest.approx(0.9)
    png = plot(tmp_path, tmp_path / "m.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000


def test_episode_transcripts_are_readable(tmp_path):
    from t1async.models.tokenizer import ChatTokenizer
    from t1async.rollout.transcripts import write_transcripts
    from t1async.trajectory import TURN_COMMAND_TIMEOUT, Trajectory

    tok = ChatTokenizer.load()
    ids = tok.render_prompt("system text", "Count the lines of /app/data.txt")
    s1 = len(ids)
    ids += tok.encode("wc -l /app/data.txt") + [tok.im_end_id]
    e1 = len(ids)
    ids += tok.render_observation("42 /app/data.txt")
    s2 = len(ids)
    ids += tok.encode("sleep 99") + [tok.im_end_id]
    e2 = len(ids)
    n = len(ids)
    traj = Trajectory(task="count-lines", actor_id=1, token_ids=np.asarray(ids, np.uint32),
                      loss_mask=np.zeros(n, np.uint8), logprobs=np.zeros(n, np.float32),
                      versions=np.full(n, 3, np.int32), turn_offsets=np.asarray([[s1, e1], [s2, e2]], np.int32),
                      routed_experts=np.zeros((n - 1, 1, 1), np.uint8), num_experts=2, reward=1.0, passed=1,
                      total=2, resolved=False, finish_reason="max_turns",
                      tests=[("test_count", True), ("test_format", False)],
                      turn_status=np.asarray([0, TURN_COMMAND_TIMEOUT], np.uint8))
    for step in range(1, 204):
        path = write_transcripts(tmp_path, step, [traj], 1, tok)
    text = path.read_text()
    for needle in ("count-lines", "Count the lines of /app/data.txt", "$ wc -l /app/data.txt", "42 /app/data.txt",
                   "(command_timeout)", "not resolved, 1/2 tests passed", "FAIL test_format"):
        assert needle in text, needle
    assert "<|im_end|>" not in text and len(list(tmp_path.glob("step_*.md"))) == 200


def test_sandboxes_outliving_their_actor_are_found_by_their_workspace_path(tmp_path):
    from t1async.service.reaper import kill_sandboxes_under

    work = tmp_path / "workspaces"
    # a path in the command line, as bwrap's --bind arguments name it. One process each, that never
    # forks: a shell's forked child carries the shell's command line until it execs, so it would
    # match too, and the count would depend on timing.
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    inside = subprocess.Popen([*sleeper, str(work / "t1async-rollout0-x" / "app")])
    outside = subprocess.Popen([*sleeper, str(tmp_path / "elsewhere")])
    try:
        assert kill_sandboxes_under(work) == 1
        assert inside.wait(timeout=5) == -signal.SIGKILL and outside.poll() is None
    finally:
        outside.kill()
        inside.kill()
