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
embedding, norms, router, head (t1async/learner/megatron/convert.py):

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
tensors by :func:`join_hf` once every rank's are gathered.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import torch

from t1async.config import ModelConfig
from t1async.models.qwen3_5_moe import Qwen35TextConfig, _l2norm, delta_rule, text_config

__all__ = ["config_fields", "hf_layer_to_megatron", "join_hf", "layer_specs", "megatron_layer_to_hf", "pack_gated_qkv",
           "shim_gated_delta_net", "tp_split", "unpack_gated_qkv"]

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
_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight")
_PER_EXPERT = re.compile(r"(.*\.mlp\.experts\.)(\d+)\.(gate_up_proj|down_proj)")


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


def layer_specs(tc, attention_layer, plain_norm: type, first: int, count: int) -> list:
    """The ModuleSpecs of global layers ``first .. first + count - 1``: ``attention_layer`` (the local
    spec's layer, gated attention, :class:`SdpaAttention`) where megatron's ``get_linear_attention_pattern``
    says 0, the same layer with megatron's GatedDeltaNet as its ``self_attention`` where it says 1.

    Args:
        tc: the TransformerConfig (:func:`config_fields` in it). attention_layer: the full-attention layer spec
            (its norms, zero-centred by ``tc``, are the linear-attention layer's too); plain_norm: GatedDeltaNet's
            ``out_norm``. first, count: this pipeline stage's layers.
    """
    # megatron (deferred on each line: megatron-core is an optional extra; the weight names need none of it)
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import get_linear_attention_pattern
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules  # megatron
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear  # megatron
    from megatron.core.transformer.spec_utils import ModuleSpec  # megatron

    linear = copy.deepcopy(attention_layer)
    linear.submodules.self_attention = ModuleSpec(
        module=GatedDeltaNet,
        submodules=GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear, out_norm=plain_norm,
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
    routed experts under per-expert names ``{src}mlp.experts.{e}.{gate_up_proj,down_proj}`` (:func:`join_hf`
    stacks them). Returns False for a name the family does not know."""
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
    elif (x := _EXPERT.fullmatch(rest)) is not None:
        kind = "gate_up_proj" if x.group(2) == "linear_fc1" else "down_proj"
        out[f"{src}mlp.experts.{e0 + int(x.group(1))}.{kind}"] = w
    else:
        return False
    return True


def _split_in_proj(w: torch.Tensor, c: Qwen35TextConfig) -> list[torch.Tensor]:
    """``in_proj`` rows -> HF (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a)."""
    qk, _, v, _, hv, _ = _sections(c)[0]
    return list(w.split([2 * qk + v, v, hv, hv]))


def join_hf(sd: dict[str, torch.Tensor], c: Qwen35TextConfig) -> dict[str, torch.Tensor]:
    """Every rank's converted weights -> the torch model's names: per-expert ``mlp.experts.{e}.gate_up_proj``
    / ``down_proj`` stacked into ``mlp.experts.gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I].

    Raises:
        ValueError: a layer's experts are not all present (0 .. E-1).
    """
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for k, w in sd.items():
        if (m := _PER_EXPERT.fullmatch(k)) is not None:
            experts.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = w
        else:
            out[k] = w
    for (prefix, kind), per in experts.items():
        if sorted(per) != list(range(c.num_experts)):
            raise ValueError(f"{prefix}{kind}: experts {sorted(per)} gathered, {c.num_experts} expected")
        out[prefix + kind] = torch.stack([per[e] for e in range(c.num_experts)])
    return out


def tp_split(name: str, c: Qwen35TextConfig) -> tuple[int, tuple[int, ...]] | None:
    """How tensor parallelism splits the family's own Megatron weight ``name``: (dim, row sections each split
    on its own over the ranks; () for one section), or None when it is not one of the family's split weights
    (qwen3_moe's rules then apply: ``linear_qkv``, ``linear_proj``, the MLPs, the vocabulary)."""
    in_proj, conv = _sections(c)
    if name.endswith(".self_attention.in_proj.weight"):
        return 0, in_proj
    if name.endswith(".self_attention.conv1d.weight"):
        return 0, conv
    if name.endswith((".self_attention.A_log", ".self_attention.dt_bias")):
        return 0, ()
    if name.endswith(".self_attention.out_proj.weight"):
        return 1, ()
    return None


def tp_sizes(cfg: ModelConfig) -> dict[str, int]:
    """The family's sizes ``learner.megatron.tensor_parallel`` must also divide: the linear-attention key and
    value heads (megatron's TransformerConfig asserts it) and the shared expert's width."""
    c = text_config(cfg)
    return {"linear_num_key_heads": c.linear_num_key_heads, "linear_num_value_heads": c.linear_num_value_heads,
            "shared_expert_intermediate_size": c.shared_expert_intermediate_size}
