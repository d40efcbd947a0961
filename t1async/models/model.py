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
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from t1async.config import ModelConfig
from t1async.config.model_folder import decoder_config
from t1async.models.batch_invariance import Linear, padded_rows, rows_for
from t1async.models.hf_folder import load_weights, read_config, save_folder
from t1async.models.moe import KVCache, ModelOutput, MoeCausalLM, MoeDecoderLayer, MoeDecoderTrunk, PackedSegments

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
