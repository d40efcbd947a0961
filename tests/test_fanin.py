"""Fan-in: many real senders into one real Learner receive path lose and duplicate nothing
(tools/bench_fanin.py's core, run small), and ``ZmqSender(on_ack=...)`` reports each ACK/REJ once."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

from t1async.transport import ZmqReceiver, ZmqSender

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from bench_fanin import run_fanin  # noqa: E402


def test_fanin_core_counts_every_message_once(tmp_path):
    out = run_fanin(8, procs=2, messages=5, depth=2, log_fsync="never", workdir=str(tmp_path))
    assert out["sent"] == 8 * 5  # every logical actor sent its share
    assert out["delivered"] == 40 and out["lost"] == 0 and out["duplicated"] == 0 and out["unknown"] == 0
    assert out["unacked"] == 0 and out["all_flushed"]
    assert out["learner_counters"]["received"] == 40 and out["learner_counters"]["rejected"] == 0


def test_on_ack_reports_each_ack_and_rejection_once_even_when_resent(tmp_path):
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
