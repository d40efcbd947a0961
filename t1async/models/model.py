"""Qwen3-MoE decoder in plain PyTorch, with routing replay (R3) and a KV cache.

The module tree and parameter names equal Hugging Face's ``Qwen3MoeForCausalLM`` in its
per-expert layout (``model.layers.{i}.mlp.experts.{e}.gate_proj.weight`` ...), so
``state_dict()`` keys are the checkpoint keys that SGLang, transformers and the weight broadcast
use. Architecture (Qwen3 technical report, Yang et al. 2025; HF ``Qwen3MoeConfig`` naming):

- pre-norm decoder layers: ``x + attn(rmsnorm(x))`` then ``x + moe(rmsnorm(x))``;
- grouped-query attention with a per-head RMSNorm on queries and keys (``q_norm``/``k_norm``,
  applied before RoPE), rotary position embedding in the rotate-half convention (Su et al. 2021,
  "RoFormer"), causal, no biases;
- every layer is a sparse MoE layer (``decoder_sparse_step`` = 1, no ``mlp_only_layers``): router
  logits ``gate(x)``, probabilities ``softmax(logits)`` in float32, top-k experts, weights
  renormalised over the chosen k when ``norm_topk_prob``; experts are SwiGLU MLPs
  ``down(silu(gate(x)) * up(x))``; no shared expert;
- final RMSNorm and an untied (by default) LM head; logits are returned in float32.

Padding: there is no attention mask. Batches must be right-padded: causality alone keeps every
real token from seeing the padding to its right, and the outputs at padded positions are garbage
the caller ignores. (Padded positions still pick experts; that does not change real tokens.)

Packed batches (:meth:`Qwen3MoeForCausalLM.forward_packed`, the embedded engine's continuous
batching): the new tokens of several sequences are concatenated into one row of N tokens, each
sequence with its own :class:`KVCache`; every row-wise op (norms, projections, router, experts,
LM head) runs over the N tokens at once, attention runs per sequence on exactly the shapes a lone
forward of that sequence uses. No padding token exists, so none can route or be attended to.

Batch invariance: every linear layer is a :class:`~t1async.models.batch_invariance.Linear`, which
feeds its matmul enough rows (zero rows appended) that a row's result never depends on the rows beside it;
how many is probed per shape on the machine it runs on (t1async/models/batch_invariance.py). The experts'
SiLU runs on the same padded rows (on an AVX-512 machine the elements left over after its vectorised loop
take a path whose exp differs in the last bit). Hence a sequence decoded in a packed batch gets bitwise the
logits and routing of the same sequence decoded alone (tests/unit/models/test_batching.py).

Newer transformers (v5) store a layer's experts fused as 3D tensors
(``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]) and convert the
per-expert layout written here on load; :meth:`Qwen3MoeForCausalLM.from_pretrained` also accepts
the fused layout and splits it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from t1async.config import ModelConfig
from t1async.config.model_folder import decoder_config
from t1async.models.batch_invariance import Linear, padded_rows, rows_for
from t1async.models.hf_folder import load_weights, read_config, save_folder

__all__ = [
    "KVCache",
    "MoeDecoderLayer",
    "MoeDecoderTrunk",
    "Linear",
    "MoeCausalLM",
    "PackedSegments",
    "ModelOutput",
    "Qwen3MoeForCausalLM",
    "Qwen3MoeModel",
    "model_config_from_hf",
    "model_config_to_hf",
    "save_hf",
    "swiglu",
]


# ----------------------------------------------------------------------------- config <-> HF


def model_config_to_hf(cfg: ModelConfig) -> dict:
    """Render a :class:`ModelConfig` as a Hugging Face ``Qwen3MoeConfig`` config.json dict.

    Every ModelConfig field is written under its own (HF) name, plus the keys HF needs to pick the
    architecture (``architectures``, ``model_type``) and the constants this implementation fixes:
    every layer sparse, SiLU experts, no attention bias, no sliding window. ``torch_dtype`` is
    "float32" here; :meth:`Qwen3MoeForCausalLM.save_pretrained` writes the weights' real dtype.
    """
    d = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("path", "hf_config")}
    d.update(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        decoder_sparse_step=1,
        mlp_only_layers=[],
        hidden_act="silu",
        attention_bias=False,
        attention_dropout=0.0,
        use_sliding_window=False,
        intermediate_size=cfg.moe_intermediate_size,  # dense-MLP width; unused (no dense layers)
        torch_dtype="float32",
    )
    return d


def model_config_from_hf(d: dict) -> ModelConfig:
    """Read the :class:`ModelConfig` fields out of a HF Qwen3-MoE config.json dict.

    Unknown keys are ignored; a missing field takes the ModelConfig default; a field written under another
    name by some transformers version is read under it too (t1async/config/model_folder.py
    :data:`~t1async.config.model_folder.FIELD_NAMES`: ``num_local_experts``). ``rope_theta`` is
    also read from transformers v5's ``rope_parameters``; ``head_dim`` defaults to
    hidden_size / num_attention_heads as in HF.

    Raises:
        ValueError: the config is not one this implementation can run (another ``model_type``,
            dense layers via ``mlp_only_layers`` or ``decoder_sparse_step`` != 1, a RoPE scaling
            type other than default).
    """
    mt = d.get("model_type", "qwen3_moe")
    if mt != "qwen3_moe":
        raise ValueError(f"config.json has model_type {mt!r}; only 'qwen3_moe' is supported")
    d = decoder_config({**d, "model_type": mt})  # the expert count under the name its transformers wrote
    if d.get("mlp_only_layers") or d.get("decoder_sparse_step", 1) != 1:
        raise ValueError("config.json has dense layers (mlp_only_layers / decoder_sparse_step != 1); "
                         "only all-MoE Qwen3-MoE models are supported")
    d = dict(d)
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(f"RoPE scaling {rope!r} is not supported (only the default RoPE)")
    if "rope_theta" not in d and "rope_theta" in rope:
        d["rope_theta"] = rope["rope_theta"]
    if d.get("head_dim") is None and "hidden_size" in d and "num_attention_heads" in d:
        d["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
    names = {f.name: f.type for f in dataclasses.fields(ModelConfig)}
    kwargs = {k: d[k] for k in names if k in d}
    return ModelConfig(**kwargs)


def _check_config(cfg: ModelConfig) -> None:
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ValueError(f"num_key_value_heads={cfg.num_key_value_heads} must divide "
                         f"num_attention_heads={cfg.num_attention_heads}")
    if cfg.head_dim % 2:
        raise ValueError(f"head_dim={cfg.head_dim} must be even for RoPE")
    if not 1 <= cfg.num_experts_per_tok <= cfg.num_experts:
        raise ValueError(f"num_experts_per_tok={cfg.num_experts_per_tok} must be in [1, num_experts="
                         f"{cfg.num_experts}]")


# ----------------------------------------------------------------------------- KV cache


class KVCache:
    """Per-layer key/value cache for incremental decoding.

    ``truncatable``: setting :attr:`seq_len` to m < seq_len rolls the cache back to its first m tokens
    (the embedded engine's prefix cache reuses a shorter shared prefix so).

    Holds, for each layer, keys and values after q/k-norm and RoPE, shaped
    [B, num_key_value_heads, capacity, head_dim] in the model's dtype, of which the first
    :attr:`seq_len` positions are filled. Storage is allocated on the first write and doubles when
    full, so pass ``capacity`` (tokens) when the final length is known to avoid copies.
    All rows of the batch share one length: the cache is for same-length (or right-padded and then
    decoded in lockstep) batches; the embedded engine uses batch 1.

    The model writes every layer during a forward, then advances :attr:`seq_len` by the number of
    new tokens. Positions default to ``seq_len + arange(T)``.
    """

    truncatable = True

    def __init__(self, capacity: int = 0) -> None:
        self.capacity = int(capacity)
        self.seq_len = 0
        self._k: list[torch.Tensor] = []
        self._v: list[torch.Tensor] = []

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write new keys/values [B, Hkv, T, D] for ``layer`` after the cached ones.

        Returns the keys and values of every cached position plus the new ones,
        [B, Hkv, seq_len + T, D] (views into the storage).
        """
        t0, t1 = self.seq_len, self.seq_len + k.shape[2]
        if layer == len(self._k):  # first write of this layer
            cap = max(self.capacity, t1)
            shape = (k.shape[0], k.shape[1], cap, k.shape[3])
            self._k.append(k.new_empty(shape))
            self._v.append(v.new_empty(shape))
        elif layer > len(self._k):
            raise ValueError(f"KVCache: layer {layer} written before layer {len(self._k)}")
        kb, vb = self._k[layer], self._v[layer]
        if kb.shape[0] != k.shape[0]:
            raise ValueError(f"KVCache holds batch {kb.shape[0]}, got batch {k.shape[0]}")
        if t1 > kb.shape[2]:  # grow: double (or to fit)
            cap = max(t1, 2 * kb.shape[2])
            nk = kb.new_empty((*kb.shape[:2], cap, kb.shape[3]))
            nv = vb.new_empty(nk.shape)
            nk[:, :, :t0] = kb[:, :, :t0]
            nv[:, :, :t0] = vb[:, :, :t0]
            self._k[layer], self._v[layer], kb, vb = nk, nv, nk, nv
        kb[:, :, t0:t1] = k
        vb[:, :, t0:t1] = v
        return kb[:, :, :t1], vb[:, :, :t1]


@dataclass
class PackedSegments:
    """How one packed row of N new tokens splits into sequences (continuous batching).

    Sequence s owns the next ``lengths[s]`` tokens of the row (in order) and ``caches[s]``, a
    batch-1 :class:`KVCache` holding its earlier positions; its tokens sit at positions
    ``caches[s].seq_len + arange(lengths[s])`` and attend only to their own sequence.
    """

    caches: list[KVCache]
    lengths: list[int]


# ----------------------------------------------------------------------------- layers


@dataclass
class ModelOutput:
    """What :meth:`Qwen3MoeForCausalLM.forward` returns.

    Attributes:
        logits: [B, T, V] float32 (upcast from the model dtype).
        hidden: [B, T, H] hidden states after the final RMSNorm, model dtype (for a value head).
        routed_experts: [B, T, L, K] int64 expert ids used at each MoE layer (the replayed ones
            under replay), or None unless ``return_routing``.
        kv_cache: the cache passed in (now advanced by T), or None.
        router_experts: [B, T, L, K] int64: the router's OWN top-k at each layer, computed from
            the same forward (so under replay it is what this model would have chosen given the
            replayed history; without replay it equals ``routed_experts``), or None unless
            ``return_routing``. Ordered by descending probability, like ``routed_experts``
            without replay. Compare expert *sets* (sort over K), not orders.
    """

    logits: torch.Tensor
    hidden: torch.Tensor
    routed_experts: torch.Tensor | None
    kv_cache: KVCache | None
    router_experts: torch.Tensor | None = None


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019): ``w * x / sqrt(mean(x^2) + eps)``.

    Normalises in float32 and casts back before scaling, as HF Qwen3 does.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dt)


def _rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin tables [B, 1, T, D] for positions [B, T] (rotate-half layout: halves repeated)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32,
                                             device=position_ids.device) / head_dim))
    freqs = position_ids[..., None].float() * inv_freq  # [B, T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [B, 1, T, D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE (Su et al. 2021) on x [B, h, T, D], rotate-half convention."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Qwen3MoeAttention(nn.Module):
    """Causal grouped-query attention with per-head q/k RMSNorm (Qwen3) and RoPE."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, self.nh * self.hd, bias=False)
        self.k_proj = Linear(cfg.hidden_size, self.nkv * self.hd, bias=False)
        self.v_proj = Linear(cfg.hidden_size, self.nkv * self.hd, bias=False)
        self.o_proj = Linear(self.nh * self.hd, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: "KVCache | PackedSegments | None") -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, self.nh, self.hd)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(B, T, self.nkv, self.hd)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        if isinstance(kv_cache, PackedSegments):  # B == 1: each sequence attends to its own cache
            outs, a = [], 0
            for cache, n in zip(kv_cache.caches, kv_cache.lengths):
                past = cache.seq_len
                ks, vs = cache.update(self.layer_idx, k[:, :, a:a + n], v[:, :, a:a + n])
                outs.append(self._attend(q[:, :, a:a + n], ks, vs, past))
                a += n
            o = outs[0] if len(outs) == 1 else torch.cat(outs, 2)
        else:
            past = 0
            if kv_cache is not None:
                past = kv_cache.seq_len
                k, v = kv_cache.update(self.layer_idx, k, v)
            o = self._attend(q, k, v, past)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.nh * self.hd))

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int) -> torch.Tensor:
        """Causal SDPA of queries q [B, nh, T, D] at positions past.. over keys/values
        [B, nkv, past + T, D]; returns [B, nh, T, D]."""
        T = q.shape[2]
        # GQA: kv head j serves query heads [j*nh/nkv, (j+1)*nh/nkv) (HF's repeat_kv grouping),
        # done inside SDPA without materialising repeated keys.
        gqa = self.nkv != self.nh
        if T == 1:  # one new token sees everything cached
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
        if past == 0:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        # chunk after a cached prefix: query i (absolute past+i) sees keys j <= past+i
        mask = torch.ones(T, past + T, dtype=torch.bool, device=q.device).tril(diagonal=past)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


class Qwen3MoeMLP(nn.Module):
    """One expert: SwiGLU MLP ``down(silu(gate(x)) * up(x))`` (Shazeer 2020)."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, inter, bias=False)
        self.up_proj = Linear(hidden, inter, bias=False)
        self.down_proj = Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[N, hidden]`` -> ``[N, hidden]``. The SiLU runs on the row-padded batch (see
        :func:`padded_rows`): on an AVX-512 CPU its vectorised exp and the leftover elements' path
        differ in the last bit, so an unpadded SiLU made a row's result depend on the row count."""
        return swiglu(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """``down(silu(gate(x)) * up(x))`` on rows x ``[N, hidden]`` with weights ``gate``, ``up`` ``[inter, hidden]`` and
    ``down`` ``[hidden, inter]``, row-padded once as :class:`~t1async.models.batch_invariance.Linear` pads (one
    function, no module calls: the per-expert loop runs it for every used expert)."""
    rows, m = padded_rows(x, max(rows_for(x, gate, silu=True), rows_for(x, down)))
    return F.linear(F.silu(F.linear(rows, gate)) * F.linear(rows, up), down)[:m].reshape(x.shape)


class Qwen3MoeSparseMoeBlock(nn.Module):
    """Top-k routed MoE MLP with optional routing replay.

    Dispatch groups the N*K (token, expert) pairs by expert with one stable sort, runs each
    used expert once on its contiguous slice and scatters back with ``index_add``; the Python
    loop is over experts, never over tokens.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = (
            cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob)
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(
            Qwen3MoeMLP(cfg.hidden_size, cfg.moe_intermediate_size) for _ in range(cfg.num_experts))

    def forward(self, x: torch.Tensor, replay: torch.Tensor | None = None, own_topk: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """x [N, H]; replay [N, K] int64 expert ids or None.

        Returns (out [N, H], ids used [N, K] int64, the router's own top-k [N, K] int64 or None):
        the third is computed only when ``own_topk`` (under replay it costs one extra top-k over
        [N, E]; without replay it is ``ids``)."""
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)  # [N, E]
        own = None
        if replay is None:
            weights, ids = torch.topk(probs, self.top_k, dim=-1)
            own = ids if own_topk else None
        else:  # R3: the sampler's experts, this router's probabilities (gradient flows to gate)
            ids = replay
            weights = probs.gather(1, ids)
            if own_topk:
                own = torch.topk(probs.detach(), self.top_k, dim=-1).indices
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)

        if x.shape[0] == 0:
            return x.new_zeros(x.shape), ids, own
        flat = ids.reshape(-1)  # [N*K], pair p belongs to token p // K
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        token_of = order // self.top_k
        xs = x.index_select(0, token_of)
        outs = []
        # split, not a slice per expert: a slice's backward zero-fills a gradient the size of xs for each expert
        for ex, rows in zip(self.experts, xs.split(counts)):
            if rows.shape[0]:
                outs.append(swiglu(rows, ex.gate_proj.weight, ex.up_proj.weight, ex.down_proj.weight))
        ys = torch.cat(outs, 0) * weights.reshape(-1)[order, None]
        return x.new_zeros(x.shape).index_add(0, token_of, ys), ids, own


class MoeDecoderLayer(nn.Module):
    """One pre-norm MoE decoder layer, every family's: the token mixer, then the MoE block, each in a
    residual branch. A family's layer sets ``input_layernorm``, ``post_attention_layernorm``, ``mlp``
    (``(x [N, H], replay [N, K] or None, own_topk) -> (y [N, H], expert ids used [N, K], own top-k
    [N, K] or None)``) and implements :meth:`mix`."""

    def mix(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: Any) -> torch.Tensor:
        """The token mixer (attention, or a linear-attention recurrence) on the normed input h [B, T, H]."""
        raise NotImplementedError

    def forward(self, x, cos, sin, kv_cache, replay, own_topk=False):
        """(x [B, T, H], expert ids used [B, T, K], the router's own top-k [B, T, K] or None)."""
        x = x + self.mix(self.input_layernorm(x), cos, sin, kv_cache)
        B, T, H = x.shape
        y, ids, own = self.mlp(self.post_attention_layernorm(x).reshape(B * T, H), replay, own_topk)
        return x + y.view(B, T, H), ids.view(B, T, -1), None if own is None else own.view(B, T, -1)


class Qwen3MoeDecoderLayer(MoeDecoderLayer):
    """Pre-norm decoder layer: attention then MoE MLP, each in a residual branch."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Qwen3MoeAttention(cfg, layer_idx)
        self.mlp = Qwen3MoeSparseMoeBlock(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def mix(self, h, cos, sin, kv_cache):
        return self.self_attn(h, cos, sin, kv_cache)


class MoeDecoderTrunk(nn.Module):
    """The decoder loop every family shares (forward, prefill and decode alike): embed, then each
    :class:`MoeDecoderLayer` with its slice of the replayed experts (gradient checkpointing when
    asked), advance the cache(s), final norm. A family's trunk sets ``embed_tokens``, ``layers``,
    ``norm`` and ``gradient_checkpointing`` and implements :meth:`rope`.
    """

    def rope(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of the rotary embedding at ``position_ids`` [B, T], in ``dtype``."""
        raise NotImplementedError

    def forward(self, input_ids, position_ids, routed_experts, kv_cache, own_topk=False):
        """Returns (final-norm hidden [B, T, H], expert ids used [B, T, L, K] int64, the routers'
        own top-k [B, T, L, K] int64 or None unless ``own_topk``)."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rope(position_ids, x.dtype)
        B, T = input_ids.shape
        routing, owns = [], []
        for i, layer in enumerate(self.layers):
            replay = None if routed_experts is None else routed_experts[:, :, i].reshape(B * T, -1)
            if self.gradient_checkpointing and kv_cache is None and torch.is_grad_enabled():
                x, ids, own = checkpoint(layer, x, cos, sin, None, replay, own_topk, use_reentrant=False)
            else:
                x, ids, own = layer(x, cos, sin, kv_cache, replay, own_topk)
            routing.append(ids)
            owns.append(own)
        if isinstance(kv_cache, PackedSegments):
            for cache, n in zip(kv_cache.caches, kv_cache.lengths):
                cache.seq_len += n
        elif kv_cache is not None:
            kv_cache.seq_len += T
        return self.norm(x), torch.stack(routing, dim=2), torch.stack(owns, dim=2) if own_topk else None


class Qwen3MoeModel(MoeDecoderTrunk):
    """Decoder trunk (HF ``model.``): ``embed_tokens``, ``layers``, final ``norm``.

    Attributes:
        gradient_checkpointing: when True (HF's attribute name), a forward with gradients and
            no KV cache keeps only each layer's input and recomputes the layer in the backward
            (``torch.utils.checkpoint``, non-reentrant): activation memory of one layer instead
            of all. The recomputation takes the same inputs (replayed expert ids included), so
            outputs, routing and gradients equal those of the plain forward. Default False.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.gradient_checkpointing = False
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Qwen3MoeDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def rope(self, position_ids, dtype):
        return _rope_cos_sin(position_ids, self.cfg.head_dim, self.cfg.rope_theta, dtype)


class MoeCausalLM(nn.Module):
    """What every family's causal LM shares: the forward over right-padded batches with routing replay, the
    packed forward of the embedded engine, the replay checks, and a per-sequence cache.

    A subclass sets ``cfg`` (the run's :class:`ModelConfig`), ``model`` (a trunk whose forward is
    ``(input_ids, position_ids, routed_experts, kv_cache, own_topk) -> (final-norm hidden [B, T, H], expert
    ids used [B, T, L, K] int64, the routers' own top-k or None)``, advancing the cache(s) by the tokens fed)
    and ``lm_head``, and overrides :meth:`new_cache` when its layers keep more than keys and values.

    Attributes:
        routed_layers: MoE layers L, the L of every routed-experts array.
    """

    cfg: ModelConfig

    @property
    def routed_layers(self) -> int:
        return self.cfg.routed_layers

    def new_cache(self, capacity: int = 0) -> KVCache:
        """An empty per-sequence cache for incremental decoding (``capacity``: tokens to reserve)."""
        return KVCache(capacity)

    def forward(self, input_ids: torch.Tensor, *, position_ids: torch.Tensor | None = None,
                routed_experts: torch.Tensor | None = None, kv_cache: KVCache | None = None,
                return_routing: bool = False, logits_to_keep: int = 0) -> ModelOutput:
        """Run the decoder on right-padded token ids.

        Args:
            input_ids: [B, T] int64 token ids in [0, vocab_size).
            position_ids: [B, T] int64 RoPE positions; default ``kv_cache.seq_len + arange(T)``
                (``arange(T)`` without a cache).
            routed_experts: [B, T, L, K] integer expert ids in [0, num_experts) to replay (R3):
                each MoE layer uses these instead of its own top-k, with gate weights = its own
                softmax probabilities gathered at them (renormalised if ``norm_topk_prob``), so
                the router still receives gradients. Any integer dtype (int32 from the sampler is
                fine). Expert 0 is an ordinary expert (no padding sentinel); at padded positions
                pass any in-range ids (e.g. zeros).
            kv_cache: cache to read and extend (incremental decoding); advanced by T.
            return_routing: also return the expert ids used, [B, T, L, K] int64, and the
                routers' own top-k from the same forward (``router_experts``; differs from the
                used ids only under replay).
            logits_to_keep: if > 0, compute logits only for the last this many positions
                (``logits`` is then [B, logits_to_keep, V]; ``hidden`` stays full); the engine's
                prefill uses 1. 0 keeps all (HF's name and meaning).

        Returns:
            :class:`ModelOutput` (logits float32).

        Raises:
            ValueError: ``input_ids`` not 2-D, ``position_ids`` or ``routed_experts`` of the wrong
                shape, or expert ids out of range.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
        B, T = input_ids.shape
        if position_ids is None:
            past = 0 if kv_cache is None else kv_cache.seq_len
            position_ids = torch.arange(past, past + T, device=input_ids.device).expand(B, T)
        elif tuple(position_ids.shape) != (B, T):
            raise ValueError(f"position_ids must have shape [B, T] = {(B, T)}, got {tuple(position_ids.shape)}")
        if routed_experts is not None:
            routed_experts = self._check_replay(routed_experts, B, T)
        hidden, routing, own = self.model(input_ids, position_ids, routed_experts, kv_cache,
                                          own_topk=return_routing)
        logits = self.lm_head(hidden[:, -logits_to_keep:] if logits_to_keep > 0 else hidden).float()
        return ModelOutput(logits=logits, hidden=hidden,
                           routed_experts=routing if return_routing else None, kv_cache=kv_cache,
                           router_experts=own)

    def forward_packed(self, input_ids: torch.Tensor, segments: PackedSegments) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward over the new tokens of several sequences packed into one row (the
        embedded engine's continuous batching: prefill chunks and decode steps together).

        Args:
            input_ids: [N] int64 token ids, the sequences' new tokens concatenated in order.
            segments: per sequence its KV cache (batch 1; read, written, advanced by its length)
                and its number of new tokens (>= 1; they sum to N). A cache may appear once.

        Returns:
            (logits [S, V] float32 at each sequence's last new token, routed experts [N, L, K]
            int64 of every new token). A sequence's logits and routing rows are bitwise those of
            the same tokens fed alone through :meth:`forward_packed` (see the module docstring).

        Raises:
            ValueError: ``input_ids`` not 1-D, a length < 1, lengths not summing to N, or a cache
                listed twice.
        """
        if input_ids.dim() != 1:
            raise ValueError(f"input_ids must be [N], got shape {tuple(input_ids.shape)}")
        lengths = [int(n) for n in segments.lengths]
        if len(lengths) != len(segments.caches) or any(n < 1 for n in lengths) or sum(lengths) != input_ids.shape[0]:
            raise ValueError(f"segments.lengths {lengths} must be >= 1 each, one per cache, and sum to "
                             f"{input_ids.shape[0]} tokens")
        if len({id(c) for c in segments.caches}) != len(segments.caches):
            raise ValueError("a KV cache appears twice in one packed forward")
        pos = torch.cat([torch.arange(c.seq_len, c.seq_len + n) for c, n in zip(segments.caches, lengths)])
        hidden, routing, _ = self.model(input_ids[None], pos[None].to(input_ids.device), None,
                                        PackedSegments(list(segments.caches), lengths), own_topk=False)
        last = torch.tensor(lengths).cumsum(0) - 1
        logits = self.lm_head(hidden[0, last.to(hidden.device)]).float()
        return logits, routing[0]

    def _check_replay(self, r: torch.Tensor, B: int, T: int) -> torch.Tensor:
        L, K, E = self.routed_layers, self.cfg.num_experts_per_tok, self.cfg.num_experts
        if tuple(r.shape) != (B, T, L, K):
            raise ValueError(f"routed_experts must have shape [B, T, MoE layers, num_experts_per_tok]"
                             f" = {(B, T, L, K)}, got {tuple(r.shape)}")
        if r.dtype.is_floating_point or r.dtype.is_complex or r.dtype == torch.bool:
            raise ValueError(f"routed_experts must hold integer expert ids, got dtype {r.dtype}")
        r = r.to(torch.int64)
        if r.numel() and (int(r.min()) < 0 or int(r.max()) >= E):
            raise ValueError(f"routed_experts ids must be in [0, num_experts={E}), got range "
                             f"[{int(r.min())}, {int(r.max())}]")
        return r



class Qwen3MoeForCausalLM(MoeCausalLM):
    """Qwen3-MoE causal LM: :class:`Qwen3MoeModel` trunk plus ``lm_head``.

    Args:
        cfg: architecture (HF ``Qwen3MoeConfig`` field names). Weights are initialised N(0,
            ``initializer_range``) for linear and embedding weights, ones for norms.

    Raises:
        ValueError: inconsistent config (kv heads not dividing heads, odd head_dim, top-k out of
            range).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        _check_config(cfg)
        self.cfg = cfg
        self.model = Qwen3MoeModel(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.apply(self._init_weights)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def _init_weights(self, m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=self.cfg.initializer_range)

    # ------------------------------------------------------------------------- checkpoints

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "Qwen3MoeForCausalLM":
        """Load a Hugging Face Qwen3-MoE folder: ``config.json`` and the weights, one
        ``model.safetensors`` or shards listed in ``model.safetensors.index.json``, streamed tensor by
        tensor into the float32 parameters (t1async/models/hf_folder.py: peak about one copy).

        Call ``.to(dtype)`` afterwards for another dtype. Accepts transformers v5's fused expert tensors as
        well as the per-expert layout; a tied model's checkpoint may omit ``lm_head.weight``.

        Raises:
            ModelFolderError: no config.json or weights, a truncated shard, missing, unexpected or
                mis-shaped weights (named). ValueError: a config this implementation cannot run.
        """
        path = Path(path)
        cfg = model_config_from_hf(read_config(path))
        model = cls(cfg)
        load_weights(model, path, convert=lambda name, t: _unfuse_experts({name: t}, cfg).items(),
                     skip=lambda name: cfg.tie_word_embeddings and name == "lm_head.weight")
        return model

    def save_pretrained(self, path: str | Path, **kw) -> None:
        """Write ``config.json`` (HF Qwen3-MoE keys) and the weights into folder ``path``
        (:func:`save_hf`; ``kw``: its ``max_shard_bytes`` and ``source``)."""
        save_hf(path, self.cfg, self.state_dict(), **kw)


def save_hf(path: str | Path, cfg: ModelConfig, state_dict: dict[str, torch.Tensor], *,
            max_shard_bytes: int = 5 * 2**30, source: str | Path | None = None) -> list[str]:
    """Write a Hugging Face Qwen3-MoE folder: ``config.json`` and ``state_dict`` (HF names, per-expert layout,
    ``lm_head.weight`` omitted when tied) as safetensors shards of at most ``max_shard_bytes`` with their
    index (one ``model.safetensors`` when it fits), created if needed: the Megatron backend's checkpoints and a model
    without a source folder (the torch learner writes a source's own layout: t1async/models/families.py ``save_model``).

    The config is the source model's own config.json (``cfg.hf_config``, from ``model.path``) with its dtype
    set to the weights' (``torch_dtype``, and transformers v5's ``dtype``), else :func:`model_config_to_hf`.
    ``source`` (default ``cfg.path``): a model folder whose tokenizer files and chat template are copied.

    Returns:
        the weight file names written (t1async/models/hf_folder.py :func:`save_folder`).
    """
    dtype = str(state_dict["model.embed_tokens.weight"].dtype).removeprefix("torch.")
    if cfg.hf_config:
        d = dict(cfg.hf_config)
        d["torch_dtype"] = dtype
        if "dtype" in d:
            d["dtype"] = dtype
    else:
        d = model_config_to_hf(cfg)
        d["torch_dtype"] = dtype
    items = ((k, v) for k, v in state_dict.items() if not (cfg.tie_word_embeddings and k == "lm_head.weight"))
    return save_folder(path, items, d, max_shard_bytes=max_shard_bytes, source=source or cfg.path or None)


def _unfuse_experts(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Split transformers-v5 fused expert tensors into the per-expert HF names (in place)."""
    inter = cfg.moe_intermediate_size
    for key in [k for k in sd if k.endswith("mlp.experts.gate_up_proj")]:
        gu = sd.pop(key)  # [E, 2I, H]: gate rows then up rows
        for e in range(gu.shape[0]):
            sd[f"{key[:-len('gate_up_proj')]}{e}.gate_proj.weight"] = gu[e, :inter]
            sd[f"{key[:-len('gate_up_proj')]}{e}.up_proj.weight"] = gu[e, inter:]
    for key in [k for k in sd if k.endswith("mlp.experts.down_proj")]:
        dn = sd.pop(key)  # [E, H, I]
        for e in range(dn.shape[0]):
            sd[f"{key[:-len('down_proj')]}{e}.down_proj.weight"] = dn[e]
    return sd
