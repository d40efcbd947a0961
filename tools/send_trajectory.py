"""Send one valid-looking trajectory of N tokens to a running service's learner, as a rollout actor of
the run would, and print the learner's answer: how an operator sees intake refuse what the model
cannot hold (``rejected_by.length`` in ``t1async status``), from outside the service.

The trajectory is random but consistent for the run's model (token ids below ``model.vocab_size``,
distinct routed experts per row, the learner's weight version now (asked of ``t1async status``; 0 when
it does not answer), so it is never dropped as stale, one assistant turn from position 100, one of two
tests passed, reward 1): the only thing that can be wrong with it is its length. It is sent to the
learner's trajectory socket (``trajectories`` in ``RUN_DIR/service.json``) with the run's CurveZMQ
keys (``transport.keys_dir``, else ``RUN_DIR/keys``; plain ZMTP when the run has
``transport.curve=false``), so whoever runs this must be able to read those keys, as the rollout
actors do. A trajectory within the limit is ACKed and trained like any other: send one only into a
run you mean to train on it.

Usage::

    python tools/send_trajectory.py RUN_DIR [--tokens N] [--id ID] [--timeout-s 60]

``--tokens`` defaults to twice the learner's limit (``model.max_position_embeddings``, or
``env.max_context_tokens`` where smaller). Prints one JSON object: ``trajectory_id``, ``tokens``,
``limit``, ``reply`` (``ACK``, ``REJ`` or null when none came within ``--timeout-s``) and ``reason``
(the REJ's text). Exit status 0 when the learner answered, 1 when it did not, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import zmq

from t1async.config import ConfigError, load_config
from t1async.service.control import ControlError, request
from t1async.service.rundir import read_service
from t1async.trajectory import Trajectory, encode, experts_dtype
from t1async.transport.intake import context_limit
from t1async.transport.keys import KeysError, client_keys
from t1async.transport.transport import PROTOCOL


def trajectory(model, tokens: int, trajectory_id: str, seed: int = 0, version: int = 0) -> Trajectory:
    """A consistent trajectory of ``tokens`` positions for ``model`` (a ``ModelConfig``), sampled at
    weight ``version``; see the module docstring."""
    rng = np.random.default_rng(seed)
    start = min(100, tokens - 1)
    mask = np.zeros(tokens, np.uint8)
    mask[start:] = 1
    routed = (rng.integers(0, model.num_experts, (tokens - 1, model.num_hidden_layers, 1))
              + np.arange(model.num_experts_per_tok)) % model.num_experts
    return Trajectory(task="send_trajectory", actor_id=999, token_ids=rng.integers(0, model.vocab_size, tokens).astype(np.uint32),
                      loss_mask=mask, logprobs=np.where(mask == 1, -1.0, 0.0).astype(np.float32),
                      versions=np.where(mask == 1, version, -1).astype(np.int32),
                      turn_offsets=np.array([[start, tokens]], np.int32),
                      routed_experts=routed.astype(experts_dtype(model.num_experts)), num_experts=model.num_experts,
                      reward=1.0, passed=1, total=2, resolved=False, finish_reason="max_turns",
                      tests=[("a", True), ("b", False)], trajectory_id=trajectory_id, started_at=time.time() - 1,
                      finished_at=time.time())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir")
    p.add_argument("--tokens", type=int, default=0, help="trajectory length (default: twice the learner's limit)")
    p.add_argument("--id", default=None, help="trajectory id (default send-<time>)")
    p.add_argument("--timeout-s", type=float, default=60.0, help="how long to wait for the ACK or REJ")
    args = p.parse_args(argv)
    run_dir = Path(args.run_dir)
    try:
        cfg = load_config(run_dir / "config.yaml")
    except ConfigError as e:
        print(f"send_trajectory: error: {e} (is {run_dir} a run directory?)", file=sys.stderr)
        return 2
    endpoint = (read_service(run_dir) or {}).get("trajectories")
    if not endpoint:
        print(f"send_trajectory: error: {run_dir}/service.json names no trajectory socket (is the run running?)",
              file=sys.stderr)
        return 2
    limit = context_limit(cfg.model.max_position_embeddings, cfg.env.max_context_tokens)
    tokens = args.tokens or 2 * limit
    if tokens < 2:
        print("send_trajectory: error: --tokens must be at least 2", file=sys.stderr)
        return 2
    key = args.id or f"send-{time.time_ns()}"
    try:  # the learner's version now: a trajectory stamped 0 is dropped as stale past version 2 (and a resumed
        # run counts it as stale_restart)
        version = int(request(run_dir, {"cmd": "status"}).get("version") or 0)
    except (ControlError, TypeError, ValueError):
        version = 0
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if cfg.transport.curve:
        try:
            keys = client_keys(cfg.transport.keys_dir or run_dir / "keys")
        except KeysError as e:
            print(f"send_trajectory: error: {e}", file=sys.stderr)
            return 2
        sock.curve_secretkey, sock.curve_publickey, sock.curve_serverkey = keys.secret, keys.public, keys.server_public
    try:
        sock.connect(endpoint)
        sock.send_multipart([PROTOCOL, key.encode(), encode(trajectory(cfg.model, tokens, key, version=version))])
        reply = reason = None
        if sock.poll(int(args.timeout_s * 1000)):
            kind, _, text = sock.recv_multipart()
            reply, reason = kind.decode(), text.decode(errors="replace")
    finally:
        sock.close()
    print(json.dumps({"trajectory_id": key, "tokens": tokens, "limit": limit, "version": version, "reply": reply,
                      "reason": reason}))
    return 0 if reply else 1


if __name__ == "__main__":
    sys.exit(main())
