"""The ``megatron`` learner backend: megatron-core 0.16.1's GPTModel as policy, critic and reference.

The interface is t1async/backend.py; the Hugging Face <-> Megatron weight layouts are
t1async/megatron_convert.py. What it builds (facts in ../shared/DESIGN.md §3, read from
megatron-core 0.16.1's sources):

- the local layer spec (``get_gpt_layer_local_spec``, no Transformer Engine): RMSNorm, q/k
  layernorm, SwiGLU experts (``SequentialMLP``), no biases, RoPE (rotate-half), softmax router
  in float32 (``moe_router_dtype='fp32'``; bf16 routers fail in backward), top-k renormalised
  (``moe_router_pre_softmax=False``) when ``norm_topk_prob``, no aux loss, no dropout;
- routing replay (R3) with megatron-core's own ``RouterReplay`` (``moe_enable_routing_replay``,
  unfused router: the fused path skips replay): REPLAY_FORWARD with the sampler's rows, RECORD to
  read what the router chose; indices are set and cleared around every forward;
- the critic: the same trunk (its own copy, its own router, no replay) whose ``output_layer`` is
  a float32 ``Linear(hidden, 1)`` with a bias on the final-norm hidden states, as
  t1async/torch_backend.py's ``ValueModel``;
- AdamW and global-norm clipping shared with the torch backend (t1async/backend.py); with one
  process this is the whole distributed optimizer's job.

Initial weights are t1async/model.py's (same seed, same numbers as the torch backend), converted.

On CPU megatron-core 0.16.1 runs with three shims, applied only when CUDA is absent:
``torch.cuda.current_device`` returns the CPU device (routers move their weight to it), an
inference RNG tracker (no CUDA RNG), and ``moe_utils.te_general_gemm = None`` (it is otherwise
called without Transformer Engine). A causal mask is passed explicitly on CPU (the default one is
built on CUDA). The ``alltoall`` dispatcher needs CUDA.

Parallelism: expert parallelism P (``learner.megatron.expert_parallel``, P dividing the number of
experts) times tensor parallelism T (``tensor_parallel``) times pipeline parallelism S
(``pipeline_parallel``) over N = T x S x P processes (t1async/megatron_ranks.py). This object in
the learner is rank 0; it starts ranks 1..N-1 as Ray actors, all join one torch.distributed world
(gloo on CPU, nccl on CUDA) and Megatron's groups (T, S, expert_model_parallel_size=P; rank =
tp_rank + T dp_rank + T P pp_rank), and each builds its GPTModels with its stage's L/S layers, its
own E/P experts per MoE layer and its own 1/T slices (weights sent from rank 0, sliced by
t1async/megatron_convert.py). Every call is announced by rank 0 and run by every rank. Across the
P expert-parallel ranks the data is split (data parallelism, as Megatron lays out EP within DP);
the T tensor-parallel ranks and the S stages of one of them work on the same rows, while the
learner's loop and the LearnerBackend interface stay as with one process.

Pipeline parallelism: stage s > 0 receives its input hidden states from stage s - 1 (the rank
of the same tensor- and data-parallel coordinates, point-to-point) and the last stage computes
the outputs; in the backward the gradients of those hidden states go back stage by stage. One
micro-batch at a time, the stages one after another (no 1F1B schedule: this shards the layers and
their optimiser state, it does not overlap stages). Each stage's routers replay and record their
own layers' rows.

Tensor parallelism, as megatron-core lays it out: attention heads (query groups), the vocabulary
(embedding and LM head) and each expert's MLP width are split over the T ranks, with sequence
parallelism (megatron-core requires it for MoE with TP): between the split layers each rank holds
1/T of the sequence, so norms and routers run on that slice. Hence:

- sequences are right-padded to a multiple of T (token 0, distinct replay ids), outputs cut back;
- the sampler's replay rows are sliced per rank (its routers see its part of the sequence), and
  the routing each rank records is all-gathered back in sequence order;
- the LM head's vocabulary slices are all-gathered before the log-probs (the sampler's top-k /
  top-p processing needs every logit); the critic's head runs on the sequence slice and its
  values are all-gathered;
- norms are megatron's local-spec RMSNorm made to accept sequence parallelism (:class:`_Norm`;
  megatron-core 0.16.1's ``WrappedTorchNorm`` asserts it is off).

Data parallelism within the expert-parallel group (N below is P, the expert-parallel size):

- forward: a micro-batch ``[B, T]`` (int64 token ids, integer replay ``[B, T, L, K]``) is dealt by
  rows (:func:`deal_rows`): rank r forwards the contiguous chunk r of ``ceil(B/N)`` rows; the last
  chunks are filled up with dummy copies of row 0 (and its replay rows), so every rank forwards
  the same number of tokens, at least one row (Megatron's dispatcher exchanges equal token counts
  between all ranks of the group) and the code path is the same for every B. Rank 0 alone receives
  the micro-batch; each follower is sent only its own rows.
- outputs: each rank's log-probs (float32), outside flags (bool), routing tensors (int64
  ``[b, T, L, K]``), values and reference log-probs are gathered to rank 0, dummy rows dropped,
  and returned as the ``[B, ...]`` tensors one process returns (``PolicyForward`` etc.).
- backward: the learner computes its scalar loss on rank 0 from those tensors;
  :meth:`MegatronBackend.backward` takes its gradient w.r.t. them, splits it by rows as the forward
  was split (dummy rows: zeros), sends each rank only its rows' part (a scatter), and every rank
  backpropagates its own outputs with it (the dispatcher's collectives run in that backward).
- gradients: each token reaches its experts once, so an expert's gradient, on the ranks that
  hold its slices, is the whole micro-batch's, unscaled; the other sliced gradients hold one
  data-parallel rank's rows and are summed over the data-parallel group, whole weights (norms,
  routers, the critic's head) are summed over the stage's tensor- and data-parallel ranks
  (:meth:`MegatronBackend._clip`). The clip norm is the true global norm over every distinct
  slice; every rank clips with it and steps AdamW on its own parameters (verified against the
  torch backend to 1e-5 in tests/test_megatron.py, with B = 1, 2 and 5, TP x EP x PP = 1x2x1,
  2x1x1, 1x1x2, 2x2x1 and 1x2x2).

Checkpoints and the weight broadcast gather every rank's experts, slices and stages to rank 0 in HF layout
(one HF checkpoint, loadable by one process or other parallel sizes); optimiser state is one file per rank
(``optimizers.pt``, ``optimizers-rank{r}.pt``).

What this buys: each rank holds 1/S of the layers, 1/P of their experts (and their AdamW
moments) and 1/T of the attention and vocabulary, and computes 1/P of each micro-batch's rows
(1/T of each of their layers). Speed needs a micro-batch of at least P rows (B = 1 leaves P-1 expert-parallel ranks a
dummy row each) and devices that compute in parallel; the dispatcher's all-gather /
reduce-scatter, sequence parallelism's per-layer all-gathers and reduce-scatters, the
announcements, the output gathers and the gradient all-reduces come on top
(tools/bench_expert_parallel.py). The loss normalisers and advantage statistics stay the learner's
(rank 0 holds every output), so nothing of the RL maths is reduced across ranks.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.nn.functional as F
from loguru import logger
from torch import nn

from t1async.backend import ONE_PROCESS, AdamWPair, MasterWeightAdamW, PolicyForward
from t1async.config import GenerationConfig, LearnerConfig, MegatronConfig, ModelConfig, tensor_parallel_sizes
from t1async.megatron_convert import CRITIC, POLICY, hf_to_megatron, megatron_to_hf, merge_tp, shard_tp, tp_partition
from t1async.megatron_ranks import (RankGroup, all_reduce_, all_reduce_sum, expert_owner, from_bytes, gather_bytes,
                                    gather_tensors, leave_world, scatter_bytes, scatter_flat, share_state, to_bytes)
from t1async.model import save_hf
from t1async.rl import token_logprobs
from t1async.torch_backend import ValueModel, chunked_token_logprobs, load_policy
from t1async.weight_sync import is_expert

try:
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.mappings import (gather_from_sequence_parallel_region,
                                                        gather_from_tensor_model_parallel_region)
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
    from megatron.core.transformer.transformer_config import TransformerConfig
except ImportError as e:  # the optional extra
    raise ImportError(f"learner.backend=megatron needs megatron-core: pip install 't1async[megatron]' ({e})") from None

__all__ = ["MegatronBackend", "build_gpt", "deal_rows", "init_megatron", "replay_rows", "transformer_config"]


def init_megatron(device: torch.device, seed: int = 0, *, expert_parallel: int = 1, tensor_parallel: int = 1,
                  pipeline_parallel: int = 1) -> None:
    """Make this process a Megatron rank (idempotent).

    With every size 1: starts torch.distributed's default group if it is not started (gloo on
    CPU, nccl on CUDA, world size 1, an in-memory store) and Megatron's model-parallel groups (all
    sizes 1), first leaving a world of another shape (a closed multi-rank backend's in this
    process). Otherwise the world of ``tensor_parallel x pipeline_parallel x expert_parallel``
    ranks and Megatron's groups were formed by t1async/megatron_ranks.py; this checks their sizes.
    Then
    Megatron's RNG tracker; on CPU the shims described in the module docstring. The learner's
    weight broadcast uses its own process groups (t1async/weight_sync.py), never the default one.

    Raises:
        RuntimeError: several ranks asked for without a world of that shape.
    """
    import torch.distributed as dist

    if device.type == "cpu" and not torch.cuda.is_available():
        torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
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
                           f"expert_parallel={expert_parallel} needs a world of that shape (t1async/megatron_ranks.py)")
    from megatron.core.tensor_parallel import random as mrandom

    if device.type == "cpu":
        mrandom.initialize_rng_tracker(inference_rng_tracker=True)
    elif not mrandom.get_cuda_rng_tracker().is_initialized():
        mrandom.model_parallel_cuda_manual_seed(seed)


def transformer_config(cfg: ModelConfig, *, replay: bool, dtype: torch.dtype, device: torch.device,
                       dispatcher: str = "auto", expert_parallel: int = 1, tensor_parallel: int = 1,
                       pipeline_parallel: int = 1) -> TransformerConfig:
    """Megatron's TransformerConfig for the HF Qwen3-MoE architecture ``cfg`` (the parallel sizes
    must match Megatron's initialised groups).
    ``tensor_parallel`` > 1 turns on sequence parallelism, which megatron-core requires for MoE
    with tensor parallelism (experts are split over the tensor-parallel ranks too).

    Raises:
        ValueError: ``alltoall`` asked for on CPU.
    """
    if dispatcher == "auto":
        dispatcher = "alltoall" if device.type == "cuda" else "allgather"
    if dispatcher == "alltoall" and device.type != "cuda":
        raise ValueError("learner.megatron.dispatcher=alltoall needs CUDA; use allgather on CPU")
    return TransformerConfig(
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


class _ValueHead(nn.Module):
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


class _LMHead(nn.Module):
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


class _Norm(nn.RMSNorm):
    """Megatron's local-spec norm (``WrappedTorchNorm`` builds ``torch.nn.RMSNorm(hidden, eps)``,
    the same module and numbers) that also runs under sequence parallelism, which megatron-core
    0.16.1's wrapper refuses. A norm is per token, so it runs unchanged on a rank's slice of the
    sequence; its weight's gradient then holds that slice's share and is marked
    ``sequence_parallel`` (summed over the tensor-parallel ranks, as Megatron's TE norm is)."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_: object):
        if config.normalization != "RMSNorm":
            raise ValueError(f"t1async's Megatron spec has RMSNorm only, got {config.normalization}")
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel


def _with_norm(spec, norm: type) -> None:
    """Replace ``WrappedTorchNorm`` by ``norm`` everywhere in a Megatron module spec (in place)."""
    import dataclasses

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
    replaced by :class:`_Norm`, the same RMSNorm that also runs under sequence parallelism.

    Raises:
        RuntimeError: the converted weights do not cover the model's parameters exactly.
    """
    tc = transformer_config(cfg, replay=replay, dtype=dtype, device=device, dispatcher=dispatcher,
                            expert_parallel=ep_size, tensor_parallel=tp_size, pipeline_parallel=pp_size)
    layer = get_gpt_layer_local_spec(num_experts=cfg.num_experts, moe_grouped_gemm=False, qk_layernorm=True,
                                     normalization="RMSNorm")
    block = TransformerBlockSubmodules(layer_specs=[layer] * (cfg.num_hidden_layers // pp_size), layer_norm=_Norm)
    _with_norm(block, _Norm)
    last = pp_rank == pp_size - 1
    model = GPTModel(tc, block, vocab_size=cfg.vocab_size, max_sequence_length=cfg.max_position_embeddings,
                     position_embedding_type="rope", rotary_base=cfg.rope_theta,
                     share_embeddings_and_output_weights=cfg.tie_word_embeddings and not critic,
                     pre_process=pp_rank == 0, post_process=last)
    if critic and last:
        model.output_layer = _ValueHead(cfg.hidden_size, device, sequence_parallel=tp_size > 1)
    elif last:
        model.output_layer = _LMHead(model.output_layer, sequence_parallel=tp_size > 1, tensor_parallel=tp_size)
    model.to(device)
    RouterReplay.clear_global_router_replay_instances()  # each router keeps its own; no process-wide list
    layout = CRITIC if critic else POLICY
    load_megatron(model, shard_tp(hf_to_megatron(hf, cfg, layout, ep_rank=ep_rank, ep_size=ep_size, pp_rank=pp_rank,
                                                 pp_size=pp_size), layout, tp_rank, tp_size))
    return model


def load_megatron(model: nn.Module, sd: dict[str, torch.Tensor]) -> None:
    """Copy Megatron-named tensors into ``model``'s parameters (cast to their dtype).

    Raises:
        RuntimeError: a parameter without a tensor, or a tensor without a parameter.
    """
    params = dict(model.named_parameters())
    if set(params) != set(sd):
        raise RuntimeError(f"Megatron weights: missing {sorted(set(params) - set(sd))[:5]}, "
                           f"unexpected {sorted(set(sd) - set(params))[:5]}")
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(sd[n])


def replay_rows(routed: torch.Tensor, num_experts: int, lengths: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Routed experts [B, T, L, K] -> Megatron's replay rows: per layer, int64 [T * B, K] in its
    token order (sequence-major: row s * B + b is token s of sequence b).

    Megatron builds a token's routing map by scattering its K ids, so a repeated id within a row
    would silently route to fewer than K experts and break the dispatcher's token count. Padded
    positions (``t >= lengths[b]``) get the distinct ids ``arange(K) % num_experts``.

    Raises:
        ValueError: a real row repeats an expert id (the sampler's rows never do).
    """
    B, T, L, K = routed.shape
    r = routed.long()
    if lengths is not None:
        pad = torch.arange(T, device=r.device)[None, :] >= lengths.to(r.device)[:, None]  # [B, T]
        r = torch.where(pad[:, :, None, None], torch.arange(K, device=r.device) % num_experts, r)
    s = r.sort(dim=-1).values
    if K > 1 and bool((s[..., 1:] == s[..., :-1]).any()):
        b, t, layer = (s[..., 1:] == s[..., :-1]).any(-1).nonzero()[0].tolist()
        raise ValueError(f"routed experts repeat an expert id at sequence {b}, token {t}, layer {layer}: "
                         f"{r[b, t, layer].tolist()}; Megatron's replay needs K distinct ids per row")
    return [r[:, :, layer].transpose(0, 1).reshape(T * B, K) for layer in range(L)]


# calls rank 0 announces to its followers (each runs MegatronBackend._<name>)
FOLLOWER_OPS = frozenset({"forward_policy", "forward_values", "forward_reference", "zero_grad", "backward_outputs",
                          "step", "gather_hf", "save_optimizers", "load_rank_optimizers", "load_hf", "forward_counts"})


def _cpu_state(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu() for k, v in sd.items()}


def deal_rows(batch: int, ranks: int) -> list[torch.Tensor]:
    """The rows of a ``[batch, T]`` micro-batch each of ``ranks`` ranks forwards: contiguous
    chunks of ``ceil(batch / ranks)`` row indices (int64), rank r the r-th; the last chunks are
    filled up with row 0 (dummy rows: forwarded, never returned, zero output gradient), so every
    rank forwards the same number of rows (Megatron's dispatcher exchanges equal token counts)
    and at least one.

    Raises:
        ValueError: ``batch`` < 1 or ``ranks`` < 1.
    """
    if batch < 1 or ranks < 1:
        raise ValueError(f"deal_rows: batch={batch} and ranks={ranks} must be >= 1")
    per = -(-batch // ranks)
    idx = torch.arange(per * ranks)
    idx[idx >= batch] = 0
    return list(idx.view(ranks, per))


class ShardedAdamW:
    """AdamW for one rank of a data-parallel group: its own weights (``own``: the experts) through
    :class:`t1async.backend.MasterWeightAdamW`, and the weights every rank of the group holds
    (``replicated``, identical on each, their gradients already summed over the group) with
    ZeRO stage 1 (Rajbhandari et al. 2020; megatron-core's distributed optimizer): their float32
    masters and AdamW moments are one flat buffer split into ``size`` contiguous shards, this rank
    keeps and steps shard ``rank`` only, and the updated shards are all-gathered into every rank's
    weights (rounded to their dtype). AdamW is elementwise, so the weights after a step are those
    of unsharded AdamW, bit for bit.

    Args:
        own, replicated: parameters. lr, weight_decay: AdamW's. group, rank, size: the
            data-parallel process group, this rank's index in it and its size.

    Behaves as an optimiser for the backend: ``param_groups`` (both parts' groups, so a learning
    rate set on each reaches both), ``zero_grad``, ``step``, ``state_dict``, ``load_state_dict``.
    """

    def __init__(self, own, replicated, *, lr: float, weight_decay: float, group, rank: int, size: int):
        self.own = MasterWeightAdamW(own, lr=lr, weight_decay=weight_decay)
        self.replicated = list(replicated)
        self.group, self.rank, self.size = group, rank, size
        self.numel = sum(p.numel() for p in self.replicated)
        self.per = -(-self.numel // size)
        lo = rank * self.per
        flat = self._flat([p.detach() for p in self.replicated])
        self.shard = flat[lo:lo + self.per].clone()  # float32 masters of this rank's shard (a leaf)
        self.opt = torch.optim.AdamW([self.shard], lr=lr, weight_decay=weight_decay)

    def _flat(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """The replicated weights' tensors as one float32 vector, zero-padded to size x per."""
        dev = self.replicated[0].device if self.replicated else torch.device("cpu")
        parts = [t.float().reshape(-1) for t in tensors]
        return torch.cat(parts + [torch.zeros(self.per * self.size - self.numel, device=dev)])

    @property
    def param_groups(self) -> list[dict]:
        return self.own.param_groups + self.opt.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.own.zero_grad(set_to_none)
        for p in self.replicated:
            p.grad = None
        self.shard.grad = None

    @torch.no_grad()
    def step(self) -> None:
        """Step the own weights, then this rank's shard (its slice of the summed gradients), then
        all-gather the shards into every replicated weight."""
        import torch.distributed as dist

        self.own.step()
        if not self.replicated:
            return
        lo = self.rank * self.per
        grads = self._flat([p.grad if p.grad is not None else torch.zeros_like(p) for p in self.replicated])
        self.shard.grad = grads[lo:lo + self.per].clone()
        del grads
        self.opt.step()
        full = self.shard.new_empty(self.per * self.size)
        dist.all_gather_into_tensor(full, self.shard.detach(), group=self.group)
        at = 0
        for p in self.replicated:
            p.copy_(full[at:at + p.numel()].view_as(p))
            at += p.numel()

    def state_dict(self) -> dict:
        return {"own": self.own.state_dict(), "shard": self.opt.state_dict(), "master_shard": self.shard.detach().clone(),
                "shard_of": [self.rank, self.size, self.numel]}

    @torch.no_grad()
    def load_state_dict(self, sd: dict) -> None:
        """Raises: ValueError: a state saved for another shard (rank, group size or weight count)."""
        if list(sd.get("shard_of", [])) != [self.rank, self.size, self.numel]:
            raise ValueError(f"optimiser state of shard {sd.get('shard_of')} (rank, ranks, weights), this rank "
                             f"holds {[self.rank, self.size, self.numel]}")
        self.own.load_state_dict(sd["own"])
        self.opt.load_state_dict(sd["shard"])
        self.shard.copy_(sd["master_shard"])


class MegatronBackend(AdamWPair):
    """Policy (with routing replay), critic and, with ``cfg.kl_coef`` > 0, a frozen reference as
    megatron-core GPTModels; settings in ``cfg.megatron`` (:class:`t1async.config.MegatronConfig`).

    With ``cfg.megatron.expert_parallel`` N > 1 this object is rank 0 of N processes (module
    docstring): it starts ranks 1..N-1 (t1async/megatron_ranks.py, Ray must be initialised) and
    every public call runs on every rank; each rank holds E/N experts of each MoE layer and
    forwards its share of each micro-batch's rows. What it returns (tensors on rank 0's device)
    and what it saves are the same as with one process.

    Args:
        cfg, model_cfg, generation, init: as :class:`t1async.backend.LearnerBackend`.
        device, dtype: override ``cfg.megatron.device`` / ``dtype`` (the bench uses them).
        ranks: set on a follower rank only (t1async/megatron_ranks.py ``Follower``): its place
            in the world; its weights come from rank 0, not from ``init``.

    Raises:
        ValueError: a pipeline-parallel size other than 1, an expert-parallel size that does not
            divide ``model_cfg.num_experts``, a tensor-parallel size that does not divide the
            attention heads, key/value heads, vocabulary and expert width, alltoall on CPU, a
            checkpoint of another architecture. RuntimeError: several ranks without Ray
            initialised. megatron_ranks.RankFailed: a follower rank failed to start or join.
    """

    name = "megatron"

    def __init__(self, cfg: LearnerConfig, model_cfg: ModelConfig, generation: GenerationConfig,
                 init: str | Path | None = None, *, device: str | torch.device | None = None,
                 dtype: torch.dtype | None = None, ranks: RankGroup | None = None):
        mc: MegatronConfig = cfg.megatron
        ep, tp, pp = mc.expert_parallel, mc.tensor_parallel, mc.pipeline_parallel
        if pp < 1 or model_cfg.num_hidden_layers % pp:
            raise ValueError(f"learner.megatron.pipeline_parallel={pp} must divide model.num_hidden_layers="
                             f"{model_cfg.num_hidden_layers}")
        if pp > 1 and model_cfg.tie_word_embeddings:
            raise ValueError("learner.megatron.pipeline_parallel > 1 with model.tie_word_embeddings: the tied "
                             "embedding and LM head would sit on two stages, whose gradients t1async does not sum")
        if ep < 1 or model_cfg.num_experts % ep:
            raise ValueError(f"learner.megatron.expert_parallel={ep} must divide model.num_experts="
                             f"{model_cfg.num_experts}")
        split = tensor_parallel_sizes(model_cfg)
        if tp < 1 or any(v % tp for v in split.values()):
            raise ValueError(f"learner.megatron.tensor_parallel={tp} must divide each of {split}")
        self.cfg, self.generation, self.model_cfg = cfg, generation, model_cfg
        want = device or mc.device
        if want == "auto":
            want = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(want)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = dtype or {"float32": torch.float32, "bfloat16": torch.bfloat16}[mc.dtype]
        self.expert_parallel, self.tensor_parallel, self.pipeline_parallel = ep, tp, pp
        self.world = ep * tp * pp
        self.distributed_optimizer = bool(mc.distributed_optimizer and ep > 1)
        self._outputs: list[torch.Tensor] = []  # this rank's outputs with a graph since the last backward (ranks > 1)
        self._stage_io: list[tuple[torch.Tensor | None, torch.Tensor | None]] = []  # pipeline: (input, output) with a graph
        self._returned: list[torch.Tensor] = []  # rank 0: the gathered [B, ...] leaves it returned for them
        self.forwarded = {"forwards": 0, "rows": 0, "tokens": 0}  # this rank's model forwards since it was built
        if self.world > 1 and ranks is None:
            ranks = RankGroup.start(self.world, self.device, mc.timeout_s, dict(
                cfg=cfg, model_cfg=model_cfg, generation=generation, device=self.device.type, dtype=self.dtype,
                threads=torch.get_num_threads()), tensor_parallel=tp, pipeline_parallel=pp)
        self._ranks = ranks
        self._lock = threading.RLock()
        self.rank = ranks.rank if ranks is not None else 0
        # Megatron's rank order: tensor parallel innermost, pipeline outermost (t1async/megatron_ranks.py);
        # dp_rank = the expert-parallel rank
        self.tp_rank, self.dp_rank, self.pp_rank = self._coords(self.rank)
        try:
            init_megatron(self.device, expert_parallel=ep, tensor_parallel=tp, pipeline_parallel=pp)
            if self.world > 1:
                got = (parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_data_parallel_rank(),
                       parallel_state.get_pipeline_model_parallel_rank())
                if got != (self.tp_rank, self.dp_rank, self.pp_rank):
                    raise RuntimeError(f"rank {self.rank}: Megatron's (tp, dp, pp) ranks are {got}, t1async's "
                                       f"{(self.tp_rank, self.dp_rank, self.pp_rank)}")
            if ranks is not None and self.rank == 0:
                ranks.run(lambda: self._build(init))  # a follower failing meanwhile is named
            else:
                self._build(init)
        except BaseException:
            if ranks is not None and self.rank == 0:  # (the followers may wait mid-collective: no goodbye)
                ranks.kill()
                leave_world()
            raise
        self._init_optimizers()

    def _init_optimizers(self) -> None:
        """AdamW for policy and critic (:class:`t1async.backend.AdamWPair`); with several
        data-parallel ranks and ``learner.megatron.distributed_optimizer``, :class:`ShardedAdamW`."""
        if not self.distributed_optimizer:
            return AdamWPair._init_optimizers(self)
        cfg, dp = self.cfg, self.expert_parallel

        def sharded(model: nn.Module, lr: float) -> ShardedAdamW:
            named = list(model.named_parameters())
            return ShardedAdamW([p for k, p in named if is_expert(k)], [p for k, p in named if not is_expert(k)],
                                lr=lr, weight_decay=cfg.weight_decay, group=parallel_state.get_data_parallel_group(),
                                rank=self.dp_rank, size=dp)

        self.policy_opt = sharded(self.policy, cfg.lr)
        self.critic_opt = sharded(self.critic, cfg.critic_lr) if self.critic is not None else None

    def _build(self, init: str | Path | None) -> None:
        """Policy, critic, reference: rank 0 loads them (the torch backend's initial weights, same
        seed, same numbers, or the checkpoint ``init``), converted; followers get theirs from it."""
        cfg, mc = self.cfg, self.cfg.megatron
        lead = self.rank == 0
        hf_policy = load_policy(self.model_cfg, init) if lead else None
        policy_sd = hf_policy.state_dict() if lead else None
        critic_sd = ValueModel(hf_policy).state_dict() if lead and cfg.critic else None
        ref_sd = None
        if lead and cfg.kl_coef > 0:
            ref_sd = load_policy(self.model_cfg, cfg.init_checkpoint).state_dict() if cfg.init_checkpoint else policy_sd
        kw = dict(dtype=self.dtype, device=self.device, dispatcher=mc.dispatcher, ep_rank=self.dp_rank,
                  ep_size=self.expert_parallel, tp_rank=self.tp_rank, tp_size=self.tensor_parallel)
        self._num_parameters = sum(p.numel() for p in hf_policy.parameters()) if lead else 0
        kw.update(pp_rank=self.pp_rank, pp_size=self.pipeline_parallel)
        self.policy = build_gpt(self.model_cfg, self._share(policy_sd), replay=True, **kw)
        self.critic = (build_gpt(self.model_cfg, self._share(critic_sd), critic=True, **kw) if cfg.critic
                       else None)  # learner.critic: false builds none
        self.reference: GPTModel | None = None
        if cfg.kl_coef > 0:
            self.reference = build_gpt(self.model_cfg, self._share(ref_sd), **kw).eval().requires_grad_(False)
        del hf_policy, policy_sd, critic_sd, ref_sd
        if self.tensor_parallel > 1:  # _clip sums a gradient over the ranks by what the weight is: check each is known
            for model, layout in ((self.policy, POLICY), (self.critic, CRITIC)):
                for k, p in model.named_parameters() if model is not None else ():
                    if not (is_expert(k) or tp_partition(k, layout) is not None
                            or getattr(p, "sequence_parallel", False)):
                        raise RuntimeError(f"Megatron weight {k} is neither split over the tensor-parallel ranks "
                                           "nor marked sequence_parallel: its gradient would not be summed right")
        self._routers = [layer.mlp.router for layer in self.policy.decoder.layers]  # this stage's layers
        self._first_layer = self.pp_rank * len(self._routers)
        self._router_inputs: list[torch.Tensor | None] = [None] * len(self._routers)
        for i, r in enumerate(self._routers):
            r.register_forward_pre_hook(lambda mod, args, i=i: self._keep_router_input(i, args[0]))
        self._capture = False
        self._masks: dict[int, torch.Tensor] = {}

    def _share(self, sd: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        """Rank 0's HF state dict ``sd`` on this rank: the shared weights and this rank's experts
        (whole: this rank slices its tensor-parallel part when it converts them)."""
        if self.world == 1:
            return sd
        E, n = self.model_cfg.num_experts, self.expert_parallel
        return share_state(self._ranks, sd, lambda k: expert_owner(k, E, n) in (None, self.dp_rank), self.device)

    # ---- announced calls ----------------------------------------------------------------
    def _call(self, op: str, *args, parts: list[tuple] | None = None, **leader):
        """Run ``self._<op>(*args, **leader)`` here and, with followers, ``self._<op>(*args)`` on
        each of them (``leader``: keyword arguments for rank 0 only, never sent). With ``parts``
        (one argument tuple per rank) rank r runs ``self._<op>(*parts[r])`` instead, each
        follower receiving only its own part."""
        local = getattr(self, "_" + op)
        mine = args if parts is None else parts[0]
        if self.world == 1 or self.rank != 0:
            return local(*mine, **leader)
        with self._lock:  # one announced call at a time (the learner may close from another thread)
            ranks = self._ranks
            if ranks is None:
                raise RuntimeError("the megatron backend's ranks were closed")
            ranks.check()

            def both():
                ranks.announce(op, args, parts)
                return local(*mine, **leader)

            return ranks.run(both)

    def _call_rows(self, op: str, rows: tuple[torch.Tensor | None, ...], *args):
        """An announced forward of a micro-batch split by rows (:func:`deal_rows`) over the
        data-parallel (= expert-parallel) ranks: rank r runs ``self._<op>(*(its rows of each of
        rows), *args, B)``, the tensor-parallel ranks of one data-parallel rank the same rows;
        ``B`` = the micro-batch's rows (``rows[0].shape[0]``); None stays None. One process: the
        whole micro-batch."""
        B = rows[0].shape[0]
        if self.world == 1:
            return self._call(op, *rows, *args, B)
        dealt = [tuple(None if t is None else t[i.to(t.device)] for t in rows) + (*args, B)
                 for i in deal_rows(B, self.expert_parallel)]
        return self._call(op, parts=[dealt[self._coords(r)[1]] for r in range(self.world)])

    def _coords(self, rank: int) -> tuple[int, int, int]:
        """(tensor-, data-, pipeline-parallel rank) of world rank ``rank`` in Megatron's order
        (tp-cp-ep-dp-pp: rank = tp_rank + T dp_rank + T P pp_rank)."""
        tp, dp = self.tensor_parallel, self.expert_parallel
        return rank % tp, (rank // tp) % dp, rank // (tp * dp)

    def _rank_at(self, tp_rank: int, dp_rank: int, pp_rank: int) -> int:
        """Inverse of :meth:`_coords`."""
        return tp_rank + self.tensor_parallel * (dp_rank + self.expert_parallel * pp_rank)

    def _gather_rows(self, tensors: list[torch.Tensor | None], batch: int, grad: bool,
                     staged: tuple[bool, ...] = ()) -> list[torch.Tensor | None]:
        """Each rank's outputs of its rows -> the micro-batch's ``[batch, ...]`` outputs on rank 0
        (data-parallel rank order = row order, dummy rows dropped; None on followers), taken from
        the last pipeline stage (tensor-parallel rank 0), or, for the tensors ``staged`` marks
        (routing ``[b, T, L_s, K]`` of each stage's own layers), from every stage, concatenated
        along the layers. With ``grad`` the first tensor, when it has a graph, is kept for
        :meth:`backward` on every rank, and rank 0 returns it as a new leaf that requires grad (the
        learner's loss is differentiated w.r.t. it)."""
        if self.world == 1:
            return tensors
        first = tensors[0]
        if grad and first.requires_grad:
            self._outputs.append(first)
        present = [t for t in tensors if t is not None]
        sent = [t.to(torch.uint8) if t.dtype == torch.bool else t for t in present]
        parts = gather_tensors(self._ranks, sent)
        if self.rank != 0:
            return [None] * len(tensors)
        # the tensor-parallel ranks of one data-parallel rank hold the same outputs: take the first's
        staged = [st for st, t in zip(list(staged) + [False] * len(tensors), tensors) if t is not None]
        last = self.pipeline_parallel - 1
        rows = lambda p, stage: torch.cat([p[self._rank_at(0, d, stage)]  # noqa: E731
                                           for d in range(self.expert_parallel)])[:batch]
        full = iter([(torch.cat([rows(p, st) for st in range(last + 1)], 2) if stg else rows(p, last)).to(t.dtype)
                     for p, t, stg in zip(parts, present, staged)])
        out = [None if t is None else next(full) for t in tensors]
        if grad:  # (a pipeline's rank 0 holds a placeholder: the last stage's output has the graph)
            out[0] = out[0].requires_grad_()
            self._returned.append(out[0])
        return out

    def close(self) -> None:
        """Stop and kill the follower ranks and leave the world (a no-op with one process). Waits
        up to a minute for a call in progress on another thread, then kills the followers anyway
        (that call then fails)."""
        if self._ranks is None or self.rank != 0:
            return
        got = self._lock.acquire(timeout=60)
        try:
            ranks, self._ranks = self._ranks, None
            if ranks is None:
                return
            if got:
                ranks.close()
            else:
                logger.warning("megatron backend closing during a call: killing its other ranks")
                ranks.kill()
        finally:
            if got:
                self._lock.release()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # ---- forward ------------------------------------------------------------------------
    def _keep_router_input(self, i: int, x: torch.Tensor) -> None:
        if self._capture:
            self._router_inputs[i] = x.detach()

    def _run(self, model: GPTModel, inp: torch.Tensor) -> torch.Tensor | None:
        """GPTModel forward of inp [B, T]: the final-norm hidden states [B, T, H] of the policy or
        the reference (their head is :class:`_LMHead`, applied by :meth:`_logprobs`) or the
        critic's values [B, T, 1]. With tensor parallelism T must be a multiple of it
        (:meth:`_pad_tp`): sequence parallelism splits the sequence evenly over the ranks.

        With pipeline parallelism each stage but the first receives its input hidden states
        ``[T/TP, B, H]`` from the previous stage's rank of the same tensor- and data-parallel
        coordinates (``send``/``recv`` on the default group), and each stage but the last sends its
        output to the next one and returns None. With gradients on, the stage keeps (its received
        input, its sent output) for :meth:`_backward_outputs`, which runs the stages' backwards in
        reverse order, one forward after another (no overlap of stages: one micro-batch at a time).
        """
        import torch.distributed as dist

        B, T = inp.shape
        self.forwarded["forwards"] += 1
        self.forwarded["rows"] += B
        self.forwarded["tokens"] += B * T
        pos = torch.arange(T, device=self.device).expand(B, T)
        mask = None  # CUDA: Megatron's own causal mask
        if self.device.type == "cpu":
            if T not in self._masks:
                self._masks[T] = torch.ones(T, T, dtype=torch.bool).triu(1)[None, None]  # True: masked
            mask = self._masks[T]
        first, last = self.pp_rank == 0, self.pp_rank == self.pipeline_parallel - 1
        x = None
        if not first:
            x = torch.empty(T // self.tensor_parallel, B, self.model_cfg.hidden_size, dtype=self.dtype,
                            device=self.device)
            dist.recv(x, src=self._rank_at(self.tp_rank, self.dp_rank, self.pp_rank - 1))
            x.requires_grad_(torch.is_grad_enabled())
            model.set_input_tensor(x)
        out = model(inp.to(self.device), pos, mask)
        if not last:
            dist.send(out.detach().contiguous(), dst=self._rank_at(self.tp_rank, self.dp_rank, self.pp_rank + 1))
            if out.requires_grad:
                self._stage_io.append((x, out))
            return None
        if x is not None and torch.is_grad_enabled():
            self._stage_io.append((x, None))  # the last stage sends its input's gradient back
        return out

    def _logprobs(self, model: GPTModel, hidden: torch.Tensor, tgt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(float32 [B, T] log-probs of ``tgt`` under the sampling distribution, bool [B, T]
        outside flags) from ``model``'s final hidden states [B, T, H]. A sequence longer than
        ``learner.max_tokens_per_chunk`` runs the LM head and the log-probs that many positions
        at a time, each chunk recomputed in the backward (t1async/torch_backend.py
        ``chunked_token_logprobs``): the same log-probs, never the whole ``[T, V]`` logits."""
        g, head, c = self.generation, model.output_layer, self.cfg.max_tokens_per_chunk
        tgt = tgt.to(self.device)
        if c and hidden.shape[1] > c:
            return chunked_token_logprobs(head.logits, hidden, tgt, g, c)
        return token_logprobs(head.logits(hidden).float(), tgt, g.temperature, g.top_k, g.top_p, return_outside=True)

    def _pad_tp(self, inp: torch.Tensor, *more: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        """Right-pad ``[b, T, ...]`` tensors to a multiple of the tensor-parallel size in T
        (sequence parallelism splits the sequence evenly): token ids with 0, replay rows
        ``[b, T, L, K]`` with the distinct ids ``arange(K) % E``; None stays None. Causal attention
        keeps the real positions' results unchanged; callers cut the outputs back to T."""
        pad = -inp.shape[1] % self.tensor_parallel
        if pad == 0:
            return (inp, *more)
        out = []
        for t in (inp, *more):
            if t is None or t.dim() == 2:
                out.append(None if t is None else F.pad(t, (0, pad)))
            else:
                K = t.shape[-1]
                fill = (torch.arange(K, device=t.device) % self.model_cfg.num_experts).to(t.dtype)
                out.append(torch.cat([t, fill.expand(t.shape[0], pad, *t.shape[2:])], 1))
        return tuple(out)

    def _tp_tokens(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's ``[T/TP * b, ...]`` token rows (sequence-major, its slice of the sequence
        under sequence parallelism) -> every tensor-parallel rank's, ``[T * b, ...]`` in sequence
        order (no gradient). One rank: ``rows``."""
        if self.tensor_parallel == 1:
            return rows
        import torch.distributed as dist

        rows = rows.contiguous()
        out = rows.new_empty(rows.shape[0] * self.tensor_parallel, *rows.shape[1:])
        dist.all_gather_into_tensor(out, rows, group=parallel_state.get_tensor_model_parallel_group())
        return out

    def policy_logprobs(self, inp, tgt, replay, *, grad, routing) -> PolicyForward:
        """See :class:`t1async.backend.LearnerBackend`; with expert parallelism each rank forwards
        its rows and rank 0 returns the gathered ``[B, T]`` outputs (module docstring).

        Raises:
            ValueError: a replay row repeats an expert id (:func:`replay_rows`), before any rank runs.
        """
        if replay is not None and self.world > 1:
            replay_rows(replay, self.model_cfg.num_experts)  # refused here, before the ranks are told
        return self._call_rows("forward_policy", (inp, tgt, replay), grad, routing)

    def _forward_policy(self, inp, tgt, replay, grad, routing, batch) -> PolicyForward | None:
        """This rank's rows ``inp``, ``tgt`` [b, T] (``replay`` [b, T, L, K] or None) of a
        ``batch``-row micro-batch; returns the micro-batch's outputs on rank 0, None on followers."""
        B, T = inp.shape
        given = replay
        inp, tgt, replay = self._pad_tp(inp, tgt, replay)
        Tp, tp = inp.shape[1], self.tensor_parallel
        rows = replay_rows(replay, self.model_cfg.num_experts) if replay is not None else None
        replays = [r.router_replay for r in self._routers]
        if rows is not None:
            rows = rows[self._first_layer:self._first_layer + len(replays)]  # this pipeline stage's layers
            n = Tp // tp * B  # sequence parallelism: this rank's routers see its slice of the sequence
            for rr, row in zip(replays, rows):
                rr.set_target_indices(row[self.tp_rank * n:(self.tp_rank + 1) * n].to(self.device))
                rr.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        elif routing:
            for rr in replays:
                rr.set_router_replay_action(RouterReplayAction.RECORD)
        self._capture = routing
        try:
            with torch.set_grad_enabled(grad):
                hidden = self._run(self.policy, inp)
                if hidden is None:  # a pipeline stage before the last: placeholders for the gather
                    logp, outside = torch.zeros(B, T, device=self.device), torch.zeros(B, T, dtype=torch.bool,
                                                                                       device=self.device)
                else:
                    logp, outside = self._logprobs(self.policy, hidden, tgt)
                    logp, outside = logp[:, :T], outside[:, :T]
            used = own = None
            if routing:
                own = torch.stack([self._own_topk(r, x, B, Tp) for r, x in zip(self._routers, self._router_inputs)],
                                  2)[:, :T]
                if given is None:
                    used = torch.stack([self._tp_tokens(rr.get_recorded_indices()).view(Tp, B, -1).transpose(0, 1)
                                        for rr in replays], 2)[:, :T]
                else:
                    used = given.to(self.device).long()
        finally:
            self._capture = False
            self._router_inputs = [None] * len(self._routers)
            for rr in replays:
                rr.clear_indices()
                rr.clear_router_replay_action()
        out = self._gather_rows([logp, outside, used, own], batch, grad, staged=(False, False, given is None, True))
        return PolicyForward(*out) if out[0] is not None else None

    def _own_topk(self, router: nn.Module, x: torch.Tensor, B: int, T: int) -> torch.Tensor:
        """The router's own top-k [B, T, K] from its input (what it would choose without replay;
        with sequence parallelism its input is this rank's slice, the top-k rows are gathered)."""
        logits = x.reshape(-1, x.shape[-1]).float() @ router.weight.float().t()  # [T * B, E], float32 as it routes
        top = self._tp_tokens(logits.topk(self.model_cfg.num_experts_per_tok, dim=-1).indices)
        return top.view(T, B, -1).transpose(0, 1)

    def reference_logprobs(self, inp, tgt) -> torch.Tensor:
        if self.reference is None:
            raise RuntimeError("no reference policy: learner.kl_coef is 0")
        return self._call_rows("forward_reference", (inp, tgt))

    def _forward_reference(self, inp, tgt, batch) -> torch.Tensor | None:
        T = inp.shape[1]
        inp, tgt = self._pad_tp(inp, tgt)
        with torch.no_grad():
            hidden = self._run(self.reference, inp)
            logp = (torch.zeros(inp.shape[0], T, device=self.device) if hidden is None else
                    self._logprobs(self.reference, hidden, tgt)[0][:, :T])
        return self._gather_rows([logp], batch, False)[0]

    def values(self, inp, *, grad) -> torch.Tensor:
        if self.critic is None:
            raise RuntimeError("no critic: learner.critic is false")
        return self._call_rows("forward_values", (inp,), grad)

    def _forward_values(self, inp, grad, batch) -> torch.Tensor | None:
        T = inp.shape[1]
        (inp,) = self._pad_tp(inp)
        with torch.set_grad_enabled(grad):
            v = self._run(self.critic, inp)
            v = torch.zeros(inp.shape[0], T, device=self.device) if v is None else v.squeeze(-1)[:, :T]
        return self._gather_rows([v], batch, grad)[0]

    def forward_counts(self) -> list[dict[str, int]]:
        """Per rank (list index = rank): the model forwards it ran since it was built, the rows
        and the tokens (rows x positions, dummy rows included) they held."""
        return self._call("forward_counts")

    def _forward_counts(self) -> list[dict[str, int]] | None:
        keys = sorted(self.forwarded)
        mine = torch.tensor([self.forwarded[k] for k in keys], dtype=torch.int64, device=self.device)
        if self.world == 1:
            return [dict(self.forwarded)]
        parts = gather_tensors(self._ranks, [mine])
        return None if parts is None else [dict(zip(keys, map(int, p.tolist()))) for p in parts[0]]

    # ---- gradients and steps ------------------------------------------------------------
    def zero_grad(self) -> None:
        self._call("zero_grad")

    def _zero_grad(self) -> None:
        self._outputs, self._returned, self._stage_io = [], [], []
        AdamWPair.zero_grad(self)

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``; with several ranks: the gradient of ``loss`` w.r.t. the ``[B, ...]``
        outputs returned with a graph since the last backward (rank 0), split by rows as their
        forwards were (dummy rows: zeros), each rank sent only its data-parallel rank's part, and
        every rank backpropagates its own outputs with it (pipeline stages in reverse order).

        Raises:
            RuntimeError: no output with a graph was returned since the last backward.
        """
        if self.world == 1:
            loss.backward()
            return
        if not self._returned:
            raise RuntimeError("backward(): no policy log-probs or values with grad=True since the last backward")
        returned = self._returned
        grads = torch.autograd.grad(loss, returned, allow_unused=True)
        grads = [torch.zeros_like(o) if g is None else g for g, o in zip(grads, returned)]
        n = self.expert_parallel  # the data-parallel ranks; each of its tensor-parallel ranks gets the same part
        per_rank: list[list[torch.Tensor]] = [[] for _ in range(n)]
        shapes = []
        for g in grads:  # rank r's rows of each output, as deal_rows dealt them (dummy rows last): zeros there
            B, per = g.shape[0], -(-g.shape[0] // n)
            padded = torch.cat([g.float(), g.new_zeros(n * per - B, *g.shape[1:], dtype=torch.float32)])
            for r, part in enumerate(padded.split(per)):
                per_rank[r].append(part.reshape(-1))
            shapes.append((per, *g.shape[1:]))
        self._call("backward_outputs", shapes, flat=[torch.cat(per_rank[self._coords(r)[1]]) for r in range(self.world)])

    def _backward_outputs(self, shapes: list[tuple[int, ...]], flat: list[torch.Tensor] | None = None) -> None:
        """Receive this rank's part (float32, flattened in ``shapes``' order) of the output
        gradients and backpropagate this rank's outputs with it (``flat``: every rank's parts, on
        rank 0 only). With pipeline parallelism the last stage does so, then sends the gradient of
        each input it received (in forward order) to the previous stage, which backpropagates its
        output with it and sends its own input's gradient on, down to the first stage.

        Raises:
            RuntimeError: this rank's outputs with a graph do not have ``shapes``.
        """
        import torch.distributed as dist

        outs, self._outputs, self._returned = self._outputs, [], []
        io, self._stage_io = self._stage_io, []
        last = self.pp_rank == self.pipeline_parallel - 1
        if last and [tuple(o.shape) for o in outs] != [tuple(s) for s in shapes]:
            raise RuntimeError(f"rank {self.rank}: outputs with a graph of shapes {[tuple(o.shape) for o in outs]}, "
                               f"gradients of shapes {shapes}")
        sizes = [math.prod(s) for s in shapes]
        buf = scatter_flat(self._ranks, flat, sum(sizes), torch.float32, self.device)
        if last:
            grads = [g.view(o.shape).to(o.dtype) for g, o in zip(buf.split(sizes), outs)]
            torch.autograd.backward(outs, grads)
        for x, out in io:  # pipeline: this stage's forwards in order (the last stage's are done above)
            if out is not None:
                g = torch.empty_like(out)
                dist.recv(g, src=self._rank_at(self.tp_rank, self.dp_rank, self.pp_rank + 1))
                torch.autograd.backward(out, g)
            if x is not None:
                dist.send(x.grad if x.grad is not None else torch.zeros_like(x),
                          dst=self._rank_at(self.tp_rank, self.dp_rank, self.pp_rank - 1))

    def step(self, *, policy: bool, policy_lr: float) -> float | None:
        if self.world == 1:
            return AdamWPair.step(self, policy=policy, policy_lr=policy_lr)
        return self._call("step", policy, policy_lr)

    def _step(self, policy: bool, policy_lr: float) -> float | None:
        if self.critic is not None:
            self._clip(self.critic)
            self.critic_opt.step()
        if not policy:
            return None
        gn = self._clip(self.policy)
        for group in self.policy_opt.param_groups:
            group["lr"] = policy_lr
        self.policy_opt.step()
        return gn

    def _clip(self, model: nn.Module) -> float:
        """Gradients of several ranks made whole, then clipped to ``cfg.max_grad_norm`` by their
        global norm, which is returned (before clipping). One process: the plain global norm.

        Each data-parallel rank forwarded its own rows, and Megatron's dispatcher brings each
        token to its experts once: an expert's gradient (on the ranks holding its slices) is
        already the whole batch's and is left as it is. Tensor-parallel slices of the other
        weights hold their data-parallel rank's rows: summed over the data-parallel group. Weights
        every rank holds whole under sequence parallelism (norms, routers, the critic's head:
        attribute ``sequence_parallel``) hold one slice of one rank's rows: summed over the
        tensor- and data-parallel ranks (of this pipeline stage: each stage holds its own layers).
        Norm: sqrt of the sum of squares of every distinct slice (experts on every rank, the
        tensor-parallel slices on data-parallel rank 0, the whole weights on tensor- and
        data-parallel rank 0 of each stage), the same on every rank.
        """
        named = [(k, p) for k, p in model.named_parameters() if p.grad is not None]
        experts = [p.grad for k, p in named if is_expert(k)]
        whole = [p.grad for k, p in named if not is_expert(k) and getattr(p, "sequence_parallel", False)]
        sliced = [p.grad for k, p in named if not is_expert(k) and not getattr(p, "sequence_parallel", False)]
        if self.world > 1:
            one_stage = self.pipeline_parallel == 1
            all_reduce_(sliced, None if one_stage and self.tensor_parallel == 1 else parallel_state.get_data_parallel_group())
            all_reduce_(whole, None if one_stage else parallel_state.get_tensor_and_data_parallel_group())
        sq = lambda gs: float(sum(g.float().pow(2).sum() for g in gs)) if gs else 0.0  # noqa: E731
        mine = [sq(experts), (sq(sliced) if self.dp_rank == 0 else 0.0)
                + (sq(whole) if self.dp_rank == 0 and self.tp_rank == 0 else 0.0)]
        expert_sq, other_sq = all_reduce_sum(mine, self.device) if self.world > 1 else mine
        total = math.sqrt(expert_sq + other_sq)
        self.last_expert_grad_norm = math.sqrt(expert_sq)  # (before clipping)
        coef = min(1.0, self.cfg.max_grad_norm / (total + 1e-6))
        if coef < 1.0:
            for g in experts + whole + sliced:
                g.mul_(coef)
        return total

    def num_parameters(self) -> int:
        """Parameters of the whole policy (every rank's experts, slices and stages; counted on rank 0
        from the HF model it built them from, 0 on followers)."""
        return self._num_parameters

    # ---- weights and checkpoints ----------------------------------------------------------
    def megatron_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """This rank's Megatron-named parameters of ``model`` (detached, its own experts only)."""
        return {n: p.detach() for n, p in model.named_parameters()}

    def _gather_hf(self, role: str) -> dict[str, torch.Tensor] | None:
        """The whole ``role`` model (policy or critic) in HF layout on rank 0, every rank's experts,
        tensor-parallel slices (:func:`merge_tp`) and pipeline stages gathered there; None on
        followers."""
        model, layout = (self.policy, POLICY) if role == "policy" else (self.critic, CRITIC)
        local = self.megatron_state(model)
        n, tp, pp = self.expert_parallel, self.tensor_parallel, self.pipeline_parallel
        if self.world == 1:
            return megatron_to_hf(local, self.model_cfg, layout)
        if pp == 1:  # what rank 0 lacks: the other ranks' experts and slices (whole weights are the same everywhere)
            names = [k for k in local if is_expert(k) or (tp > 1 and tp_partition(k, layout) is not None)]
            parts = gather_tensors(self._ranks, [local[k] for k in names])
            if self.rank != 0:
                return None
            states = [{**local, **{k: p[r] for k, p in zip(names, parts)}} for r in range(self.world)]
        else:  # stages hold different weights: each rank's whole state, serialised
            blobs = gather_bytes(self._ranks, b"" if self.rank == 0 else to_bytes(_cpu_state(local)), self.device)
            if self.rank != 0:
                return None
            states = [local] + [{k: v.to(self.device) for k, v in from_bytes(b).items()} for b in blobs[1:]]
        out: dict[str, torch.Tensor] = {}
        for stage in range(pp):
            for e in range(n):  # expert-parallel rank e of this stage: its tp ranks' slices merged
                merged = merge_tp([states[self._rank_at(t, e, stage)] for t in range(tp)], layout)
                if e > 0:
                    merged = {k: v for k, v in merged.items() if is_expert(k)}
                out.update(megatron_to_hf(merged, self.model_cfg, layout, ep_rank=e, ep_size=n, pp_rank=stage,
                                          pp_size=pp))
        return out

    def hf_state(self) -> dict[str, torch.Tensor]:
        """The policy under its HF names (contiguous tensors on rank 0's device; with expert
        parallelism every rank's experts are gathered to rank 0)."""
        return {k: v.contiguous() for k, v in self._call("gather_hf", "policy").items()}

    def hf_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        return self.hf_state().items()

    def critic_hf_state(self) -> dict[str, torch.Tensor]:
        """The critic under its HF names (``backbone.*``, ``head.*``), gathered as :meth:`hf_state`."""
        return {k: v.contiguous() for k, v in self._call("gather_hf", "critic").items()}

    def save(self, folder: Path) -> None:
        """One HF checkpoint (every rank's experts and slices gathered): config.json +
        model.safetensors, critic.safetensors, optimizers.pt (rank 0's optimiser state) and, with
        N ranks, optimizers-rank{r}.pt for ranks r = 1..N-1 (rank 0 writes them all)."""
        save_hf(folder, self.model_cfg, {k: v.cpu() for k, v in self.hf_state().items()})
        self._save_state(folder, self.critic_hf_state() if self.critic is not None else None)
        if self.world > 1:
            self._call("save_optimizers", folder=folder)

    def _save_optimizers(self, folder: Path | None = None) -> None:
        blobs = gather_bytes(self._ranks, b"" if self.rank == 0 else to_bytes(self._optimizer_state()), self.device)
        for r in range(1, self.world) if self.rank == 0 else ():
            (folder / f"optimizers-rank{r}.pt").write_bytes(blobs[r])

    def _optimizer_state(self) -> dict:
        return {"policy": self.policy_opt.state_dict(),
                "critic": self.critic_opt.state_dict() if self.critic_opt is not None else None,
                "backend": self.name, **self.parallel_sizes(), "rank": self.rank}

    def _rank_file(self, folder: Path, r: int) -> bytes:
        """Rank r's saved optimiser state (``optimizers-ep{r}.pt``: written by expert-parallel runs
        before tensor and pipeline parallelism, where rank = expert-parallel rank)."""
        path = folder / f"optimizers-rank{r}.pt"
        old = folder / f"optimizers-ep{r}.pt"
        only_ep = self.tensor_parallel == self.pipeline_parallel == 1
        return (old if not path.exists() and old.exists() and only_ep else path).read_bytes()

    def load_state(self, folder: Path) -> bool:
        """Restore the critic and every rank's optimisers. Returns False (optimisers start fresh,
        logged) when the checkpoint's optimisers are another backend's or another tensor- or
        expert-parallel size's, or a rank's file is missing."""
        saved = self._critic_file(folder)
        if saved is not None and self.critic is not None:
            self._call("load_hf", "critic", sd=saved)
        blobs = None
        if self.world > 1:
            try:
                blobs = [b""] + [self._rank_file(folder, r) for r in range(1, self.world)]
            except FileNotFoundError as e:
                logger.warning("{}: {}: optimisers start fresh", folder, e)
        ok = self._load_optimizers(folder) if blobs is not None or self.world == 1 else False
        if not ok:
            logger.warning("{}: optimiser state of another backend or parallel layout (this run: megatron, {}): "
                           "optimisers start fresh", folder, self.parallel_sizes())
        if self.world > 1:
            self._call("load_rank_optimizers", ok, blobs=blobs if ok else None)
        return ok

    def _load_rank_optimizers(self, ok: bool, blobs: list[bytes] | None = None) -> None:
        """Every follower loads its optimiser state from rank 0's ``blobs`` (when ``ok``)."""
        if not ok:  # (every rank got the same ok)
            return
        data = scatter_bytes(self._ranks, blobs, self.device)
        if self.rank != 0:
            opt = from_bytes(data)
            saved = {k: opt.get(k, ONE_PROCESS[k]) for k in self.parallel_sizes()}
            if opt.get("rank") != self.rank or saved != self.parallel_sizes():
                raise RuntimeError(f"rank {self.rank}: its optimiser file holds rank {opt.get('rank')} of {saved}, "
                                   f"this run is {self.parallel_sizes()}")
            self.policy_opt.load_state_dict(opt["policy"])
            if self.critic_opt is not None and opt.get("critic") is not None:
                self.critic_opt.load_state_dict(opt["critic"])

    def _load_hf(self, role: str, sd: dict[str, torch.Tensor] | None = None) -> None:
        model, layout = (self.policy, POLICY) if role == "policy" else (self.critic, CRITIC)
        sd = self._share(sd)
        load_megatron(model, shard_tp(hf_to_megatron(sd, self.model_cfg, layout, ep_rank=self.dp_rank,
                                                     ep_size=self.expert_parallel, pp_rank=self.pp_rank,
                                                     pp_size=self.pipeline_parallel), layout, self.tp_rank,
                                      self.tensor_parallel))
