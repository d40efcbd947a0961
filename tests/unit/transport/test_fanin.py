"""Fan-in: many real senders into one real Learner receive path lose and duplicate nothing
(``t1async bench fanin --messages``, run small), and ``ZmqSender(on_ack=...)`` reports each ACK/REJ once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from t1async.transport.transport import ZmqReceiver, ZmqSender
from tests.support import REPO
from tests.support.trajectories import model_trajectory


@pytest.mark.slow
def test_fanin_core_counts_every_message_once(tmp_path):
    bench = subprocess.run([sys.executable, str(REPO / "tools" / "bench_fanin.py"), "--actors", "8", "--procs", "2",
                            "--messages", "5", "--depth", "2", "--log-fsync", "never"], capture_output=True, text=True,
                           timeout=300, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert bench.returncode == 0, bench.stderr[-2000:]
    (out,) = json.loads(bench.stdout)["runs"]
    assert out["sent"] == 8 * 5  # every logical actor sent its share
    assert out["delivered"] == 40 and out["lost"] == 0 and out["duplicated"] == 0 and out["unknown"] == 0
    assert out["unacked"] == 0 and out["all_flushed"]
    assert out["learner_counters"]["received"] == 40 and out["learner_counters"]["rejected"] == 0


def test_on_ack_reports_each_ack_and_rejection_once_even_when_acked_twice(tmp_path):
    rx = ZmqReceiver("tcp://127.0.0.1:*")
    seen: list[tuple[str, bool, str]] = []
    tx = ZmqSender(rx.endpoint, spool_dir=str(tmp_path), on_ack=lambda k, ok, r: seen.append((k, ok, r)))
    stop = threading.Event()

    def learner():  # answers k0 twice (a resend's duplicate ACK), rejects k1
        while not stop.is_set():
            d = rx.recv(0.05)
            if d is None:
                continue
            if d.key == "k1":
                rx.ack(d, False, "bad frame")
            else:
                rx.ack(d, True)
                rx.ack(d, True)

    th = threading.Thread(target=learner, daemon=True)
    th.start()
    try:
        tx.send("k0", b"a" * 100)
        tx.send("k1", b"b" * 100)
        assert tx.flush(10.0)
        time.sleep(0.2)  # let the second ACK of k0 arrive
        assert sorted(seen) == [("k0", True, ""), ("k1", False, "bad frame")]
    finally:
        stop.set()
        th.join()
        tx.close()
        rx.close()


def test_on_ack_callback_error_does_not_stop_deliveries(tmp_path):
    rx = ZmqReceiver("tcp://127.0.0.1:*")
    tx = ZmqSender(rx.endpoint, spool_dir=str(tmp_path), on_ack=lambda k, ok, r: 1 / 0)
    try:
        for i in range(3):
            tx.send(f"k{i}", b"x")
        for _ in range(3):
            d = None
            while d is None:
                d = rx.recv(5.0)
            rx.ack(d, True)
        assert tx.flush(10.0) and tx.stats.acked == 3
    finally:
        tx.close()
        rx.close()


def test_receive_log_group_commit_flushes_once_and_forgets_what_a_failed_flush_lost(tmp_path, monkeypatch):
    from t1async.transport.delivery import ReceiveLog

    calls = []
    real = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (calls.append(fd), real(fd)))
    log = ReceiveLog(tmp_path / "log", fsync="always")
    calls.clear()
    for i in range(5):
        log.append(f"k{i}", b"frame %d" % i, sync=False)
    assert calls == []  # nothing flushed yet
    log.sync()
    assert len(calls) == 1 and log.read("k3") == b"frame 3"
    log.sync()
    assert len(calls) == 1  # nothing new to flush

    def broken(fd):
        raise OSError(5, "EIO")

    log.append("lost", b"x", sync=False)
    monkeypatch.setattr(os, "fdatasync", broken)
    with pytest.raises(OSError):
        log.sync()
    assert "lost" not in log and "k4" in log and "lost" not in log.keys()
    log.close()


def test_learner_acks_a_burst_after_one_flush_never_before(tmp_path, monkeypatch):
    """A slow disk (each flush takes 50 ms): messages arriving meanwhile are stored with one flush,
    and no ACK reaches an actor before the flush covering its trajectory returned."""
    from t1async.actors.learner import Learner
    from t1async.config import LearnerConfig, ModelConfig, TransportConfig, WeightSyncConfig
    from t1async.trajectory import EncodedTrajectory

    learner = Learner(LearnerConfig(max_steps=0, episodes_per_step=0), ModelConfig(),
                      TransportConfig(curve=False, log_fsync="always", recv_queue_messages=64), WeightSyncConfig(),
                      str(tmp_path / "run"))
    log = learner.inbox.log
    durable_at: dict[str, float] = {}
    flushes = []
    real = os.fdatasync

    def slow_fdatasync(fd):
        pending = [k for k in log.keys() if k not in durable_at]
        time.sleep(0.05)
        real(fd)
        flushes.append(fd)
        now = time.monotonic()
        for k in pending:
            durable_at.setdefault(k, now)

    monkeypatch.setattr(os, "fdatasync", slow_fdatasync)
    acked: dict[str, float] = {}
    senders = [ZmqSender(learner.endpoint(), spool_dir=str(tmp_path / "spool"),
                         on_ack=lambda k, ok, r: acked.setdefault(k, time.monotonic())) for _ in range(3)]
    traj = model_trajectory(ModelConfig(), 512, "first")
    traj.versions = np.where(traj.loss_mask == 1, 0, -1).astype(np.int32)
    try:
        keys = []
        for i in range(30):
            traj.trajectory_id = f"{'abcdef0123456789'}-{i}"
            keys.append(traj.trajectory_id)
            senders[i % 3].send(traj.trajectory_id, EncodedTrajectory(traj))
        assert all(tx.flush(20.0) for tx in senders)
        assert sorted(acked) == sorted(keys) and learner.counters["received"] == 30
        assert learner.counters["duplicates"] == 0 and learner.inbox.queue.qsize() == 30
        assert len(flushes) < 15, f"{len(flushes)} flushes for 30 messages: no group commit"
        early = [k for k in keys if acked[k] < durable_at.get(k, float("inf"))]
        assert not early, f"ACKed before their flush: {early}"
    finally:
        for tx in senders:
            tx.close()
        learner.close()
