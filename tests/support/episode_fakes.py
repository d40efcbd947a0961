"""The edges of one episode: a scripted sampler and a fake environment, with the tiny model they serve."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from t1async.config import ModelConfig
from t1async.envs.protocol import CommandResult
from t1async.sampling.sampler_client import SamplerResponse

L, K, E = 2, 2, 8
MODEL = ModelConfig(hidden_size=32, num_hidden_layers=L, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                    num_experts=E, num_experts_per_tok=K, moe_intermediate_size=32)
class ScriptedSampler:
    """Answers each request with the next scripted turn; routing row of position p is p % E in
    every layer and slot, so a stale or shifted row is visible in the trajectory."""

    def __init__(self, turns: list[list[int]]):
        self.turns, self.calls = list(turns), []

    def generate(self, input_ids, sampling_params, *, routed_experts_start_len=0):
        out = self.turns.pop(0)
        self.calls.append(list(input_ids))
        positions = np.arange(routed_experts_start_len, len(input_ids) + len(out) - 1)
        rows = np.broadcast_to((positions % E)[:, None, None], (positions.size, L, K)).astype(np.int32)
        return SamplerResponse(output_ids=out, logprobs=[-1.0 - 0.01 * i for i in range(len(out))], routed_experts=rows,
                               finish_reason="stop", weight_version=3)
class FakeEnv:
    """The shell edge: records commands, echoes them back as output."""

    def __init__(self):
        self.commands: list[str] = []

    def reset(self):
        return "make a file"

    def step(self, command):
        self.commands.append(command)
        return CommandResult(f"ran {command}", 0, False, False, 0.0)

    def verify(self):
        return SimpleNamespace(reward=1.0, passed=1, total=2, resolved=False, tests=[], error=None)
