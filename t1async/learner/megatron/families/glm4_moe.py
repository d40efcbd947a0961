"""GLM-4.5 / 4.6 (``glm4_moe``) on the megatron learner: megatron-core 0.16.1's own modules, configured as
transformers' ``Glm4MoeForCausalLM`` computes (the torch learner's model, t1async/models/hf_generic.py).

Config mapping (transformers ``Glm4MoeConfig`` -> megatron-core ``TransformerConfig`` / ``GPTModel``), read from
megatron-core 0.16.1's sources:

========================================  ==============================================================
GLM (config.json)                         megatron-core
========================================  ==============================================================
first_k_dense_replace k                   ``moe_layer_freq`` = [0] * k + [1] * (L - k): dense MLP layers
                                          first (``get_gpt_decoder_block_spec``, local spec)
intermediate_size                         ``ffn_hidden_size`` (the dense layers' SwiGLU width)
moe_intermediate_size                     ``moe_ffn_hidden_size``
n_shared_experts                          ``moe_shared_expert_intermediate_size`` = n_shared_experts x
                                          moe_intermediate_size, no gate (``SharedExpertMLP``)
sigmoid router, e_score_correction_bias   ``moe_router_score_function='sigmoid'``,
                                          ``moe_router_enable_expert_bias`` (the router's ``expert_bias``
                                          buffer, float32)
n_group, topk_group                       ``moe_router_num_groups``, ``moe_router_group_topk`` (left unset
                                          when they select every expert: n_group 1 or topk_group = n_group)
routed_scaling_factor                     ``moe_router_topk_scaling_factor``
attention_bias                            ``add_qkv_bias`` (q, k, v biases; o_proj has none)
use_qk_norm                               ``qk_layernorm``
partial_rotary_factor                     GPTModel ``rotary_percent`` (rotate-half RoPE on the first
                                          head_dim x factor channels of each head, as transformers)
========================================  ==============================================================

The expert-bias buffer (GLM's aux-loss-free balancing, DeepSeek-V3 technical report section 2.1.2): transformers
keeps it as a buffer (no gradient) and the torch learner never changes it. megatron-core also keeps it as a
buffer (``TopKRouter.expert_bias``, no gradient) and counts tokens per expert in training forwards
(``local_tokens_per_expert``); it moves the bias only in ``finalize_model_grads``
(distributed/finalize_model_grads.py ``_update_router_expert_bias``), which the learner never calls, and
``moe_router_bias_update_rate`` is set to 0 here besides. So both learners keep the checkpoint's bias as it is;
the converter carries it both ways (HF ``mlp.gate.e_score_correction_bias`` <-> ``mlp.router.expert_bias``).

Multi-token prediction (``num_nextn_predict_layers``, checkpoint layers L .. L + n - 1): as on the torch learner
(t1async/models/families.py ``_glm4_convert``) they are not built and not trained; the checkpoint carries them
through from ``model.path`` unchanged (:func:`t1async.models.families.save_model`).

What megatron-core 0.16.1 cannot express, refused in one line by :func:`config_overrides`:

- ``norm_topk_prob: false`` with top-k > 1, or top-k = 1 with it true: its sigmoid routing divides the top-k
  scores by their sum exactly when top-k > 1 (transformer/moe/moe_utils.py:724);
- group-limited routing whose ``num_experts_per_tok // topk_group`` is not 2: it ranks a group by the sum of its
  top ``topk // group_topk`` scores (moe_utils.py:553-555), transformers by its top 2 (modeling_glm4_moe.py:289);
- a ``rope_type`` other than ``default``, an activation other than SiLU.

Weight names (one decoder layer i, Megatron prefix ``decoder.layers.{i - stage offset}.``; the projections,
norms and experts as for qwen3_moe, t1async/learner/megatron/families/convert.py):

=============================================  ==================================================
HF (per-expert checkpoint layout)              Megatron
=============================================  ==================================================
self_attn.{q,k,v}_proj.bias                    self_attention.linear_qkv.bias (the weight's order)
self_attn.{q,k}_norm.weight (use_qk_norm)      self_attention.{q,k}_layernorm.weight
mlp.{gate,up}_proj.weight (i < k)              mlp.linear_fc1.weight = cat(gate, up) on rows
mlp.down_proj.weight (i < k)                   mlp.linear_fc2.weight
mlp.gate.weight                                mlp.router.weight
mlp.gate.e_score_correction_bias               mlp.router.expert_bias (a buffer)
mlp.shared_experts.{gate,up}_proj.weight       mlp.shared_experts.linear_fc1.weight = cat(gate, up)
mlp.shared_experts.down_proj.weight            mlp.shared_experts.linear_fc2.weight
=============================================  ==================================================

The torch model's own names hold the routed experts fused (transformers v5: ``mlp.experts.gate_up_proj``
[E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]); :func:`to_converter` splits them into the per-expert names
(views, no copy) that expert parallelism deals out by expert, :func:`from_converter` stacks them back.
"""

from __future__ import annotations

import functools
import json

import torch

from t1async.config import ModelConfig
from t1async.learner.megatron.families import convert
from t1async.learner.megatron.families.convert import POLICY, Layout, layer_ranges, pack_qkv, unpack_qkv
from t1async.models.families import fuse_experts, unfuse_experts
from t1async.models.hf_generic import config_from_hf

__all__ = ["block_spec", "checkpoint_state", "config_overrides", "from_converter", "gpt_kwargs", "hf_to_megatron",
           "megatron_to_hf", "moe_layer_pattern", "to_converter"]

_ATTN = {  # HF suffix -> Megatron suffix, every layer
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
}
_QK_NORM = {"self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
            "self_attn.k_norm.weight": "self_attention.k_layernorm.weight"}
_MOE = {"mlp.gate.weight": "mlp.router.weight", "mlp.gate.e_score_correction_bias": "mlp.router.expert_bias",
        "mlp.shared_experts.down_proj.weight": "mlp.shared_experts.linear_fc2.weight"}
_DENSE = {"mlp.down_proj.weight": "mlp.linear_fc2.weight"}
_FC1 = {"mlp.": "mlp.linear_fc1.weight", "mlp.shared_experts.": "mlp.shared_experts.linear_fc1.weight"}


_SETTINGS: dict[str, dict] = {}
"""settings() by config.json text (reading a transformers config takes milliseconds; the converter asks per rank)."""


def settings(cfg: ModelConfig) -> dict:
    """GLM's settings the Megatron model needs, from ``cfg.hf_config`` with transformers' defaults filled in (as
    the torch model reads it).

    Raises:
        ValueError: no config.json dict (``model.path`` unset).
    """
    if not cfg.hf_config:
        raise ValueError("glm4_moe on the megatron learner needs model.path (a folder whose config.json is the "
                         "architecture)")
    key = json.dumps(cfg.hf_config, sort_keys=True, default=str)
    if key not in _SETTINGS:
        _SETTINGS[key] = _read(config_from_hf(cfg.hf_config))
    return dict(_SETTINGS[key])


def _read(c) -> dict:
    rope = dict(getattr(c, "rope_parameters", None) or {})
    return {"first_dense": int(c.first_k_dense_replace), "intermediate_size": int(c.intermediate_size),
            "shared": int(c.n_shared_experts or 0), "n_group": int(c.n_group), "topk_group": int(c.topk_group),
            "scaling": float(c.routed_scaling_factor), "norm_topk_prob": bool(c.norm_topk_prob),
            "attention_bias": bool(c.attention_bias), "qk_norm": bool(getattr(c, "use_qk_norm", False)),
            "rotary_percent": float(rope.get("partial_rotary_factor", getattr(c, "partial_rotary_factor", 1.0))),
            "rope_type": rope.get("rope_type", "default"), "act": c.hidden_act}


def moe_layer_pattern(cfg: ModelConfig) -> list[int]:
    """Per decoder layer 1 (MoE) or 0 (dense): megatron-core's ``moe_layer_freq`` list."""
    k = settings(cfg)["first_dense"]
    return [0] * k + [1] * (cfg.num_hidden_layers - k)


def config_overrides(cfg: ModelConfig) -> dict:
    """The ``TransformerConfig`` keyword arguments that make megatron-core's GPT layers GLM's (module docstring).

    Raises:
        ValueError: a GLM setting megatron-core 0.16.1 cannot express exactly (one line: the setting, the
            megatron-core source line, what to do).
    """
    s = settings(cfg)
    K = cfg.num_experts_per_tok
    if (K > 1) != s["norm_topk_prob"]:
        raise ValueError(f"glm4_moe with norm_topk_prob={s['norm_topk_prob']} and num_experts_per_tok={K}: megatron-core "
                         "0.16.1's sigmoid router normalises the top-k weights exactly when top-k > 1 "
                         "(transformer/moe/moe_utils.py:724); use learner.backend=torch for this model")
    grouped = 1 < s["n_group"] and s["topk_group"] < s["n_group"]
    if grouped and K // s["topk_group"] != 2:
        raise ValueError(f"glm4_moe with n_group={s['n_group']}, topk_group={s['topk_group']}, num_experts_per_tok={K}: "
                         "megatron-core 0.16.1 ranks expert groups by their top num_experts_per_tok // topk_group scores "
                         "(transformer/moe/moe_utils.py:553), GLM by its top 2; use learner.backend=torch for this model")
    if s["rope_type"] != "default" or s["act"] != "silu":
        raise ValueError(f"glm4_moe with rope_type={s['rope_type']!r}, hidden_act={s['act']!r}: the megatron learner "
                         "builds the default RoPE and SiLU experts only; use learner.backend=torch for this model")
    return dict(
        ffn_hidden_size=s["intermediate_size"], moe_layer_freq=moe_layer_pattern(cfg),
        moe_shared_expert_intermediate_size=(s["shared"] * cfg.moe_intermediate_size) if s["shared"] else None,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.0,
        moe_router_num_groups=s["n_group"] if grouped else None,
        moe_router_group_topk=s["topk_group"] if grouped else None,
        moe_router_topk_scaling_factor=s["scaling"], moe_router_pre_softmax=False,
        add_qkv_bias=s["attention_bias"], qk_layernorm=s["qk_norm"])


def gpt_kwargs(cfg: ModelConfig) -> dict:
    """The ``GPTModel`` keyword arguments of GLM: ``rotary_percent`` (partial_rotary_factor)."""
    return {"rotary_percent": settings(cfg)["rotary_percent"]}


def block_spec(tc, pp_rank: int):
    """megatron-core's own decoder block spec of this pipeline stage's layers (the local spec, dense layers where
    ``moe_layer_freq`` says 0: ``get_gpt_decoder_block_spec``); the caller swaps in its core attention and norms."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec  # (megatron: deferred, heavy)

    return get_gpt_decoder_block_spec(tc, use_transformer_engine=False, normalization="RMSNorm", pp_rank=pp_rank)


# ----------------------------------------------------------------------------- weights




def to_converter(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The torch model's state dict (fused experts) -> per-expert names (views; everything else as it is)."""
    return dict(unfuse_experts(sd.items()))


def from_converter(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`to_converter`: per-expert tensors stacked into ``gate_up_proj`` [E, 2I, H] (gate rows,
    then up rows) and ``down_proj`` [E, H, I], bit for bit (:func:`t1async.models.families.fuse_experts`); other
    names as they are, in order.

    Raises:
        ValueError: a layer's experts are not numbered 0 .. E-1.
    """
    return fuse_experts(sd)


def checkpoint_state(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The torch model's state dict as its checkpoint holds it without a source folder: one tensor per expert
    (transformers' layout, ``HFMoeForCausalLM.checkpoint_state_dict``), i.e. :func:`to_converter`'s names."""
    return to_converter(sd)


def _pack_bias(sd, src: str, cfg: ModelConfig) -> torch.Tensor:
    q, k, v = (sd[f"{src}self_attn.{p}_proj.bias"][:, None] for p in "qkv")
    return pack_qkv(q, k, v, cfg)[:, 0]


def hf_to_megatron(sd: dict[str, torch.Tensor], cfg: ModelConfig, layout: Layout = POLICY, *, ep_rank: int = 0,
                   ep_size: int = 1, pp_rank: int = 0, pp_size: int = 1) -> dict[str, torch.Tensor]:
    """The Megatron state dict (parameters and the routers' ``expert_bias``) of one (expert, pipeline) rank from a
    full HF state dict in per-expert names (:func:`to_converter`); as
    :func:`t1async.learner.megatron.families.convert.hf_to_megatron` for qwen3_moe, with GLM's dense layers, shared experts,
    qkv biases and expert bias (module docstring).

    Raises:
        KeyError: a weight the mapping needs is missing. ValueError: sizes that do not divide.
    """
    first, n_layers, e0, n_exp = layer_ranges(cfg, ep_rank, ep_size, pp_rank, pp_size)
    s, pattern, t = settings(cfg), moe_layer_pattern(cfg), layout.trunk
    out: dict[str, torch.Tensor] = {}
    if pp_rank == 0:
        out["embedding.word_embeddings.weight"] = sd[f"{t}embed_tokens.weight"]
    for j in range(n_layers):
        i = first + j
        src, dst = f"{t}layers.{i}.", f"decoder.layers.{j}."
        same = {**_ATTN, **(_QK_NORM if s["qk_norm"] else {}), **(_MOE if pattern[i] else _DENSE)}
        if pattern[i] and not s["shared"]:
            same.pop("mlp.shared_experts.down_proj.weight")
        for a, b in same.items():
            out[dst + b] = sd[src + a]
        out[dst + "self_attention.linear_qkv.weight"] = pack_qkv(
            *(sd[f"{src}self_attn.{p}_proj.weight"] for p in "qkv"), cfg)
        if s["attention_bias"]:
            out[dst + "self_attention.linear_qkv.bias"] = _pack_bias(sd, src, cfg)
        # the dense layers' MLP, or the MoE layers' shared experts: SwiGLU [gate; up] rows
        fc1 = [] if pattern[i] and not s["shared"] else ["mlp.shared_experts." if pattern[i] else "mlp."]
        for hf_mlp in fc1:
            out[dst + _FC1[hf_mlp]] = torch.cat([sd[f"{src}{hf_mlp}gate_proj.weight"], sd[f"{src}{hf_mlp}up_proj.weight"]])
        for local in range(n_exp if pattern[i] else 0):
            e = f"{src}mlp.experts.{e0 + local}."
            x = f"{dst}mlp.experts.local_experts.{local}."
            out[x + "linear_fc1.weight"] = torch.cat([sd[e + "gate_proj.weight"], sd[e + "up_proj.weight"]])
            out[x + "linear_fc2.weight"] = sd[e + "down_proj.weight"]
    if pp_rank == pp_size - 1:
        out["decoder.final_layernorm.weight"] = sd[f"{t}norm.weight"]
        tied = layout is POLICY and cfg.tie_word_embeddings
        for a, b in layout.head.items():
            if not tied:
                out[b] = sd[a]
    return out


def _layer_to_hf(cfg: ModelConfig, rest: str, w: torch.Tensor, src: str, e0: int, out: dict[str, torch.Tensor]) -> bool:
    """Megatron weight ``rest`` (its name after ``decoder.layers.{j}.``) of HF layer prefix ``src`` into ``out``
    (convert.py's :data:`LayerToHf` for this family; experts under per-expert names). False: a name it does not know."""
    back = {b: a for a, b in {**_ATTN, **_QK_NORM, **_MOE, **_DENSE}.items()}
    fc1 = {b: a for a, b in _FC1.items()}
    if rest in back:
        out[src + back[rest]] = w
    elif rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = rest.rsplit(".", 1)[1]
        parts = unpack_qkv(w if kind == "weight" else w[:, None], cfg)
        for p, x in zip("qkv", parts):
            out[f"{src}self_attn.{p}_proj.{kind}"] = x if kind == "weight" else x[:, 0]
    elif rest in fc1:
        out[f"{src}{fc1[rest]}gate_proj.weight"], out[f"{src}{fc1[rest]}up_proj.weight"] = w.chunk(2)
    else:
        return convert.routed_expert_to_hf(rest, w, src, e0, out)
    return True


def megatron_to_hf(sd: dict[str, torch.Tensor], cfg: ModelConfig, layout: Layout = POLICY, *, ep_rank: int = 0,
                   ep_size: int = 1, pp_rank: int = 0, pp_size: int = 1) -> dict[str, torch.Tensor]:
    """Inverse of :func:`hf_to_megatron`: the HF tensors (per-expert names) one (expert, pipeline) rank holds,
    views into ``sd``; the union over every rank is the full HF state dict, bit for bit (convert.py's loop
    with this family's layers, :func:`_layer_to_hf`).

    Raises:
        KeyError: a Megatron name this mapping does not know.
    """
    return convert.megatron_to_hf(sd, cfg, layout, ep_rank=ep_rank, ep_size=ep_size, pp_rank=pp_rank,
                                  pp_size=pp_size, layer=functools.partial(_layer_to_hf, cfg))
