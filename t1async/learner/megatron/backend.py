"""The ``megatron`` learner backend: megatron-core 0.16.1's GPTModel as policy, critic and reference.

The interface is t1async/learner/backend.py; the models are built by t1async/learner/megatron/model.py (layer spec,
routing replay, heads, CPU shims), their Hugging Face <-> Megatron weight layouts are
t1async/learner/megatron/families/convert.py, the processes of a multi-rank backend t1async/learner/megatron/ranks.py.
AdamW (float32 masters for 16-bit weights) and global-norm clipping are shared with the torch
backend (t1async/learner/backend.py); with several data-parallel ranks the replicated weights'
optimiser state is sharded (t1async/learner/backend.py ``ShardedAdamW``, ``learner.megatron.distributed_optimizer``).

Parallelism: expert parallelism P (``learner.megatron.expert_parallel``, P dividing the number of
experts) times tensor parallelism T (``tensor_parallel``) times pipeline parallelism S
(``pipeline_parallel``) over N = T x S x P processes (t1async/learner/megatron/ranks.py). This object in
the learner is rank 0; it starts ranks 1..N-1 as Ray actors, all join one torch.distributed world
(gloo on CPU, nccl on CUDA) and Megatron's groups (T, S, expert_model_parallel_size=P; rank =
tp_rank + T dp_rank + T P pp_rank), and each builds its GPTModels with its stage's L/S layers, its
own E/P experts per MoE layer and its own 1/T slices (weights sent from rank 0, sliced by
t1async/learner/megatron/families/convert.py). Every call is announced by rank 0 and run by every rank. Across the
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
- norms are megatron's local-spec RMSNorm made to accept sequence parallelism
  (t1async/learner/megatron/model.py ``Norm``; megatron-core 0.16.1's ``WrappedTorchNorm`` asserts it is off).

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
  (t1async/learner/megatron/grads.py). The clip norm is the true global norm over every distinct
  slice; every rank clips with it and steps AdamW on its own parameters (verified against the
  torch backend to 1e-5 in tests/unit/learner/test_megatron.py, with B = 1, 2 and 5, TP x EP x PP = 1x2x1,
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
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from loguru import logger
from megatron.core import parallel_state  # noqa: E402  (t1async.learner.megatron.model says what to install if missing)
from megatron.core.models.gpt.gpt_model import GPTModel  # noqa: E402
from megatron.core.transformer.moe.router_replay import RouterReplayAction  # noqa: E402
from torch import nn

from t1async.config import GenerationConfig, LearnerConfig, MegatronConfig, ModelConfig, tensor_parallel_sizes
from t1async.learner.backend import AdamWPair, PolicyForward, ShardedAdamW, chunk_size
from t1async.learner.megatron.families import family_tp_sizes, moe_layer_pattern, to_converter, tp_partition
from t1async.learner.megatron.families.convert import CRITIC, POLICY
from t1async.learner.megatron.grads import clip_global_norm
from t1async.learner.megatron.model import (  # noqa: F401  (re-exported)
    LayerRecompute,
    build_gpt,
    init_megatron,
    load_megatron,
    replay_rows,
    router_topk,
    transformer_config,
)
from t1async.learner.megatron.ranks import (
    RankGroup,
    expert_owner,
    gather_tensors,
    leave_world,
    scatter_flat,
    share_state,
)
from t1async.learner.megatron.state import MegatronState
from t1async.learner.torch_backend import ValueModel, chunked_token_logprobs, load_policy
from t1async.models.families import family
from t1async.models.logprobs import EMBEDDED, SamplingSemantics, token_logprobs
from t1async.weights.buckets import is_expert

__all__ = ["MegatronBackend", "build_gpt", "deal_rows", "init_megatron", "replay_rows", "transformer_config"]


# calls rank 0 announces to its followers (each runs MegatronBackend._<name>)
FOLLOWER_OPS = frozenset({"forward_policy", "forward_values", "forward_reference", "zero_grad", "backward_outputs",
                          "step", "gather_hf", "save_optimizers", "load_rank_optimizers", "load_hf", "forward_counts"})


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


class MegatronBackend(MegatronState, AdamWPair):
    """Policy (with routing replay), critic and, with ``cfg.kl_coef`` > 0, a frozen reference as
    megatron-core GPTModels; settings in ``cfg.megatron`` (:class:`t1async.config.MegatronConfig`).

    With ``cfg.megatron.expert_parallel`` N > 1 this object is rank 0 of N processes (module
    docstring): it starts ranks 1..N-1 (t1async/learner/megatron/ranks.py, Ray must be initialised) and
    every public call runs on every rank; each rank holds E/N experts of each MoE layer and
    forwards its share of each micro-batch's rows. What it returns (tensors on rank 0's device)
    and what it saves are the same as with one process.

    Args:
        cfg, model_cfg, generation, init: as :class:`t1async.learner.backend.LearnerBackend`.
        semantics: which distribution the samplers' log-probs are of (t1async/models/logprobs.py
            :class:`SamplingSemantics`, from ``sampler.backend``); every rank scores under it.
        device, dtype: override ``cfg.megatron.device`` / ``dtype`` (the bench uses them).
        ranks: set on a follower rank only (t1async/learner/megatron/ranks.py ``Follower``): its place
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
                 dtype: torch.dtype | None = None, ranks: RankGroup | None = None,
                 semantics: SamplingSemantics = EMBEDDED):
        family(model_cfg, self.name)  # another family: one line naming the backend that runs it
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
        split = {**tensor_parallel_sizes(model_cfg), **family_tp_sizes(model_cfg)}
        if tp < 1 or any(v % tp for v in split.values()):
            raise ValueError(f"learner.megatron.tensor_parallel={tp} must divide each of {split}")
        self.cfg, self.generation, self.model_cfg, self.semantics = cfg, generation, model_cfg, semantics
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
                cfg=cfg, model_cfg=model_cfg, generation=generation, semantics=semantics, device=self.device.type,
                dtype=self.dtype, threads=torch.get_num_threads(), backend=type(self), ops=FOLLOWER_OPS),
                tensor_parallel=tp, pipeline_parallel=pp)
        self._ranks = ranks
        self._lock = threading.RLock()
        self.rank = ranks.rank if ranks is not None else 0
        # Megatron's rank order: tensor parallel innermost, pipeline outermost (t1async/learner/megatron/ranks.py);
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
        """AdamW for policy and critic (:class:`t1async.learner.backend.AdamWPair`); with several
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
        names = lambda sd: to_converter(self.model_cfg, sd)  # noqa: E731  (a family's fused experts split, views)
        policy_sd = names(hf_policy.state_dict()) if lead else None
        critic_sd = names(ValueModel(hf_policy).state_dict()) if lead and cfg.critic else None
        ref_sd = None
        if lead and cfg.kl_coef > 0:
            ref_sd = (names(load_policy(self.model_cfg, cfg.init_checkpoint).state_dict()) if cfg.init_checkpoint
                      else policy_sd)
        kw = dict(dtype=self.dtype, device=self.device, dispatcher=mc.dispatcher, ep_rank=self.dp_rank,
                  ep_size=self.expert_parallel, tp_rank=self.tp_rank, tp_size=self.tensor_parallel,
                  pp_rank=self.pp_rank, pp_size=self.pipeline_parallel)
        self._num_parameters = sum(p.numel() for p in hf_policy.parameters()) if lead else 0
        self.policy = build_gpt(self.model_cfg, self._share(policy_sd), replay=True, **kw)
        self.critic = (build_gpt(self.model_cfg, self._share(critic_sd), critic=True, replay=True, **kw) if cfg.critic
                       else None)  # learner.critic: false builds none; its routers replay only for the recompute
        self.reference: GPTModel | None = None
        if cfg.kl_coef > 0:
            self.reference = build_gpt(self.model_cfg, self._share(ref_sd), **kw).eval().requires_grad_(False)
        del hf_policy, policy_sd, critic_sd, ref_sd
        if self.tensor_parallel > 1:  # _clip sums a gradient over the ranks by what the weight is: check each is known
            for model, layout in ((self.policy, POLICY), (self.critic, CRITIC)):
                for k, p in model.named_parameters() if model is not None else ():
                    if not (is_expert(k) or tp_partition(k, layout, self.model_cfg) is not None
                            or getattr(p, "sequence_parallel", False)):
                        raise RuntimeError(f"Megatron weight {k} is neither split over the tensor-parallel ranks "
                                           "nor marked sequence_parallel: its gradient would not be summed right")
        # this stage's MoE layers' routers (a family's dense layers have none); replay rows are per MoE layer
        self._routers = [layer.mlp.router for layer in self.policy.decoder.layers if hasattr(layer.mlp, "router")]
        per_stage, pattern = self.model_cfg.num_hidden_layers // self.pipeline_parallel, moe_layer_pattern(self.model_cfg)
        self._first_layer = sum(pattern[:self.pp_rank * per_stage])
        self._stage_moe = [sum(pattern[s * per_stage:(s + 1) * per_stage]) for s in range(self.pipeline_parallel)]
        self._router_inputs: list[torch.Tensor | None] = [None] * len(self._routers)
        for i, r in enumerate(self._routers):
            r.register_forward_pre_hook(lambda mod, args, i=i: self._keep_router_input(i, args[0]))
        self._capture = False
        self._recompute = {m: LayerRecompute(m) for m in (self.policy, self.critic) if m is not None}

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
        along the layers. With ``grad`` the first tensor, where it has a graph (the last stage), is
        kept for :meth:`backward`, and rank 0 returns it as a new leaf that requires grad (the
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
        full = iter([(torch.cat([rows(p, st)[:, :, :self._stage_moe[st]] for st in range(last + 1)], 2) if stg
                      else rows(p, last)).to(t.dtype)
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
        the reference (their head is :class:`t1async.learner.megatron.model.LMHead`, applied by :meth:`_logprobs`) or the
        critic's values [B, T, 1]. With tensor parallelism T must be a multiple of it
        (:meth:`_pad_tp`): sequence parallelism splits the sequence evenly over the ranks. A
        sequence longer than ``learner.max_tokens_per_chunk`` run with gradients keeps only each
        decoder layer's input and recomputes the layer in the backward, its routing replayed
        (:class:`t1async.learner.megatron.model.LayerRecompute`).

        With pipeline parallelism each stage but the first receives its input hidden states
        ``[T/TP, B, H]`` from the previous stage's rank of the same tensor- and data-parallel
        coordinates (``send``/``recv`` on the default group), and each stage but the last sends its
        output to the next one and returns None. With gradients on, the stage keeps (its received
        input, its sent output) for :meth:`_backward_outputs`, which runs the stages' backwards in
        reverse order, one forward after another (no overlap of stages: one micro-batch at a time).
        """
        B, T = inp.shape
        self.forwarded["forwards"] += 1
        self.forwarded["rows"] += B
        self.forwarded["tokens"] += B * T
        pos = torch.arange(T, device=self.device).expand(B, T)
        first, last = self.pp_rank == 0, self.pp_rank == self.pipeline_parallel - 1
        x = None
        if not first:
            x = torch.empty(T // self.tensor_parallel, B, self.model_cfg.hidden_size, dtype=self.dtype,
                            device=self.device)
            dist.recv(x, src=self._rank_at(self.tp_rank, self.dp_rank, self.pp_rank - 1))
            x.requires_grad_(torch.is_grad_enabled())
            model.set_input_tensor(x)
        with (self._recompute[model](bool(chunk_size(self.cfg.max_tokens_per_chunk, T))) if model in self._recompute
              else nullcontext()):
            out = model(inp.to(self.device), pos, None)  # (causal: t1async.learner.megatron.model.SdpaAttention)
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
        at a time, each chunk recomputed in the backward (t1async/learner/torch_backend.py
        ``chunked_token_logprobs``): the same log-probs, never the whole ``[T, V]`` logits."""
        g, head = self.generation, model.output_layer
        tgt = tgt.to(self.device)
        if c := chunk_size(self.cfg.max_tokens_per_chunk, hidden.shape[1]):
            return chunked_token_logprobs(head.logits, hidden, tgt, g, c, self.semantics)
        return token_logprobs(head.logits(hidden).float(), tgt, g.temperature, g.top_k, g.top_p,
                              semantics=self.semantics, return_outside=True)

    def _pad_tp(self, inp: torch.Tensor, *more: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        """Right-pad ``[b, T, ...]`` tensors with zeros to a multiple of the tensor-parallel size in
        T (sequence parallelism splits the sequence evenly); None stays None. Causal attention
        keeps the real positions' results unchanged; callers cut the outputs back to T (replay
        rows get distinct ids at the padded positions from :func:`replay_rows`' ``lengths``)."""
        pad = -inp.shape[1] % self.tensor_parallel
        if pad == 0:
            return (inp, *more)
        return tuple(None if t is None else F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad)) for t in (inp, *more))

    def _tp_tokens(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's ``[T/TP * b, ...]`` token rows (sequence-major, its slice of the sequence
        under sequence parallelism) -> every tensor-parallel rank's, ``[T * b, ...]`` in sequence
        order (no gradient). One rank: ``rows``."""
        if self.tensor_parallel == 1:
            return rows
        rows = rows.contiguous()
        out = rows.new_empty(rows.shape[0] * self.tensor_parallel, *rows.shape[1:])
        dist.all_gather_into_tensor(out, rows, group=parallel_state.get_tensor_model_parallel_group())
        return out

    def policy_logprobs(self, inp, tgt, replay, *, grad, routing, score=None) -> PolicyForward:
        """See :class:`t1async.learner.backend.LearnerBackend` (``score`` is not used: every position is scored);
        with expert parallelism each rank forwards its rows and rank 0 returns the gathered ``[B, T]`` outputs
        (module docstring).

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
        lengths = torch.full((B,), T)  # positions past T: padding, replayed with distinct ids
        rows = (replay_rows(replay, self.model_cfg.num_experts, lengths, self.expert_parallel) if replay is not None
                else None)
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
                K = self.model_cfg.num_experts_per_tok
                none = torch.zeros(B, Tp, 0, K, dtype=torch.int64, device=self.device)  # (a stage of dense layers)
                own = torch.stack([self._own_topk(r, x, B, Tp) for r, x in zip(self._routers, self._router_inputs)],
                                  2)[:, :T] if self._routers else none[:, :T]
                if given is None:
                    used = torch.stack([self._tp_tokens(rr.get_recorded_indices()).view(Tp, B, -1).transpose(0, 1)
                                        for rr in replays], 2)[:, :T] if replays else none[:, :T]
                else:
                    used = given.to(self.device).long()
        finally:
            self._capture = False
            self._router_inputs = [None] * len(self._routers)
            for rr in replays:
                rr.clear_indices()
                rr.clear_router_replay_action()
        if self.pipeline_parallel > 1 and routing:  # every stage sends as many MoE layers (a family's dense layers
            most = max(self._stage_moe)  # leave stages unequal): padded here, cut back by _gather_rows
            used, own = (t if t is None or given is not None and t is used else
                         F.pad(t, (0, 0, 0, most - t.shape[2])) for t in (used, own))
        out = self._gather_rows([logp, outside, used, own], batch, grad, staged=(False, False, given is None, True))
        return PolicyForward(*out) if out[0] is not None else None

    def _own_topk(self, router: nn.Module, x: torch.Tensor, B: int, T: int) -> torch.Tensor:
        """The router's own top-k [B, T, K] from its input (what it would choose without replay;
        with sequence parallelism its input is this rank's slice, the top-k rows are gathered):
        :func:`t1async.learner.megatron.model.router_topk`."""
        return self._tp_tokens(router_topk(router, x)).view(T, B, -1).transpose(0, 1)

    def reference_logprobs(self, inp, tgt, score=None) -> torch.Tensor:  # scores every position
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
        global norm, which is returned (before clipping; t1async/learner/megatron/grads.py
        :func:`clip_global_norm`). One process: the plain global norm."""
        total, self.last_expert_grad_norm = clip_global_norm(model, self.cfg.max_grad_norm, world=self.world,
                                                             dp_rank=self.dp_rank, tp_rank=self.tp_rank,
                                                             device=self.device)
        return total
