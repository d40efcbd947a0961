"""``t1async bench learner``: training tokens/s of the learner backends, side by side, on one model and batch.

Prints ONE JSON object. Each backend (``torch``, ``megatron``; t1async/learner/backend.py) is built from
the same seeded init and runs the same RL step as the learner does per micro-batch
(t1async/actors/learner.py ``_train_step``), through the backend interface only:

    old values (critic, no grad) -> policy log-probs with routing replay (grad) -> critic values
    (grad) -> decoupled-PPO policy loss + clipped value loss (t1async/learner/rl.py) -> backward ->
    clip + AdamW step of both models

on ``--batch`` sequences of ``--seq`` random tokens with random routed experts (K distinct per
row, as a sampler records). Both backends are built first; after ``--warmup`` steps each, the
``--steps`` timed steps alternate between them (this machine is shared: a load change then moves
both alike), each timed on its own (CUDA synchronised); tokens/s = batch x seq / the median step
time.

On CUDA it also reports MFU against the bf16 dense peak of an H100/H200 SXM, 989.4 TFLOP/s
(NVIDIA's datasheet figure without sparsity; ``--peak-tflops`` for another device), counting
model FLOPs per token as

    policy forward + backward  6 N_policy + 12 L T a
    critic forward + backward  6 N_trunk  + 12 L T a
    critic forward (old values) 2 N_trunk +  4 L T a

where N counts the matrix weights one token touches (attention, router, its K experts, and the
LM head for the policy; no embedding), L layers, T the sequence length and a = heads x head_dim
(attention scores and values, full square, as Megatron's own MFU formula counts them).

Models (``--model``): ``local`` (configs/local.yaml's default ModelConfig, 4.4 M parameters) and
``mid`` (8 layers, hidden 1024, 16 experts top-2, expert width 768, 16 heads, 4 KV heads,
vocabulary 32768: about 390 M parameters, the size measured on an H200 in docs/results/2026-11-30-gpu-h200.md).

Usage: ``t1async bench learner [--model local|mid | --model-path DIR] [--batch 4] [--seq 256] [--steps 5]
[--backends torch,megatron] [--device auto|cpu|cuda] [--dtype auto|float32|bfloat16] [--scored-frac F]``.

``--scored-frac F`` < 1: the loss mask covers that fraction of each row (the sampled tokens of four turns) and the
torch backend scores only those positions, as the learner does; the same backend with its LM head at every position
is timed beside it (``scored_over_every_position``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from t1async.cli import OneLineErrors, at_least_one, at_least_zero
from t1async.config import GenerationConfig, LearnerConfig, ModelConfig
from t1async.learner.backend import LearnerBackend
from t1async.learner.rl import policy_loss, value_loss

MODELS = {
    "local": ModelConfig(),
    "mid": ModelConfig(vocab_size=32768, hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
                       num_key_value_heads=4, head_dim=64, num_experts=16, num_experts_per_tok=2,
                       moe_intermediate_size=768, max_position_embeddings=8192),
}
H200_BF16_DENSE_TFLOPS = 989.4
EVERY_POSITION = "torch (LM head at every position)"


def make_backend(name: str, cfg: LearnerConfig, model: ModelConfig, device: torch.device,
                 dtype: torch.dtype, seed: int = 0) -> LearnerBackend:
    """Backend ``name`` on ``device`` in ``dtype``, from t1async/models/model.py's init with ``seed``."""
    torch.manual_seed(seed)
    if name == "torch":
        from t1async.learner.torch_backend import TorchBackend

        return TorchBackend(cfg, model, GenerationConfig(), device=device, dtype=dtype)
    from t1async.learner.megatron.backend import MegatronBackend

    return MegatronBackend(cfg, model, GenerationConfig(), device=device, dtype=dtype)


def make_batch(model: ModelConfig, batch: int, seq: int, device: torch.device, seed: int = 1,
               scored_frac: float = 1.0) -> dict:
    """Token ids [B, T + 1], routed experts [B, T, L, K] (K distinct per row), behaviour
    log-probs, advantages, returns and a loss mask, on ``device``: ones, or with ``scored_frac`` < 1 that
    fraction of each row as the sampled tokens of four turns (the rest: prompt and observations)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.vocab_size, (batch, seq + 1), generator=g)
    scores = torch.rand(batch, seq, model.num_hidden_layers, model.num_experts, generator=g)
    experts = scores.argsort(dim=-1)[..., :model.num_experts_per_tok]
    b = {"inp": ids[:, :-1], "tgt": ids[:, 1:], "replay": experts, "mu": -torch.rand(batch, seq, generator=g) - 4.0,
         "adv": torch.randn(batch, seq, generator=g), "ret": torch.randn(batch, seq, generator=g),
         "mask": torch.ones(batch, seq)}
    if scored_frac < 1.0:
        b["mask"].zero_()
        turn, span = seq // 4, max(1, round(seq * scored_frac / 4))
        for t in range(4):  # each turn: its observation, then the sampled tokens at its end
            b["mask"][:, (t + 1) * turn - span:(t + 1) * turn] = 1.0
    return {k: v.to(device) for k, v in b.items()}


def rl_step(backend: LearnerBackend, b: dict, cfg: LearnerConfig, replay: bool = True,
            scored: bool = True) -> dict[str, float]:
    """One learner micro-batch step through the backend interface (see the module docstring); ``scored``: the
    policy's log-probs at the mask's positions only, as the learner asks for them (t1async/learner/update.py)."""
    n = float(b["mask"].sum())
    old_v = backend.values(b["inp"], grad=False)
    backend.zero_grad()
    out = backend.policy_logprobs(b["inp"], b["tgt"], b["replay"] if replay else None, grad=True, routing=False,
                                  score=b["mask"] > 0 if scored else None)
    pl = policy_loss(out.logp, out.logp.detach(), b["mu"], b["adv"], b["mask"], clip_eps=cfg.clip_eps,
                     is_cap=cfg.is_cap, denom=n)
    vl = value_loss(backend.values(b["inp"], grad=True), old_v, b["ret"], b["mask"], clip=cfg.value_clip, denom=n)
    backend.backward(cfg.value_coef * vl + pl.loss)
    gn = backend.step(policy=True, policy_lr=cfg.lr)
    return {"policy_loss": float(pl.loss.detach()), "value_loss": float(vl.detach()), "grad_norm": gn}


def flops_per_token(m: ModelConfig, seq: int) -> float:
    """Model FLOPs of one token of :func:`rl_step` (module docstring's formula)."""
    H, a = m.hidden_size, m.num_attention_heads * m.head_dim
    kv = m.num_key_value_heads * m.head_dim
    layer = H * a * 2 + H * kv * 2 + H * m.num_experts + m.num_experts_per_tok * 3 * H * m.moe_intermediate_size
    trunk = m.num_hidden_layers * layer
    policy = trunk + H * m.vocab_size
    attn = m.num_hidden_layers * seq * a
    return (6 * policy + 12 * attn) + (6 * trunk + 12 * attn) + (2 * trunk + 4 * attn)


def run(names: list[str], model: ModelConfig, args: argparse.Namespace, device: torch.device,
        dtype: torch.dtype) -> dict[str, dict]:
    """Build every backend, warm each up, then time ``args.steps`` steps of each, alternating."""
    cfg = LearnerConfig(lr=1e-5, critic_lr=1e-5)
    backends = {n: make_backend(n, cfg, model, device, dtype) for n in names}
    if args.scored_frac < 1.0 and "torch" in backends:  # side by side: the LM head at every position
        backends[EVERY_POSITION] = make_backend("torch", cfg, model, device, dtype)
    b = make_batch(model, args.batch, args.seq, device, scored_frac=args.scored_frac)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times: dict[str, list[float]] = {n: [] for n in backends}
    last: dict[str, dict] = {}
    for i in range(args.warmup + args.steps):
        for n, backend in backends.items():
            sync()
            t0 = time.perf_counter()
            last[n] = rl_step(backend, b, cfg, replay=not args.no_replay, scored=n != EVERY_POSITION)
            sync()
            if i >= args.warmup:
                times[n].append(time.perf_counter() - t0)
    out = {}
    for n, backend in backends.items():
        dt = statistics.median(times[n])
        tps = args.batch * args.seq / dt
        out[n] = {"tokens_per_s": round(tps, 1), "step_s_median": round(dt, 4),
                  "step_s_all": [round(t, 4) for t in times[n]], "policy_loss_last": last[n]["policy_loss"],
                  "parameters": backend.num_parameters()}
        if device.type == "cuda":
            out[n]["mfu"] = round(flops_per_token(model, args.seq) * tps / (args.peak_tflops * 1e12), 4)
    if device.type == "cuda":
        out["max_memory_gib_all_backends"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return out


def main(argv: list[str] | None = None) -> dict:
    p = OneLineErrors(prog="t1async bench learner", description=__doc__.split("\n\n")[0],
                      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="local", help="model size (see the module docstring)")
    p.add_argument("--batch", type=at_least_one, default=4, help="sequences per step")
    p.add_argument("--seq", type=at_least_one, default=256, help="tokens per sequence")
    p.add_argument("--steps", type=at_least_one, default=5, help="timed steps")
    p.add_argument("--warmup", type=at_least_zero, default=1, help="untimed steps first")
    p.add_argument("--backends", default="torch,megatron", help="comma-separated learner backends")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="auto: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--no-replay", action="store_true", help="route with the learner's own routers")
    p.add_argument("--peak-tflops", type=float, default=H200_BF16_DENSE_TFLOPS, help="bf16 dense peak for MFU")
    p.add_argument("--threads", type=at_least_one, default=2, help="torch intra-op threads (CPU)")
    p.add_argument("--model-path", default=None, help="a Hugging Face model folder instead of --model")
    p.add_argument("--scored-frac", type=float, default=1.0,
                   help="fraction of positions that are sampled tokens (the loss mask); below 1 the torch backend is "
                        "also timed with its LM head at every position, side by side")
    args = p.parse_args(argv)
    if not 0.0 < args.scored_frac <= 1.0:
        p.error(f"--scored-frac must be in (0, 1], got {args.scored_frac}")
    device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32, "float32": torch.float32,
             "bfloat16": torch.bfloat16}[args.dtype]
    torch.set_num_threads(args.threads)
    if args.model_path:
        from t1async.config.model_folder import resolve_model  # the folder's architecture (reads config.json)

        model = resolve_model(ModelConfig(path=args.model_path))
    else:
        model = MODELS[args.model]
    out = {"model": args.model_path or args.model, "scored_frac": args.scored_frac,
           "batch": args.batch, "seq": args.seq, "steps": args.steps, "device": str(device),
           "dtype": str(dtype).removeprefix("torch."), "replay": not args.no_replay,
           "flops_per_token": flops_per_token(model, args.seq), "results": {}}
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name()
        out["peak_tflops_bf16_dense"] = args.peak_tflops
    out["results"] = run([n.strip() for n in args.backends.split(",") if n.strip()], model, args, device, dtype)
    r = out["results"]
    if "torch" in r and "megatron" in r:
        out["megatron_over_torch"] = round(r["megatron"]["tokens_per_s"] / r["torch"]["tokens_per_s"], 3)
    if "torch" in r and EVERY_POSITION in r:
        out["scored_over_every_position"] = round(r["torch"]["tokens_per_s"] / r[EVERY_POSITION]["tokens_per_s"], 3)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
