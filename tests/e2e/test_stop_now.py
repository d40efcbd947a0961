"""``t1async stop --now`` does not wait for a learner step (issue 42: a step on a 16,384-token
trajectory held ``stop``, ``stop --now``, SIGINT and SIGTERM for minutes), and nothing is lost by
ending the learner mid-step: the trajectory it was training on is in its receive log, not in the
consumed-id ledger, so a resume trains it.

Real launch (Ray, ZeroMQ with the run's CurveZMQ keys, the torch learner). The long step is real: a
valid trajectory of 16,384 tokens, with ``model.max_position_embeddings=16384`` so that intake takes
it, sent with the run's own keys as a rollout actor would. Meanwhile an operator sends one token more
than the context with ``tools/send_trajectory.py`` (the run's keys, from outside the service): it is
refused as ``length``, counted, and shown by ``t1async status`` (table and ``--json``) beside the
drop counters (``dropped_stale_restart``: 0).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import zmq

from t1async.config import load_config
from t1async.learner.checkpoints import latest_checkpoint
from t1async.trajectory import encode
from t1async.transport.delivery import ReceiveLog, read_consumed
from t1async.transport.keys import client_keys
from t1async.transport.transport import ACK, PROTOCOL
from tests.support import REPO
from tests.support.service import CLI, read_status, wait_for
from tests.support.trajectories import model_trajectory

pytestmark = pytest.mark.slow
LONG = 16384


def in_long_step(run_dir, window_s: float = 10.0, timeout_s: float = 180.0) -> None:
    """Wait until the learner has sat in one step for ``window_s`` with a trajectory waiting (batch
    size 1: an idle learner takes it within a second, a step on a few hundred tokens takes about one):
    it is in the step on the long trajectory."""
    since, last = time.monotonic(), None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        st = read_status(run_dir)
        now = (st["step"], st["queue_depth"] >= 1)
        if now != last or not now[1]:
            since, last = time.monotonic(), now
        elif time.monotonic() - since >= window_s:
            return
        time.sleep(1.0)
    raise AssertionError("the learner never sat in one step with a trajectory waiting")


def test_stop_now_ends_a_learner_stuck_in_a_long_step_and_loses_nothing(tmp_path):
    run_dir = tmp_path / "run"
    overrides = [f"run.dir={run_dir}", f"model.max_position_embeddings={LONG}", "learner.max_steps=0",
                 "learner.batch_size=1", "learner.checkpoint_every=1", "rollout.num_actors=1", "env.max_turns=1",
                 "generation.max_new_tokens=8"]
    out = open(tmp_path / "launch.out", "w")
    proc = subprocess.Popen(CLI + overrides, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
    sock = None
    try:
        wait_for(lambda: (run_dir / "service.json").exists() and "control" in json.loads(
            (run_dir / "service.json").read_text()), 600, "the service to start")
        endpoint = json.loads((run_dir / "service.json").read_text())["trajectories"]
        keys = client_keys(run_dir / "keys")
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.curve_secretkey, sock.curve_publickey, sock.curve_serverkey = keys.secret, keys.public, keys.server_public
        sock.connect(endpoint)
        model = load_config(REPO / "configs" / "local.yaml", [f"model.max_position_embeddings={LONG}"]).model
        sock.send_multipart([PROTOCOL, b"long-1", encode(model_trajectory(model, LONG, "long-1"))])
        assert sock.poll(120_000), "no ACK for the long trajectory"
        kind, key, _ = sock.recv_multipart()
        assert (kind, key) == (ACK, b"long-1")
        sock.send_multipart([PROTOCOL, b"short-1", encode(model_trajectory(model, 200, "short-1", seed=1))])
        in_long_step(run_dir)
        # an operator provokes the length refusal from outside, as docs/operations.md says, and sees it in status
        sent = subprocess.run([sys.executable, str(REPO / "tools" / "send_trajectory.py"), str(run_dir),
                               "--tokens", str(LONG + 1), "--id", "too-long-1"], capture_output=True, text=True,
                              timeout=180, cwd=REPO)
        table = subprocess.run([*CLI[:3], "status", str(run_dir)], capture_output=True, text=True, timeout=120)
        seen = json.loads(subprocess.run([*CLI[:3], "status", str(run_dir), "--json"], capture_output=True, text=True,
                                         timeout=120).stdout)
        t0 = time.monotonic()
        stop = subprocess.run([*CLI[:3], "stop", str(run_dir), "--now"], capture_output=True, text=True, timeout=300)
        rc = proc.wait(timeout=300)
        took = time.monotonic() - t0
    finally:
        if sock is not None:
            sock.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = (tmp_path / "launch.out").read_text()
    got = json.loads(sent.stdout.strip().splitlines()[-1])
    assert sent.returncode == 0 and got["reply"] == "REJ", (sent.stdout, sent.stderr)
    assert f"{LONG + 1} tokens, more than the {LONG}" in got["reason"] and got["limit"] == LONG
    assert seen["rejected_by"] == {"length": 1} and seen["rejected"] == 1, seen  # counted, visible from outside
    assert seen["dropped_stale_restart"] == 0 and seen["dropped_stale"] == 0  # (issue 42: only in summary.json)
    assert '{"length": 1}' in table.stdout and '"stale_restart": 0' in table.stdout, table.stdout
    assert "no role killed by Ray's memory monitor" in table.stdout, table.stdout
    print(f"t1async stop --now returned after {took:.1f} s")
    assert stop.returncode == 0 and rc == 0, (stop.stdout, stop.stderr, text[-3000:])
    assert took < 60, f"stop --now waited {took:.0f} s (the step was not ended)"
    assert "ending it in its step" in text and "Traceback" not in text
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["ended"] == "stopped" and summary["learner"]["ended_mid_step"] is True
    # nothing lost: the long trajectory is in the receive log and was never consumed, so a resume trains it
    ckpt = latest_checkpoint(run_dir / "checkpoints")
    consumed = read_consumed(ckpt / "consumed.json") if ckpt else read_consumed(run_dir / "none.json")
    assert "long-1" not in consumed
    assert "long-1" in ReceiveLog(run_dir / "receive_log", fsync="never")
