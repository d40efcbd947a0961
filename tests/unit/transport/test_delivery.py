"""The learner's receive path under attack and under SIGKILL, with a real learner and real ZeroMQ.

- Fuzz: >= 10,000 random and mutated messages go to the decoder and to a live learner socket:
  only typed errors, each counted exactly, no crash, no hang, nothing queued for training.
- SIGKILL: a learner process is killed mid-run and restarted with ``resume``; every trajectory
  sent is trained exactly once by the surviving model state (its checkpoint's consumed ids).
"""

from __future__ import annotations

import collections
import json
import os
import random
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import msgpack
import pytest
import zmq

from t1async.actors.learner import Learner
from t1async.config import LearnerConfig, TransportConfig, WeightSyncConfig
from t1async.trajectory import TrajectoryError, decode, encode
from t1async.transport.delivery import read_consumed
from t1async.transport.transport import PROTOCOL, REJECT, ZmqSender
from tests.support import REPO
from tests.support.delivery_fakes import MODEL, synthetic


def _mutate(rng: random.Random, base: bytes) -> bytes:
    """One random corruption: byte flips, truncation, splices, header field swaps, or pure noise."""
    kind = rng.randrange(6)
    b = bytearray(base)
    if kind == 0:
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] = rng.randrange(256)
    elif kind == 1:
        b = b[:rng.randrange(len(b))]
    elif kind == 2:
        return os.urandom(rng.randrange(0, 400))
    elif kind == 3:
        i = rng.randrange(len(b))
        b[i:i] = os.urandom(rng.randint(1, 16))
    elif kind == 4:  # a valid header map with one field replaced by a random value
        hlen = int.from_bytes(b[4:8], "little")
        header = msgpack.unpackb(bytes(b[8:8 + hlen]), raw=False)
        key = rng.choice(list(header))
        header[key] = rng.choice([None, -1, 2**40, "x", 1.5, [], {}, b"\x00", True, {"dtype": "<u4"}])
        head = msgpack.packb(header, use_bin_type=True)
        return bytes(b[:4]) + len(head).to_bytes(4, "little") + head + bytes(b[8 + hlen:])
    else:  # data section: corrupt an array's bytes (mask values, expert ids, offsets, log-probs)
        start = len(b) - rng.randrange(1, 600)
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(max(0, start), len(b))] = rng.choice([2, 9, 0xFF, 0x7F, 0x80])
    return bytes(b)


def fuzz_corpus(n_invalid: int, seed: int = 0) -> tuple[list[bytes], collections.Counter, int]:
    """Messages the decoder refuses (every exception checked to be a TrajectoryError), the count of
    refusals by field, and how many random mutations happened to stay valid (left out)."""
    rng = random.Random(seed)
    bases = [encode(synthetic(s)) for s in range(8)]
    invalid, fields, valid = [], collections.Counter(), 0
    while len(invalid) < n_invalid:
        msg = _mutate(rng, rng.choice(bases))
        try:
            decode(msg, num_experts=4, num_layers=2, top_k=2, max_version=0)
        except TrajectoryError as e:
            fields[e.field] += 1
            invalid.append(msg)
            continue
        # anything else propagates and fails the test: only typed errors are allowed
        valid += 1
    return invalid, fields, valid


@pytest.mark.slow
def test_fuzz_decoder_and_live_learner_socket(tmp_path):
    invalid, fields, valid = fuzz_corpus(10_000)
    assert len(invalid) == 10_000 and len(fields) >= 10  # many different fields were hit
    learner = Learner(LearnerConfig(max_steps=1, batch_size=1), MODEL, TransportConfig(curve=False, log_fsync="never"),
                      WeightSyncConfig(), str(tmp_path), seed=0)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(learner.endpoint())
    try:
        envelopes = [[b"junk"], [PROTOCOL, b"k"], [PROTOCOL, b"\xff\xfe", b"x"], [b"other/1", b"k", b"x"],
                     [PROTOCOL, b"", b"x"], [PROTOCOL, b"a" * 200, b"x"], [PROTOCOL, b"k", b"x", b"extra"]]
        replies = 0
        for i, msg in enumerate(invalid):
            sock.send_multipart([PROTOCOL, f"fuzz-{i}".encode(), msg])
            if i % 100 == 0:
                sock.send_multipart(envelopes[(i // 100) % len(envelopes)])
            while sock.poll(0):
                replies += sock.recv_multipart()[0] == REJECT
        n_env = len(range(0, len(invalid), 100))
        assert _wait(lambda: learner.counters["rejected"] == len(invalid) + n_env, 120), learner.status()
        deadline = time.monotonic() + 30
        while replies < len(invalid) and time.monotonic() < deadline:
            if sock.poll(100):
                replies += sock.recv_multipart()[0] == REJECT
        assert replies == len(invalid)  # every keyed message got its REJ: the sender will not resend it
        # the learner is alive, stored and queued nothing, and still takes a valid trajectory
        st = learner.status()
        assert st["received"] == 0 and st["queue_depth"] == 0 and len(learner.inbox.log) == 0 and learner.step == 0
        kept = list((tmp_path / "quarantine").glob("*.json"))  # bounded: the newest, prefix and metadata
        assert len(kept) == TransportConfig(curve=False).quarantine_max_files and learner.counters["quarantine_evicted"] == (
            len(invalid) + n_env - len(kept))
        assert sum(st["rejected_by"].values()) == st["rejected"] and len(st["rejected_by"]) >= 10
        good = synthetic(99)
        sock.send_multipart([PROTOCOL, good.trajectory_id.encode(), encode(good)])
        assert _wait(lambda: learner.status()["received"] == 1, 10)
        assert learner.inbox.queue.get(1.0).trajectory_id == good.trajectory_id
        assert learner.counters["rejected"] == len(invalid) + n_env  # exact: no double counting
        # a rejected trajectory resent (its REJ was lost) is answered REJ again and not counted again
        sock.send_multipart([PROTOCOL, b"fuzz-0", invalid[0]])
        reply = None
        while sock.poll(10_000):
            reply = sock.recv_multipart()
            if reply[1] == b"fuzz-0":  # (the good trajectory's ACK may come first)
                break
        assert reply is not None and reply[:2] == [REJECT, b"fuzz-0"]
        assert learner.counters["rejected"] == len(invalid) + n_env and learner.counters["duplicates"] == 1
    finally:
        sock.close()
        learner.close()


def _wait(cond, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


LEARNER_PROC = textwrap.dedent("""
    import json, sys
    from t1async.actors.learner import Learner
    from t1async.config import LearnerConfig, ModelConfig, TransportConfig, WeightSyncConfig
    run_dir, port, resume = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
    model = ModelConfig(**json.loads(sys.argv[4]))
    cfg = LearnerConfig(max_steps=6, batch_size=3, publish_every=1000, checkpoint_every=2, resume=resume,
                        batch_timeout_s=120, lr=1e-3)
    learner = Learner(cfg, model, TransportConfig(curve=False, port=port, log_fsync="never"), WeightSyncConfig(), run_dir)
    print("ready", flush=True)
    print(json.dumps(learner.run()), flush=True)
    learner.close()
""")


def _start_learner(run_dir: Path, port: int, resume: bool) -> subprocess.Popen:
    from dataclasses import asdict

    log = open(run_dir.parent / f"learner-{int(resume)}.log", "w")
    proc = subprocess.Popen([sys.executable, "-c", LEARNER_PROC, str(run_dir), str(port), "1" if resume else "0",
                             json.dumps(asdict(MODEL))], stdout=subprocess.PIPE, stderr=log, text=True, cwd=REPO)
    assert proc.stdout.readline().strip() == "ready", (run_dir.parent / f"learner-{int(resume)}.log").read_text()[-2000:]
    return proc


def _steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x)["step"] for x in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow
def test_sigkill_learner_and_resume_trains_every_trajectory_exactly_once(tmp_path):
    run_dir = tmp_path / "run"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    trajs = [synthetic(seed) for seed in range(18)]  # 6 steps x batch 3
    first = _start_learner(run_dir, port, resume=False)
    tx = ZmqSender(f"tcp://127.0.0.1:{port}", spool_dir=str(tmp_path / "spool"), window_messages=4)
    try:
        for t in trajs[:10]:
            tx.send(t.trajectory_id, encode(t))
        assert _wait(lambda: 3 in _steps(run_dir), 60), "the first learner did not reach step 3"
        first.send_signal(signal.SIGKILL)  # mid-run: step 3 trained after the step-2 checkpoint
        first.wait()
        ckpts = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
        assert ckpts == ["step_000002"]  # step 3's weights died with the process
        for t in trajs[10:]:  # the learner is down: these wait in the spool
            tx.send(t.trajectory_id, encode(t))
        second = _start_learner(run_dir, port, resume=True)
        out, _ = second.communicate(timeout=120)
        status = json.loads(out.strip().splitlines()[-1])
        assert second.returncode == 0
        assert tx.flush(10.0)
    finally:
        tx.close(flush_timeout_s=0)
        for p in (first,):
            if p.poll() is None:
                p.kill()
    final = run_dir / "checkpoints" / "step_000006"
    consumed = dict(read_consumed(final / "consumed.json").recent)
    # every sent trajectory consumed by the surviving model state, each exactly once, 3 per step
    assert sorted(consumed) == sorted(t.trajectory_id for t in trajs)
    assert sorted(collections.Counter(consumed.values()).items()) == [(s, 3) for s in range(1, 7)]
    ckpt2 = read_consumed(run_dir / "checkpoints" / "step_000002" / "consumed.json").recent \
        if (run_dir / "checkpoints" / "step_000002").exists() else None
    assert ckpt2 is None or all(consumed[k] == v for k, v in ckpt2.items())
    assert status["step"] == 6 and status["trained"] == 18 and status["rejected"] == 0
    assert status["replayed"] >= 4  # the log's unconsumed records (incl. the lost step 3) were re-queued
    assert _steps(run_dir) == [1, 2, 3, 4, 5, 6]  # the lost timeline's row 3 was replaced
