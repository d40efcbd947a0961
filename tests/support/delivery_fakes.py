"""The model and the synthetic trajectory the receive-path tests send (seed first, then version)."""

from __future__ import annotations

import numpy as np

from t1async.config import ModelConfig
from t1async.trajectory import Trajectory

MODEL = ModelConfig(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                    head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
def synthetic(seed: int, version: int = 0, T: int = 40) -> Trajectory:
    rng = np.random.default_rng(seed)
    mask = np.zeros(T, np.uint8)
    mask[10:20] = 1
    mask[28:T] = 1
    return Trajectory(
        task="synthetic", actor_id=0, token_ids=rng.integers(0, 256, T).astype(np.uint32), loss_mask=mask,
        logprobs=np.where(mask == 1, -5.5, 0.0).astype(np.float32), versions=np.where(mask == 1, version, -1).astype(np.int32),
        turn_offsets=np.array([[10, 20], [28, T]], np.int32),
        routed_experts=((rng.integers(0, 4, (T - 1, 2, 1)) + np.arange(2)) % 4).astype(np.uint8),  # top-2 distinct
        num_experts=4, reward=1.0, passed=1, total=2, resolved=False, finish_reason="max_turns",
        tests=[("a", True), ("b", False)],
        trajectory_id=f"traj-{seed:05d}", started_at=1.0, finished_at=2.0,
    )
