"""Model families on the megatron learner beyond qwen3_moe: one module per ``model_type`` with what differs.

``qwen3_moe`` is the built-in path of t1async/learner/megatron/model.py (config, local layer spec) and
convert.py (weights). Another family is a module here, registered in :data:`MEGATRON_FAMILIES`, providing:

- ``config_overrides(cfg) -> dict``: ``TransformerConfig`` keyword arguments over the built-in ones (refusing, in
  one ValueError line, what megatron-core cannot express); ``gpt_kwargs(cfg) -> dict``: ``GPTModel`` keyword
  arguments; ``block_spec(transformer_config, pp_rank)``: the decoder block spec of one pipeline stage;
  ``moe_layer_pattern(cfg) -> list[int]``: 1 per MoE layer, 0 per dense one;
- ``hf_to_megatron`` / ``megatron_to_hf``: the weight layouts, with convert.py's signatures;
- ``to_converter(sd)`` / ``from_converter(sd)``: the torch model's state dict <-> the names the converter and
  expert parallelism use (per-expert names: ``...mlp.experts.{e}....``).

The functions below dispatch on ``cfg.model_type``, falling back to the built-in qwen3_moe path.
"""

from __future__ import annotations

from types import ModuleType

import torch

from t1async.config import ModelConfig
from t1async.learner.megatron import convert
from t1async.learner.megatron.convert import POLICY, Layout
from t1async.learner.megatron.families import glm4_moe

__all__ = ["MEGATRON_FAMILIES", "check_family", "from_converter", "hf_to_megatron", "megatron_family", "megatron_to_hf",
           "moe_layer_pattern", "to_converter"]

MEGATRON_FAMILIES: dict[str, ModuleType] = {"glm4_moe": glm4_moe}
"""Families with their own module here, by ``model_type`` (qwen3_moe: the built-in path)."""


def megatron_family(cfg: ModelConfig) -> ModuleType | None:
    """The family module of ``cfg.model_type``, or None for the built-in qwen3_moe path."""
    return MEGATRON_FAMILIES.get(cfg.model_type)


def check_family(cfg: ModelConfig) -> None:
    """Refuse, before any process starts, a model whose family settings megatron-core cannot express (the
    family's ``config_overrides``; needs no megatron-core).

    Raises:
        ValueError: one line naming the setting, the megatron-core source line and what to do.
    """
    fam = megatron_family(cfg)
    if fam is not None:
        fam.config_overrides(cfg)


def moe_layer_pattern(cfg: ModelConfig) -> list[int]:
    """Per decoder layer: 1 when it holds an MoE block (a router), 0 when its MLP is dense."""
    fam = megatron_family(cfg)
    return fam.moe_layer_pattern(cfg) if fam is not None else [1] * cfg.num_hidden_layers


def hf_to_megatron(sd: dict[str, torch.Tensor], cfg: ModelConfig, layout: Layout = POLICY,
                   **ranks: int) -> dict[str, torch.Tensor]:
    """:func:`t1async.learner.megatron.convert.hf_to_megatron` of ``cfg``'s family (``ranks``: ep_rank, ep_size,
    pp_rank, pp_size); ``sd`` in the converter's names (:func:`to_converter`)."""
    fam = megatron_family(cfg)
    return (fam.hf_to_megatron if fam is not None else convert.hf_to_megatron)(sd, cfg, layout, **ranks)


def megatron_to_hf(sd: dict[str, torch.Tensor], cfg: ModelConfig, layout: Layout = POLICY,
                   **ranks: int) -> dict[str, torch.Tensor]:
    """:func:`t1async.learner.megatron.convert.megatron_to_hf` of ``cfg``'s family (converter names out)."""
    fam = megatron_family(cfg)
    return (fam.megatron_to_hf if fam is not None else convert.megatron_to_hf)(sd, cfg, layout, **ranks)


def to_converter(cfg: ModelConfig, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The torch model's state dict (t1async/models/families.py) in the names the converter takes (views)."""
    fam = megatron_family(cfg)
    return fam.to_converter(sd) if fam is not None else sd


def from_converter(cfg: ModelConfig, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`to_converter`: the torch model's names (what the torch learner publishes and saves)."""
    fam = megatron_family(cfg)
    return fam.from_converter(sd) if fam is not None else sd
