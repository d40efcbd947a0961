"""``t1async plan MODEL [--gpus N] [--gpu-memory GiB] [--json] [key=value ...]``: what a learner layout needs per
GPU, before anything starts.

MODEL is a Hugging Face model folder or just its ``config.json`` (any file name). The model is built on the meta
device (no weights, t1async/learner/megatron/plan.py) and sharded as the learner shards it; ``key=value`` are config
overrides (``learner.backend=megatron``, ``learner.megatron.tensor_parallel=2``, ``learner.megatron.dtype=bfloat16``,
``learner.micro_batch_tokens=8192``, ``sampler.num_samplers=4`` ...). Printed: per pipeline stage, the bytes of one
rank for policy, critic and reference (parameters, gradients, float32 masters, AdamW moments, activations of one
micro-batch with and without recompute); the SGLang servers' share of the GPUs and the bfloat16 weights each server
holds; with ``--gpu-memory``, the smallest layouts on the learner's GPUs that fit.
"""

from __future__ import annotations

import argparse
import json

from t1async.config import ConfigError, load_config
from t1async.learner.megatron.plan import GiB, Layout, fitting_layouts, load_model_config, model_tensors, plan_layout, to_json

__all__ = ["register", "run_plan", "plan_report"]


def register(sub: argparse._SubParsersAction) -> None:
    """``t1async plan``."""
    p = sub.add_parser("plan", help="per-GPU memory of a learner layout for a model folder or config.json, and the "
                                    "smallest layouts that fit")
    p.add_argument("model", help="model folder or config.json")
    p.add_argument("--gpus", type=int, default=0, help="GPUs in all (the SGLang servers' share is taken first)")
    p.add_argument("--gpu-memory", type=float, default=0.0, help="GiB per GPU: list the smallest layouts that fit")
    p.add_argument("--tokens", type=int, default=0, help="positions of one micro-batch (default "
                                                         "learner.micro_batch_tokens)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("overrides", nargs="*", default=[], help="key=value config overrides, e.g. learner.backend=megatron")
    p.set_defaults(func=run_plan)


def plan_report(model: str, overrides: list[str], *, gpus: int = 0, gpu_memory: float = 0.0, tokens: int = 0) -> dict:
    """The plan as one dict (bytes): ``model``, ``layout``, ``stages`` (per stage: policy/critic/reference bytes by
    kind), ``largest``, ``sglang`` (servers, GPUs, weight bytes per server), ``learner_gpus``, ``fits`` (layout,
    bytes).

    Raises:
        ConfigError: a bad override, model path, or a layout that does not divide the model (one line).
    """
    cfg = load_config(None, overrides)
    mcfg = load_model_config(model)
    learner = cfg.learner
    mc = learner.megatron
    lay = Layout(mc.tensor_parallel, mc.pipeline_parallel, mc.expert_parallel) if learner.backend == "megatron" \
        else Layout()
    tokens = tokens or learner.micro_batch_tokens or mcfg.max_position_embeddings
    plans = plan_layout(mcfg, learner, lay, tokens)
    n_params = sum(t.numel for t in model_tensors(mcfg))
    sg = cfg.sampler
    servers = sg.num_samplers if sg.backend == "sglang" and not sg.urls else 0
    sglang_gpus = servers * sg.tp_size
    out = {"model": str(model), "model_type": mcfg.model_type, "parameters": n_params, "layout": str(lay),
           "ranks": lay.ranks, "backend": learner.backend,
           "dtype": mc.dtype if learner.backend == "megatron" else "float32", "tokens": tokens,
           "stages": to_json(plans), "largest": max(p.total for p in plans),
           "sglang": {"servers": servers, "gpus": sglang_gpus, "tp_size": sg.tp_size,
                      "weight_bytes_per_server": 2 * n_params // max(sg.tp_size, 1)},
           "learner_gpus": max(gpus - sglang_gpus, 0) if gpus else 0, "fits": []}
    if gpu_memory > 0:
        ranks = out["learner_gpus"] if gpus else 64
        out["fits"] = [{"layout": str(f), "ranks": f.ranks, "bytes": b}
                       for f, b in fitting_layouts(mcfg, learner, ranks, int(gpu_memory * GiB), tokens)]
        out["gpu_memory_gib"] = gpu_memory
    return out


def _g(b: int) -> str:
    return f"{b / GiB:8.2f}"


def run_plan(args: argparse.Namespace) -> int:
    """Print the plan (a table, or ``--json``); 0, or 1 when ``--gpu-memory`` is given and nothing fits."""
    if args.gpus < 0 or args.gpu_memory < 0 or args.tokens < 0:
        raise ConfigError("--gpus, --gpu-memory and --tokens must be >= 0")
    rep = plan_report(args.model, args.overrides, gpus=args.gpus, gpu_memory=args.gpu_memory, tokens=args.tokens)
    if args.json:
        print(json.dumps(rep))
        return 0 if not args.gpu_memory or rep["fits"] else 1
    print(f"{rep['model']}: {rep['model_type']}, {rep['parameters'] / 1e9:.2f} B parameters; learner {rep['backend']} "
          f"{rep['dtype']}, layout {rep['layout']} ({rep['ranks']} ranks), micro-batch {rep['tokens']} tokens")
    print("GiB per rank   model      params    grads  masters  moments  activ.    total")
    for st in rep["stages"]:
        for m in ("policy", "critic", "reference"):
            b = st[m]
            tot = sum(b.values())
            if tot:
                print(f"stage {st['stage']:<8} {m:<9} {_g(b['params'])} {_g(b['grads'])} {_g(b['masters'])} "
                      f"{_g(b['moments'])} {_g(b['activations'])} {_g(tot)}")
        print(f"stage {st['stage']:<8} activations (policy + critic): {st['activations_plain'] / GiB:.2f} GiB without "
              f"recompute, {st['activations_recompute'] / GiB:.2f} GiB with")
    print(f"largest rank: {rep['largest'] / GiB:.2f} GiB")
    s = rep["sglang"]
    if s["servers"]:
        print(f"SGLang: {s['servers']} servers x {s['tp_size']} GPUs = {s['gpus']} GPUs, bfloat16 weights "
              f"{s['weight_bytes_per_server'] / GiB:.2f} GiB per GPU of a server (the rest is its KV cache)")
    if args.gpus:
        print(f"GPUs: {args.gpus} in all, {rep['learner_gpus']} for the learner")
    if args.gpu_memory:
        if not rep["fits"]:
            print(f"no layout fits {args.gpu_memory:g} GiB per GPU on {rep['learner_gpus'] or 64} learner GPUs")
            return 1
        print(f"smallest layouts that fit {args.gpu_memory:g} GiB:")
        for f in rep["fits"]:
            print(f"  {f['layout']:<18} {f['ranks']:>4} ranks {f['bytes'] / GiB:8.2f} GiB")
    return 0
