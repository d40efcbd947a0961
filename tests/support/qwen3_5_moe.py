"""A tiny Qwen3.5-MoE model folder for the tests that run the family on both learner backends: three Gated DeltaNet
layers and one gated-attention layer, 8 experts top-2 with a gated shared expert, written by
:meth:`t1async.models.qwen3_5_moe.Qwen3_5MoeForCausalLM.save_pretrained` (config.json + safetensors)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from t1async.config import ModelConfig
from t1async.config.model_folder import resolve_model
from t1async.models.qwen3_5_moe import Qwen3_5MoeForCausalLM, config_from_hf, config_to_hf

TINY_QWEN35 = dict(vocab_size=512, hidden_size=64, num_hidden_layers=4,
                   layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                   linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                   num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                   rope_parameters={"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.25},
                   max_position_embeddings=1024)
"""transformers ``Qwen3_5MoeTextConfig`` keys of the tiny model (2 query groups, 2 linear key heads of 2 value heads
each: the grouped layouts matter; a quarter of each head rotated)."""


def perturb(model: torch.nn.Module, seed: int = 0) -> None:
    """Non-trivial weights in place: norms, decays and conv away from their initial values, a decisive router
    (no near-ties in top-k for float32 noise to flip), the rest normal(0, 0.04)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight") or name.endswith(("dt_bias", "A_log")):
                p.add_(0.2 * r)
            elif name.endswith("mlp.gate.weight"):
                p.copy_(0.5 * r)
            elif name.endswith("conv1d.weight"):
                p.copy_(0.3 * r)
            else:
                p.copy_(0.04 * r)


def qwen35_folder(path: Path, seed: int = 0, **keys) -> ModelConfig:
    """Write the tiny model (:data:`TINY_QWEN35` updated with ``keys``, :func:`perturb` ed) into folder ``path``;
    returns its resolved :class:`ModelConfig` (``model.path`` = the folder)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config_to_hf(config_from_hf({**TINY_QWEN35, **keys}))))
    cfg = resolve_model(ModelConfig(path=str(path)))
    torch.manual_seed(seed)
    model = Qwen3_5MoeForCausalLM(cfg)
    perturb(model, seed)
    model.save_pretrained(path)
    return resolve_model(ModelConfig(path=str(path)))
