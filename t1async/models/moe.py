"""What every MoE family's decoder shares: the caches, the output, one decoder loop, the causal LM.

A family (t1async/models/model.py: Qwen3-MoE; t1async/models/qwen3_5_moe.py: Qwen3.5-MoE) supplies
its layers (a :class:`MoeDecoderLayer` with its token mixer, norms and MoE block), its trunk (a
:class:`MoeDecoderTrunk` with its embedding, layers, final norm and rotary embedding) and its
causal LM (a :class:`MoeCausalLM` with the trunk and ``lm_head``); the loop over layers with
routing replay and gradient checkpointing, the forward over right-padded batches, the packed
forward of the embedded engine (decode) and the replay checks are written once, here. The
public names are re-exported by t1async/models/model.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from t1async.config import ModelConfig

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

    def checked_lengths(self, input_ids: torch.Tensor) -> list[int]:
        """The lengths as ints, once ``input_ids`` is checked to be the packed row they split.

        Args:
            input_ids: [N] the sequences' new tokens concatenated.

        Raises:
            ValueError: ``input_ids`` not 1-D, a length < 1, not one length per cache, lengths not
                summing to N, or a cache listed twice.
        """
        if input_ids.dim() != 1:
            raise ValueError(f"input_ids must be [N], got shape {tuple(input_ids.shape)}")
        lengths = [int(n) for n in self.lengths]
        if len(lengths) != len(self.caches) or any(n < 1 for n in lengths) or sum(lengths) != input_ids.shape[0]:
            raise ValueError(f"segments.lengths {lengths} must be >= 1 each, one per cache, and sum to "
                             f"{input_ids.shape[0]} tokens")
        if len({id(c) for c in self.caches}) != len(self.caches):
            raise ValueError("a KV cache appears twice in one packed forward")
        return lengths


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
        lengths = segments.checked_lengths(input_ids)
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

