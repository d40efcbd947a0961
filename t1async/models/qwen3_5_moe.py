"""Qwen3.5-MoE text decoder in plain PyTorch: Gated DeltaNet and gated attention layers, routed plus shared
experts, routing replay, and a per-sequence cache that keeps the linear-attention recurrent state.

Reference: transformers 5.x ``Qwen3_5MoeForCausalLM`` (its module tree and parameter names are used here, so a
folder either writes loads in the other) and the papers behind its parts:

- Gated DeltaNet (Yang, Kautz, Hatamizadeh 2024, "Gated Delta Networks: Improving Mamba2 with Delta Rule"):
  per head, state ``S_t = exp(g_t) (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T`` ([Dk, Dv]), output
  ``o_t = S_t^T q_t``, with ``q, k`` L2-normalised, ``q`` scaled by ``Dk^-1/2``, ``b = sigmoid(W_b x)``,
  ``g = -exp(A_log) softplus(W_a x + dt_bias)``; inputs pass a depthwise causal conv1d (kernel
  ``linear_conv_kernel_dim``) and SiLU first; the output goes through an RMSNorm gated by ``silu(W_z x)``.
  Sequences longer than one token use the chunkwise form (the WY/UT representation of the delta rule within
  a chunk of :data:`CHUNK` tokens, a scan over chunks); one token uses the recurrence. Both run in float32.
- gated attention (every ``full_attention`` layer): grouped-query attention whose query projection also
  yields a per-channel output gate ``sigmoid(gate)``, q/k RMSNorm, RoPE on the first
  ``partial_rotary_factor`` of each head (rotate-half), causal SDPA.
- MoE in every layer: softmax router, top-k renormalised, SwiGLU experts stored fused
  (``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]), plus a shared SwiGLU expert
  scaled by ``sigmoid(shared_expert_gate(x))``.
- RMSNorms of the residual stream and of q/k are zero-centred (``x_hat * (1 + w)``, computed in float32).

Text positions are the same on the three multimodal RoPE axes, so the interleaved MRoPE of the reference
reduces to ordinary RoPE here. The vision tower and the MTP head are not built (RL on text needs neither):
their config keys and weights are ignored with a warning naming them.

Batch invariance and packing follow t1async/models/model.py: every projection is its row-padded
:class:`~t1async.models.batch_invariance.Linear`, and a packed forward runs each sequence's token mixer on its own
(attention on its own keys; the gates, conv, delta rule and gated norm of a linear-attention layer on its
own slice and state). The float32 transcendentals taken over all packed rows at once whose length is not
a multiple of the vector width (the shared-expert gate's sigmoid over [N, 1], RoPE's cos/sin) are rounded
from float64 (:func:`_invariant_sigmoid`), so a sequence's logits and routed experts are bitwise the same
whatever it is packed with (tests/unit/models/test_qwen3_5_moe.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from loguru import logger
from torch import nn

from t1async.config import ModelConfig
from t1async.config.model_folder import decoder_config, resolve_model
from t1async.models.batch_invariance import Linear, padded_rows, rows_for
from t1async.models.hf_folder import Convert, ModelFolderError, fuse_expert, load_weights
from t1async.models.model import (
    KVCache,
    MoeCausalLM,
    MoeDecoderLayer,
    MoeDecoderTrunk,
    PackedSegments,
    Qwen3MoeMLP,
    _apply_rope,
    save_hf,
    swiglu,
)

__all__ = ["Qwen3_5MoeForCausalLM", "Qwen35TextConfig", "HybridCache", "config_from_hf", "config_to_hf", "CHUNK",
           "delta_rule", "text_config"]

CHUNK = 64
"""Tokens per chunk of the chunkwise delta rule (the reference's default)."""


@dataclass(frozen=True)
class Qwen35TextConfig:
    """The text decoder's architecture (transformers ``Qwen3_5MoeTextConfig`` names and defaults)."""

    vocab_size: int = 248320
    hidden_size: int = 2048
    num_hidden_layers: int = 40
    layer_types: tuple[str, ...] = ()
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    head_dim: int = 256
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    num_experts: int = 256
    num_experts_per_tok: int = 8
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02


_SHARED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_experts", "num_experts_per_tok",
           "max_position_embeddings", "tie_word_embeddings")
"""Fields the run's ModelConfig and the text config both hold: they must agree."""

_IGNORED = ("mtp_", "vision_config", "image_token_id", "video_token_id", "vision_start_token_id",
            "vision_end_token_id")
_warned: set[tuple[str, ...]] = set()
"""Ignored-key sets already warned about (one warning per set and process)."""


def config_from_hf(d: dict) -> Qwen35TextConfig:
    """The text decoder of a Qwen3.5-MoE config.json dict (a conditional-generation config's ``text_config``).

    Keys of the parts not built (``vision_config``, the image/video token ids, ``mtp_*``, inside
    ``text_config`` or beside it) are ignored with one ``loguru`` warning naming them; keys transformers'
    ``Qwen3_5MoeTextConfig`` has and this decoder does not need (``router_aux_loss_coef``, token ids, ...)
    are ignored silently. A key the dict lacks takes transformers' default.

    Raises:
        ValueError: what this implementation does not run, named: another activation, attention biases, a RoPE
            scaling type, ``layer_types`` of another length or with other values, heads that do not divide.
    """
    t = decoder_config(d)
    # a conditional-generation config.json keeps vision_config outside and the mtp_* keys inside text_config
    ignored = tuple(sorted({k for k in (*d, *t) if k.startswith(_IGNORED)}))
    if ignored and ignored not in _warned:
        _warned.add(ignored)
        logger.warning("qwen3_5_moe: the vision tower and the MTP head are not built (RL on text needs neither); "
                       "ignored config keys: {}", ", ".join(ignored))
    if t.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {t['hidden_act']!r} is not supported (only silu)")
    if t.get("attention_bias"):
        raise ValueError("attention_bias true is not supported (Qwen3.5 has none)")
    rope = t.get("rope_parameters") or t.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(f"RoPE scaling {rope!r} is not supported (only the default RoPE)")
    names = {f.name for f in fields(Qwen35TextConfig)}
    kw: dict[str, Any] = {k: t[k] for k in names if t.get(k) is not None}
    for k in ("rope_theta", "partial_rotary_factor"):
        if k not in kw and k in rope:
            kw[k] = rope[k]
    n = int(kw.get("num_hidden_layers", Qwen35TextConfig.num_hidden_layers))
    types = tuple(kw.get("layer_types") or ("linear_attention" if (i + 1) % int(t.get("full_attention_interval", 4))
                                             else "full_attention" for i in range(n)))
    if len(types) != n or set(types) - {"linear_attention", "full_attention"}:
        raise ValueError(f"layer_types must list 'linear_attention' or 'full_attention' for each of the {n} layers, "
                         f"got {list(types)}")
    kw["layer_types"] = types
    c = Qwen35TextConfig(**kw)
    if c.num_attention_heads % c.num_key_value_heads or c.linear_num_value_heads % c.linear_num_key_heads:
        raise ValueError("num_key_value_heads must divide num_attention_heads and linear_num_key_heads must divide "
                         "linear_num_value_heads")
    if not 1 <= c.num_experts_per_tok <= c.num_experts:
        raise ValueError(f"num_experts_per_tok={c.num_experts_per_tok} must be in [1, num_experts={c.num_experts}]")
    return c


def text_config(cfg: ModelConfig) -> Qwen35TextConfig:
    """The Qwen3.5 text decoder of a run's :class:`ModelConfig`: :func:`config_from_hf` of ``cfg.hf_config`` (a
    folder's config.json), of ``cfg``'s size fields when ``hf_config`` is empty.

    Raises:
        ValueError: a config this implementation cannot run (:func:`config_from_hf`), or size fields of ``cfg``
            that disagree with its ``hf_config`` (build it with :func:`t1async.config.model_folder.resolve_model`).
    """
    c = config_from_hf(cfg.hf_config) if cfg.hf_config else config_from_hf(
        {k: getattr(cfg, k) for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                      "num_key_value_heads", "head_dim", "num_experts", "num_experts_per_tok",
                                      "moe_intermediate_size", "rms_norm_eps", "rope_theta",
                                      "max_position_embeddings", "tie_word_embeddings", "initializer_range")})
    for k in _SHARED:  # the rest of t1async (engine, replay checks, routed-experts rows) reads cfg's
        if getattr(cfg, k) != getattr(c, k):
            raise ValueError(f"model.{k}={getattr(cfg, k)!r} but the Qwen3.5 text config has {k}="
                             f"{getattr(c, k)!r} (transformers' default where config.json omits it); build the "
                             "ModelConfig with t1async.config.model_folder.resolve_model from a config.json that "
                             f"states {k}")
    return c


HF_SKIPPED = ("mtp.", "model.visual.", "visual.")
"""Checkpoint name prefixes of the vision tower and the MTP head: not loaded (not needed for RL on text)."""


def hf_convert(cfg: ModelConfig) -> Convert:
    """The checkpoint-to-model name map of a Qwen3.5-MoE folder (:data:`t1async.models.hf_folder.Convert`): a
    conditional-generation checkpoint's text decoder (``model.language_model.*``) under the text model's names;
    routed experts stored one tensor per expert fused into the model's 3D parameters
    (:func:`t1async.models.hf_folder.fuse_expert`), fused ones as they are; :data:`HF_SKIPPED` weights map to
    nothing (the config's warning names them). ``cfg`` is unused: every Qwen3.5-MoE checkpoint names its
    tensors the same way."""
    def convert(name: str, t: torch.Tensor):
        if name.startswith(HF_SKIPPED):
            return ()
        return fuse_expert(name.replace("model.language_model.", "model.", 1), t)
    return convert


def config_to_hf(c: Qwen35TextConfig) -> dict:
    """A config.json dict transformers reads as ``Qwen3_5MoeForCausalLM`` (``model_type`` qwen3_5_moe_text)."""
    d = {f.name: getattr(c, f.name) for f in fields(c)}
    d["layer_types"] = list(c.layer_types)
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": d.pop("rope_theta"),
                            "partial_rotary_factor": d.pop("partial_rotary_factor")}
    d.update(model_type="qwen3_5_moe_text", architectures=["Qwen3_5MoeForCausalLM"], hidden_act="silu",
             attention_bias=False, attention_dropout=0.0, torch_dtype="float32")
    return d


# ----------------------------------------------------------------------------- cache


class HybridCache(KVCache):
    """A sequence's cache: keys and values of the full-attention layers (a :class:`KVCache`, slot = the
    layer's rank among full-attention layers) and, per linear-attention layer, the conv state (the last
    ``kernel - 1`` conv inputs, [B, conv_dim, kernel - 1]) and the recurrent state ([B, Hv, Dk, Dv] float32).

    Not truncatable: the recurrent state after m tokens cannot be recovered from the state after more, so
    the embedded engine's prefix cache resumes such a cache only at its full length.
    """

    truncatable = False

    def __init__(self, capacity: int = 0) -> None:
        super().__init__(capacity)
        self.conv: dict[int, torch.Tensor] = {}
        self.recurrent: dict[int, torch.Tensor] = {}


# ----------------------------------------------------------------------------- layers


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm with weight stored as an offset from one: ``x / rms(x) * (1 + w)``, all in float32, then cast."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)


class GatedRMSNorm(nn.Module):
    """``w * x / rms(x) * silu(gate)`` over the last dim (the Gated DeltaNet output norm)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dt = x.dtype
        y = x.float()
        y = self.weight * (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)).to(dt)
        return (y * F.silu(gate.float())).to(dt)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, b: torch.Tensor,
               state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over a sequence (Yang et al. 2024), float32.

    Args:
        q, k: [B, H, T, Dk] (L2-normalised; q already scaled), v: [B, H, T, Dv], g: [B, H, T] log decay (<= 0),
            b: [B, H, T] write strength in (0, 1); state: [B, H, Dk, Dv] before the first token, or None (zeros).

    Returns:
        (outputs [B, H, T, Dv], the state after the last token [B, H, Dk, Dv]).

    One token runs the recurrence; longer sequences the chunkwise form: within a chunk the T delta-rule
    updates are written as ``U = (I + L)^-1 (b * v)`` and ``W = (I + L)^-1 (b * exp(G) * k)`` with
    ``L[i, j] = b_i k_i.k_j exp(G_i - G_j)`` strictly below the diagonal (G: cumulative log decay in the
    chunk), so a chunk costs two triangular solves and a few matmuls, and the state passes once per chunk.
    """
    B, H, T, Dk = k.shape
    S = state if state is not None else q.new_zeros(B, H, Dk, v.shape[-1])
    if T == 1:
        S = S * g[..., 0].exp()[..., None, None]
        kk, qq = k[:, :, 0], q[:, :, 0]
        delta = (v[:, :, 0] - (S * kk[..., None]).sum(-2)) * b[:, :, 0, None]
        S = S + kk[..., None] * delta[..., None, :]
        return (S * qq[..., None]).sum(-2)[:, :, None], S
    pad = -T % CHUNK
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, b = F.pad(g, (0, pad)), F.pad(b, (0, pad))
    n = (T + pad) // CHUNK
    q, k, v = (x.reshape(B, H, n, CHUNK, x.shape[-1]) for x in (q, k, v))
    g, b = g.reshape(B, H, n, CHUNK), b.reshape(B, H, n, CHUNK)
    G = g.cumsum(-1)
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(upper, float("-inf")).exp()  # [.., i, j], j <= i
    kb = k * b[..., None]
    L = (kb @ k.transpose(-1, -2)) * decay
    U = torch.linalg.solve_triangular(L, v * b[..., None], upper=False, unitriangular=True)
    W = torch.linalg.solve_triangular(L, kb * G.exp()[..., None], upper=False, unitriangular=True)
    inner = (q @ k.transpose(-1, -2)) * decay
    q_dec = q * G.exp()[..., None]
    k_dec = k * (G[..., -1:] - G).exp()[..., None]
    chunk_decay = G[..., -1].exp()[..., None, None]
    outs = []
    for c in range(n):
        u = U[:, :, c] - W[:, :, c] @ S
        outs.append(q_dec[:, :, c] @ S + inner[:, :, c] @ u)
        S = S * chunk_decay[:, :, c] + k_dec[:, :, c].transpose(-1, -2) @ u
    o = torch.stack(outs, 2).reshape(B, H, n * CHUNK, -1)[:, :, :T]
    return o, S


class GatedDeltaNet(nn.Module):
    """The linear-attention token mixer (HF ``linear_attn``): see the module docstring."""

    def __init__(self, c: Qwen35TextConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.hk, self.hv = c.linear_num_key_heads, c.linear_num_value_heads
        self.dk, self.dv = c.linear_key_head_dim, c.linear_value_head_dim
        self.key_dim, self.value_dim = self.hk * self.dk, self.hv * self.dv
        self.kernel = c.linear_conv_kernel_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False,
                                padding=self.kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.A_log = nn.Parameter(torch.empty(self.hv).uniform_(0.01, 16).log())
        self.norm = GatedRMSNorm(self.dv, c.rms_norm_eps)
        self.out_proj = Linear(self.value_dim, c.hidden_size, bias=False)
        self.in_proj_qkv = Linear(c.hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = Linear(c.hidden_size, self.value_dim, bias=False)
        self.in_proj_b = Linear(c.hidden_size, self.hv, bias=False)
        self.in_proj_a = Linear(c.hidden_size, self.hv, bias=False)

    def forward(self, x: torch.Tensor, cache: "HybridCache | PackedSegments | None") -> torch.Tensor:
        """x [B, T, H] -> [B, T, H]; ``cache``: a sequence's :class:`HybridCache` (read and written), a packed
        row's segments (B == 1: each sequence on its own state), or None (zero state, nothing kept)."""
        qkv, z = self.in_proj_qkv(x), self.in_proj_z(x)  # [B, T, conv_dim], [B, T, Hv*Dv]
        b, a = self.in_proj_b(x), self.in_proj_a(x)  # [B, T, Hv] each
        if isinstance(cache, PackedSegments):
            # everything after the projections runs per sequence on its own [1, n, .] slice, as when fed
            # alone: elementwise and reduction kernels then see the same shapes (bitwise batch invariance)
            outs, s = [], 0
            for c, n in zip(cache.caches, cache.lengths):
                outs.append(self._mix(qkv[:, s:s + n], z[:, s:s + n], b[:, s:s + n], a[:, s:s + n], c))
                s += n
            o = torch.cat(outs, 1)
        else:
            o = self._mix(qkv, z, b, a, cache)
        return self.out_proj(o)

    def _mix(self, qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
             cache: HybridCache | None) -> torch.Tensor:
        """Gates, conv1d + SiLU, the delta rule and the gated norm of one sequence (or a right-padded batch
        without cache), from the projections: -> [B, T, Hv*Dv] (the input of ``out_proj``)."""
        B, T, _ = qkv.shape
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        xt = qkv.transpose(1, 2)  # [B, C, T]
        past = cache.conv.get(self.layer_idx) if cache is not None else None
        if past is None:
            past = xt.new_zeros(B, self.conv_dim, self.kernel - 1)
        full = torch.cat([past, xt], -1)
        if cache is not None:
            cache.conv[self.layer_idx] = full[:, :, -(self.kernel - 1):].detach().clone()
        y = F.silu(F.conv1d(full, self.conv1d.weight, groups=self.conv_dim))  # [B, C, T]
        q, k, v = torch.split(y.transpose(1, 2), [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        rep = self.hv // self.hk
        q = q.reshape(B, T, self.hk, self.dk).repeat_interleave(rep, 2).transpose(1, 2).float()
        k = k.reshape(B, T, self.hk, self.dk).repeat_interleave(rep, 2).transpose(1, 2).float()
        v = v.reshape(B, T, self.hv, self.dv).transpose(1, 2).float()
        q = _l2norm(q) * self.dk ** -0.5
        k = _l2norm(k)
        state = cache.recurrent.get(self.layer_idx) if cache is not None else None
        o, S = delta_rule(q, k, v, g.transpose(1, 2), beta.transpose(1, 2).float(), state)
        if cache is not None:
            cache.recurrent[self.layer_idx] = S.detach()
        o = o.transpose(1, 2).to(qkv.dtype).reshape(-1, self.dv)
        return self.norm(o, z.reshape(-1, self.dv)).reshape(B, T, -1)


class GatedAttention(nn.Module):
    """Gated grouped-query attention with q/k norms and partial RoPE (HF ``self_attn``)."""

    def __init__(self, c: Qwen35TextConfig, slot: int) -> None:
        super().__init__()
        self.slot = slot  # this layer's index among the full-attention layers (its KVCache layer)
        self.nh, self.nkv, self.hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = Linear(c.hidden_size, self.nh * self.hd * 2, bias=False)
        self.k_proj = Linear(c.hidden_size, self.nkv * self.hd, bias=False)
        self.v_proj = Linear(c.hidden_size, self.nkv * self.hd, bias=False)
        self.o_proj = Linear(self.nh * self.hd, c.hidden_size, bias=False)
        self.q_norm = ZeroCenteredRMSNorm(self.hd, c.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(self.hd, c.rms_norm_eps)

    def forward(self, x, cos, sin, cache):
        B, T, _ = x.shape
        q, gate = self.q_proj(x).view(B, T, self.nh, 2 * self.hd).chunk(2, dim=-1)
        q = self.q_norm(q).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(B, T, self.nkv, self.hd)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        r = cos.shape[-1]
        q = torch.cat([_apply_rope(q[..., :r], cos, sin), q[..., r:]], -1)
        k = torch.cat([_apply_rope(k[..., :r], cos, sin), k[..., r:]], -1)
        if isinstance(cache, PackedSegments):
            outs, a = [], 0
            for c, n in zip(cache.caches, cache.lengths):
                past = c.seq_len
                ks, vs = c.update(self.slot, k[:, :, a:a + n], v[:, :, a:a + n])
                outs.append(_attend(q[:, :, a:a + n], ks, vs, past, self.nkv != self.nh))
                a += n
            o = torch.cat(outs, 2)
        else:
            past = 0
            if cache is not None:
                past = cache.seq_len
                k, v = cache.update(self.slot, k, v)
            o = _attend(q, k, v, past, self.nkv != self.nh)
        o = o.transpose(1, 2).reshape(B, T, self.nh * self.hd) * torch.sigmoid(gate.reshape(B, T, -1))
        return self.o_proj(o)


def _attend(q, k, v, past: int, gqa: bool) -> torch.Tensor:
    """Causal SDPA of queries [B, nh, T, D] at positions past.. over keys/values [B, nkv, past + T, D]."""
    T = q.shape[2]
    if T == 1:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    if past == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    mask = torch.ones(T, past + T, dtype=torch.bool, device=q.device).tril(diagonal=past)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def _invariant_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """``sigmoid(x)`` in float64, rounded to x's dtype: a row's value whatever the tensor's length.

    CPU kernels run a tensor's elements through a vectorized loop and its last few through a scalar one,
    and the two float32 transcendentals may differ by an ulp; which elements are the last few depends on the
    tensor's length (the tokens packed together), so a float32 sigmoid over [N, 1] could make one
    sequence's result depend on its neighbours. Rounded from float64 the two paths agree (bar a double
    rounding tie). Also used for RoPE's cos/sin.
    """
    return torch.sigmoid(x.double()).to(x.dtype)


class SwiGLU(Qwen3MoeMLP):
    """``down(silu(gate(x)) * up(x))`` (the shared expert): an expert's projections, its own forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)


class FusedExperts(nn.Module):
    """The routed experts as two 3D parameters (HF v5 layout): ``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I].

    ``column_major`` names both for :func:`~t1async.models.batch_invariance.to_column_major` (the engine's layout)."""

    column_major = ("gate_up_proj", "down_proj")

    def __init__(self, c: Qwen35TextConfig) -> None:
        super().__init__()
        self.num_experts, self.inter = c.num_experts, c.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(c.num_experts, 2 * c.moe_intermediate_size, c.hidden_size))
        self.down_proj = nn.Parameter(torch.empty(c.num_experts, c.hidden_size, c.moe_intermediate_size))

    def weights(self) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """Per-expert views of both parameters, taken once per forward: ``unbind``'s backward writes all
        experts' gradients in one stack (indexing per expert would zero-fill a full-size gradient each time)."""
        return self.gate_up_proj.unbind(0), self.down_proj.unbind(0)

    @staticmethod
    def expert(gate_up: torch.Tensor, down: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """One expert (its ``gate_up`` [2I, H] and ``down`` [H, I]) on rows x [n, H], row-padded as
        :class:`~t1async.models.batch_invariance.Linear`."""
        rows, m = padded_rows(x, max(rows_for(x, gate_up, silu=True), rows_for(x, down)))
        gate, up = F.linear(rows, gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, down)[:m]


class SparseMoeBlock(nn.Module):
    """Routed top-k experts (softmax router, renormalised) plus a sigmoid-gated shared expert, with replay."""

    def __init__(self, c: Qwen35TextConfig) -> None:
        super().__init__()
        self.top_k, self.num_experts = c.num_experts_per_tok, c.num_experts
        self.gate = Linear(c.hidden_size, c.num_experts, bias=False)
        self.experts = FusedExperts(c)
        self.shared_expert = SwiGLU(c.hidden_size, c.shared_expert_intermediate_size)
        self.shared_expert_gate = Linear(c.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor, replay: torch.Tensor | None = None, own_topk: bool = False):
        """x [N, H]; replay [N, K] int64 or None; returns (out [N, H], ids used [N, K], own top-k or None)."""
        logits = self.gate(x)
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        own = None
        if replay is None:
            weights, ids = torch.topk(probs, self.top_k, dim=-1)
            own = ids if own_topk else None
        else:  # R3: the sampler's experts, this router's probabilities (the router still gets a gradient)
            ids = replay
            weights = probs.gather(1, ids)
            if own_topk:
                own = torch.topk(probs.detach(), self.top_k, dim=-1).indices
        weights = (weights / weights.sum(-1, keepdim=True)).to(logits.dtype)
        out = x.new_zeros(x.shape)
        if x.shape[0]:
            flat = ids.reshape(-1)
            order = torch.argsort(flat, stable=True)
            counts = torch.bincount(flat, minlength=self.num_experts).tolist()
            token_of = order // self.top_k
            xs = x.index_select(0, token_of)
            gate_up, down = self.experts.weights()
            # split, not a slice per expert: a slice's backward zero-fills a gradient the size of xs for each expert
            parts = [self.experts.expert(gate_up[e], down[e], rows)
                     for e, rows in enumerate(xs.split(counts)) if rows.shape[0]]
            ys = torch.cat(parts, 0) * weights.reshape(-1)[order, None]
            out = out.index_add(0, token_of, ys)
        shared = _invariant_sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out + shared, ids, own


class DecoderLayer(MoeDecoderLayer):
    """Pre-norm layer: the token mixer of its ``layer_types`` entry, then the MoE block."""

    def __init__(self, c: Qwen35TextConfig, layer_idx: int, slot: int) -> None:
        super().__init__()
        self.kind = c.layer_types[layer_idx]
        if self.kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(c, layer_idx)
        else:
            self.self_attn = GatedAttention(c, slot)
        self.mlp = SparseMoeBlock(c)
        self.input_layernorm = ZeroCenteredRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(c.hidden_size, c.rms_norm_eps)

    def mix(self, h, cos, sin, cache):
        return self.linear_attn(h, cache) if self.kind == "linear_attention" else self.self_attn(h, cos, sin, cache)


class Qwen3_5MoeTextModel(MoeDecoderTrunk):
    """The trunk (HF ``model.``): ``embed_tokens``, ``layers``, final ``norm``; the shared decoder loop
    and ``gradient_checkpointing`` of :class:`t1async.models.model.MoeDecoderTrunk`."""

    def __init__(self, c: Qwen35TextConfig) -> None:
        super().__init__()
        self.c = c
        self.gradient_checkpointing = False
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        slots = [sum(t == "full_attention" for t in c.layer_types[:i]) for i in range(c.num_hidden_layers)]
        self.layers = nn.ModuleList(DecoderLayer(c, i, slots[i]) for i in range(c.num_hidden_layers))
        self.norm = ZeroCenteredRMSNorm(c.hidden_size, c.rms_norm_eps)
        rot = int(c.head_dim * c.partial_rotary_factor) // 2 * 2
        self.rotary_dim = rot

    def rope(self, position_ids: torch.Tensor, dtype: torch.dtype):
        r = self.rotary_dim
        inv = 1.0 / (self.c.rope_theta ** (torch.arange(0, r, 2, dtype=torch.float32, device=position_ids.device) / r))
        freqs = position_ids[..., None].float() * inv  # [B, T, r/2]
        emb = torch.cat([freqs, freqs], -1)[:, None].double()  # [B, 1, T, r], rotate-half layout
        return emb.cos().to(dtype), emb.sin().to(dtype)  # float64: see _invariant_sigmoid



class Qwen3_5MoeForCausalLM(MoeCausalLM):
    """Qwen3.5-MoE causal LM: :class:`Qwen3_5MoeTextModel` plus ``lm_head`` (tied when the config says so).

    Args:
        cfg: the run's :class:`ModelConfig`; the architecture is read from ``cfg.hf_config`` (a folder's
            config.json, :func:`config_from_hf`), its ModelConfig sizes when ``hf_config`` is empty.

    Raises:
        ValueError: a config this implementation cannot run (:func:`config_from_hf`), or a ``cfg`` whose
            size fields disagree with its ``hf_config`` (build it with
            :func:`t1async.config.model_folder.resolve_model`).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.config = c = text_config(cfg)
        self.model = Qwen3_5MoeTextModel(c)
        self.lm_head = Linear(c.hidden_size, c.vocab_size, bias=False)
        std = c.initializer_range
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=std)
            elif isinstance(m, FusedExperts):
                nn.init.normal_(m.gate_up_proj, std=std)
                nn.init.normal_(m.down_proj, std=std)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def new_cache(self, capacity: int = 0) -> HybridCache:
        """A :class:`HybridCache` (not truncatable)."""
        return HybridCache(capacity)

    # ------------------------------------------------------------------------- checkpoints

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "Qwen3_5MoeForCausalLM":
        """Load a Hugging Face Qwen3.5-MoE folder (``config.json``, a text-only or conditional-generation one,
        and the weights: one ``model.safetensors`` or shards with their index), streamed into float32
        parameters (:func:`hf_convert`: vision and MTP weights are skipped).

        Raises:
            ConfigError: no such folder or config.json, another ``model_type``. ModelFolderError: missing,
                unexpected or mis-shaped weights (named), a config this implementation cannot run.
        """
        cfg = resolve_model(ModelConfig(path=str(path)))
        if cfg.model_type != "qwen3_5_moe":
            raise ModelFolderError(f"{path}: config.json has model_type {cfg.model_type!r}, not qwen3_5_moe; load it "
                                   "with t1async.models.families.load_model")
        try:
            model = cls(cfg)
        except ValueError as e:
            raise ModelFolderError(f"model.path={cfg.path}: {e}") from None
        load_weights(model, path, convert=hf_convert(cfg),
                     skip=lambda name: cfg.tie_word_embeddings and name == "lm_head.weight")
        return model

    def save_pretrained(self, path: str | Path, **kw) -> list[str]:
        """Write ``config.json`` (the source's, or :func:`config_to_hf` for a model built from sizes) and the
        weights into folder ``path``, loadable by ``transformers.AutoModelForCausalLM.from_pretrained``
        (:func:`t1async.models.model.save_hf`; ``kw``: its ``max_shard_bytes`` and ``source``).

        Returns:
            the weight file names written.
        """
        cfg = self.cfg if self.cfg.hf_config else dataclasses.replace(self.cfg, hf_config=config_to_hf(self.config))
        return save_hf(path, cfg, self.state_dict(), **kw)
