"""Figures of docs/results/2026-12-07-plan.md: ``t1async plan`` on the shipped real configs, and its bytes against
what the megatron learner allocates on a tiny model.

    python tools/plan_figures.py layouts [--gpus 8 32 64] [--gpu-memory 80] [--no-critic]   # real configs
    python tools/plan_figures.py truth                                        # planned vs allocated, tiny model

``layouts``: per config and GPU count, the smallest layout (fewest ranks, then least memory) of the megatron learner in
bfloat16 (critic on, no KL reference, 4,096-token micro-batches, recompute off) whose largest rank fits, and that
rank's GiB by kind. ``truth``: the one-rank megatron backend on CPU (float32 and bfloat16) after one AdamW step, and
the tensors a forward keeps for its backward, against the plan.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from t1async.config import GenerationConfig, LearnerConfig, ModelConfig  # noqa: E402
from t1async.learner.megatron.plan import GiB, Layout, fitting_layouts, load_model_config, plan_layout  # noqa: E402

REAL = ROOT / "tests" / "fixtures" / "real_configs"


def _learner(dtype: str = "bfloat16", **kw) -> LearnerConfig:
    return LearnerConfig(backend="megatron", **kw,
                         megatron=dataclasses.replace(LearnerConfig().megatron, dtype=dtype, device="cpu"))


def layouts(gpus: list[int], gpu_memory: float, critic: bool = True) -> None:
    lc = _learner(kl_coef=0.0, max_tokens_per_chunk=0, critic=critic)
    print("| model | GPUs | smallest layout that fits | GiB per rank: params | grads | masters | moments | activations "
          "| total |")
    print("|---|---|---|---|---|---|---|---|---|")
    for f in sorted(REAL.glob("*.json")):
        cfg = load_model_config(f)
        for n in gpus:
            fit = fitting_layouts(cfg, lc, n, int(gpu_memory * GiB), 4096, limit=1)
            if not fit:
                one = max(plan_layout(cfg, lc, Layout(), 4096), key=lambda p: p.total)
                print(f"| {f.stem} | {n} | none (1 rank would need {one.total / GiB:.0f} GiB) | | | | | | |")
                continue
            lay, _ = fit[0]
            worst = max(plan_layout(cfg, lc, lay, 4096), key=lambda p: p.total)
            k = {x: sum(getattr(getattr(worst, m), x) for m in ("policy", "critic", "reference"))
                 for x in ("params", "grads", "masters", "moments", "activations")}
            print(f"| {f.stem} | {n} | {lay} ({lay.ranks} ranks) | " + " | ".join(f"{v / GiB:.1f}" for v in k.values())
                  + f" | {worst.total / GiB:.1f} |")


def truth() -> None:
    from t1async.learner.megatron.backend import MegatronBackend

    warnings.filterwarnings("ignore")
    model = ModelConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    print("| dtype | model | kind | planned bytes | allocated bytes |")
    print("|---|---|---|---|---|")

    def nb(ts):
        return sum(t.numel() * t.element_size() for t in ts)
    for dt in ("float32", "bfloat16"):
        lc = _learner(dt, kl_coef=0.1, max_tokens_per_chunk=0, micro_batch_tokens=1024)
        b = MegatronBackend(lc, model, GenerationConfig())
        plan = plan_layout(model, lc, Layout(), 1024)[0]
        inp, tgt = torch.randint(0, 512, (1, 1024)), torch.randint(0, 512, (1, 1024))
        for name, m, opt in (("policy", b.policy, b.policy_opt), ("critic", b.critic, b.critic_opt),
                             ("reference", b.reference, None)):
            ps = list(m.parameters())
            want = getattr(plan, name)
            rows = {"params": nb(ps)}
            if opt is not None:
                skip = {p.untyped_storage().data_ptr() for p in ps}
                seen: dict[int, int] = {}

                def pack(t, skip=skip, seen=seen):
                    if t.untyped_storage().data_ptr() not in skip:
                        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                    return t
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    if name == "policy":
                        b.policy_logprobs(inp, tgt, None, grad=True, routing=False)
                    else:
                        b.values(inp, grad=True)
                for p in ps:
                    p.grad = torch.ones_like(p)
                opt.step()
                rows |= {"grads": nb(p.grad for p in ps),
                         "masters": nb(x for x, p in zip(opt.masters, opt.params) if x is not p),
                         "moments": nb(v for st in opt.state.values() for k, v in st.items()
                                       if k in ("exp_avg", "exp_avg_sq")),
                         "activations": sum(seen.values())}
            for kind, got in rows.items():
                planned = getattr(want, kind)
                note = f" (ratio {planned / got:.2f})" if kind == "activations" else ""
                print(f"| {dt} | {name} | {kind} | {planned} | {got}{note} |")
        b.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    lp = sub.add_parser("layouts")
    lp.add_argument("--gpus", type=int, nargs="+", default=[8, 32, 64])
    lp.add_argument("--gpu-memory", type=float, default=80.0)
    lp.add_argument("--no-critic", action="store_true", help="learner.critic=false (no value model)")
    sub.add_parser("truth")
    a = ap.parse_args()
    if a.what == "layouts":
        layouts(a.gpus, a.gpu_memory, critic=not a.no_critic)
    else:
        truth()
    return 0


if __name__ == "__main__":
    sys.exit(main())
