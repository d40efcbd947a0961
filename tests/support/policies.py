"""A real embedded sampler serving a random policy over HTTP."""

from __future__ import annotations

import torch

from t1async.actors.sampler import EmbeddedSampler
from t1async.config import ModelConfig, SamplerConfig
from t1async.models.model import Qwen3MoeForCausalLM
from t1async.weights.distributed import DistributedWeightSync


def serve_random_policy(model: ModelConfig):
    """An embedded sampler holding random weights (seed 0) as version 0; yields its URL (for module fixtures)."""
    s = EmbeddedSampler(model, SamplerConfig(), seed=0)
    sync = DistributedWeightSync("gloo", timeout_s=30)
    sync.connect([s.url()])
    torch.manual_seed(0)
    sync.publish(Qwen3MoeForCausalLM(model).named_parameters(), 0)
    yield s.url()
    sync.close()
    s.shutdown()
