"""Megatron-core 0.16.1 GPTModels for the ``megatron`` learner backend (t1async/learner/megatron/backend.py):
the process set-up, the config, the layer spec, the heads, weight loading and replay rows.

The Hugging Face <-> Megatron weight layouts are t1async/learner/megatron/families/convert.py. What it builds
(facts in docs/gpu.md, read from megatron-core 0.16.1's sources):

- the local layer spec (``get_gpt_layer_local_spec``, no Transformer Engine) with its core
  attention replaced by :class:`SdpaAttention` (torch's fused causal attention instead of the
  spec's ``[s, s]`` scores and probabilities; the same numbers): RMSNorm, q/k
  layernorm, SwiGLU experts (``SequentialMLP``), no biases, RoPE (rotate-half), softmax router
  in float32 (``moe_router_dtype='fp32'``; bf16 routers fail in backward), top-k renormalised
  (``moe_router_pre_softmax=False``) when ``norm_topk_prob``, no aux loss, no dropout;
- routing replay (R3) with megatron-core's own ``RouterReplay`` (``moe_enable_routing_replay``,
  unfused router: the fused path skips replay): REPLAY_FORWARD with the sampler's rows, RECORD to
  read what the router chose; indices are set and cleared around every forward;
- the critic: the same trunk (its own copy, its own router, never replaying the sampler's rows;
  its ``RouterReplay`` serves :class:`LayerRecompute` only) whose ``output_layer`` is
  a float32 ``Linear(hidden, 1)`` with a bias on the final-norm hidden states, as
  t1async/learner/torch_backend.py's ``ValueModel``.

Initial weights are t1async/models/model.py's (same seed, same numbers as the torch backend), converted.

On CPU megatron-core 0.16.1 runs with four shims, applied only when CUDA is absent:
``torch.cuda.current_device`` returns the CPU device (routers move their weight to it), an
inference RNG tracker (no CUDA RNG), ``moe_utils.te_general_gemm = None`` (it is otherwise
called without Transformer Engine), and GatedDeltaNet's flash-linear-attention kernels replaced by
the torch model's delta rule (``shim_gated_delta_net`` in t1async/learner/megatron/families/qwen3_5_moe.py).
The ``alltoall`` dispatcher needs CUDA.

Families with their own layers (qwen3_5_moe: Gated DeltaNet and gated attention, zero-centred norms,
a gated shared expert) take their config fields, layer specs and weight names from
t1async/learner/megatron/families/.

Under tensor parallelism (sequence parallelism on) the norms are :class:`Norm`, megatron's
local-spec RMSNorm allowed to run on a slice of the sequence; the policy's and reference's
``output_layer`` is :class:`LMHead` (GPTModel returns hidden states, the learner applies the
head, in chunks for long sequences), the critic's :class:`ValueHead`. Long sequences recompute
their decoder layers in the backward (:class:`LayerRecompute`, routing exact).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from t1async.config import ModelConfig
from t1async.learner.megatron.families import hf_to_megatron, megatron_family, shard_tp
from t1async.learner.megatron.families import qwen3_5_moe as q35
from t1async.learner.megatron.families.convert import CRITIC, POLICY
from t1async.learner.rl import fill_padding_routes

try:
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.mappings import (
        gather_from_sequence_parallel_region,
        gather_from_tensor_model_parallel_region,
    )
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.moe_utils import group_limited_topk
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig
except ImportError as e:  # the optional extra
    raise ImportError(f"learner.backend=megatron needs megatron-core: pip install 't1async[megatron]' ({e})") from None

__all__ = ["LMHead", "LayerRecompute", "Norm", "PlainNorm", "SdpaAttention", "ValueHead", "build_gpt", "init_megatron",
           "load_megatron", "megatron_tensors", "replay_rows", "router_topk", "transformer_config"]


def init_megatron(device: torch.device, seed: int = 0, *, expert_parallel: int = 1, tensor_parallel: int = 1,
                  pipeline_parallel: int = 1) -> None:
    """Make this process a Megatron rank (idempotent).

    With every size 1: starts torch.distributed's default group if it is not started (gloo on
    CPU, nccl on CUDA, world size 1, an in-memory store) and Megatron's model-parallel groups (all
    sizes 1), first leaving a world of another shape (a closed multi-rank backend's in this
    process). Otherwise the world of ``tensor_parallel x pipeline_parallel x expert_parallel``
    ranks and Megatron's groups were formed by t1async/learner/megatron/ranks.py; this checks their sizes.
    Then Megatron's RNG tracker; on CPU the shims described in the module docstring. The
    learner's weight broadcast uses its own process groups (t1async/weights/), never the
    default one.

    Raises:
        RuntimeError: several ranks asked for without a world of that shape.
    """
    if device.type == "cpu" and not torch.cuda.is_available():
        torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
        q35.shim_gated_delta_net()  # flash-linear-attention's kernels -> the torch model's delta rule
    if not hasattr(moe_utils, "te_general_gemm"):  # no Transformer Engine: the router's GEMM is torch's
        moe_utils.te_general_gemm = None  # (measured on an H200: NameError there too, not only on CPU)
    if expert_parallel == 1 and tensor_parallel == 1 and pipeline_parallel == 1:
        if dist.is_initialized() and (dist.get_world_size() != 1 or (
                parallel_state.model_parallel_is_initialized()
                and parallel_state.get_expert_model_parallel_world_size() != 1)):
            if parallel_state.model_parallel_is_initialized():
                parallel_state.destroy_model_parallel()
            dist.destroy_process_group()
        if not dist.is_initialized():
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                    world_size=1)
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=1)
    elif not (dist.is_initialized() and dist.get_world_size() == expert_parallel * tensor_parallel * pipeline_parallel
              and parallel_state.get_expert_model_parallel_world_size() == expert_parallel
              and parallel_state.get_tensor_model_parallel_world_size() == tensor_parallel
              and parallel_state.get_pipeline_model_parallel_world_size() == pipeline_parallel):
        raise RuntimeError(f"tensor_parallel={tensor_parallel} x pipeline_parallel={pipeline_parallel} x "
                           f"expert_parallel={expert_parallel} needs a world of that shape (t1async/learner/megatron/ranks.py)")
    from megatron.core.tensor_parallel import random as mrandom  # (megatron: deferred to the first build)

    if device.type == "cpu":
        mrandom.initialize_rng_tracker(inference_rng_tracker=True)
    elif not mrandom.get_cuda_rng_tracker().is_initialized():
        mrandom.model_parallel_cuda_manual_seed(seed)


def transformer_config(cfg: ModelConfig, *, replay: bool, dtype: torch.dtype, device: torch.device,
                       dispatcher: str = "auto", expert_parallel: int = 1, tensor_parallel: int = 1,
                       pipeline_parallel: int = 1) -> TransformerConfig:
    """Megatron's TransformerConfig for the HF Qwen3-MoE architecture ``cfg``, or another family's
    (t1async/learner/megatron/families/: its ``config_overrides``; the parallel sizes must match
    Megatron's initialised groups).
    ``tensor_parallel`` > 1 turns on sequence parallelism, which megatron-core requires for MoE
    with tensor parallelism (experts are split over the tensor-parallel ranks too).

    Raises:
        ValueError: ``alltoall`` asked for on CPU; a family setting megatron-core cannot express.
    """
    if dispatcher == "auto":
        dispatcher = "alltoall" if device.type == "cuda" else "allgather"
    if dispatcher == "alltoall" and device.type != "cuda":
        raise ValueError("learner.megatron.dispatcher=alltoall needs CUDA; use allgather on CPU")
    kw = dict(
        num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_key_value_heads, kv_channels=cfg.head_dim, ffn_hidden_size=cfg.moe_intermediate_size,
        moe_ffn_hidden_size=cfg.moe_intermediate_size, num_moe_experts=cfg.num_experts,
        moe_router_topk=cfg.num_experts_per_tok, moe_router_pre_softmax=not cfg.norm_topk_prob,
        normalization="RMSNorm", layernorm_epsilon=cfg.rms_norm_eps, qk_layernorm=True, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        moe_router_dtype="fp32", moe_router_fusion=False, moe_enable_routing_replay=replay,
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_token_dispatcher_type=dispatcher,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, use_cpu_initialization=device.type == "cpu",
        perform_initialization=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        masked_softmax_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        expert_model_parallel_size=expert_parallel, tensor_model_parallel_size=tensor_parallel,
        sequence_parallel=tensor_parallel > 1, pipeline_model_parallel_size=pipeline_parallel,
        pipeline_dtype=dtype)
    fam = megatron_family(cfg)
    return TransformerConfig(**{**kw, **(fam.config_overrides(cfg) if fam is not None else {})})


class ValueHead(nn.Module):
    """The critic's head in GPTModel's ``output_layer`` slot: float32 ``hidden -> 1`` with a bias.

    With sequence parallelism its input is this rank's slice of the sequence ``[T/TP, B, H]``:
    the values of the slice are gathered along the sequence (backward: each rank takes its own
    slice of the gradient, as every rank backpropagates the same whole output), and the head's
    gradients, one slice's each, are summed over the ranks (``sequence_parallel`` attribute)."""

    def __init__(self, hidden: int, device: torch.device, sequence_parallel: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, hidden, device=device))
        self.bias = nn.Parameter(torch.zeros(1, device=device))
        self.sequence_parallel = sequence_parallel
        for w in (self.weight, self.bias):
            w.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor, weight=None, runtime_gather_output=None):
        v = F.linear(x.float(), self.weight, self.bias)
        if self.sequence_parallel:
            v = gather_from_sequence_parallel_region(v, tensor_parallel_output_grad=False)
        return v, None


class LMHead(nn.Module):
    """Stands in GPTModel's ``output_layer`` slot of the policy and the reference, holding the LM
    head's weight (same parameter, same name ``output_layer.weight``; this rank's vocabulary slice
    under tensor parallelism): GPTModel's forward returns the final-norm hidden states (gathered
    along the sequence under sequence parallelism, as the column-parallel head gathers its input),
    and :meth:`logits` applies the head, so the learner can run it a chunk of positions at a time
    (``learner.max_tokens_per_chunk``) and never hold a long sequence's ``[T, V]`` logits.

    :meth:`logits` is what megatron-core's ``ColumnParallelLinear`` computes (``x W^T``, no bias),
    followed by the vocabulary all-gather (backward: each rank its own slice) the learner's
    log-probs need; the hidden states' gather sums the ranks' partial input gradients in the
    backward (reduce-scatter), as that layer does."""

    def __init__(self, layer: nn.Module, sequence_parallel: bool, tensor_parallel: int):
        super().__init__()
        self.weight = layer.weight  # None when tied to the embedding (GPTModel passes that weight)
        self.sequence_parallel, self.tensor_parallel = sequence_parallel, tensor_parallel
        self._tied: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output=None):
        self._tied = weight
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=True)
        return x, None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden ``[..., H]`` -> logits ``[..., V]`` (model dtype; every rank the whole vocabulary)."""
        out = F.linear(hidden, self.weight if self.weight is not None else self._tied)
        return gather_from_tensor_model_parallel_region(out) if self.tensor_parallel > 1 else out


class Norm(nn.RMSNorm):
    """Megatron's local-spec norm (``WrappedTorchNorm`` builds ``torch.nn.RMSNorm(hidden, eps)``,
    the same module and numbers) that also runs under sequence parallelism, which megatron-core
    0.16.1's wrapper refuses. A norm is per token, so it runs unchanged on a rank's slice of the
    sequence; its weight's gradient then holds that slice's share and is marked
    ``sequence_parallel`` (summed over the tensor-parallel ranks, as Megatron's TE norm is).

    With ``config.layernorm_zero_centered_gamma`` (which the wrapper refuses too) the weight is an
    offset from one, as Transformer Engine's ``zero_centered_gamma``: ``x_hat * (1 + w)``, computed
    in float32 and cast back (transformers' Qwen3.5 RMSNorm, the same operations in the same order)."""

    zero_centered_gamma: bool | None = None  # None: the config's

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_: object):
        if config.normalization != "RMSNorm":
            raise ValueError(f"t1async's Megatron spec has RMSNorm only, got {config.normalization}")
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel
        if self.zero_centered_gamma is None:
            self.zero_centered_gamma = config.layernorm_zero_centered_gamma

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.zero_centered_gamma:
            return super().forward(x)
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)


class PlainNorm(Norm):
    """:class:`Norm` with a weight that is the scale itself whatever ``layernorm_zero_centered_gamma``
    says (``w * x_hat``): GatedDeltaNet's ``out_norm``, as the Qwen3.5 checkpoint's gated norm."""

    zero_centered_gamma = False


class SdpaAttention(nn.Module):
    """Core attention of the local layer spec through ``torch.nn.functional.scaled_dot_product_attention``
    (causal, softmax scale 1/sqrt(head_dim), no dropout): what megatron-core 0.16.1's
    ``DotProductAttention`` computes, without its ``[b, heads, s, s]`` scores and probabilities.
    ``DotProductAttention`` materialises both (and keeps the probabilities for the backward), so its
    memory grows with the square of the sequence (2.2 GB per such tensor at 11.7k tokens and 4
    heads, float32), while torch's fused kernels (flash / memory-efficient, CPU and CUDA) keep O(s) per
    head; Megatron's own fused path is Transformer Engine, which needs CUDA.

    Interface of megatron's core attention (megatron/core/transformer/attention.py): query
    ``[sq, b, np, hn]``, key and value ``[sk, b, ng, hn]`` (np heads, ng query groups of this
    tensor-parallel rank) -> context ``[sq, b, np * hn]``. Keys and values are shared by the heads of
    a group (grouped-query attention, as Megatron's repeat_interleave). ``attention_mask`` is
    ignored: the mask is causal, from ``is_causal``.

    Raises:
        ValueError: a mask type other than causal, attention dropout, query-key layer scaling,
            context parallelism or a softmax type other than vanilla (built), packed sequences or
            an attention bias (forward).
    """

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None, cp_comm_type=None,
                 pg_collection=None):
        super().__init__()
        tp = pg_collection.tp.size() if pg_collection is not None else config.tensor_model_parallel_size
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if (attn_mask_type != AttnMaskType.causal or dropout or config.context_parallel_size != 1
                or config.softmax_type != "vanilla" or config.apply_query_key_layer_scaling):
            raise ValueError(f"SdpaAttention: causal attention without dropout only (mask {attn_mask_type}, "
                             f"dropout {dropout}, context parallel {config.context_parallel_size}, "
                             f"softmax {config.softmax_type}, apply_query_key_layer_scaling "
                             f"{config.apply_query_key_layer_scaling})")
        self.heads = config.num_attention_heads // tp
        self.scale = softmax_scale if softmax_scale is not None else config.kv_channels ** -0.5
        self.current_max_attn_logits = None

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask=None,
                attn_mask_type=None, attention_bias=None, packed_seq_params=None) -> torch.Tensor:
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("SdpaAttention: packed sequences and attention biases are not supported")
        sq, b = query.shape[:2]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, hn]
        if self.heads != k.shape[1]:
            k = k.repeat_interleave(self.heads // k.shape[1], dim=1)
            v = v.repeat_interleave(self.heads // v.shape[1], dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)


def _with_norm(spec, norm: type) -> None:
    """Replace ``WrappedTorchNorm`` by ``norm`` everywhere in a Megatron module spec (in place)."""
    if isinstance(spec, ModuleSpec):
        if spec.module is WrappedTorchNorm:
            spec.module = norm
        if spec.submodules is not None:
            _with_norm(spec.submodules, norm)
    elif dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        for f in dataclasses.fields(spec):
            v = getattr(spec, f.name)
            if v is WrappedTorchNorm:
                setattr(spec, f.name, norm)
            elif isinstance(v, (ModuleSpec, list, tuple)) or (dataclasses.is_dataclass(v) and not isinstance(v, type)):
                _with_norm(v, norm)
    elif isinstance(spec, (list, tuple)):
        for v in spec:
            _with_norm(v, norm)


def build_gpt(cfg: ModelConfig, hf: dict[str, torch.Tensor], *, critic: bool = False, replay: bool = False,
              dtype: torch.dtype = torch.float32, device: torch.device = torch.device("cpu"),
              dispatcher: str = "auto", ep_rank: int = 0, ep_size: int = 1, tp_rank: int = 0,
              tp_size: int = 1, pp_rank: int = 0, pp_size: int = 1) -> GPTModel:
    """A GPTModel holding the HF weights ``hf`` (policy layout, or the critic's with ``critic``);
    with ``ep_size`` > 1 only this rank's experts, with ``tp_size`` > 1 only this rank's
    tensor-parallel slices, with ``pp_size`` > 1 only this pipeline stage's layers (the embedding
    on the first stage, the final norm and head on the last; Megatron's groups of those sizes
    initialised).

    The layer spec is megatron-core's local one (``get_gpt_layer_local_spec``) with its norms
    replaced by :class:`Norm`, the same RMSNorm that also runs under sequence parallelism; for
    ``qwen3_5_moe`` the family's per-layer specs (megatron-core's GatedDeltaNet where ``layer_types``
    says linear attention) and RoPE on ``partial_rotary_factor`` of each head.

    Raises:
        RuntimeError: the converted weights do not cover the model's parameters exactly.
    """
    tc = transformer_config(cfg, replay=replay, dtype=dtype, device=device, dispatcher=dispatcher,
                            expert_parallel=ep_size, tensor_parallel=tp_size, pipeline_parallel=pp_size)
    fam = megatron_family(cfg)
    if fam is None:
        layer = get_gpt_layer_local_spec(num_experts=cfg.num_experts, moe_grouped_gemm=False, qk_layernorm=True,
                                         normalization="RMSNorm")
        block = TransformerBlockSubmodules(layer_specs=[layer] * (cfg.num_hidden_layers // pp_size), layer_norm=Norm)
    else:  # megatron-core's own block spec of the family's layers on this stage (dense and MoE, attention variants)
        block = fam.block_spec(tc, pp_rank)
        block.layer_norm = Norm
    for layer in block.layer_specs:
        sub = layer.submodules.self_attention.submodules
        if hasattr(sub, "core_attention"):
            sub.core_attention = SdpaAttention
        if hasattr(sub, "out_norm"):  # qwen3_5_moe's Gated DeltaNet: a plain RMSNorm whatever the config says
            sub.out_norm = PlainNorm
    _with_norm(block, Norm)
    last = pp_rank == pp_size - 1
    model = GPTModel(tc, block, vocab_size=cfg.vocab_size, max_sequence_length=cfg.max_position_embeddings,
                     position_embedding_type="rope", share_embeddings_and_output_weights=cfg.tie_word_embeddings and not critic,
                     pre_process=pp_rank == 0, post_process=last,
                     **{"rotary_base": cfg.rope_theta, **(fam.gpt_kwargs(cfg) if fam is not None else {})})
    if critic and last:
        model.output_layer = ValueHead(cfg.hidden_size, device, sequence_parallel=tp_size > 1)
    elif last:
        model.output_layer = LMHead(model.output_layer, sequence_parallel=tp_size > 1, tensor_parallel=tp_size)
    model.to(device)
    RouterReplay.clear_global_router_replay_instances()  # each router keeps its own; no process-wide list
    layout = CRITIC if critic else POLICY
    load_megatron(model, shard_tp(hf_to_megatron(hf, cfg, layout, ep_rank=ep_rank, ep_size=ep_size, pp_rank=pp_rank,
                                                 pp_size=pp_size), layout, tp_rank, tp_size, cfg))
    return model


class LayerRecompute:
    """Activation recompute of a GPTModel's decoder layers that keeps routing exact: inside
    ``with recompute():`` each decoder layer run with gradients keeps only its inputs and is run
    again in the backward (``torch.utils.checkpoint``, non-reentrant), the experts of every token
    replayed there as the forward chose them.

    Why not megatron-core's own ``recompute_granularity='full'``: its ``CheckpointFunction`` saves
    and restores the CUDA RNG state, so it fails on CPU (megatron-core 0.16.1,
    tensor_parallel/random.py); and under routing replay it expects the caller to switch every
    router to ``REPLAY_BACKWARD`` before the backward, whose list of rows it pops first-in
    first-out. Here each layer call keeps the rows its router used, whatever order the backward
    runs the layers in: under REPLAY_FORWARD the recompute replays the same sampler's rows; a
    router's own choice is RECORDed in the forward, recomputed the same way (the same code path,
    so the same saved tensors) and checked equal, a RuntimeError otherwise. (A router built
    without replay, ``moe_enable_routing_replay`` off, would recompute its own top-k unchecked;
    the learner builds every policy and critic router with it.)

    Memory: per layer its input ``[T/TP, B, H]`` (and its router's rows ``[T/TP * B, K]``)
    instead of every activation of the layer; time:
    one more forward of every layer in the backward. Collectives of the layer (sequence
    parallelism's all-gathers, the dispatcher's exchanges) run again in the backward, in the same
    order on every rank.
    """

    def __init__(self, model: GPTModel):
        self.on = False
        for layer in model.decoder.layers:
            layer.forward = self._wrap(layer, layer.forward)

    @contextmanager
    def __call__(self, on: bool = True) -> Iterator[None]:
        """Recompute the decoder layers run with gradients inside the block when ``on``."""
        before, self.on = self.on, on
        try:
            yield
        finally:
            self.on = before

    def _wrap(self, layer: nn.Module, forward):
        router = getattr(getattr(layer, "mlp", None), "router", None)
        replay = getattr(router, "router_replay", None)

        def run(*args, **kwargs):
            if not (self.on and torch.is_grad_enabled()):
                return forward(*args, **kwargs)
            first: dict = {}  # the forward's: replayed (bool) and the rows the router used

            def layer_forward(*a, **k):
                if replay is None:
                    return forward(*a, **k)
                action, target, recorded = (replay.router_replay_action, replay.target_topk_idx,
                                            replay.recorded_topk_idx)
                again = bool(first)  # True: the recompute in the backward
                replayed = first["replayed"] if again else action is RouterReplayAction.REPLAY_FORWARD
                if replayed:
                    replay.router_replay_action = RouterReplayAction.REPLAY_FORWARD
                    replay.target_topk_idx = first["rows"] if again else target
                else:  # the router's own top-k, RECORDed in the forward, checked in the recompute
                    replay.router_replay_action = RouterReplayAction.RECORD
                    replay.recorded_topk_idx = None  # (None after the call: the router was not reached)
                try:
                    out = forward(*a, **k)
                finally:  # (also when the recompute stops early, past the router)
                    chosen = replay.recorded_topk_idx
                    replay.router_replay_action, replay.target_topk_idx = action, target
                    if again or action is not RouterReplayAction.RECORD:  # (a RECORD asked for keeps its rows)
                        replay.recorded_topk_idx = recorded
                    if again and not replayed and chosen is not None and not torch.equal(chosen, first["rows"]):
                        raise RuntimeError("activation recompute: a router chose other experts than in the forward "
                                           "(non-deterministic kernels?); learner.max_tokens_per_chunk=0 turns the "
                                           "recompute off")
                if not again:
                    first.update(replayed=replayed, rows=target if replayed else chosen)
                return out

            return checkpoint(layer_forward, *args, use_reentrant=False, **kwargs)

        return run


def megatron_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s parameters and the state buffers a checkpoint carries (the sigmoid routers' ``expert_bias``,
    GLM's score-correction bias: a buffer, no gradient), by Megatron name."""
    out = dict(model.named_parameters())
    out.update((n, b) for n, b in model.named_buffers() if n.endswith(".router.expert_bias"))
    return out


def load_megatron(model: nn.Module, sd: dict[str, torch.Tensor]) -> None:
    """Copy Megatron-named tensors into ``model``'s parameters and checkpointed buffers (:func:`megatron_tensors`;
    cast to their dtype).

    Raises:
        RuntimeError: a parameter without a tensor, or a tensor without a parameter.
    """
    params = megatron_tensors(model)
    if set(params) != set(sd):
        raise RuntimeError(f"Megatron weights: missing {sorted(set(params) - set(sd))[:5]}, "
                           f"unexpected {sorted(set(sd) - set(params))[:5]}")
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(sd[n])


def router_topk(router: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A megatron-core ``TopKRouter``'s own choice for its input ``x`` ``[..., H]``: int64 ``[N, K]`` expert ids
    (N tokens, best first), what it picks without replay, in float32 as it routes: the top-k of its logits
    (softmax routers: the softmax keeps their order), or of the sigmoid scores plus its ``expert_bias``, within
    its best groups when group-limited (megatron-core 0.16.1 ``topk_routing_with_score_function`` and
    ``group_limited_topk``, transformer/moe/moe_utils.py)."""
    c = router.config
    scores = x.reshape(-1, x.shape[-1]).float() @ router.weight.float().t()  # [N, E]
    if c.moe_router_score_function == "sigmoid":
        scores = scores.sigmoid() + (router.expert_bias if router.expert_bias is not None else 0.0)
    if c.moe_router_group_topk:
        return group_limited_topk(scores, c.moe_router_topk, scores.shape[0], scores.shape[1], c.moe_router_num_groups,
                                  c.moe_router_group_topk)[1]
    return scores.topk(c.moe_router_topk, dim=-1).indices


def replay_rows(routed: torch.Tensor, num_experts: int, lengths: torch.Tensor | None = None,
                expert_parallel: int = 1) -> list[torch.Tensor]:
    """Routed experts [B, T, L, K] -> Megatron's replay rows: per layer, int64 [T * B, K] in its
    token order (sequence-major: row s * B + b is token s of sequence b).

    Megatron builds a token's routing map by scattering its K ids, so a repeated id within a row
    would silently route to fewer than K experts and break the dispatcher's token count. Padded
    positions (``t >= lengths[b]``) get K distinct ids, spread evenly over the experts and the
    ``expert_parallel`` ranks (:func:`t1async.learner.rl.fill_padding_routes`).

    Raises:
        ValueError: a real row repeats an expert id (the sampler's rows never do).
    """
    B, T, L, K = routed.shape
    r = routed.long()
    if lengths is not None:
        pad = torch.arange(T, device=r.device)[None, :] >= lengths.to(r.device)[:, None]  # [B, T]
        r = fill_padding_routes(r, pad, num_experts, expert_parallel)
    s = r.sort(dim=-1).values
    if K > 1 and bool((s[..., 1:] == s[..., :-1]).any()):
        b, t, layer = (s[..., 1:] == s[..., :-1]).any(-1).nonzero()[0].tolist()
        raise ValueError(f"routed experts repeat an expert id at sequence {b}, token {t}, layer {layer}: "
                         f"{r[b, t, layer].tolist()}; Megatron's replay needs K distinct ids per row")
    return [r[:, :, layer].transpose(0, 1).reshape(T * B, K) for layer in range(L)]
