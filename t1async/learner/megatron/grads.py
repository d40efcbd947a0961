"""Global-norm gradient clipping over the ranks of a multi-rank Megatron backend.

Used by t1async/learner/megatron/backend.py (``MegatronBackend._clip``) on every rank, after the
backward pass and before the optimiser step. With one process it is the plain global-norm clip.
"""

from __future__ import annotations

import math

import torch
from megatron.core import parallel_state  # noqa: E402  (t1async.learner.megatron.model says what to install if missing)
from torch import nn

from t1async.learner.megatron.ranks import all_reduce_, all_reduce_sum
from t1async.weights.buckets import is_expert


def clip_global_norm(model: nn.Module, max_norm: float, *, world: int, dp_rank: int, tp_rank: int,
                     device: torch.device) -> tuple[float, float]:
    """Make the gradients of ``model``'s slice on this rank whole across ranks, then clip them to
    ``max_norm`` by their global norm.

    Each data-parallel rank forwarded its own rows, and Megatron's dispatcher brings each token to
    its experts once: an expert's gradient (on the ranks holding its slices) is already the whole
    batch's and is left as it is. Tensor-parallel slices of the other weights hold their
    data-parallel rank's rows: summed over the data-parallel group. Weights every rank holds whole
    under sequence parallelism (norms, routers, the critic's head: attribute
    ``sequence_parallel``) hold one slice of one rank's rows: summed over the tensor- and
    data-parallel ranks (of this pipeline stage: each stage holds its own layers). Norm: sqrt of
    the sum of squares of every distinct slice (experts on every rank, the tensor-parallel slices
    on data-parallel rank 0, the whole weights on tensor- and data-parallel rank 0 of each stage),
    the same on every rank.

    Args:
        model: this rank's module; gradients (any float dtype) are changed in place.
        max_norm: ``learner.max_grad_norm`` (L2 over every distinct gradient element).
        world: number of ranks (1: no collective is called).
        dp_rank, tp_rank: this rank's data- and tensor-parallel ranks.
        device: where the scalar all-reduce runs (this rank's device).

    Returns:
        ``(total norm, expert norm)``, both before clipping (float, L2).
    """
    named = [(k, p) for k, p in model.named_parameters() if p.grad is not None]
    experts = [p.grad for k, p in named if is_expert(k)]
    whole = [p.grad for k, p in named if not is_expert(k) and getattr(p, "sequence_parallel", False)]
    sliced = [p.grad for k, p in named if not is_expert(k) and not getattr(p, "sequence_parallel", False)]
    if world > 1:
        all_reduce_(sliced, parallel_state.get_data_parallel_group())
        all_reduce_(whole, parallel_state.get_tensor_and_data_parallel_group())
    sq = lambda gs: float(sum(g.float().pow(2).sum() for g in gs)) if gs else 0.0  # noqa: E731
    mine = [sq(experts), (sq(sliced) if dp_rank == 0 else 0.0) + (sq(whole) if dp_rank == 0 and tp_rank == 0 else 0.0)]
    expert_sq, other_sq = all_reduce_sum(mine, device) if world > 1 else mine
    total = math.sqrt(expert_sq + other_sq)
    coef = min(1.0, max_norm / (total + 1e-6))
    if coef < 1.0:
        for g in experts + whole + sliced:
            g.mul_(coef)
    return total, math.sqrt(expert_sq)
