"""Qwen3.5-MoE (``model_type`` qwen3_5_moe) on the megatron learner, from megatron-core 0.16.1's own modules:
the TransformerConfig fields, the per-layer spec, the HF <-> Megatron weight names and the tensor-parallel
split of the family's weights, and the CPU stand-in for the Gated DeltaNet kernels.

What megatron-core builds (facts read from its 0.16.1 sources):

- ``linear_attention`` layers: ``megatron.core.ssm.gated_delta_net.GatedDeltaNet`` (config
  ``experimental_attention_variant='gated_delta_net'``, ``linear_conv_kernel_dim``, ``linear_{key,value}_head_dim``,
  ``linear_num_{key,value}_heads``), its ``in_proj`` a ``ColumnParallelLinear`` emitting ``[q, k, v, z, b, a]``,
  ``conv1d`` depthwise over ``[q, k, v]``, ``A_log``, ``dt_bias``, ``out_norm`` and a ``RowParallelLinear``
  ``out_proj``. Which layer is which comes from megatron's ``get_linear_attention_pattern`` over
  ``linear_attention_freq`` = the config's ``layer_types`` as a list (1: linear, 0: full attention).
- ``full_attention`` layers: megatron's ``SelfAttention`` with ``attention_output_gate`` (``linear_qkv`` emits per
  query group ``[q heads; gate heads; k; v]``, the context is multiplied by ``sigmoid(gate)``), q/k norms, RoPE on
  the first ``partial_rotary_factor`` of each head (GPTModel's ``rotary_percent``), t1async's
  :class:`~t1async.learner.megatron.model.SdpaAttention` as core attention.
- norms: ``layernorm_zero_centered_gamma`` (``x_hat * (1 + w)``) for the residual-stream and q/k norms; the Gated
  DeltaNet output norm is a plain RMSNorm (transformers' ``Qwen3_5MoeRMSNormGated``: ``w * x_hat``).
- MoE in every layer: the softmax router and ``SequentialMLP`` experts of the qwen3_moe spec, plus megatron's
  ``SharedExpertMLP`` (``moe_shared_expert_intermediate_size``) with ``moe_shared_expert_gate``
  (``sigmoid(x gate_weight^T)`` times its output).

Not expressible as megatron-core 0.16.1 has it, and what is built instead (exact):

- ``get_transformer_block_with_experimental_attention_variant_spec`` asserts ``transformer_impl ==
  'transformer_engine'`` (megatron/core/models/gpt/experimental_attention_variant_module_specs.py:356,
  ``_get_backend_spec_provider``), and its Gated DeltaNet spec fuses the input norm into ``in_proj``
  (``column_parallel_layer_norm_linear``, a TE module). :func:`layer_specs` builds the same layers from the local
  spec's modules: the input norm as its own module, ``in_proj`` a plain ``ColumnParallelLinear``.
- ``WrappedTorchNorm`` (the local spec's norm) asserts ``not layernorm_zero_centered_gamma``
  (megatron/core/transformer/torch_norm.py:27); t1async's :class:`~t1async.learner.megatron.model.Norm` computes the
  zero-centred RMSNorm itself, as transformers' Qwen3.5 norm does (float32, then cast). With the TE spec and that
  flag, megatron would make ``out_norm`` zero-centred too, unlike the checkpoint's; here it stays plain.

On CPU (no CUDA): ``GatedDeltaNet.__init__`` raises ImportError without flash-linear-attention
(megatron/core/ssm/gated_delta_net.py:103) and its forward calls fla's ``chunk_gated_delta_rule`` and ``l2norm``
(triton). :func:`shim_gated_delta_net` (called by :func:`t1async.learner.megatron.model.init_megatron`, only when
CUDA is absent) puts :func:`t1async.models.qwen3_5_moe.delta_rule`, the torch model's own chunkwise gated delta rule,
behind fla's interface; ``causal_conv1d`` is already optional there (megatron falls back to ``nn.Conv1d``).
GatedDeltaNet's and attention's ``jit_fuser`` methods (``torch.compile`` in megatron-core 0.16.1, which on CPU
compiles C++ per shape) run uncompiled there. On a GPU nothing is shimmed: fla's kernels run.

HF <-> Megatron names of layer i (``model.layers.{i}.`` / ``decoder.layers.{i - pp_offset}.``), beyond qwen3_moe's
embedding, norms, router, head (t1async/learner/megatron/families/convert.py):

==============================================  ================================================================
HF (transformers ``Qwen3_5MoeForCausalLM``)     Megatron
==============================================  ================================================================
linear_attn.in_proj_{qkv,z,b,a}.weight          self_attention.in_proj.weight = cat(qkv, z, b, a) on rows
linear_attn.conv1d.weight                       self_attention.conv1d.weight
linear_attn.{A_log,dt_bias}                     self_attention.{A_log,dt_bias}
linear_attn.norm.weight                         self_attention.out_norm.weight
linear_attn.out_proj.weight                     self_attention.out_proj.weight
self_attn.q_proj.weight [nh 2hd, H]             self_attention.linear_qkv.weight, per query group g:
  (per head: hd query rows, hd gate rows)       [q heads of g; gate heads of g; k_g; v_g] (:func:`pack_gated_qkv`)
self_attn.{k,v}_proj.weight                     (in linear_qkv)
mlp.experts.gate_up_proj [E, 2I, H]             mlp.experts.local_experts.{e - ep_rank E/EP}.linear_fc1.weight
mlp.experts.down_proj [E, H, I]                 mlp.experts.local_experts.{...}.linear_fc2.weight
mlp.shared_expert.{gate,up}_proj.weight         mlp.shared_experts.linear_fc1.weight = cat(gate, up) on rows
mlp.shared_expert.down_proj.weight              mlp.shared_experts.linear_fc2.weight
mlp.shared_expert_gate.weight [1, H]            mlp.shared_experts.gate_weight
==============================================  ================================================================

Tensor parallelism (megatron's column/row-parallel layers and GatedDeltaNet's ``sharded_state_dict``): ``in_proj``
splits each of its six sections over the ranks (rank r: ``[q_r, k_r, v_r, z_r, b_r, a_r]``), ``conv1d`` each of
``[q, k, v]``, ``A_log`` and ``dt_bias`` by value head, ``out_proj`` by columns; the gated ``linear_qkv`` by query
groups as qwen3_moe's. Routed experts are written per rank under per-expert names and fused back into the 3D
tensors by :func:`from_converter` once every rank's are gathered.

Registered in t1async/learner/megatron/families/ (``MEGATRON_FAMILIES``): :func:`config_overrides`,
:func:`gpt_kwargs`, :func:`block_spec`, :func:`moe_layer_pattern`, :func:`hf_to_megatron` /
:func:`megatron_to_hf`, :func:`to_converter` / :func:`from_converter`, :func:`checkpoint_state`, :func:`tp_split`
and :func:`tp_sizes`.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch

from t1async.config import ModelConfig
from t1async.learner.megatron.families import convert
from t1async.learner.megatron.families.convert import POLICY, Layout, TpSplit
from t1async.models.families import fuse_experts, unfuse_experts
from t1async.models.qwen3_5_moe import Qwen35TextConfig, _l2norm, delta_rule, text_config

__all__ = ["block_spec", "checkpoint_state", "config_fields", "config_overrides", "from_converter", "gpt_kwargs",
           "hf_layer_to_megatron", "hf_to_megatron", "layer_specs", "megatron_layer_to_hf", "megatron_to_hf",
           "moe_layer_pattern", "pack_gated_qkv", "shim_gated_delta_net", "to_converter", "tp_sizes", "tp_split",
           "unpack_gated_qkv"]

_SAME = {  # per-layer names that only change their prefix (HF suffix -> Megatron suffix)
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "mlp.gate.weight": "mlp.router.weight",
    "mlp.shared_expert.down_proj.weight": "mlp.shared_experts.linear_fc2.weight",
    "mlp.shared_expert_gate.weight": "mlp.shared_experts.gate_weight",
    "linear_attn.conv1d.weight": "self_attention.conv1d.weight",
    "linear_attn.A_log": "self_attention.A_log",
    "linear_attn.dt_bias": "self_attention.dt_bias",
    "linear_attn.norm.weight": "self_attention.out_norm.weight",
    "linear_attn.out_proj.weight": "self_attention.out_proj.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
}
_BACK = {b: a for a, b in _SAME.items()}
_IN_PROJ = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")


# ----------------------------------------------------------------------------- megatron-core config and spec


def config_fields(cfg: ModelConfig) -> dict[str, Any]:
    """The TransformerConfig fields of the family (added to / replacing the qwen3_moe ones of
    :func:`t1async.learner.megatron.model.transformer_config`), from the text config of ``cfg``."""
    c = text_config(cfg)
    return dict(
        num_attention_heads=c.num_attention_heads, num_query_groups=c.num_key_value_heads, kv_channels=c.head_dim,
        ffn_hidden_size=c.moe_intermediate_size, moe_ffn_hidden_size=c.moe_intermediate_size,
        moe_router_pre_softmax=False,  # top-k renormalised (Qwen3.5 always renormalises)
        moe_shared_expert_intermediate_size=c.shared_expert_intermediate_size, moe_shared_expert_gate=True,
        layernorm_epsilon=c.rms_norm_eps, layernorm_zero_centered_gamma=True, attention_output_gate=True,
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=[int(t == "linear_attention") for t in c.layer_types],
        linear_conv_kernel_dim=c.linear_conv_kernel_dim, linear_key_head_dim=c.linear_key_head_dim,
        linear_value_head_dim=c.linear_value_head_dim, linear_num_key_heads=c.linear_num_key_heads,
        linear_num_value_heads=c.linear_num_value_heads)


def rotary_percent(cfg: ModelConfig) -> float:
    """GPTModel's ``rotary_percent``: the rotated share of each head, as the torch model rounds it
    (``int(head_dim * partial_rotary_factor)`` made even, over ``head_dim``)."""
    c = text_config(cfg)
    return (int(c.head_dim * c.partial_rotary_factor) // 2 * 2) / c.head_dim


def config_overrides(cfg: ModelConfig) -> dict[str, Any]:
    """The registry's name for :func:`config_fields` (t1async/learner/megatron/families/).

    Raises:
        ValueError: a config the torch model's :func:`~t1async.models.qwen3_5_moe.text_config` refuses.
    """
    return config_fields(cfg)


def gpt_kwargs(cfg: ModelConfig) -> dict[str, Any]:
    """GPTModel's keyword arguments: ``rotary_percent`` (:func:`rotary_percent`) and the text config's
    ``rope_theta`` as ``rotary_base``."""
    return {"rotary_percent": rotary_percent(cfg), "rotary_base": text_config(cfg).rope_theta}


def moe_layer_pattern(cfg: ModelConfig) -> list[int]:
    """Every decoder layer holds an MoE block (1 per layer)."""
    return [1] * cfg.num_hidden_layers


def block_spec(tc, pp_rank: int):
    """The decoder block spec of pipeline stage ``pp_rank``: :func:`layer_specs` of its layers over the local
    spec's layer (``get_gpt_layer_local_spec``). The caller swaps in its core attention, its norms and
    GatedDeltaNet's plain ``out_norm`` (left None here: t1async/learner/megatron/model.py ``build_gpt``)."""
    # megatron (deferred on each line: megatron-core is an optional extra; the weight names need none of it)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules  # megatron

    layer = get_gpt_layer_local_spec(num_experts=tc.num_moe_experts, moe_grouped_gemm=False, qk_layernorm=True,
                                     normalization="RMSNorm")
    count = tc.num_layers // tc.pipeline_model_parallel_size
    return TransformerBlockSubmodules(layer_specs=layer_specs(tc, layer, pp_rank * count, count))


def layer_specs(tc, attention_layer, first: int, count: int) -> list:
    """The ModuleSpecs of global layers ``first .. first + count - 1``: ``attention_layer`` (the local
    spec's layer, gated attention, :class:`SdpaAttention`) where megatron's ``get_linear_attention_pattern``
    says 0, the same layer with megatron's GatedDeltaNet as its ``self_attention`` where it says 1.

    Args:
        tc: the TransformerConfig (:func:`config_fields` in it). attention_layer: the full-attention layer spec
            (its norms, zero-centred by ``tc``, are the linear-attention layer's too). first, count: this pipeline
            stage's layers. GatedDeltaNet's ``out_norm`` is left None for the caller's plain RMSNorm.
    """
    # megatron (deferred on each line: megatron-core is an optional extra; the weight names need none of it)
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import get_linear_attention_pattern
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules  # megatron
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear  # megatron
    from megatron.core.transformer.spec_utils import ModuleSpec  # megatron

    linear = copy.deepcopy(attention_layer)
    linear.submodules.self_attention = ModuleSpec(
        module=GatedDeltaNet,
        submodules=GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear, out_norm=None,
                                           out_proj=RowParallelLinear))
    pattern = get_linear_attention_pattern(tc)
    return [linear if pattern[i] else attention_layer for i in range(first, first + count)]


_SHIMMED: dict[str, Any] = {}


def shim_gated_delta_net() -> None:
    """CPU stand-in for flash-linear-attention in megatron-core's GatedDeltaNet (idempotent; see the module
    docstring): fla's ``l2norm`` and ``chunk_gated_delta_rule`` become :func:`_fla_l2norm` and
    :func:`chunk_gated_delta_rule`, and the ``jit_fuser`` (``torch.compile``) methods of GatedDeltaNet and
    Attention run as plain functions. Nothing is changed when fla is installed."""
    # megatron (deferred: megatron-core is an optional extra; the weight names need none of it)
    from megatron.core.ssm import gated_delta_net as gdn
    from megatron.core.transformer.attention import Attention  # megatron

    if gdn.HAVE_FLA and not _SHIMMED:  # the real kernels are installed
        return
    gdn.HAVE_FLA = True
    gdn.l2norm, gdn.chunk_gated_delta_rule = _fla_l2norm, chunk_gated_delta_rule
    for cls, name in ((gdn.GatedDeltaNet, "_apply_gated_norm"), (Attention, "_apply_output_gate")):
        f = cls.__dict__[name]
        _SHIMMED[name] = getattr(f, "_torchdynamo_orig_callable", f)
        setattr(cls, name, _SHIMMED[name])


def _fla_l2norm(x: torch.Tensor, eps: float = 1e-6, output_dtype: torch.dtype | None = None) -> torch.Tensor:
    """fla's ``l2norm`` over the last dim (``x / sqrt(sum x^2 + eps)`` in float32, cast back), through the torch
    model's own ``_l2norm``."""
    return _l2norm(x.float(), eps).to(output_dtype or x.dtype)


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           scale: float | None = None, initial_state: torch.Tensor | None = None,
                           output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False, **_: Any):
    """fla's ``chunk_gated_delta_rule`` interface over :func:`t1async.models.qwen3_5_moe.delta_rule`.

    Args:
        q, k: [B, T, H, Dk]; v: [B, T, H, Dv]; g: [B, T, H] log decay; beta: [B, T, H]; scale: of q
            (``Dk ** -0.5`` when None); initial_state: [B, H, Dk, Dv] or None.

    Returns:
        (o [B, T, H, Dv] in q's dtype, the final state [B, H, Dk, Dv] float32 when ``output_final_state`` else None).
    """
    dt = q.dtype
    if use_qk_l2norm_in_kernel:
        q, k = _fla_l2norm(q), _fla_l2norm(k)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q, k, v = (x.transpose(1, 2).float() for x in (q, k, v))
    o, state = delta_rule(q * scale, k, v, g.transpose(1, 2).float(), beta.transpose(1, 2).float(),
                          None if initial_state is None else initial_state.float())
    return o.transpose(1, 2).to(dt), (state if output_final_state else None)


# ----------------------------------------------------------------------------- weights


def pack_gated_qkv(q_proj: torch.Tensor, k: torch.Tensor, v: torch.Tensor, c: Qwen35TextConfig) -> torch.Tensor:
    """HF gated attention's projections -> megatron's ``linear_qkv`` with ``attention_output_gate``.

    Args:
        q_proj: [nh * 2 hd, H], per head hd query rows then hd gate rows; k, v: [nkv * hd, H].

    Returns:
        [(2 nh + 2 nkv) hd, H]: per query group g, its nh/nkv query heads, their gate heads, k_g, v_g
        (megatron/core/transformer/attention.py ``get_query_key_value_tensors`` with ``output_gate``).
    """
    nkv, hd, H = c.num_key_value_heads, c.head_dim, q_proj.shape[1]
    per = c.num_attention_heads // nkv
    qg = q_proj.reshape(nkv, per, 2, hd, H)
    return torch.cat([qg[:, :, 0].reshape(nkv, per * hd, H), qg[:, :, 1].reshape(nkv, per * hd, H),
                      k.reshape(nkv, hd, H), v.reshape(nkv, hd, H)], 1).reshape(-1, H)


def unpack_gated_qkv(w: torch.Tensor, c: Qwen35TextConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_gated_qkv`: (q_proj [nh 2hd, H], k [nkv hd, H], v [nkv hd, H])."""
    nkv, hd, H = c.num_key_value_heads, c.head_dim, w.shape[1]
    per = c.num_attention_heads // nkv
    q, gate, k, v = w.reshape(nkv, (2 * per + 2) * hd, H).split([per * hd, per * hd, hd, hd], 1)
    q_proj = torch.stack([q.reshape(nkv, per, hd, H), gate.reshape(nkv, per, hd, H)], 2).reshape(-1, H)
    return q_proj, k.reshape(-1, H), v.reshape(-1, H)


def _sections(c: Qwen35TextConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Row sections of ``in_proj`` ([q, k, v, z, b, a]) and of ``conv1d`` ([q, k, v])."""
    qk, v, hv = c.linear_num_key_heads * c.linear_key_head_dim, c.linear_num_value_heads * c.linear_value_head_dim, \
        c.linear_num_value_heads
    return (qk, qk, v, v, hv, hv), (qk, qk, v)


def hf_layer_to_megatron(sd: dict[str, torch.Tensor], src: str, dst: str, c: Qwen35TextConfig, e0: int, n_exp: int,
                         out: dict[str, torch.Tensor]) -> None:
    """Layer ``src`` (HF prefix ``...layers.{i}.``) of ``sd`` into ``out`` under Megatron prefix ``dst``, with
    experts ``e0 .. e0 + n_exp - 1`` as local experts 0.. (fused HF experts sliced, per-expert names accepted).

    Raises:
        KeyError: a weight of the layer is missing.
    """
    linear = src + "linear_attn.in_proj_qkv.weight" in sd
    for a, b in _SAME.items():
        if a.startswith("linear_attn.") and not linear or a.startswith("self_attn.") and linear:
            continue
        out[dst + b] = sd[src + a]
    if linear:
        out[dst + "self_attention.in_proj.weight"] = torch.cat([sd[f"{src}linear_attn.{n}.weight"] for n in _IN_PROJ])
    else:
        out[dst + "self_attention.linear_qkv.weight"] = pack_gated_qkv(
            sd[src + "self_attn.q_proj.weight"], sd[src + "self_attn.k_proj.weight"], sd[src + "self_attn.v_proj.weight"],
            c)
    out[dst + "mlp.shared_experts.linear_fc1.weight"] = torch.cat(
        [sd[src + "mlp.shared_expert.gate_proj.weight"], sd[src + "mlp.shared_expert.up_proj.weight"]])
    fused = src + "mlp.experts.gate_up_proj" in sd
    for local in range(n_exp):
        e, x = e0 + local, f"{dst}mlp.experts.local_experts.{local}."
        if fused:
            out[x + "linear_fc1.weight"] = sd[src + "mlp.experts.gate_up_proj"][e]
            out[x + "linear_fc2.weight"] = sd[src + "mlp.experts.down_proj"][e]
        else:  # one tensor per expert (a public checkpoint's layout)
            p = f"{src}mlp.experts.{e}."
            out[x + "linear_fc1.weight"] = torch.cat([sd[p + "gate_proj.weight"], sd[p + "up_proj.weight"]])
            out[x + "linear_fc2.weight"] = sd[p + "down_proj.weight"]


def megatron_layer_to_hf(rest: str, w: torch.Tensor, src: str, c: Qwen35TextConfig, e0: int,
                         out: dict[str, torch.Tensor]) -> bool:
    """Megatron weight ``rest`` (its name after ``decoder.layers.{j}.``) of HF layer prefix ``src`` into ``out``;
    routed experts under per-expert names ``{src}mlp.experts.{e}.{gate,up,down}_proj.weight`` (views;
    :func:`from_converter` stacks them). Returns False for a name the family does not know."""
    if rest in _BACK:
        out[src + _BACK[rest]] = w
    elif rest == "self_attention.in_proj.weight":
        for n, part in zip(_IN_PROJ, _split_in_proj(w, c)):
            out[f"{src}linear_attn.{n}.weight"] = part
    elif rest == "self_attention.linear_qkv.weight":
        q, k, v = unpack_gated_qkv(w, c)
        out[src + "self_attn.q_proj.weight"], out[src + "self_attn.k_proj.weight"] = q, k
        out[src + "self_attn.v_proj.weight"] = v
    elif rest == "mlp.shared_experts.linear_fc1.weight":
        out[src + "mlp.shared_expert.gate_proj.weight"], out[src + "mlp.shared_expert.up_proj.weight"] = w.chunk(2)
    else:
        return convert.routed_expert_to_hf(rest, w, src, e0, out)
    return True


def _split_in_proj(w: torch.Tensor, c: Qwen35TextConfig) -> list[torch.Tensor]:
    """``in_proj`` rows -> HF (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a)."""
    qk, _, v, _, hv, _ = _sections(c)[0]
    return list(w.split([2 * qk + v, v, hv, hv]))


def to_converter(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The torch model's state dict (fused experts) -> one tensor per expert (views), the names expert parallelism
    deals out by expert and :func:`megatron_layer_to_hf` writes (:func:`t1async.models.families.unfuse_experts`)."""
    return dict(unfuse_experts(sd.items()))


def from_converter(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`to_converter`: every rank's converted weights -> the torch model's names, per-expert
    tensors stacked into ``mlp.experts.gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I]
    (:func:`t1async.models.families.fuse_experts`).

    Raises:
        ValueError: a layer's experts are not numbered 0 .. E-1.
    """
    return fuse_experts(sd)


def checkpoint_state(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The torch model's state dict as its checkpoint holds it without a source folder: as it is (fused experts,
    what the torch learner's ``save_model`` writes of ``Qwen3_5MoeForCausalLM``)."""
    return sd


def hf_to_megatron(sd: dict[str, torch.Tensor], cfg: ModelConfig, layout: Layout = POLICY, *, ep_rank: int = 0,
                   ep_size: int = 1, pp_rank: int = 0, pp_size: int = 1) -> dict[str, torch.Tensor]:
    """:func:`t1async.learner.megatron.families.convert.hf_to_megatron` with this family's layers
    (:func:`hf_layer_to_megatron`: fused or per-expert routed experts alike).

    Raises:
        KeyError: a weight the mapping needs is missing. ValueError: sizes that do not divide, a tied head that
            differs from the embedding, a config :func:`~t1async.models.qwen3_5_moe.text_config` refuses.
    """
    c = text_config(cfg)
    return convert.hf_to_megatron(sd, cfg, layout, ep_rank=ep_rank, ep_size=ep_size, pp_rank=pp_rank, pp_size=pp_size,
                                  layer=lambda hf, src, dst, e0, n, out: hf_layer_to_megatron(hf, src, dst, c, e0, n, out))


def megatron_to_hf(sd: dict[str, torch.Tensor], cfg: ModelConfig, layout: Layout = POLICY, *, ep_rank: int = 0,
                   ep_size: int = 1, pp_rank: int = 0, pp_size: int = 1) -> dict[str, torch.Tensor]:
    """Inverse of :func:`hf_to_megatron` (:func:`megatron_layer_to_hf` per layer weight): the HF tensors of one
    (expert, pipeline) rank, per-expert names for the routed experts (:func:`from_converter` stacks the union).

    Raises:
        KeyError: a Megatron name this mapping does not know.
    """
    c = text_config(cfg)
    return convert.megatron_to_hf(sd, cfg, layout, ep_rank=ep_rank, ep_size=ep_size, pp_rank=pp_rank, pp_size=pp_size,
                                  layer=lambda rest, w, src, e0, out: megatron_layer_to_hf(rest, w, src, c, e0, out))


def tp_split(cfg: ModelConfig) -> TpSplit:
    """How tensor parallelism splits the family's own Megatron weights: a function of a weight name giving
    (dim, row sections each split on their own over the ranks, or False for one section) as
    :func:`t1async.learner.megatron.families.convert.tp_partition` returns it, or None when the name is not one of the
    family's split weights (qwen3_moe's rules then apply: ``linear_qkv``, ``linear_proj``, the MLPs, the
    vocabulary)."""
    return functools.partial(_tp_split, sections=_sections(text_config(cfg)))


def _tp_split(name: str, sections: tuple[tuple[int, ...], tuple[int, ...]]):
    in_proj, conv = sections
    if name.endswith(".self_attention.in_proj.weight"):
        return 0, in_proj
    if name.endswith(".self_attention.conv1d.weight"):
        return 0, conv
    if name.endswith((".self_attention.A_log", ".self_attention.dt_bias")):
        return 0, False
    if name.endswith(".self_attention.out_proj.weight"):
        return 1, False
    return None


def tp_sizes(cfg: ModelConfig) -> dict[str, int]:
    """The family's sizes ``learner.megatron.tensor_parallel`` must also divide: the linear-attention key and
    value heads (megatron's TransformerConfig asserts it) and the shared expert's width."""
    c = text_config(cfg)
    return {"linear_num_key_heads": c.linear_num_key_heads, "linear_num_value_heads": c.linear_num_value_heads,
            "shared_expert_intermediate_size": c.shared_expert_intermediate_size}
