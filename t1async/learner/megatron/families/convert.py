"""Hugging Face Qwen3-MoE <-> Megatron-core GPTModel: config and weight layouts (pure torch).

Checkpoints and the weight broadcast always use the Hugging Face names of t1async/models/model.py
(``model.layers.{i}.mlp.experts.{e}.gate_proj.weight`` ...); the Megatron learner backend
(t1async/learner/megatron/backend.py) keeps its weights in Megatron's layout and converts at the edges.
This module needs no megatron-core: the layouts are plain tensor reshuffles, tested bitwise.

The table below is qwen3_moe's. Other families (t1async/learner/megatron/families/: glm4_moe, qwen3_5_moe) map
their decoder layers with their own modules, built on the helpers here, and qwen3_5_moe adds its tensor-parallel
rules (``split`` of :func:`tp_partition`); the registry there dispatches by ``cfg.model_type``.

Mapping (one decoder layer i, global index; written from megatron-core 0.16.1's local layer spec,
``get_gpt_layer_local_spec``, and the HF ``Qwen3MoeForCausalLM`` module tree):

=========================================  =====================================================
HF                                         Megatron (``decoder.layers.{i - pp_offset}.`` prefix)
=========================================  =====================================================
model.embed_tokens.weight                  embedding.word_embeddings.weight (first stage)
input_layernorm.weight                     input_layernorm.weight
self_attn.{q,k,v}_proj.weight              self_attention.linear_qkv.weight, per query group g:
                                           rows [q heads of g; k_g; v_g] (see :func:`pack_qkv`)
self_attn.o_proj.weight                    self_attention.linear_proj.weight
self_attn.{q,k}_norm.weight                self_attention.{q,k}_layernorm.weight
post_attention_layernorm.weight            pre_mlp_layernorm.weight
mlp.gate.weight                            mlp.router.weight
mlp.experts.{e}.{gate,up}_proj.weight      mlp.experts.local_experts.{e - ep_rank E/EP}.linear_fc1
                                           .weight = cat(gate, up) on rows
mlp.experts.{e}.down_proj.weight           mlp.experts.local_experts.{...}.linear_fc2.weight
model.norm.weight                          decoder.final_layernorm.weight (last stage)
lm_head.weight                             output_layer.weight (last stage); none when tied
                                           (the head reads embedding.word_embeddings.weight)
=========================================  =====================================================

Parallel ranks: with expert parallelism EP a rank holds experts [ep_rank E/EP, (ep_rank+1) E/EP)
as local ids 0..E/EP-1; with pipeline parallelism PP a rank holds layers
[pp_rank L/PP, (pp_rank+1) L/PP) as local indices 0..L/PP-1. Tensor parallelism TP splits a
rank's Megatron tensors further (:func:`shard_tp`, :func:`merge_tp`, applied after
:func:`hf_to_megatron` and before :func:`megatron_to_hf`), as megatron-core's column- and
row-parallel layers hold them: ``linear_qkv`` and the vocabulary (``word_embeddings``, the
policy's ``output_layer``) by rows (rank r: query groups [r G/TP, (r+1) G/TP), as the fused layout
is group-major), ``linear_proj`` and expert ``linear_fc2`` by columns, expert ``linear_fc1`` by
rows of gate and of up separately (rank r: [gate_r; up_r], the halves Megatron's SwiGLU splits
locally). Norms, routers and the critic's head are whole on every TP rank.

The critic (t1async/learner/torch_backend.py ``ValueModel``) is the same trunk under ``backbone.`` plus a
scalar ``head.weight`` [1, H] / ``head.bias`` [1]; in Megatron it is a GPTModel whose
``output_layer`` is that head (``output_layer.weight`` / ``output_layer.bias``).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from t1async.config import ModelConfig

__all__ = ["CRITIC", "POLICY", "Layout", "hf_to_megatron", "layer_ranges", "megatron_to_hf", "merge_tp", "pack_qkv",
           "shard_tp", "LayerToHf", "LayerToMegatron", "TpSplit", "tp_partition", "unpack_qkv"]


class Layout:
    """Where a model's trunk and head sit in its HF state dict.

    Args:
        trunk: prefix of the HF trunk (``model.`` for the policy, ``backbone.`` for the critic).
        head: HF head names -> Megatron names (``lm_head.weight`` -> ``output_layer.weight``).
    """

    def __init__(self, trunk: str, head: dict[str, str]):
        self.trunk, self.head = trunk, head


POLICY = Layout("model.", {"lm_head.weight": "output_layer.weight"})
CRITIC = Layout("backbone.", {"head.weight": "output_layer.weight", "head.bias": "output_layer.bias"})

# per-layer names that only change their prefix (HF suffix -> Megatron suffix)
_SAME = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "mlp.gate.weight": "mlp.router.weight",
}


def pack_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """HF q/k/v projections -> Megatron's fused ``linear_qkv`` weight.

    Args:
        q: [nh * hd, H]; k, v: [nkv * hd, H] (nh query heads, nkv key/value heads = query groups).

    Returns:
        [(nh + 2 nkv) * hd, H]: for each query group g in order, the rows of its nh/nkv query
        heads, then k head g, then v head g (Megatron splits the projection per group this way).
    """
    nkv, hd = cfg.num_key_value_heads, cfg.head_dim
    per = cfg.num_attention_heads // nkv
    H = q.shape[1]
    q = q.reshape(nkv, per * hd, H)
    return torch.cat([q, k.reshape(nkv, hd, H), v.reshape(nkv, hd, H)], dim=1).reshape(-1, H)


def unpack_qkv(qkv: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_qkv`: returns (q [nh hd, H], k [nkv hd, H], v [nkv hd, H])."""
    nkv, hd = cfg.num_key_value_heads, cfg.head_dim
    per = cfg.num_attention_heads // nkv
    H = qkv.shape[1]
    g = qkv.reshape(nkv, (per + 2) * hd, H)
    q, k, v = g.split([per * hd, hd, hd], dim=1)
    return q.reshape(-1, H), k.reshape(-1, H), v.reshape(-1, H)


def layer_ranges(cfg: ModelConfig, ep_rank: int, ep_size: int, pp_rank: int, pp_size: int):
    """(first global layer, layers on this stage, first global expert, experts on this rank).

    Raises:
        ValueError: sizes that do not divide the layers or experts, a rank out of range.
    """
    L, E = cfg.num_hidden_layers, cfg.num_experts
    if L % pp_size or E % ep_size:
        raise ValueError(f"pipeline_parallel={pp_size} must divide num_hidden_layers={L} and "
                         f"expert_parallel={ep_size} must divide num_experts={E}")
    if not (0 <= pp_rank < pp_size and 0 <= ep_rank < ep_size):
        raise ValueError(f"rank out of range: pp_rank {pp_rank} of {pp_size}, ep_rank {ep_rank} of {ep_size}")
    return pp_rank * (L // pp_size), L // pp_size, ep_rank * (E // ep_size), E // ep_size


LayerToMegatron = Callable[[dict, str, str, int, int, dict], None]
"""A family's decoder-layer mapping: (HF state dict, HF layer prefix, Megatron layer prefix, first global expert,
experts on this rank, the output dict to fill)."""
LayerToHf = Callable[[str, torch.Tensor, str, int, dict], bool]
"""Its inverse, one Megatron weight at a time: (name after ``decoder.layers.{j}.``, tensor, HF layer prefix, first
global expert, the output dict to fill) -> False for a name it does not know."""


def hf_to_megatron(sd: dict[str, torch.Tensor], cfg: ModelConfig, layout: Layout = POLICY, *, ep_rank: int = 0,
                   ep_size: int = 1, pp_rank: int = 0, pp_size: int = 1,
                   layer: LayerToMegatron | None = None) -> dict[str, torch.Tensor]:
    """The Megatron state dict of one (expert, pipeline) rank, from a full HF state dict.

    Args:
        sd: HF names (per-expert layout, as t1async/models/model.py writes) -> tensors. With
            ``cfg.tie_word_embeddings`` (policy layout) ``lm_head.weight`` may be absent; present, it
            must equal the embedding, and no ``output_layer.weight`` is written (megatron-core's
            ``share_embeddings_and_output_weights``: the LM head reads the embedding).
        cfg: the architecture. layout: :data:`POLICY` or :data:`CRITIC`.
        ep_rank, ep_size, pp_rank, pp_size: this rank's place (sizes must divide E and L).
        layer: a family's own decoder-layer mapping (qwen3_5_moe's, t1async/learner/megatron/families/), the
            table above when None; embedding, final norm and heads are mapped here either way.

    Returns:
        Megatron names -> tensors (views or concatenations of ``sd``'s, same dtype).

    Raises:
        KeyError: a weight the mapping needs is missing. ValueError: sizes that do not divide, or a
            tied config whose ``lm_head.weight`` differs from its embedding.
    """
    first, n_layers, e0, n_exp = layer_ranges(cfg, ep_rank, ep_size, pp_rank, pp_size)
    t = layout.trunk
    out: dict[str, torch.Tensor] = {}
    if pp_rank == 0:
        out["embedding.word_embeddings.weight"] = sd[f"{t}embed_tokens.weight"]
    for j in range(n_layers):
        src, dst = f"{t}layers.{first + j}.", f"decoder.layers.{j}."
        if layer is not None:
            layer(sd, src, dst, e0, n_exp, out)
            continue
        for a, b in _SAME.items():
            out[dst + b] = sd[src + a]
        out[dst + "self_attention.linear_qkv.weight"] = pack_qkv(
            sd[src + "self_attn.q_proj.weight"], sd[src + "self_attn.k_proj.weight"], sd[src + "self_attn.v_proj.weight"],
            cfg)
        for local in range(n_exp):
            e = f"{src}mlp.experts.{e0 + local}."
            x = f"{dst}mlp.experts.local_experts.{local}."
            out[x + "linear_fc1.weight"] = torch.cat([sd[e + "gate_proj.weight"], sd[e + "up_proj.weight"]], dim=0)
            out[x + "linear_fc2.weight"] = sd[e + "down_proj.weight"]
    if pp_rank == pp_size - 1:
        out["decoder.final_layernorm.weight"] = sd[f"{t}norm.weight"]
        tied = layout is POLICY and cfg.tie_word_embeddings
        for a, b in layout.head.items():
            if tied:  # the LM head is the embedding (megatron: share_embeddings_and_output_weights)
                if a in sd and sd[a] is not sd[f"{t}embed_tokens.weight"] and not torch.equal(
                        sd[a], sd[f"{t}embed_tokens.weight"]):
                    raise ValueError(f"model.tie_word_embeddings is true but {a} differs from "
                                     f"{t}embed_tokens.weight: set model.tie_word_embeddings=false for an untied "
                                     "checkpoint")
            elif a in sd:
                out[b] = sd[a]
            else:
                raise KeyError(a)
    return out


_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight")


def routed_expert_to_hf(rest: str, w: torch.Tensor, src: str, e0: int, out: dict[str, torch.Tensor]) -> bool:
    """Put a routed expert's Megatron weight (``rest``: ``mlp.experts.local_experts.<j>.linear_fc1|2.weight``
    of the layer whose HF prefix is ``src``) into ``out`` under its HF names: expert ``e0 + j``'s
    ``gate_proj`` and ``up_proj`` (the halves of ``linear_fc1``'s rows, views) or ``down_proj``. Returns
    whether ``rest`` was a routed expert's weight (every family's layer mapping shares this)."""
    x = _EXPERT.fullmatch(rest)
    if x is None:
        return False
    e = f"{src}mlp.experts.{e0 + int(x.group(1))}."
    if x.group(2) == "linear_fc1":
        out[e + "gate_proj.weight"], out[e + "up_proj.weight"] = w.chunk(2)
    else:
        out[e + "down_proj.weight"] = w
    return True


def megatron_to_hf(sd: dict[str, torch.Tensor], cfg: ModelConfig, layout: Layout = POLICY, *, ep_rank: int = 0,
                   ep_size: int = 1, pp_rank: int = 0, pp_size: int = 1,
                   layer: LayerToHf | None = None) -> dict[str, torch.Tensor]:
    """The HF tensors one (expert, pipeline) rank holds, from its Megatron state dict (``layer``: a family's own
    decoder-layer mapping, :data:`LayerToHf`; the table above when None).

    Inverse of :func:`hf_to_megatron`: the union over every rank of the results is the full HF
    state dict, bit for bit (expert weights appear on their EP rank only; attention, norms and
    the router appear on every EP rank of a stage, identical). Tensors are views into ``sd``
    (split along rows), or ``sd``'s own.

    Raises:
        KeyError: a Megatron name this mapping does not know (e.g. a TE-fused or grouped-GEMM
            layout, biases).
    """
    first, n_layers, e0, _ = layer_ranges(cfg, ep_rank, ep_size, pp_rank, pp_size)
    t = layout.trunk
    back = {b: a for a, b in _SAME.items()}
    head = {b: a for a, b in layout.head.items()}
    out: dict[str, torch.Tensor] = {}
    for name, w in sd.items():
        if name == "embedding.word_embeddings.weight":
            out[f"{t}embed_tokens.weight"] = w
        elif name == "decoder.final_layernorm.weight":
            out[f"{t}norm.weight"] = w
        elif name in head:
            out[head[name]] = w
        elif (m := _LAYER.fullmatch(name)) is not None and int(m.group(1)) < n_layers:
            i, rest = first + int(m.group(1)), m.group(2)
            src = f"{t}layers.{i}."
            if layer is not None:
                if not layer(rest, w, src, e0, out):
                    raise KeyError(f"no HF name for Megatron weight {name!r}")
            elif rest in back:
                out[src + back[rest]] = w
            elif rest == "self_attention.linear_qkv.weight":
                q, k, v = unpack_qkv(w, cfg)
                out[src + "self_attn.q_proj.weight"], out[src + "self_attn.k_proj.weight"] = q, k
                out[src + "self_attn.v_proj.weight"] = v
            elif not routed_expert_to_hf(rest, w, src, e0, out):
                raise KeyError(f"no HF name for Megatron weight {name!r}")
        else:
            raise KeyError(f"no HF name for Megatron weight {name!r}")
    return out


_TP_SUFFIX = {  # Megatron weight suffix -> (dim split over TP ranks, gated: gate and up halves split apart)
    "self_attention.linear_qkv.weight": (0, False),
    "self_attention.linear_qkv.bias": (0, False),  # (glm4_moe's attention_bias: the weight's rows)
    "self_attention.linear_proj.weight": (1, False),
    "linear_fc1.weight": (0, True),
    "linear_fc2.weight": (1, False),
}


TpSplit = Callable[[str], "tuple[int, bool | tuple[int, ...]] | None"]
"""A family's own tensor-parallel rule (t1async/learner/megatron/families/ ``tp_split``): a Megatron weight name ->
its split as :func:`tp_partition` returns it, or None to leave the name to the rules here."""


def tp_partition(name: str, layout: Layout = POLICY, split: TpSplit | None = None) -> tuple[int, bool | tuple[int, ...]] | None:
    """How megatron-core's tensor parallelism splits Megatron weight ``name``: ``(dim, gated)``
    (``gated``: the rows are [gate; up] and each half is split on its own; a tuple of sizes: those
    row sections of the whole tensor are each split on their own), or None when every TP rank
    holds it whole (norms, routers, the critic's head). ``split``: a family's own rule, asked first
    (qwen3_5_moe's Gated DeltaNet; t1async/learner/megatron/families/ passes it by ``model_type``)."""
    if split is not None and (how := split(name)) is not None:
        return how
    if name == "embedding.word_embeddings.weight" or (name == "output_layer.weight" and layout is POLICY):
        return 0, False
    for suffix, how in _TP_SUFFIX.items():
        if name.endswith("." + suffix):
            return how
    return None


def _parts(w: torch.Tensor, dim: int, gated: bool | tuple[int, ...], ranks: int = 1) -> tuple[torch.Tensor, ...]:
    """The row sections of ``w`` split on their own (:func:`tp_partition`); ``ranks``: ``w`` is one of that
    many equal slices (section sizes divided by it)."""
    if isinstance(gated, tuple):
        return w.split([n // ranks for n in gated], dim)
    return w.chunk(2, dim) if gated else (w,)


def shard_tp(sd: dict[str, torch.Tensor], layout: Layout, tp_rank: int, tp_size: int,
             split: TpSplit | None = None) -> dict[str, torch.Tensor]:
    """TP rank ``tp_rank``'s part of one (expert, pipeline) rank's Megatron state dict ``sd``
    (``split``: a family's own rule, see :func:`tp_partition`).

    Returns:
        The same names; split tensors are contiguous copies of rank ``tp_rank``'s slice
        (:func:`tp_partition`), whole ones are ``sd``'s own.

    Raises:
        ValueError: ``tp_rank`` out of range, or a split dimension (of each gated half or row
            section) that ``tp_size`` does not divide.
    """
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} out of range for tensor_parallel={tp_size}")
    out = {}
    for name, w in sd.items():
        how = tp_partition(name, layout, split)
        if how is None or tp_size == 1:
            out[name] = w
            continue
        dim, gated = how
        halves = _parts(w, dim, gated)
        for h in halves:
            if h.shape[dim] % tp_size:
                raise ValueError(f"tensor_parallel={tp_size} must divide dimension {dim} ({h.shape[dim]}) of "
                                 f"Megatron weight {name}")
        out[name] = torch.cat([h.chunk(tp_size, dim)[tp_rank] for h in halves], dim).contiguous()
    return out


def merge_tp(parts: list[dict[str, torch.Tensor]], layout: Layout,
             split: TpSplit | None = None) -> dict[str, torch.Tensor]:
    """Inverse of :func:`shard_tp`: every TP rank's state dict (list index = TP rank) -> the
    whole one, bit for bit; whole tensors are taken from TP rank 0.

    Raises:
        ValueError: the ranks' state dicts do not hold the same names.
    """
    names = list(parts[0])
    if any(set(p) != set(names) for p in parts[1:]):
        raise ValueError("merge_tp: the tensor-parallel ranks hold different weight names")
    out = {}
    for name in names:
        how = tp_partition(name, layout, split)
        if how is None or len(parts) == 1:
            out[name] = parts[0][name]
            continue
        dim, gated = how
        secs = [_parts(p[name], dim, gated, len(parts)) for p in parts]
        out[name] = torch.cat([torch.cat([s[i] for s in secs], dim) for i in range(len(secs[0]))], dim)
    return out
