"""Any transformers 5.x MoE causal LM as a t1async model family, through a routing-replay hook on its routers.

:class:`HFMoeForCausalLM` wraps transformers' own modeling class (built from a config.json dict, or loaded with
``transformers.AutoModelForCausalLM.from_pretrained``) and provides the family contract of
t1async/models/moe.py (:class:`~t1async.models.moe.MoeCausalLM`): forward over right-padded batches with
routing replay (R3) and the routed experts of every MoE layer, a per-sequence cache for the embedded engine, the
packed forward, a trunk with ``gradient_checkpointing`` and an ``lm_head``. No transformers code is copied: every
layer runs as transformers runs it; only each MoE block's router output is read (record) or replaced (replay) by a
forward hook.

How a family plugs in: a :class:`RouterAdapter` in :data:`ADAPTERS`, keyed by ``model_type``. It says

- which decoder layers hold an MoE block (``moe_layers``) and where that block's router is (``router``);
- how to read the expert ids the router chose from its output (``chosen``; record);
- how to turn the router's output and given expert ids into the gate weights the block would have used had
  the router chosen those ids (``replay``): the router's own scores gathered at the ids, normalised as the
  family does, so the router's weight still gets a gradient through the gathered scores;
- the config.json key of the routed expert count (``num_experts_key``) and what it refuses (``check``).

transformers 5.x routers of deepseek_v3, glm4_moe, gpt_oss and qwen3_moe all return ``(router_logits [N, E],
gate weights [N, K], expert ids [N, K])``, so a further family is usually a ``replay`` function of a few lines.

glm4_moe (GLM-4.5/4.6, transformers ``Glm4MoeTopkRouter``): scores ``sigmoid(logits)`` in float32; the choice
adds ``e_score_correction_bias`` (a buffer: it gets no gradient) and is limited to the ``topk_group`` best of
``n_group`` expert groups; the gate weights are the scores (without the bias) at the chosen ids, divided by
their sum (+1e-20) when ``norm_topk_prob``, times ``routed_scaling_factor`` (DeepSeek-V3 technical report,
DeepSeek-AI 2024, section 2.1.2, whose router GLM-4.5 shares). The first ``first_k_dense_replace`` layers are
dense MLPs, so the routed-experts arrays have ``num_hidden_layers - first_k_dense_replace`` layers.

Replay under gradient checkpointing: the replayed ids of a forward are kept with each checkpointed layer
(``torch.utils.checkpoint``'s ``context_fn``) and put back while the backward recomputes it, so the recompute
routes exactly as the forward did even when other forwards ran in between.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from t1async.config import ModelConfig
from t1async.config.model_folder import SIZE_KEYS, resolve_model, text_config
from t1async.models.model import MoeCausalLM, PackedSegments

__all__ = ["ADAPTERS", "HFCache", "HFMoeForCausalLM", "HFMoeModel", "RouterAdapter", "adapter_for",
           "config_from_hf", "config_to_hf"]


# ----------------------------------------------------------------------------- adapters


@dataclass(frozen=True)
class RouterAdapter:
    """How :class:`HFMoeForCausalLM` records and replays one family's routing (see the module docstring).

    Attributes:
        model_type: config.json's ``model_type``.
        num_experts_key: the config key holding the routed expert count E.
        moe_layers: transformers config -> indices of the decoder layers that hold an MoE block, ascending.
        router: decoder layer module -> its MoE block's router module (the one the hook goes on).
        chosen: router output -> expert ids it chose, [N, K] int64.
        replay: (router module, router output, ids [N, K] int64) -> the router output the block then uses:
            those ids and the gate weights [N, K] the family computes at them from the router's own scores.
        check: transformers config -> None; raises ValueError naming what this path cannot run.
    """

    model_type: str
    num_experts_key: str
    moe_layers: Callable[[Any], list[int]]
    router: Callable[[nn.Module], nn.Module]
    chosen: Callable[[Any], torch.Tensor]
    replay: Callable[[nn.Module, Any, torch.Tensor], Any]
    check: Callable[[Any], None] = lambda config: None


def _glm4_replay(router: nn.Module, out: tuple, ids: torch.Tensor) -> tuple:
    """GLM-4.5 gate weights at ``ids``: sigmoid scores gathered, normalised, scaled (module docstring)."""
    logits = out[0]
    w = logits.sigmoid().gather(1, ids)
    if router.norm_topk_prob:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return logits, w * router.routed_scaling_factor, ids


def _glm4_check(config) -> None:
    if config.n_routed_experts % config.n_group:
        raise ValueError(f"n_group={config.n_group} must divide n_routed_experts={config.n_routed_experts}")
    if not 0 <= config.first_k_dense_replace < config.num_hidden_layers:
        raise ValueError(f"first_k_dense_replace={config.first_k_dense_replace} leaves no MoE layer among "
                         f"num_hidden_layers={config.num_hidden_layers}")


def _no_dropout(config) -> None:
    if float(getattr(config, "attention_dropout", 0.0) or 0.0) != 0.0:
        raise ValueError(f"attention_dropout={config.attention_dropout} is not supported: training-mode dropout "
                         "would make log-probs and replay non-deterministic; set it to 0.0 in config.json")


ADAPTERS: dict[str, RouterAdapter] = {
    "glm4_moe": RouterAdapter(
        model_type="glm4_moe",
        num_experts_key="n_routed_experts",
        moe_layers=lambda c: list(range(c.first_k_dense_replace, c.num_hidden_layers)),
        router=lambda layer: layer.mlp.gate,
        chosen=lambda out: out[2],
        replay=_glm4_replay,
        check=_glm4_check,
    ),
}
"""Families the generic path runs, by ``model_type``."""


def adapter_for(model_type: str) -> RouterAdapter:
    """The :class:`RouterAdapter` of ``model_type``.

    Raises:
        ValueError: one line naming the type and listing the supported ones.
    """
    a = ADAPTERS.get(model_type)
    if a is None:
        raise ValueError(f"model_type {model_type!r} has no routing-replay adapter in t1async/models/hf_generic.py; "
                         f"supported model types: {', '.join(sorted(ADAPTERS))}")
    return a


def config_from_hf(d: dict):
    """A transformers config object (its family's ``PretrainedConfig``) of a config.json dict, checked to be
    one this path runs: a ``model_type`` with an adapter, no attention dropout, the adapter's own checks.

    Raises:
        ValueError: one line naming the key and what is supported.
    """
    from transformers import AutoConfig  # transformers: deferred (heavy; an optional extra)

    d = text_config(d)
    mt = d.get("model_type")
    adapter = adapter_for(mt)
    config = AutoConfig.for_model(mt, **{k: v for k, v in d.items() if k != "model_type"})
    _no_dropout(config)
    adapter.check(config)
    return config


def config_to_hf(config) -> dict:
    """The config.json dict of a transformers config (``to_dict``), ``architectures`` set to the causal LM."""
    d = config.to_dict()
    if not d.get("architectures"):
        from transformers import AutoModelForCausalLM  # transformers: deferred (heavy; an optional extra)

        d["architectures"] = [AutoModelForCausalLM._model_mapping[type(config)].__name__]
    return d


def _model_config(config, adapter: RouterAdapter, path: str = "") -> ModelConfig:
    """The run's :class:`ModelConfig` of a transformers config: its size fields (the family's names mapped,
    ``rope_theta`` from ``rope_parameters``) and the whole config.json dict as ``hf_config``."""
    d = config_to_hf(config)
    keys = {"num_experts": adapter.num_experts_key}
    kw = {k: d[keys.get(k, k)] for k in SIZE_KEYS if d.get(keys.get(k, k)) is not None}
    kw.setdefault("head_dim", config.hidden_size // config.num_attention_heads)
    rope = d.get("rope_parameters") or {}
    if "rope_theta" not in kw and "rope_theta" in rope:
        kw["rope_theta"] = float(rope["rope_theta"])
    return dataclasses.replace(ModelConfig(), **kw, hf_config=d, path=path)


# ----------------------------------------------------------------------------- routing hook


class _Routing:
    """One trunk's routing state, read and written by its router hooks.

    ``on`` while one of our forwards runs (hooks pass through otherwise, so the wrapped transformers module
    still runs as transformers alone); ``replay``: per MoE layer the ids [N, K] to use, or None; ``used``/``own``:
    per MoE layer the ids used and the router's own choice in this forward; ``record`` False while the
    backward recomputes a checkpointed layer (nothing is recorded twice).
    """

    def __init__(self, n_layers: int) -> None:
        self.n = n_layers
        self.on = False
        self.record = True
        self.replay: list[torch.Tensor] | None = None
        self.used: list[torch.Tensor | None] = [None] * n_layers
        self.own: list[torch.Tensor | None] = [None] * n_layers

    @contextmanager
    def forward(self, replay: list[torch.Tensor] | None):
        self.on, self.replay, self.record = True, replay, True
        self.used, self.own = [None] * self.n, [None] * self.n
        try:
            yield
        finally:
            self.on, self.replay = False, None

    def checkpoint_contexts(self):
        """``torch.utils.checkpoint`` ``context_fn``: nothing in the forward; in the recompute, this forward's
        replayed ids back in place and recording off."""
        snap = self.replay

        @contextmanager
        def recompute():
            before = (self.on, self.replay, self.record)
            self.on, self.replay, self.record = True, snap, False
            try:
                yield
            finally:
                self.on, self.replay, self.record = before

        return nullcontext(), recompute()

    def checkpoint(self, fn, *args, **kwargs):
        """The layers' checkpoint function (transformers' ``_gradient_checkpointing_func``): non-reentrant,
        with :meth:`checkpoint_contexts`."""

        return checkpoint(fn, *args, use_reentrant=False, context_fn=self.checkpoint_contexts, **kwargs)


class _RouterHook:
    """Forward hook of MoE layer ``j``'s router: records its choice, substitutes replayed ids (an object, not a
    closure, so a deep copy of the trunk, the critic's, gets hooks bound to its own state)."""

    def __init__(self, state: _Routing, j: int, adapter: RouterAdapter) -> None:
        self.state, self.j, self.adapter = state, j, adapter

    def __call__(self, module: nn.Module, args, out):
        st = self.state
        if not st.on:
            return None
        own = self.adapter.chosen(out)
        if st.replay is not None:
            out = self.adapter.replay(module, out, st.replay[self.j])
        if st.record:
            st.own[self.j] = own
            st.used[self.j] = self.adapter.chosen(out)
        return out


# ----------------------------------------------------------------------------- cache


class HFCache:
    """Per-sequence cache for incremental decoding: a transformers ``DynamicCache`` (batch 1 in the engine).

    Attributes:
        cache: the ``DynamicCache`` transformers' forward reads and extends.
        seq_len: tokens held (``cache.get_seq_length()``). Setting it to m < seq_len rolls the cache back to its
            first m tokens (``DynamicCache.crop``); setting it to more than it holds raises ValueError.
        truncatable: True: every layer keeps all past keys and values (a sliding-window or recurrent layer
            would make a crop lossy; no family here has one, and :class:`HFMoeForCausalLM` refuses them).
    """

    truncatable = True

    def __init__(self, config, capacity: int = 0) -> None:
        from transformers import DynamicCache  # transformers: deferred (heavy; an optional extra)

        self.capacity = int(capacity)  # DynamicCache grows by concatenation: nothing to reserve
        self.cache = DynamicCache(config=config)

    @property
    def seq_len(self) -> int:
        return int(self.cache.get_seq_length())

    @seq_len.setter
    def seq_len(self, m: int) -> None:
        n = self.seq_len
        if m > n:
            raise ValueError(f"HFCache holds {n} tokens; seq_len can only be set lower (a rollback), not to {m}")
        if m < n:
            self.cache.crop(m - n)


# ----------------------------------------------------------------------------- trunk and causal LM


class HFMoeModel(nn.Module):
    """The trunk: transformers' base model (``model.``: ``embed_tokens``, ``layers``, ``norm``, ...) registered
    under its own names, with routing hooks on every MoE block's router.

    ``forward(input_ids [B, T], position_ids [B, T], routed_experts [B, T, L, K] int64 or None, kv_cache
    HFCache or None, own_topk=False) -> (final-norm hidden [B, T, H], expert ids used [B, T, L, K] int64, the
    routers' own top-k [B, T, L, K] int64 or None unless own_topk)``; the cache advances by T.

    Attributes:
        gradient_checkpointing: when True, transformers' per-layer checkpointing is on, with the replayed ids
            restored in the recompute (module docstring). transformers checkpoints only in training mode
            (``module.training``): the wrapper is built in training mode, as the built-in model is.
    """

    def __init__(self, base: nn.Module, adapter: RouterAdapter) -> None:
        super().__init__()
        if base._parameters or any(n for n, b in base.named_buffers(recurse=False) if n not in
                                   base._non_persistent_buffers_set):
            raise ValueError(f"{type(base).__name__} holds its own parameters; the generic wrapper registers only "
                             "its submodules")
        for name, child in base.named_children():
            self.add_module(name, child)
        object.__setattr__(self, "_base", base)  # not a submodule: its children are ours already
        self.adapter = adapter
        self.moe_layers = adapter.moe_layers(base.config)
        self._routing = _Routing(len(self.moe_layers))
        self._ckpt = False
        for j, i in enumerate(self.moe_layers):
            adapter.router(base.layers[i]).register_forward_hook(_RouterHook(self._routing, j, adapter))

    @property
    def gradient_checkpointing(self) -> bool:
        return self._ckpt

    @gradient_checkpointing.setter
    def gradient_checkpointing(self, on: bool) -> None:
        self._ckpt = bool(on)
        for layer in self._base.layers:
            layer.gradient_checkpointing = self._ckpt
            layer._gradient_checkpointing_func = self._routing.checkpoint

    def forward(self, input_ids, position_ids, routed_experts, kv_cache, own_topk=False):
        B, T = input_ids.shape
        replay = None if routed_experts is None else [routed_experts[:, :, j].reshape(B * T, -1)
                                                      for j in range(len(self.moe_layers))]
        st = self._routing
        with st.forward(replay):
            out = self._base(input_ids=input_ids, position_ids=position_ids,
                             cache=None if kv_cache is None else kv_cache.cache, use_cache=kv_cache is not None)
        used = torch.stack([u.reshape(B, T, -1) for u in st.used], 2).to(torch.int64)
        own = torch.stack([u.reshape(B, T, -1) for u in st.own], 2).to(torch.int64) if own_topk else None
        return out.last_hidden_state, used, own


class HFMoeForCausalLM(MoeCausalLM):
    """A transformers MoE causal LM with routing replay: the family contract over transformers' own modules.

    Build it with a :class:`ModelConfig` whose ``hf_config`` is a config.json dict (random weights, as
    transformers initialises them; the caller seeds torch), :meth:`wrap` an existing transformers model, or
    :meth:`from_pretrained` a folder. ``state_dict()`` names are transformers' module names (experts fused:
    ``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]), which
    ``AutoModelForCausalLM.from_pretrained`` loads as they are; :meth:`save_pretrained` writes transformers'
    checkpoint layout (per-expert names) through transformers.

    Attributes:
        cfg: the run's :class:`ModelConfig` (``num_experts`` etc. read from the config.json).
        hf: the wrapped transformers ``*ForCausalLM`` (same modules; calling it runs transformers alone, hooks
            passing through).
        model: :class:`HFMoeModel`, the trunk; ``lm_head``: transformers' LM head.
        routed_layers: MoE layers L (only the MoE ones: GLM's dense first layers are not counted).

    Raises:
        ValueError: a ``model_type`` without an adapter (one line listing the supported ones), an empty
            ``cfg.hf_config``, a config the adapter refuses.
    """

    def __init__(self, cfg: ModelConfig, *, hf: nn.Module | None = None) -> None:
        super().__init__()
        if hf is None:
            if not cfg.hf_config:
                raise ValueError("HFMoeForCausalLM needs cfg.hf_config, a config.json dict (model.path, or "
                                 "HFMoeForCausalLM.wrap / from_pretrained)")
            from transformers import AutoModelForCausalLM  # transformers: deferred (heavy; an optional extra)

            hf = AutoModelForCausalLM.from_config(config_from_hf(cfg.hf_config), dtype=torch.float32)
        else:
            config_from_hf(hf.config.to_dict())  # the same refusals for a model built elsewhere
        adapter = adapter_for(hf.config.model_type)
        self.cfg = cfg
        object.__setattr__(self, "hf", hf)
        self.model = HFMoeModel(hf.model, adapter)
        self.lm_head = hf.lm_head
        E, K = int(getattr(hf.config, adapter.num_experts_key)), int(hf.config.num_experts_per_tok)
        if (cfg.num_experts, cfg.num_experts_per_tok) != (E, K):
            raise ValueError(f"cfg has num_experts={cfg.num_experts}, num_experts_per_tok={cfg.num_experts_per_tok} "
                             f"but the model {adapter.num_experts_key}={E}, num_experts_per_tok={K}; read cfg from the "
                             "same config.json (resolve_model, or HFMoeForCausalLM.wrap)")
        self.train()

    @property
    def routed_layers(self) -> int:
        return len(self.model.moe_layers)

    @classmethod
    def wrap(cls, hf: nn.Module, path: str = "") -> "HFMoeForCausalLM":
        """Wrap a transformers causal LM (its modules are used, not copied); ``cfg`` is read from its config."""
        return cls(_model_config(hf.config, adapter_for(hf.config.model_type), path), hf=hf)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "HFMoeForCausalLM":
        """Load a Hugging Face folder with ``transformers.AutoModelForCausalLM.from_pretrained(path,
        dtype=torch.float32)`` (transformers' own loading: sharded weights, its layout conversions) and wrap it;
        ``cfg`` is :func:`t1async.config.model_folder.resolve_model` of the folder.

        Raises:
            ConfigError: no config.json or an unknown model_type. ValueError: a model type without an adapter.
            Whatever transformers raises for missing or mis-shaped weights.
        """
        from transformers import AutoModelForCausalLM  # transformers: deferred (heavy; an optional extra)

        cfg = resolve_model(ModelConfig(path=str(path)))
        adapter_for(text_config(cfg.hf_config).get("model_type"))  # before any weight is read
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        return cls(cfg, hf=hf)

    def save_pretrained(self, path: str | Path, **kw) -> None:
        """Write ``config.json`` and the weights into ``path`` with transformers' ``save_pretrained`` (its names
        and layout; ``kw`` passed on, e.g. ``max_shard_size``)."""
        self.hf.save_pretrained(str(path), **kw)

    def checkpoint_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights under the names and layout of transformers' checkpoints (what :meth:`save_pretrained`
        writes: per-expert ``mlp.experts.{e}.gate_proj.weight`` ...), through transformers'
        ``revert_weight_conversion``; :meth:`state_dict` has the fused module names."""
        from transformers.core_model_loading import revert_weight_conversion  # transformers: deferred (heavy)

        return revert_weight_conversion(self.hf, dict(self.hf.state_dict()))

    def new_cache(self, capacity: int = 0) -> HFCache:
        """An empty :class:`HFCache` (truncatable)."""
        return HFCache(self.hf.config, capacity)

    def forward_packed(self, input_ids: torch.Tensor, segments: PackedSegments) -> tuple[torch.Tensor, torch.Tensor]:
        """The engine's packed forward, run as one batch-1 forward per sequence (correct first: each sequence's
        result is exactly that of its tokens fed alone; no cross-sequence batching of the matmuls yet).

        Args:
            input_ids: [N] int64, the sequences' new tokens concatenated. segments: per sequence its
                :class:`HFCache` (read, extended) and its number of new tokens (>= 1, summing to N).

        Returns:
            (logits [S, V] float32 at each sequence's last new token, routed experts [N, L, K] int64).

        Raises:
            ValueError: ``input_ids`` not 1-D, a length < 1, lengths not summing to N, a cache listed twice.
        """
        lengths = segments.checked_lengths(input_ids)
        logits, routed, a = [], [], 0
        for cache, n in zip(segments.caches, lengths):
            out = self.forward(input_ids[a:a + n][None], kv_cache=cache, return_routing=True, logits_to_keep=1)
            logits.append(out.logits[0, -1])
            routed.append(out.routed_experts[0])
            a += n
        return torch.stack(logits), torch.cat(routed)
