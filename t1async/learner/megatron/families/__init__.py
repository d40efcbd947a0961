"""Model families on the megatron learner beyond qwen3_moe: one module per ``model_type`` with what differs.

``qwen3_moe`` is the built-in path of t1async/learner/megatron/model.py (config, local layer spec) and
convert.py here (weights; the other families reuse its tables and tensor-parallel rules). This folder imports
nothing of t1async/learner/megatron/ above it (the learner imports it, never the reverse). Another family is a
module here, registered in :data:`MEGATRON_FAMILIES`, providing:

- ``config_overrides(cfg) -> dict``: ``TransformerConfig`` keyword arguments over the built-in ones (refusing, in
  one ValueError line, what megatron-core cannot express); ``gpt_kwargs(cfg) -> dict``: ``GPTModel`` keyword
  arguments; ``block_spec(transformer_config, pp_rank)``: the decoder block spec of one pipeline stage;
  ``moe_layer_pattern(cfg) -> list[int]``: 1 per MoE layer, 0 per dense one;
- ``hf_to_megatron`` / ``megatron_to_hf``: the weight layouts, with convert.py's signatures;
- ``to_converter(sd)`` / ``from_converter(sd)``: the torch model's state dict <-> the names the converter and
  expert parallelism use (per-expert names: ``...mlp.experts.{e}....``); ``checkpoint_state(sd)``: the torch
  model's state dict as the torch learner writes it without a source folder (its ``checkpoint_state_dict``);
- optionally ``tp_split(cfg)``: the family's own tensor-parallel rule, a function of a Megatron weight name
  (convert.py's :func:`~t1async.learner.megatron.families.convert.tp_partition` form, None to leave the name to convert.py's
  rules), and
  ``tp_sizes(cfg) -> dict``: the family's sizes ``learner.megatron.tensor_parallel`` must also divide.

The functions below dispatch on ``cfg.model_type``, falling back to the built-in qwen3_moe path.
"""

from __future__ import annotations

from types import ModuleType

import torch

from t1async.config import ModelConfig
from t1async.learner.megatron.families import convert, glm4_moe, qwen3_5_moe
from t1async.learner.megatron.families.convert import POLICY, Layout, TpSplit

__all__ = ["MEGATRON_FAMILIES", "check_family", "checkpoint_state", "family_tp_sizes", "from_converter",
           "hf_to_megatron", "megatron_family", "megatron_to_hf", "merge_tp", "moe_layer_pattern", "shard_tp",
           "to_converter", "tp_partition"]

MEGATRON_FAMILIES: dict[str, ModuleType] = {"glm4_moe": glm4_moe, "qwen3_5_moe": qwen3_5_moe}
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
    """:func:`t1async.learner.megatron.families.convert.hf_to_megatron` of ``cfg``'s family (``ranks``: ep_rank, ep_size,
    pp_rank, pp_size); ``sd`` in the converter's names (:func:`to_converter`)."""
    fam = megatron_family(cfg)
    return (fam.hf_to_megatron if fam is not None else convert.hf_to_megatron)(sd, cfg, layout, **ranks)


def megatron_to_hf(sd: dict[str, torch.Tensor], cfg: ModelConfig, layout: Layout = POLICY,
                   **ranks: int) -> dict[str, torch.Tensor]:
    """:func:`t1async.learner.megatron.families.convert.megatron_to_hf` of ``cfg``'s family (converter names out)."""
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


def checkpoint_state(cfg: ModelConfig, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The torch model's state dict in the names its checkpoint has when written without a source folder (what
    the torch learner writes: glm4_moe one tensor per expert, qwen3_5_moe its fused experts)."""
    fam = megatron_family(cfg)
    return fam.checkpoint_state(sd) if fam is not None else sd


def _tp_split(cfg: ModelConfig | None) -> TpSplit | None:
    """The family's own tensor-parallel rule for ``cfg`` (its ``tp_split(cfg)``), None without one."""
    fam = megatron_family(cfg) if cfg is not None else None
    return fam.tp_split(cfg) if fam is not None and hasattr(fam, "tp_split") else None


def tp_partition(name: str, layout: Layout = POLICY, cfg: ModelConfig | None = None):
    """:func:`t1async.learner.megatron.families.convert.tp_partition` with ``cfg``'s family's own rule (``cfg`` None:
    qwen3_moe's names only)."""
    return convert.tp_partition(name, layout, _tp_split(cfg))


def shard_tp(sd: dict[str, torch.Tensor], layout: Layout, tp_rank: int, tp_size: int,
             cfg: ModelConfig | None = None) -> dict[str, torch.Tensor]:
    """:func:`t1async.learner.megatron.families.convert.shard_tp` with ``cfg``'s family's own rule (see :func:`tp_partition`).

    Raises:
        ValueError: as convert.py's (a rank out of range, a split size that does not divide).
    """
    return convert.shard_tp(sd, layout, tp_rank, tp_size, _tp_split(cfg))


def merge_tp(parts: list[dict[str, torch.Tensor]], layout: Layout,
             cfg: ModelConfig | None = None) -> dict[str, torch.Tensor]:
    """:func:`t1async.learner.megatron.families.convert.merge_tp` with ``cfg``'s family's own rule (see :func:`tp_partition`).

    Raises:
        ValueError: the ranks hold different weight names.
    """
    return convert.merge_tp(parts, layout, _tp_split(cfg))


def family_tp_sizes(cfg: ModelConfig) -> dict[str, int]:
    """The family's own sizes ``learner.megatron.tensor_parallel`` must divide beyond
    :func:`t1async.config.tensor_parallel_sizes` (qwen3_5_moe: its Gated DeltaNet heads, its shared expert's
    width), {} for a family without any."""
    fam = megatron_family(cfg)
    return fam.tp_sizes(cfg) if fam is not None and hasattr(fam, "tp_sizes") else {}
