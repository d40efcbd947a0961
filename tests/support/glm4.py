"""Tiny GLM-4.5-style (``glm4_moe``) models and folders, made by transformers itself (its ``Glm4MoeConfig``,
``AutoModelForCausalLM.from_config`` and ``save_pretrained``), for the learner backends' parity tests."""

from __future__ import annotations

from pathlib import Path

import torch

GLM4_TINY = dict(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, moe_intermediate_size=24, n_routed_experts=8,
                 num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
                 routed_scaling_factor=2.5, max_position_embeddings=256, attention_bias=True, use_qk_norm=True,
                 attention_dropout=0.0, rope_parameters={"rope_theta": 5000.0, "partial_rotary_factor": 0.5,
                                                         "rope_type": "default"})
"""4 layers (the first dense), 8 experts top-2 in 2 groups of which 1 is chosen (group-limited), a shared expert,
a routed scaling factor, q/k/v biases, q/k norms, RoPE on half of each head (head_dim 16 != hidden / heads)."""


def glm4_model(seed: int = 0, **kw):
    """transformers' Glm4MoeForCausalLM of :data:`GLM4_TINY` (``kw`` over it), float32, seeded; made as a trained
    GLM is: a score-correction bias that matters for the choice (normal, std 0.05), a decisive router (the router
    weights normal, std 1: no near-ties to flip on float32 noise) and non-zero q/k/v biases."""
    import transformers  # (transformers: deferred, heavy)

    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.Glm4MoeConfig(**{**GLM4_TINY, **kw}),
                                                       dtype=torch.float32)
    with torch.no_grad():
        for layer in hf.model.layers[hf.config.first_k_dense_replace:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.05)
            layer.mlp.gate.weight.normal_(0.0, 1.0)
        for n, p in hf.named_parameters():
            if n.endswith("_proj.bias"):
                p.normal_(0.0, 0.1)
    return hf


def glm4_folder(path: Path, seed: int = 0, **kw) -> Path:
    """A model folder written by transformers' ``save_pretrained`` of :func:`glm4_model` (config.json and
    safetensors in transformers' checkpoint layout: one tensor per expert)."""
    glm4_model(seed, **kw).save_pretrained(str(path))
    return Path(path)
