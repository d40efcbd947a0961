"""Learner step time of the megatron backend on one process against N = ``expert_parallel`` x
``tensor_parallel`` x ``pipeline_parallel`` processes.

Prints ONE JSON object. Builds the megatron backend on one process, times ``--steps`` learner
micro-batch steps (tools/bench_learner.py ``rl_step``: old values, policy log-probs with replay,
values, PPO + value loss, backward, clip + AdamW) on one batch after ``--warmup`` untimed ones,
closes it, then does the same with ``--ranks`` expert-parallel ranks times ``--tensor-parallel``
times ``--pipeline-parallel`` ranks (rank 0 here, the others Ray actors on this machine, gloo on CPU / nccl on CUDA), from the
same seeded init on the same batch. One backend at a time (a process holds one torch.distributed world), so a load change on a
shared machine between the two phases moves one and not the other: compare medians of several runs.

Each rank forwards ceil(B/N) of the batch's B rows (t1async/learner/megatron/backend.py: a data-parallel
split inside the expert-parallel group; ``forwarded_rows_per_rank`` shows it) and holds 1/N of the
experts (``parameters_rank0``); on top come the dispatcher's all-gather and reduce-scatter, the
announcements, the output gathers and the shared-gradient all-reduce. ``--batch`` should be at
least N (the default 4 sequences of ``--seq`` tokens): with B < N some ranks forward only dummy
rows. With tensor parallelism T the T ranks of each expert-parallel rank forward the same rows,
each its 1/T slice of attention, vocabulary and experts and 1/T of the sequence between them
(sequence parallelism), at the cost of all-gathers and reduce-scatters in every layer. With
pipeline parallelism S each stage holds 1/S of the layers and the stages run one after another
(memory, not speed). N ranks run faster only where they compute in parallel (one GPU each, or
free CPU cores).

Usage: ``python tools/bench_expert_parallel.py [--ranks 2] [--tensor-parallel 1] [--pipeline-parallel 1] [--model local|mid]
[--batch 4] [--seq 128] [--steps 5] [--warmup 1] [--threads 1]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_learner import MODELS, make_batch, rl_step  # noqa: E402

from t1async.config import GenerationConfig, LearnerConfig  # noqa: E402


def time_backend(ranks: int, args: argparse.Namespace, device: torch.device, tensor_parallel: int = 1,
                 pipeline_parallel: int = 1) -> dict:
    """Build the megatron backend with ``ranks`` expert-parallel ranks times ``tensor_parallel``
    times ``pipeline_parallel``, time its steps, close it."""
    from t1async.learner.megatron.backend import MegatronBackend

    model = MODELS[args.model]
    cfg = LearnerConfig(lr=1e-5, critic_lr=1e-5)
    cfg.megatron = dataclasses.replace(cfg.megatron, expert_parallel=ranks, tensor_parallel=tensor_parallel,
                                       pipeline_parallel=pipeline_parallel)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    backend = MegatronBackend(cfg, model, GenerationConfig(), device=device, dtype=torch.float32)
    build_s = time.perf_counter() - t0
    try:
        b = make_batch(model, args.batch, args.seq, device)
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        times, last = [], {}
        for i in range(args.warmup + args.steps):
            sync()
            t0 = time.perf_counter()
            last = rl_step(backend, b, cfg)
            sync()
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
        counts = backend.forward_counts()  # every rank's forwards since it was built (warm-up included)
        t0 = time.perf_counter()
        hf = backend.hf_state()
        gather_s = time.perf_counter() - t0
        local = sum(p.numel() for p in backend.policy.parameters())
        return {"ranks": ranks * tensor_parallel * pipeline_parallel, "expert_parallel": ranks,
                "tensor_parallel": tensor_parallel, "pipeline_parallel": pipeline_parallel,
                "step_s_median": round(statistics.median(times), 4),
                "step_s_all": [round(t, 4) for t in times], "tokens_per_s": round(args.batch * args.seq
                                                                                 / statistics.median(times), 1),
                "build_s": round(build_s, 2), "hf_state_s": round(gather_s, 3), "parameters": backend.num_parameters(),
                "parameters_rank0": local, "hf_tensors": len(hf), "policy_loss_last": last["policy_loss"],
                "grad_norm_last": last["grad_norm"],
                "forwarded_rows_per_rank": [c["rows"] / max(c["forwards"], 1) for c in counts]}
    finally:
        backend.close()


def check_sizes(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse, before anything starts, parallel sizes the model cannot be split by (one line, rc 2)."""
    from t1async.config import divisors, tensor_parallel_choices, tensor_parallel_sizes

    model = MODELS[args.model]
    for flag, value, ok, what in (("--ranks", args.ranks, divisors(model.num_experts), f"{model.num_experts} experts"),
                                  ("--tensor-parallel", args.tensor_parallel, tensor_parallel_choices(model),
                                   f"sizes {tensor_parallel_sizes(model)}"),
                                  ("--pipeline-parallel", args.pipeline_parallel, divisors(model.num_hidden_layers),
                                   f"{model.num_hidden_layers} layers")):
        if value not in ok:
            p.error(f"{flag} {value} must divide the {args.model} model's {what}: one of {ok}")


def main(argv: list[str] | None = None) -> dict:
    from t1async.cli import OneLineErrors, at_least_one, at_least_zero

    p = OneLineErrors(prog="t1async bench expert-parallel", description=__doc__.split("\n\n")[0],
                      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--ranks", type=at_least_one, default=2, help="expert-parallel ranks of the second phase")
    p.add_argument("--tensor-parallel", type=at_least_one, default=1,
                   help="tensor-parallel ranks per expert-parallel rank in the second phase")
    p.add_argument("--pipeline-parallel", type=at_least_one, default=1,
                   help="pipeline stages in the second phase (must divide the model's layers)")
    p.add_argument("--model", choices=sorted(MODELS), default="local", help="model size (tools/bench_learner.py)")
    p.add_argument("--batch", type=at_least_one, default=4, help="sequences per micro-batch (split across the ranks)")
    p.add_argument("--seq", type=at_least_one, default=128, help="tokens per sequence")
    p.add_argument("--steps", type=at_least_one, default=5, help="timed steps")
    p.add_argument("--warmup", type=at_least_zero, default=1, help="untimed steps first")
    p.add_argument("--threads", type=at_least_one, default=1, help="torch threads per rank")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = p.parse_args(argv)
    check_sizes(p, args)
    import warnings

    import ray

    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        device = torch.device(args.device)
        one = time_backend(1, args, device)
        many = time_backend(args.ranks, args, device, args.tensor_parallel, args.pipeline_parallel)
    finally:
        ray.shutdown()
    loss = one["policy_loss_last"]
    out = {"model": args.model, "batch": args.batch, "seq": args.seq, "threads_per_rank": args.threads,
           "device": args.device, "one_rank": one, f"{many['ranks']}_ranks": many,
           "step_time_ratio": round(many["step_s_median"] / one["step_s_median"], 3),
           "same_loss": abs(loss - many["policy_loss_last"]) <= 1e-5 * max(1.0, abs(loss))}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
