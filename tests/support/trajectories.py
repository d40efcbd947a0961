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
