"""A random but valid trajectory of any shape."""

from __future__ import annotations

import numpy as np

from t1async.trajectory import (
    TURN_CUT_NOT_RUN,
    Trajectory,
    experts_dtype,
)


def make_traj(T: int = 12, layers: int = 3, top_k: int = 2, num_experts: int = 8, seed: int = 0) -> Trajectory:
    rng = np.random.default_rng(seed)
    mask = np.zeros(T, dtype=np.uint8)
    mask[4:7] = 1
    mask[9:T] = 1
    lp = np.where(mask == 1, -rng.random(T), 0.0).astype(np.float32)
    versions = np.where(mask == 1, 3, -1).astype(np.int32)
    return Trajectory(
        task="t", actor_id=1, token_ids=rng.integers(0, 4096, T).astype(np.uint32), loss_mask=mask, logprobs=lp,
        versions=versions, turn_offsets=np.array([[4, 7], [9, T]], dtype=np.int32),
        turn_status=np.array([TURN_CUT_NOT_RUN, 0], dtype=np.uint8),
        routed_experts=rng.integers(0, num_experts, (T - 1, layers, top_k)).astype(experts_dtype(num_experts)),
        num_experts=num_experts, reward=2.0, passed=2, total=3, resolved=False, finish_reason="max_turns",
        tests=[("a", True), ("b[x y]", True), ("c", False)], started_at=1.0, finished_at=2.0,
    )


def model_trajectory(model, T: int, trajectory_id: str, *, seed: int = 0) -> Trajectory:
    """A trajectory a run of ``model`` (a ``ModelConfig``) takes: ``T`` tokens of its vocabulary, one
    assistant turn from position 100, distinct routed experts per row, one of two tests passed."""
    rng = np.random.default_rng(seed)
    mask = np.zeros(T, np.uint8)
    mask[100:T] = 1
    routed = (rng.integers(0, model.num_experts, (T - 1, model.num_hidden_layers, 1))
              + np.arange(model.num_experts_per_tok)) % model.num_experts
    return Trajectory(task="forged", actor_id=99, token_ids=rng.integers(0, model.vocab_size, T).astype(np.uint32),
                      loss_mask=mask, logprobs=np.where(mask == 1, -1.0, 0.0).astype(np.float32),
                      versions=np.where(mask == 1, 0, -1).astype(np.int32), turn_offsets=np.array([[100, T]], np.int32),
                      routed_experts=routed.astype(experts_dtype(model.num_experts)), num_experts=model.num_experts,
                      reward=1.0, passed=1, total=2, resolved=False, finish_reason="max_turns",
                      tests=[("a", True), ("b", False)], trajectory_id=trajectory_id, started_at=1.0, finished_at=2.0)
