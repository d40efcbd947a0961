"""A tiny learner model, synthetic trajectories and the controller edge the learner reports to."""

from __future__ import annotations

import numpy as np

from t1async.config import (
    ModelConfig,
)
from t1async.trajectory import Trajectory, encode

MODEL = ModelConfig(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                    head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
def synthetic(version: int, seed: int, reward: float = 1.0, T: int = 40) -> Trajectory:
    """Two assistant turns, [T/4, T/2) and [0.7 T, T) (T = 40: [10, 20) and [28, 40))."""
    rng = np.random.default_rng(seed)
    a, b, c = T // 4, T // 2, int(0.7 * T)
    mask = np.zeros(T, np.uint8)
    mask[a:b] = 1
    mask[c:T] = 1
    return Trajectory(
        task="synthetic", actor_id=0, token_ids=rng.integers(0, 256, T).astype(np.uint32), loss_mask=mask,
        logprobs=np.where(mask == 1, -5.5, 0.0).astype(np.float32), versions=np.where(mask == 1, version, -1).astype(np.int32),
        turn_offsets=np.array([[a, b], [c, T]], np.int32),
        routed_experts=((rng.integers(0, 4, (T - 1, 2, 1)) + np.arange(2)) % 4).astype(np.uint8), num_experts=4,
        reward=reward, passed=int(reward), total=2, resolved=reward == 2, finish_reason="max_turns",
        tests=[("a", reward >= 1), ("b", reward >= 2)],
    )
def send_trajectory(tx, traj):
    tx.send(traj.trajectory_id, encode(traj))
class FakeController:
    """The controller edge: records what the learner tells admission control."""

    def __init__(self):
        self.versions: list[int] = []
        self.discarded: list[str] = []

    def set_version(self, v):
        self.versions.append(v)

    def trajectory_discarded(self, reason, trajectory_id):
        self.discarded.append(reason)

    def trajectories_consumed(self, ids):
        pass
