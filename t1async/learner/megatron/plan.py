"""Memory plan of a learner layout, before anything starts: what one rank of the ``megatron`` learner (or the
one process of the ``torch`` learner) allocates for a model, from the model's shapes alone.

    model config.json -> the family's model built on the meta device (no weights; t1async/models/families.py)
      -> each parameter: which rank holds which part (the learner's sharding, below)
      -> per rank and model (policy, critic, reference): parameters, gradients, float32 masters, AdamW moments
      -> activations of one micro-batch (with and without per-layer recompute)
      -> the largest rank of a layout; the smallest layouts that fit a GPU

The sharding is the megatron backend's (t1async/learner/megatron/backend.py, convert.py, model.py), for
``tensor_parallel`` T x ``pipeline_parallel`` S x ``expert_parallel`` P ranks:

- routed experts (``.mlp.experts.``): E/P experts per rank, each expert's width split over T;
- the embedding and the LM head: vocabulary rows split over T; the embedding on stage 0, the final norm and the
  LM head on stage S-1; decoder layer i on stage i // (L/S);
- norms, routers (and GLM's score-correction bias, a buffer) and Qwen3.5's shared-expert gate: whole on every rank;
- every other weight (attention, Gated DeltaNet projections, shared and dense MLPs): split over T.

Bytes per rank: parameters in ``learner.megatron.dtype`` (norms and the critic's value head float32);
gradients as the parameters (policy, critic); float32 masters of 16-bit parameters (MasterWeightAdamW); AdamW's two
float32 moments per master element. With P > 1 and ``learner.megatron.distributed_optimizer`` the non-expert
parameters' masters and moments are ZeRO-1 shards: ceil(n / P) float32 elements per rank (ShardedAdamW, a float32
copy even for float32 weights). The critic is the policy's trunk with a ``Linear(hidden, 1)`` head (no LM head);
the reference (``learner.kl_coef`` > 0) holds parameters only. tests/unit/learner/test_plan.py holds these numbers to the
tensors the learner really allocates.

Activations are an estimate (not a count): per token and decoder layer, every non-expert weight's input and output
width, the K routed experts' widths, the float32 router logits and probabilities, each norm's float32 input and
output, the attention kernel's q, k and v; the LM head's float32 logits and
log-probabilities (per ``learner.max_tokens_per_chunk`` chunk when chunked). With recompute (``max_tokens_per_chunk``
> 0 and a longer micro-batch: per-layer activation checkpointing) a layer keeps only its input, plus one layer's
activations while it is recomputed. Each expert-parallel rank forwards 1/P of the rows and sequence/tensor
parallelism splits them over T. tests/unit/learner/test_plan.py compares it with the tensors a real forward saves for its
backward.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from t1async.config import ConfigError, LearnerConfig, ModelConfig, divisors, tensor_parallel_choices
from t1async.config.model_folder import resolve_model
from t1async.models.families import family

__all__ = ["Layout", "ModelBytes", "RankPlan", "TensorSpec", "model_tensors", "load_model_config", "plan_layout",
           "fitting_layouts", "check_layout_fits", "GiB"]

GiB = 2**30
_LAYER = re.compile(r"\.layers\.(\d+)\.")
_WHOLE = re.compile(r"(norm\.weight|\.mlp\.gate\.weight|e_score_correction_bias|shared_expert_gate\.weight)$")
_FP32 = re.compile(r"norm\.weight$")  # megatron keeps its norms (t1async/learner/megatron/model.py Norm) in float32


@dataclass(frozen=True)
class Layout:
    """``tensor_parallel`` T x ``pipeline_parallel`` S x ``expert_parallel`` P learner ranks."""

    tensor: int = 1
    pipeline: int = 1
    expert: int = 1

    @property
    def ranks(self) -> int:
        return self.tensor * self.pipeline * self.expert

    def __str__(self) -> str:
        return f"T{self.tensor} x S{self.pipeline} x P{self.expert}"


@dataclass(frozen=True)
class TensorSpec:
    """One parameter of the model (Hugging Face module name), as the learner shards it.

    Attributes:
        name, numel: the parameter and its element count (whole model).
        split: ``expert`` (1/(P T) per rank), ``tp`` (1/T), ``whole``.
        stage: ``first`` (embedding), ``last`` (final norm, LM head) or ``layer``; layer: its decoder layer.
        fp32: kept in float32 whatever the training dtype (the megatron backend's norms).
        width_in, width_out: the input and output width of a 2-D weight (0 otherwise), for the activation estimate.
    """

    name: str
    numel: int
    split: str
    stage: str
    layer: int
    fp32: bool
    width_in: int = 0
    width_out: int = 0


@dataclass
class ModelBytes:
    """Bytes one rank holds for one model: ``params``, ``grads``, ``masters`` (float32 copies of 16-bit weights, or
    the ZeRO-1 shard), ``moments`` (AdamW's two float32 moments), ``activations`` (one micro-batch, estimate)."""

    params: int = 0
    grads: int = 0
    masters: int = 0
    moments: int = 0
    activations: int = 0

    @property
    def total(self) -> int:
        return self.params + self.grads + self.masters + self.moments + self.activations


@dataclass
class RankPlan:
    """The largest-memory rank of one pipeline stage: ``policy``, ``critic``, ``reference`` bytes (activations with
    the recompute the run would use), ``activations_plain`` / ``activations_recompute`` (policy + critic, both ways)."""

    stage: int
    policy: ModelBytes
    critic: ModelBytes
    reference: ModelBytes
    activations_plain: int
    activations_recompute: int

    @property
    def total(self) -> int:
        return self.policy.total + self.critic.total + self.reference.total


def load_model_config(model: str | Path) -> ModelConfig:
    """The :class:`ModelConfig` of a model folder or of a bare ``config.json`` file (any file name).

    Raises:
        ConfigError: no such path, not JSON, an unknown ``model_type`` (one line).
    """
    p = Path(model).expanduser()
    if p.is_dir():
        return resolve_model(ModelConfig(path=str(p)))
    if not p.is_file():
        raise ConfigError(f"{model}: no such model folder or config.json file")
    tmp = Path(tempfile.mkdtemp(prefix="t1async-plan-"))
    try:
        shutil.copy(p, tmp / "config.json")
        cfg = resolve_model(ModelConfig(path=str(tmp)))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dataclasses.replace(cfg, path=str(p))


_SHAPES: dict[str, list[tuple[str, tuple[int, ...]]]] = {}  # the meta build's shapes, by architecture (one build a process)


def _shapes(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    key = json.dumps({**dataclasses.asdict(cfg), "path": ""}, sort_keys=True, default=str)
    if key not in _SHAPES:
        with torch.device("meta"):
            model = family(cfg).build(cfg)
        _SHAPES[key] = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    return _SHAPES[key]


def model_tensors(cfg: ModelConfig, critic: bool = False) -> list[TensorSpec]:
    """The family's model built on the meta device (no memory; once per architecture and process), one
    :class:`TensorSpec` per parameter; with ``critic`` the value model's (the trunk without the LM head, plus a
    float32 ``Linear(hidden, 1)``)."""
    L = cfg.num_hidden_layers
    out = []
    for name, shape in _shapes(cfg):
        p = torch.empty(shape, device="meta")
        if critic and name.startswith("lm_head."):
            continue
        m = _LAYER.search(name)
        layer = int(m.group(1)) if m else (0 if "embed_tokens" in name else L - 1)
        stage = "layer" if m else ("first" if "embed_tokens" in name else "last")
        split = "expert" if ".mlp.experts." in name else "whole" if _WHOLE.search(name) else "tp"
        w_in, w_out = (p.shape[-1], p.shape[-2]) if p.dim() >= 2 and "embed_tokens" not in name else (0, 0)
        if p.dim() == 3:  # fused experts [E, out, in]: one expert's widths
            w_in, w_out = p.shape[2], p.shape[1]
        out.append(TensorSpec(name, p.numel(), split, stage, layer, bool(_FP32.search(name)), int(w_in), int(w_out)))
    if critic:
        out.append(TensorSpec("head.weight", cfg.hidden_size + 1, "whole", "last", L - 1, True))
    return out


def _stage_of(t: TensorSpec, L: int, S: int) -> int:
    return 0 if t.stage == "first" else S - 1 if t.stage == "last" else t.layer // (L // S)


def _elements(t: TensorSpec, lay: Layout) -> int:
    if t.split == "expert":
        return t.numel // (lay.expert * lay.tensor)
    return t.numel // lay.tensor if t.split == "tp" else t.numel


def _model_bytes(specs: list[TensorSpec], cfg: ModelConfig, lay: Layout, stage: int, width: int, *,
                 trainable: bool, sharded: bool) -> ModelBytes:
    """Parameters, gradients, masters and moments of one rank of ``stage`` (``width``: bytes per training element)."""
    mb = ModelBytes()
    low = own = repl = 0  # 16-bit elements; expert elements; non-expert elements
    for t in specs:
        if _stage_of(t, cfg.num_hidden_layers, lay.pipeline) != stage:
            continue
        n = _elements(t, lay)
        w = 4 if t.fp32 else width
        mb.params += n * w
        if t.split == "expert":
            own += n
            low += n if w < 4 else 0
        else:
            repl += n
            low += n if w < 4 else 0
    if not trainable:
        return mb
    mb.grads = mb.params
    if sharded:  # ShardedAdamW: own experts through MasterWeightAdamW, the rest one float32 shard of ceil(n/P)
        low_own = sum(_elements(t, lay) for t in specs if t.split == "expert" and width < 4 and not t.fp32
                      and _stage_of(t, cfg.num_hidden_layers, lay.pipeline) == stage)
        shard = -(-repl // lay.expert)
        mb.masters = 4 * (low_own + shard)
        mb.moments = 8 * (own + shard)
    else:
        mb.masters = 4 * low
        mb.moments = 8 * (own + repl)
    return mb


def _activations(layer_bytes: dict[int, int], cfg: ModelConfig, lay: Layout, stage: int, tokens: int, width: int,
                 chunk: int, head: bool) -> tuple[int, int]:
    """(plain, recompute) activation bytes of one model's forward on one rank of ``stage`` (see the module doc)."""
    n = math.ceil(math.ceil(tokens / lay.expert) / lay.tensor)  # rows per expert-parallel rank, split over T
    L, S = cfg.num_hidden_layers, lay.pipeline
    per_layer = {i: b for i, b in layer_bytes.items() if i // (L // S) == stage}
    layers = list(per_layer.values())
    plain = n * sum(layers)
    recompute = n * (len(layers) * cfg.hidden_size * width + (max(layers) if layers else 0))
    if stage == S - 1:  # the final norm
        plain += n * 2 * 4 * cfg.hidden_size
        recompute += n * 2 * 4 * cfg.hidden_size
    if head and stage == S - 1:
        rows = min(chunk, n * lay.tensor) if chunk else n * lay.tensor
        logits = 2 * 4 * rows * cfg.vocab_size // lay.tensor
        plain += 2 * 4 * n * lay.tensor * cfg.vocab_size // lay.tensor
        recompute += logits
    return plain, recompute


def _layer_activations(specs: list[TensorSpec], cfg: ModelConfig, width: int) -> dict[int, int]:
    """Bytes per token each decoder layer keeps for the backward (before sharding), by layer."""
    K, E = cfg.num_experts_per_tok, cfg.num_experts
    per_layer: dict[int, int] = {}
    qd, kvd = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    for t in specs:
        if t.stage != "layer":
            continue
        if _FP32.search(t.name):  # a norm keeps its float32 input and output at the width it normalises
            applied = qd if t.name.endswith("q_norm.weight") else kvd if t.name.endswith("k_norm.weight") else t.numel
            per_layer[t.layer] = per_layer.get(t.layer, 0) + 2 * 4 * applied
            continue
        if t.name.endswith("self_attn.q_proj.weight"):  # the attention kernel keeps q, k, v after RoPE
            per_layer[t.layer] = per_layer.get(t.layer, 0) + width * (qd + 2 * kvd)
        if not t.width_in:
            continue
        if t.split == "expert":
            experts = t.numel // (t.width_in * t.width_out)  # 1 per-expert tensor, E when fused
            share = K / E * experts  # the routed tokens' share of this tensor's experts
            b = width * share * (t.width_in + t.width_out)
        elif _WHOLE.search(t.name):  # router: float32 logits and probabilities
            b = 4 * 2 * t.width_out
        else:
            b = width * (t.width_in + t.width_out)
        per_layer[t.layer] = per_layer.get(t.layer, 0) + int(b)
    return per_layer


def _grouped(specs: list[TensorSpec]) -> list[TensorSpec]:
    """``specs`` summed by (split, stage, layer, fp32): the same bytes for every layout whose sizes divide the
    model's shapes (each part of a sum divides alike), far fewer entries (18k experts of Qwen3-30B-A3B: 300)."""
    acc: dict[tuple, int] = {}
    for t in specs:
        k = (t.split, t.stage, t.layer, t.fp32)
        acc[k] = acc.get(k, 0) + t.numel
    return [TensorSpec(f"{sp}:{st}:{ly}", n, sp, st, ly, f) for (sp, st, ly, f), n in acc.items()]


def plan_layout(cfg: ModelConfig, learner: LearnerConfig, lay: Layout, tokens: int | None = None) -> list[RankPlan]:
    """One :class:`RankPlan` per pipeline stage of ``lay`` (its largest rank: every rank of a stage holds as much).

    Args:
        cfg: the model. learner: ``backend``, ``critic``, ``kl_coef``, ``megatron`` (dtype, distributed_optimizer),
            ``micro_batch_tokens``, ``max_tokens_per_chunk``. lay: the layout (the ``torch`` backend: 1 x 1 x 1).
        tokens: positions of one micro-batch (default ``learner.micro_batch_tokens``, else the context length).

    Raises:
        ConfigError: a layout that does not divide the model's shapes (the shape and the divisor named).
    """
    check_divides(cfg, lay)
    megatron = learner.backend == "megatron"
    width = 2 if megatron and learner.megatron.dtype == "bfloat16" else 4
    tokens = tokens or learner.micro_batch_tokens or cfg.max_position_embeddings
    chunk = learner.max_tokens_per_chunk
    recompute = bool(chunk) and tokens > chunk
    sharded = megatron and lay.expert > 1 and learner.megatron.distributed_optimizer
    gp, gc, lp, lc = _inputs(cfg, megatron, bool(learner.critic), width)
    critic = gc
    plans = []
    for s in range(lay.pipeline):
        p = _model_bytes(gp, cfg, lay, s, width, trainable=True, sharded=sharded)
        c = _model_bytes(gc, cfg, lay, s, width, trainable=True, sharded=sharded) if critic else ModelBytes()
        r = _model_bytes(gp, cfg, lay, s, width, trainable=False, sharded=False) if learner.kl_coef > 0 \
            else ModelBytes()
        pa, pr = _activations(lp, cfg, lay, s, tokens, width, chunk, head=True)
        ca, cr = _activations(lc, cfg, lay, s, tokens, width, chunk, head=False) if critic else (0, 0)
        p.activations, c.activations = (pr, cr) if recompute else (pa, ca)
        plans.append(RankPlan(s, p, c, r, pa + ca, pr + cr))
    return plans


_INPUTS: dict[tuple, tuple] = {}


def _inputs(cfg: ModelConfig, megatron: bool, critic: bool, width: int) -> tuple:
    """(policy groups, critic groups, policy and critic per-layer activation bytes per token), once per process."""
    key = (json.dumps({**dataclasses.asdict(cfg), "path": ""}, sort_keys=True, default=str), megatron, critic, width)
    if key not in _INPUTS:
        policy = model_tensors(cfg)
        if not megatron:
            policy = [dataclasses.replace(t, fp32=False) for t in policy]
        crit = model_tensors(cfg, critic=True) if critic else []
        _INPUTS[key] = (_grouped(policy), _grouped(crit), _layer_activations(policy, cfg, width),
                        _layer_activations(crit, cfg, width))
    return _INPUTS[key]


def check_divides(cfg: ModelConfig, lay: Layout) -> None:
    """Raises ConfigError naming the model shape a layout size does not divide."""
    if cfg.num_hidden_layers % lay.pipeline:
        raise ConfigError(f"pipeline_parallel={lay.pipeline} does not divide num_hidden_layers={cfg.num_hidden_layers}")
    if cfg.num_experts % lay.expert:
        raise ConfigError(f"expert_parallel={lay.expert} does not divide num_experts={cfg.num_experts}")
    if lay.tensor not in tensor_parallel_choices(cfg):
        raise ConfigError(f"tensor_parallel={lay.tensor} does not divide the heads, key/value heads, vocabulary and "
                          f"expert width of this model (sizes that do: {tensor_parallel_choices(cfg)})")


def layouts(cfg: ModelConfig, ranks: int) -> list[Layout]:
    """Every T x S x P layout of at most ``ranks`` ranks the model's shapes allow (S > 1 not with tied embeddings)."""
    stages = divisors(cfg.num_hidden_layers) if not cfg.tie_word_embeddings else [1]
    return [Layout(t, s, p) for t in tensor_parallel_choices(cfg) for s in stages for p in divisors(cfg.num_experts)
            if t * s * p <= ranks]


def fitting_layouts(cfg: ModelConfig, learner: LearnerConfig, ranks: int, gpu_bytes: int,
                    tokens: int | None = None, limit: int = 5) -> list[tuple[Layout, int]]:
    """The smallest layouts (fewest ranks, then least memory) of at most ``ranks`` ranks whose largest rank fits
    ``gpu_bytes``: ``[(layout, largest rank's bytes)]``."""
    fit = []
    for lay in layouts(cfg, ranks):
        peak = max(p.total for p in plan_layout(cfg, learner, lay, tokens))
        if peak <= gpu_bytes:
            fit.append((lay, peak))
    return sorted(fit, key=lambda x: (x[0].ranks, x[1]))[:limit]


def check_layout_fits(cfg: ModelConfig, learner: LearnerConfig, gpu_gib: float) -> int:
    """Refuse the megatron layout of ``learner`` when its largest rank exceeds ``gpu_gib`` (the launch's pre-flight).

    Returns:
        the largest rank's bytes.

    Raises:
        ConfigError: one line with the planner's numbers and the smallest layouts that would fit.
    """
    mc = learner.megatron
    lay = Layout(mc.tensor_parallel, mc.pipeline_parallel, mc.expert_parallel)
    plans = plan_layout(cfg, learner, lay)
    worst = max(plans, key=lambda p: p.total)
    if worst.total <= gpu_gib * GiB:
        return worst.total
    kinds = {k: sum(getattr(m, k) for m in (worst.policy, worst.critic, worst.reference))
             for k in ("params", "grads", "masters", "moments", "activations")}
    parts = ", ".join(f"{k} {v / GiB:.1f}" for k, v in kinds.items())
    fit = fitting_layouts(cfg, learner, 4 * lay.ranks, int(gpu_gib * GiB), limit=3)
    hint = ("; layouts that fit: " + ", ".join(f"{f} ({b / GiB:.1f} GiB)" for f, b in fit)) if fit else \
        "; no layout of up to 4x the ranks fits: shorten learner.micro_batch_tokens or use bfloat16"
    raise ConfigError(f"learner layout {lay} needs {worst.total / GiB:.1f} GiB on a rank of stage {worst.stage} "
                      f"({parts} GiB) but learner.megatron.gpu_memory_gib={gpu_gib:g}{hint} (t1async plan MODEL shows all)")


def to_json(plans: list[RankPlan]) -> list[dict]:
    """``plans`` as plain dicts (bytes), for ``t1async plan --json``."""
    return [{"stage": p.stage, "total": p.total, "activations_plain": p.activations_plain,
             "activations_recompute": p.activations_recompute,
             **{m: dataclasses.asdict(getattr(p, m)) for m in ("policy", "critic", "reference")}} for p in plans]


def dumps(obj) -> str:
    return json.dumps(obj, indent=1)
