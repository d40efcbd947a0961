"""``t1async bench micro-batch``: the learner's whole update with one trajectory per forward against
right-padded micro-batches (``learner.micro_batch_tokens``), side by side on one batch.

Prints ONE JSON object. One learner (t1async/actors/learner.py, the ``torch`` backend, configs/local.yaml's
default model unless ``--model``) per ``--micro-batch-tokens`` value is built from the same seeded
init; each runs ``TrainingLoop._train_step`` (everything the learner does per batch: old values, GAE or
group advantages, policy log-probs with routing replay, KL to the reference, losses, backward, clip,
AdamW) on the same ``--batch`` trajectories of random tokens whose lengths are drawn uniformly from
[``--min-tokens``, ``--max-tokens``] (two assistant turns each, K distinct routed experts per row,
as a sampler records). After ``--warmup`` untimed steps each, the ``--steps`` timed steps alternate
between the learners (this machine is shared: a load change moves both alike). Reported per value:
median step seconds and trajectory tokens per second; ``speedup`` is each value's tokens/s over the
first value's; ``padding_frac``, the share of the micro-batches' positions that are padding (what
packing sequences into rows instead of padding them could save at most, in positions forwarded).

``routing`` (per value, from the same micro-batches as the learner builds them, with
``learner.backend: megatron`` and ``--expert-parallel`` P ranks): where the replayed token slots
go, ``after`` (padding spread over experts and ranks, t1async/learner/rl.py ``padding_routes``)
and ``before`` (the earlier replay of ``arange(K) % E`` at every padded position), side by side:
``padding_expert_share`` (each expert's share of the padding's expert assignments; even is 1/E),
``expert_share`` (of all assignments, real tokens too), ``ep_rank_slot_ratio`` (each rank's
token slots over the ranks' mean; even is 1.0) and ``ep_rank_max_over_min``.

Usage: ``t1async bench micro-batch [--micro-batch-tokens 0,4096] [--batch 64] [--min-tokens 100]
[--max-tokens 300] [--steps 5] [--advantage group|gae] [--model local|mid] [--expert-parallel 2]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_learner import MODELS  # noqa: E402  (the same model sizes as t1async bench learner)

from t1async.cli import OneLineErrors, at_least_one, at_least_zero  # noqa: E402
from t1async.config import (  # noqa: E402
    GenerationConfig,
    LearnerConfig,
    MegatronConfig,
    ModelConfig,
    TransportConfig,
    WeightSyncConfig,
)
from t1async.learner.rl import micro_batches  # noqa: E402
from t1async.learner.update import micro_batch  # noqa: E402
from t1async.trajectory import Trajectory  # noqa: E402


def make_trajectories(model: ModelConfig, n: int, lo: int, hi: int, seed: int = 1) -> list[Trajectory]:
    """``n`` trajectories of ``lo``..``hi`` tokens: a prompt (first quarter), two assistant turns
    ([T/4, T/2) and [0.7 T, T)), behaviour log-probs near -4, routed experts K distinct per row,
    rewards 0-2 over groups of 4 episodes of one task (so group advantages are not all zero)."""
    rng = np.random.default_rng(seed)
    L, E, K = model.num_hidden_layers, model.num_experts, model.num_experts_per_tok
    out = []
    for i in range(n):
        T = int(rng.integers(lo, hi + 1))
        a, b, c = T // 4, T // 2, int(0.7 * T)
        mask = np.zeros(T, np.uint8)
        mask[a:b] = 1
        mask[c:] = 1
        experts = rng.random((T - 1, L, E)).argsort(-1)[..., :K].astype(np.uint8)
        reward = float(rng.integers(0, 3))
        out.append(Trajectory(
            task=f"task-{i // 4}", actor_id=0, token_ids=rng.integers(0, model.vocab_size, T).astype(np.uint32),
            loss_mask=mask, logprobs=np.where(mask == 1, -4.0 - rng.random(T), 0.0).astype(np.float32),
            versions=np.where(mask == 1, 0, -1).astype(np.int32), turn_offsets=np.array([[a, b], [c, T]], np.int32),
            routed_experts=experts, num_experts=E, reward=reward, passed=int(reward), total=2, resolved=reward == 2,
            finish_reason="max_turns", tests=[("a", reward >= 1), ("b", reward >= 2)]))
    return out


def routing_balance(batch: list[Trajectory], model: ModelConfig, max_tokens: int, expert_parallel: int) -> dict:
    """Where the replayed token slots of ``batch``'s micro-batches (``learner.micro_batch_tokens``
    ``max_tokens``, megatron backend with ``expert_parallel`` ranks) go: ``{"after": ..., "before":
    ...}`` (module docstring), each with ``padding_expert_share``, ``expert_share`` (lists of E
    floats summing to 1), ``ep_rank_slot_ratio`` (P floats, mean 1) and ``ep_rank_max_over_min``."""
    E, K, P = model.num_experts, model.num_experts_per_tok, expert_parallel
    cfg = LearnerConfig(backend="megatron", micro_batch_tokens=max_tokens, megatron=MegatronConfig(expert_parallel=P))
    lengths = [t.num_tokens - 1 for t in batch]
    counts = {w: {"pad": torch.zeros(E, dtype=torch.int64), "all": torch.zeros(E, dtype=torch.int64)}
              for w in ("after", "before")}
    for group in micro_batches(lengths, max_tokens):
        mb = micro_batch([batch[i] for i in group], torch.device("cpu"), cfg, E)
        after, pad = mb["recorded"], ~mb["valid"]
        before = after.clone()
        before[pad] = torch.arange(K) % E  # the earlier scheme, for comparison
        for w, rec in (("after", after), ("before", before)):
            counts[w]["pad"] += torch.bincount(rec[pad].flatten(), minlength=E)
            counts[w]["all"] += torch.bincount(rec.flatten(), minlength=E)
    out = {}
    for w, c in counts.items():
        ranks = c["all"].view(P, E // P).sum(1).double()
        out[w] = {"padding_expert_share": [round(float(x), 4) for x in c["pad"] / max(int(c["pad"].sum()), 1)],
                  "expert_share": [round(float(x), 4) for x in c["all"] / c["all"].sum()],
                  "ep_rank_slot_ratio": [round(float(x), 4) for x in ranks / ranks.mean()],
                  "ep_rank_max_over_min": round(float(ranks.max() / ranks.min()), 4)}
    return out


def main(argv: list[str] | None = None) -> dict:
    from t1async.actors.learner import Learner

    p = OneLineErrors(prog="t1async bench micro-batch", description=__doc__.split("\n\n")[0],
                      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--micro-batch-tokens", default="0,4096", help="comma-separated learner.micro_batch_tokens values")
    p.add_argument("--batch", type=at_least_one, default=64, help="trajectories per step")
    p.add_argument("--min-tokens", type=at_least_one, default=100, help="shortest trajectory")
    p.add_argument("--max-tokens", type=at_least_one, default=300, help="longest trajectory")
    p.add_argument("--steps", type=at_least_one, default=5, help="timed steps per value")
    p.add_argument("--warmup", type=at_least_zero, default=1, help="untimed steps first")
    p.add_argument("--advantage", choices=["group", "gae"], default="group",
                   help="group: no critic (configs/learning.yaml); gae: with the critic")
    p.add_argument("--model", choices=sorted(MODELS), default="local",
                   help="local: configs/local.yaml's model (4.4 M parameters); mid: about 390 M (tools/bench_learner.py)")
    p.add_argument("--threads", type=at_least_one, default=2, help="torch intra-op threads")
    p.add_argument("--expert-parallel", type=at_least_one, default=2,
                   help="expert-parallel ranks the routing balance is counted over (must divide the experts)")
    args = p.parse_args(argv)
    try:
        values = [int(v) for v in args.micro_batch_tokens.split(",") if v.strip()]
    except ValueError:
        p.error(f"--micro-batch-tokens must be comma-separated integers, got {args.micro_batch_tokens!r}")
    if not values or min(values) < 0:
        p.error("--micro-batch-tokens needs at least one value, each >= 0 (0: one trajectory per forward)")
    if args.min_tokens < 2 or args.min_tokens > args.max_tokens:
        p.error(f"--min-tokens must be >= 2 and <= --max-tokens, got --min-tokens {args.min_tokens} "
                f"--max-tokens {args.max_tokens}")
    torch.set_num_threads(args.threads)
    model = MODELS[args.model]
    if model.num_experts % args.expert_parallel:
        p.error(f"--expert-parallel {args.expert_parallel} must divide the {args.model} model's "
                f"{model.num_experts} experts")
    batch = make_trajectories(model, args.batch, args.min_tokens, args.max_tokens)
    tokens = sum(t.num_tokens for t in batch)
    learners = {}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for v in values:
                cfg = LearnerConfig(batch_size=args.batch, lr=1e-5, critic_lr=1e-5, kl_coef=0.1,
                                    advantage=args.advantage, critic=args.advantage == "gae", micro_batch_tokens=v)
                learners[v] = Learner(cfg, model, TransportConfig(curve=False), WeightSyncConfig(), f"{tmp}/{v}",
                                      generation=GenerationConfig(), seed=0)
            times: dict[int, list[float]] = {v: [] for v in values}
            last: dict[int, dict] = {}
            for i in range(args.warmup + args.steps):
                for v, learner in learners.items():
                    t0 = time.perf_counter()
                    last[v] = learner.loop._train_step(batch)
                    if i >= args.warmup:
                        times[v].append(time.perf_counter() - t0)
        finally:
            for learner in learners.values():
                learner.close()
    results = {}
    lengths = [t.num_tokens - 1 for t in batch]  # positions the learner forwards per trajectory
    for v in values:
        dt = statistics.median(times[v])
        padded = sum(len(g) * max(lengths[i] for i in g) for g in micro_batches(lengths, v))
        results[str(v)] = {"step_s_median": round(dt, 3), "step_s_all": [round(t, 3) for t in times[v]],
                           "tokens_per_s": round(tokens / dt, 1), "policy_loss_last": last[v]["policy_loss"],
                           "padding_frac": round(1 - sum(lengths) / padded, 4),
                           "routing": routing_balance(batch, model, v, args.expert_parallel)}
    first = results[str(values[0])]["tokens_per_s"]
    for r in results.values():
        r["speedup"] = round(r["tokens_per_s"] / first, 3)
    out = {"model": args.model, "batch": args.batch, "tokens": tokens, "min_tokens": args.min_tokens,
           "max_tokens": args.max_tokens, "advantage": args.advantage, "steps": args.steps,
           "expert_parallel": args.expert_parallel, "results": results}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
