"""Poison against a real ``t1async launch`` (Ray, ZeroMQ, bubblewrap, gloo all real): a trajectory
with a token id past the vocabulary, one with reward -1e30 and one twice the model's context (16,384
tokens against ``max_position_embeddings`` 8,192: it used to be ACKed and stall the learner for
minutes, and the resume replayed it), pushed to the learner's socket
beside the rollout actors' own, are REJected with their reason, counted by reason in
metrics.jsonl and summary.json, quarantined as a capped prefix with metadata, and never trained;
the run ends normally (it used to exit with IndexError, and every resume died on it again).

These are sent with the run's own CurveZMQ keys (``RUN_DIR/keys``, made by the launch: authenticated
transport is the default), as a buggy actor of the run would. A consistent forged trajectory (every
test passed, reward 2) from a process without the keys is never answered, never trained, and the
learner counts the refused connection (``refused_handshakes``; it used to be ACKed and trained)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import zmq

from t1async.config import load_config
from t1async.trajectory import Trajectory, encode
from t1async.transport.delivery import read_consumed
from t1async.transport.keys import client_keys
from t1async.transport.transport import PROTOCOL, REJECT
from tests.support import REPO

pytestmark = pytest.mark.slow
CONFIG = REPO / "configs" / "local.yaml"
PREFIX = 1024


def _poison(kind: str) -> Trajectory:
    """A well-formed trajectory for configs/local.yaml's model with one fault the frame cannot show."""
    m = load_config(CONFIG).model
    rng = np.random.default_rng(0)
    T = 2 * m.max_position_embeddings if kind == "long" else 600
    mask = np.zeros(T, np.uint8)
    mask[100:T] = 1
    ids = rng.integers(0, m.vocab_size, T).astype(np.uint32)
    reward, passed = 1.0, 1
    if kind == "token":
        ids[150] = m.vocab_size
    elif kind == "reward":
        reward = -1e30
    elif kind == "forged":
        reward, passed = 2.0, 2
    routed = (rng.integers(0, m.num_experts, (T - 1, m.num_hidden_layers, 1)) + np.arange(m.num_experts_per_tok))
    return Trajectory(task="poison", actor_id=99, token_ids=ids, loss_mask=mask,
                      logprobs=np.where(mask == 1, -1.0, 0.0).astype(np.float32),
                      versions=np.where(mask == 1, 0, -1).astype(np.int32), turn_offsets=np.array([[100, T]], np.int32),
                      routed_experts=(routed % m.num_experts).astype(np.uint8), num_experts=m.num_experts,
                      reward=reward, passed=passed, total=2, resolved=passed == 2, finish_reason="max_turns",
                      tests=[("a", True), ("b", passed == 2)], trajectory_id=f"poison-{kind}", started_at=1.0, finished_at=2.0)


def test_launch_rejects_counts_and_quarantines_poison_and_trains_on(tmp_path):
    run_dir = tmp_path / "run"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    overrides = [f"run.dir={run_dir}", f"transport.port={port}", f"transport.quarantine_prefix_bytes={PREFIX}",
                 "learner.max_steps=1", "learner.batch_size=1", "rollout.num_actors=1", "env.max_turns=1",
                 "generation.max_new_tokens=8", "learner.checkpoint_every=0"]
    out = open(tmp_path / "launch.out", "w")
    proc = subprocess.Popen([sys.executable, "-m", "t1async.cli", "launch", str(CONFIG), *overrides], stdout=out,
                            stderr=subprocess.STDOUT, cwd=REPO)
    keys = run_dir / "keys"
    deadline = time.monotonic() + 120
    while not (keys / "rollout.key_secret").exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)  # the launch makes the run's keys before Ray starts
    run_keys = client_keys(keys)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.curve_secretkey, sock.curve_publickey, sock.curve_serverkey = (run_keys.secret, run_keys.public,
                                                                       run_keys.server_public)
    sock.connect(f"tcp://127.0.0.1:{port}")  # queued by ZeroMQ until the learner binds
    forger = zmq.Context.instance().socket(zmq.DEALER)  # no keys: anyone on the machine
    forger.setsockopt(zmq.LINGER, 0)
    forger.connect(f"tcp://127.0.0.1:{port}")
    frames = {t.trajectory_id: encode(t) for t in (_poison("token"), _poison("reward"), _poison("long"))}
    try:
        forger.send_multipart([PROTOCOL, b"poison-forged", encode(_poison("forged"))])
        for key, frame in frames.items():
            sock.send_multipart([PROTOCOL, key.encode(), frame])
        replies = {}
        deadline = time.monotonic() + 240
        while len(replies) < 3 and time.monotonic() < deadline and proc.poll() is None:
            if sock.poll(500):
                kind, key, reason = sock.recv_multipart()
                replies[key.decode()] = (kind, reason.decode())
        assert proc.wait(timeout=240) == 0, (tmp_path / "launch.out").read_text()[-3000:]
        forged_reply = forger.poll(0)
    finally:
        sock.close()
        forger.close()
        if proc.poll() is None:
            proc.kill()
    log = (tmp_path / "launch.out").read_text()
    assert replies["poison-token"][0] == REJECT and "outside the vocabulary" in replies["poison-token"][1]
    assert replies["poison-reward"][0] == REJECT and "-1e+30" in replies["poison-reward"][1]
    assert replies["poison-long"][0] == REJECT and "16384 tokens, more than the 8192" in replies["poison-long"][1]
    assert not forged_reply and "poison-forged" not in replies  # the forger heard nothing back
    summary = json.loads((run_dir / "summary.json").read_text())
    assert sum(summary["learner"]["refused_handshakes"].values()) >= 1  # ... and its connection was counted
    assert "poison-forged" not in (run_dir / "logs" / "learner.log").read_text()
    consumed = read_consumed(run_dir / "checkpoints" / "step_000001" / "consumed.json")
    assert len(consumed) >= 1 and "poison-forged" not in consumed  # trained on the actors' own, never the forgery
    assert summary["ended"] == "done" and summary["steps"] == 1
    assert summary["learner"]["rejected_by"] == {"token_ids": 1, "reward": 1, "length": 1}
    assert summary["learner"]["rejected"] == 3
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["rejected_by"] == {"token_ids": 1, "reward": 1, "length": 1} and rows[-1]["reward_mean"] >= 0
    metas = {m["key"]: m for m in (json.loads(p.read_text()) for p in (run_dir / "quarantine").glob("*.json"))}
    assert set(metas) == set(frames) and all(metas[k]["size"] == len(frames[k]) > PREFIX for k in frames)
    assert all(p.stat().st_size == PREFIX for p in (run_dir / "quarantine").glob("*.prefix"))
    assert "Traceback" not in log and "IndexError" not in log
