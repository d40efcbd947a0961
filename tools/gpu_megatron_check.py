"""One-shot GPU check of the Megatron learner backend (run by tools/gpu_megatron_check.sh).

Needs only torch (CUDA), numpy, safetensors and megatron-core 0.16.1: no tokenizer, Ray, ZeroMQ
or OmegaConf. Five parts, each recorded even if another fails, written as one JSON object:

1. ``parity_fp32``: the small test model (tests/unit/learner/test_megatron.py's) in float32 on the GPU, torch vs
   megatron backend from the same weights: log-prob and value max|diff| with and without replay,
   and whether Megatron's RECORD equals the torch model's routed experts.
2. ``learner_step_bf16``: the ``mid`` model (about 390 M parameters) in bfloat16 with routing
   replay: one learner RL step (tools/bench_learner.py ``rl_step``) on 4 x 2048 tokens, its
   losses, gradient norm and seconds; the replayed experts are the ones used; log-prob
   difference to the torch backend in bf16 (same weights).
3. ``bench``: ``t1async bench learner --model mid --batch 4 --seq 2048`` (both backends, replay
   on): tokens/s and MFU against 989.4 TFLOP/s bf16 dense.
4. ``parity_fp32_glm4``: the tiny glm4_moe folder of tests/unit/learner/test_megatron_glm4_moe.py (saved by
   transformers' ``save_pretrained``; needs transformers, recorded as skipped without it) in float32 on the GPU,
   torch vs megatron backend (t1async/learner/megatron/families/glm4_moe.py): log-prob and value max|diff| with
   and without replay, whether both route to the same expert sets, and whether replay used the given rows.
5. ``qwen3_5_moe_parity_fp32``: the tiny qwen3_5_moe folder (tests/support/qwen3_5_moe.py: 3 Gated DeltaNet + 1 gated
   attention layer) in float32 on the GPU, torch vs megatron backend (megatron-core's GatedDeltaNet with
   flash-linear-attention's kernels: its wheel must be in .whl/ too, else the part records megatron's ImportError):
   log-prob max|diff| with and without replay, RECORD vs the torch model's routing, values, and one learner RL step's
   loss and gradient norm on both.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_learner
warnings.filterwarnings("ignore")

import bench_learner  # noqa: E402

from t1async.config import GenerationConfig, LearnerConfig, ModelConfig  # noqa: E402
from t1async.learner.rl import routing_differs  # noqa: E402

SMALL = ModelConfig(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, rope_theta=5000.0)


def _forward_parity(tb, mb, b: dict) -> dict:
    """Log-probs (own routing and replayed), the routers' own choice and the critic's values of the torch
    backend ``tb`` against the megatron one ``mb`` on ``bench_learner.make_batch``'s batch ``b``."""
    out = {}
    for name, rep in (("no_replay", None), ("replay", b["replay"])):
        a = tb.policy_logprobs(b["inp"], b["tgt"], rep, grad=False, routing=True)
        m = mb.policy_logprobs(b["inp"], b["tgt"], rep, grad=False, routing=True)
        out[f"logprob_max_abs_diff_{name}"] = float((a.logp - m.logp).abs().max())
        out[f"routing_equal_{name}"] = bool(torch.equal(a.routed_experts, m.routed_experts))
    out["record_equals_torch_routing"] = out.pop("routing_equal_no_replay")
    out["value_max_abs_diff"] = float((tb.values(b["inp"], grad=False) - mb.values(b["inp"], grad=False)).abs().max())
    return out


def parity_fp32(dev: torch.device) -> dict:
    from t1async.learner.megatron.backend import MegatronBackend, load_megatron
    from t1async.learner.megatron.families.convert import CRITIC, hf_to_megatron
    from t1async.learner.torch_backend import TorchBackend

    cfg = LearnerConfig()
    torch.manual_seed(0)
    tb = TorchBackend(cfg, SMALL, GenerationConfig(), device=dev)
    with torch.no_grad():
        for n, p in tb.policy.named_parameters():
            if n.endswith("mlp.gate.weight"):
                p.normal_(0.0, 1.0)
        tb.critic.head.weight.normal_(0.0, 0.5)
    mb = MegatronBackend(cfg, SMALL, GenerationConfig(), device=dev, dtype=torch.float32)
    load_megatron(mb.policy, hf_to_megatron(tb.policy.state_dict(), SMALL))
    load_megatron(mb.critic, hf_to_megatron(tb.critic.state_dict(), SMALL, CRITIC))
    b = bench_learner.make_batch(SMALL, 2, 64, dev)
    out = _forward_parity(tb, mb, b)
    out["ok"] = all(v < 1e-5 for k, v in out.items() if "diff" in k) and out["record_equals_torch_routing"]
    return out


def parity_fp32_glm4(dev: torch.device) -> dict:
    import tempfile

    try:
        import transformers  # noqa: F401  (the torch learner's glm4_moe is transformers' own modeling)
    except ImportError as e:
        return {"skipped": f"transformers is not installed ({e})"}
    from t1async.config.model_folder import resolve_model
    from t1async.learner.megatron.backend import MegatronBackend
    from t1async.learner.torch_backend import TorchBackend
    from tests.support.glm4 import glm4_folder

    with tempfile.TemporaryDirectory() as tmp:
        cfg = resolve_model(ModelConfig(path=str(glm4_folder(Path(tmp) / "glm"))))
        lc = LearnerConfig()
        torch.manual_seed(0)
        tb = TorchBackend(lc, cfg, GenerationConfig(), device=dev)
        with torch.no_grad():
            tb.critic.head.weight.normal_(0.0, 0.5)
        mb = MegatronBackend(lc, cfg, GenerationConfig(), device=dev, dtype=torch.float32)
        mb._load_hf("critic", tb.critic.state_dict())
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (2, 65), generator=g).to(dev)
    inp, tgt = ids[:, :-1], ids[:, 1:]
    L = sum(mb._stage_moe)
    replay = torch.stack([torch.randperm(cfg.num_experts, generator=g)[:cfg.num_experts_per_tok]
                          for _ in range(2 * 64 * L)]).view(2, 64, L, -1).to(dev)
    out = {}
    for name, rep in (("no_replay", None), ("replay", replay)):
        a = tb.policy_logprobs(inp, tgt, rep, grad=False, routing=True)
        m = mb.policy_logprobs(inp, tgt, rep, grad=False, routing=True)
        out[f"logprob_max_abs_diff_{name}"] = float((a.logp - m.logp).abs().max())
        out[f"same_expert_sets_{name}"] = not bool(routing_differs(a.routed_experts, m.routed_experts).any())
    out["replay_used_given_rows"] = bool(torch.equal(m.routed_experts, replay))
    out["value_max_abs_diff"] = float((tb.values(inp, grad=False) - mb.values(inp, grad=False)).abs().max())
    out["ok"] = (all(v < 1e-5 for k, v in out.items() if "diff" in k)
                 and all(v for k, v in out.items() if k.startswith(("same_", "replay_used"))))
    return out


def learner_step_bf16(dev: torch.device) -> dict:
    model = bench_learner.MODELS["mid"]
    cfg = LearnerConfig(lr=1e-5, critic_lr=1e-5)
    t0 = time.perf_counter()
    mb = bench_learner.make_backend("megatron", cfg, model, dev, torch.bfloat16)
    out = {"build_s": round(time.perf_counter() - t0, 2), "parameters": mb.num_parameters()}
    b = bench_learner.make_batch(model, 4, 2048, dev)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out.update(bench_learner.rl_step(mb, b, cfg, replay=True))
    torch.cuda.synchronize()
    out["step_s"] = round(time.perf_counter() - t0, 3)
    small = {k: v[:1, :256] for k, v in b.items()}
    fw = mb.policy_logprobs(small["inp"], small["tgt"], small["replay"], grad=False, routing=True)
    out["replayed_experts_used"] = bool(torch.equal(fw.routed_experts, small["replay"]))
    out["router_own_differs_frac"] = float(routing_differs(fw.router_experts, small["replay"]).float().mean())
    hf = {k: v.detach().clone() for k, v in mb.hf_weights()}
    del mb
    torch.cuda.empty_cache()
    tb = bench_learner.make_backend("torch", cfg, model, dev, torch.bfloat16)
    with torch.no_grad():  # the megatron weights after its step, in the torch model
        for n, p in tb.policy.named_parameters():
            p.copy_(hf[n])
    ft = tb.policy_logprobs(small["inp"], small["tgt"], small["replay"], grad=False, routing=False)
    d = (ft.logp - fw.logp).abs()
    out["bf16_logprob_diff_vs_torch"] = {"mean": float(d.mean()), "max": float(d.max())}
    del tb
    torch.cuda.empty_cache()
    return out


def qwen3_5_moe_parity_fp32(dev: torch.device) -> dict:
    import tempfile

    from t1async.learner.megatron.backend import MegatronBackend
    from t1async.learner.torch_backend import TorchBackend
    from tests.support.qwen3_5_moe import qwen35_folder

    model = qwen35_folder(Path(tempfile.mkdtemp()) / "q35")
    cfg = LearnerConfig()
    torch.manual_seed(0)
    tb = TorchBackend(cfg, model, GenerationConfig(), device=dev)
    with torch.no_grad():
        tb.critic.head.weight.normal_(0.0, 0.5)
    mb = MegatronBackend(cfg, model, GenerationConfig(), device=dev, dtype=torch.float32)
    mb._load_hf("critic", tb.critic.state_dict())
    b = bench_learner.make_batch(model, 2, 256, dev)
    out = _forward_parity(tb, mb, b)
    for name, backend in (("torch", tb), ("megatron", mb)):
        step = bench_learner.rl_step(backend, b, cfg, replay=True)
        out[f"step_{name}"] = {k: v for k, v in step.items() if isinstance(v, (int, float))}
    out["ok"] = all(v < 1e-4 for k, v in out.items() if "diff" in k) and out["record_equals_torch_routing"]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--bench-steps", type=int, default=5)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("gpu_megatron_check: no CUDA device", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    res: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    try:
        import megatron.core

        res["megatron_core"] = megatron.core.__version__
    except Exception as e:  # recorded; the parts below then fail with the reason
        res["megatron_core"] = f"import failed: {e}"
    parts = {"parity_fp32": lambda: parity_fp32(dev), "learner_step_bf16": lambda: learner_step_bf16(dev),
             "bench": lambda: bench_learner.main(["--model", "mid", "--batch", "4", "--seq", "2048",
                                                  "--steps", str(args.bench_steps), "--warmup", "2"]),
             "parity_fp32_glm4": lambda: parity_fp32_glm4(dev),
             "qwen3_5_moe_parity_fp32": lambda: qwen3_5_moe_parity_fp32(dev)}
    for name, fn in parts.items():
        t0 = time.perf_counter()
        try:
            res[name] = fn()
        except Exception as e:
            res[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        res[name]["seconds"] = round(time.perf_counter() - t0, 1)
        print(json.dumps({name: res[name]}), flush=True)
        Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
