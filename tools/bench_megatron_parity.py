"""``t1async bench megatron-parity``: the megatron learner on every layout against the single-rank torch learner.

Prints ONE JSON object (``--table``: a Markdown table too, on stderr). For each family (``qwen3_moe``: 2 layers, 4
experts; ``glm4_moe``: tests/support/glm4.py's folder, 4 layers the first dense, 8 experts in 2 groups, a shared
expert; ``qwen3_5_moe``: tests/support/qwen3_5_moe.py's folder, 3 Gated DeltaNet + 1 gated-attention layer, 8
experts, a gated shared expert; float32, CPU) and each layout (one rank; EP 2 with the optimiser replicated; TP 2;
PP 2; EP 2 x TP 2; DP 2 with the ZeRO-1 sharded optimiser: in this backend the data-parallel ranks are the
expert-parallel ones, so DP 2 is EP 2 with ``learner.megatron.distributed_optimizer=true``), the megatron backend
is loaded with the torch backend's initial policy and critic and both run, on one batch of ``--batch`` rows of
``--seq`` tokens (tools/bench_learner.py ``make_batch``: replayed expert rows, K distinct per row):

- ``logprob_replay`` / ``logprob_own``: max |log-prob difference| with the sampler's rows replayed / with each
  backend's own routing;
- ``routing_diff``: the fraction of (position, layer) rows whose own top-k expert set differs;
- ``grad``: max |gradient difference| over every policy parameter after one learner micro-batch step
  (tools/bench_learner.py ``rl_step``: PPO policy loss + value loss, backward, the clip, AdamW), read after the
  step at ``lr`` 1e-3 (``learner.max_grad_norm`` is set to 1e9 so the clip leaves them as they were: the raw gradients), and
  ``grad_rel``: that over the largest |gradient|;
- ``param``: max |parameter difference| after that AdamW step, ``param_rel`` the max over tensors of
  ||torch - megatron|| / ||torch||, ``moved``: the smallest relative move of a matrix (the step did move them).

Usage: ``t1async bench megatron-parity [--families qwen3_moe,glm4_moe,qwen3_5_moe] [--layouts 1,ep2,tp2,pp2,ep2tp2,dp2z]
[--batch 2] [--seq 32] [--table]``. Needs megatron-core (the ``megatron`` extra) and Ray (follower ranks).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_learner
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.support (the same tiny folders the parity tests use)
warnings.filterwarnings("ignore")

import bench_learner  # noqa: E402

from t1async.config import GenerationConfig, LearnerConfig, ModelConfig  # noqa: E402
from t1async.learner.rl import routing_differs  # noqa: E402

LAYOUTS = {"1": (1, 1, 1, False), "ep2": (2, 1, 1, False), "tp2": (1, 2, 1, False), "pp2": (1, 1, 2, False),
           "ep2tp2": (2, 2, 1, False), "dp2z": (2, 1, 1, True)}
"""name -> (expert, tensor, pipeline parallel, ZeRO-1 distributed optimizer)."""
LABELS = {"1": "1 rank", "ep2": "EP 2", "tp2": "TP 2", "pp2": "PP 2", "ep2tp2": "EP 2 x TP 2",
          "dp2z": "DP 2, sharded optimizer"}
FAMILIES = ("qwen3_moe", "glm4_moe", "qwen3_5_moe")
QWEN3_SMALL = ModelConfig(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=24, rope_theta=5000.0)


def family_model(family: str, tmp: Path) -> ModelConfig:
    """The tiny model of ``family`` (module docstring); a folder under ``tmp`` for glm4_moe and qwen3_5_moe."""
    if family == "qwen3_moe":
        return QWEN3_SMALL
    from t1async.config.model_folder import resolve_model

    if family == "glm4_moe":
        from tests.support.glm4 import glm4_folder

        return resolve_model(ModelConfig(path=str(glm4_folder(tmp / "glm4"))))
    from tests.support.qwen3_5_moe import qwen35_folder

    return qwen35_folder(tmp / "qwen35")


def _learner_cfg(ep: int = 1, tp: int = 1, pp: int = 1, zero: bool = False) -> LearnerConfig:
    cfg = LearnerConfig(max_grad_norm=1e9, lr=1e-3)
    mc = dataclasses.replace(cfg.megatron, expert_parallel=ep, tensor_parallel=tp, pipeline_parallel=pp,
                             distributed_optimizer=zero, timeout_s=300.0)
    return dataclasses.replace(cfg, megatron=mc)


def _replay(model: ModelConfig, b: dict, layers: int) -> dict:
    """``b`` with replay rows for ``layers`` MoE layers (glm4_moe's first layer is dense: no router)."""
    g = torch.Generator().manual_seed(7)
    B, T = b["inp"].shape
    scores = torch.rand(B, T, layers, model.num_experts, generator=g)
    return {**b, "replay": scores.argsort(dim=-1)[..., :model.num_experts_per_tok]}


def _run(backend, b: dict, cfg: LearnerConfig) -> dict:
    """Forwards (replayed, own routing), one step; the figures' raw material."""
    rep = backend.policy_logprobs(b["inp"], b["tgt"], b["replay"], grad=False, routing=True)
    own = backend.policy_logprobs(b["inp"], b["tgt"], None, grad=False, routing=True)
    step = bench_learner.rl_step(backend, b, cfg, replay=True)
    grads = (backend.hf_grads() if hasattr(backend, "hf_grads") else
             {k: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
              for k, p in backend.policy.named_parameters()})
    return {"rep": rep.logp, "own": own.logp, "routed": own.routed_experts, "step": step, "grads": grads,
            "weights": {k: v.detach().clone() for k, v in backend.hf_weights()}}


def cell(ref: dict, got: dict, before: dict) -> dict:
    """The figures of one family x layout (module docstring) from the torch run ``ref`` and the megatron one ``got``."""
    g_ref, g_got = ref["grads"], got["grads"]
    w_ref, w_got = ref["weights"], got["weights"]
    if g_ref.keys() != g_got.keys() or w_ref.keys() != w_got.keys():
        raise RuntimeError(f"parameter names differ: {sorted(set(w_ref) ^ set(w_got))[:5]}")
    grad = max(float((g_ref[k] - g_got[k]).abs().max()) for k in g_ref)
    gmax = max(float(g_ref[k].abs().max()) for k in g_ref)
    return {
        "logprob_replay": float((ref["rep"] - got["rep"]).abs().max()),
        "logprob_own": float((ref["own"] - got["own"]).abs().max()),
        "routing_diff": float(routing_differs(ref["routed"], got["routed"]).float().mean()),
        "grad": grad, "grad_rel": grad / gmax,
        "param": max(float((w_ref[k] - w_got[k]).abs().max()) for k in w_ref),
        "param_rel": max(float((w_ref[k] - w_got[k]).norm() / w_ref[k].norm()) for k in w_ref),
        "moved": min(float((w_ref[k] - before[k]).norm() / before[k].norm()) for k in w_ref if w_ref[k].dim() >= 2),
        "grad_norm": [ref["step"]["grad_norm"], got["step"]["grad_norm"]],
    }


def family_rows(family: str, layouts: list[str], batch: int, seq: int, tmp: Path) -> list[dict]:
    """Every layout of ``family``: one dict per layout (``layout``, ``seconds`` and :func:`cell`'s figures, or
    ``error``: the one line a layout failed with)."""
    from t1async.learner.megatron.backend import MegatronBackend
    from t1async.learner.torch_backend import TorchBackend

    model = family_model(family, tmp)
    cfg = _learner_cfg()
    torch.manual_seed(0)
    tb = TorchBackend(cfg, model, GenerationConfig())
    with torch.no_grad():
        for n, p in tb.policy.named_parameters():  # a decisive router (no near-ties for float32 noise to flip)
            if n.endswith("mlp.gate.weight"):
                p.normal_(0.0, 1.0)
        tb.critic.head.weight.normal_(0.0, 0.5)
    policy0 = {k: v.detach().clone() for k, v in tb.policy.state_dict().items()}
    critic0 = {k: v.detach().clone() for k, v in tb.critic.state_dict().items()}
    before = {k: v.detach().clone() for k, v in tb.hf_weights()}
    moe_layers = None
    rows = []
    ref = None
    for name in layouts:
        ep, tp, pp, zero = LAYOUTS[name]
        t0 = time.monotonic()
        mb = None
        try:
            mb = MegatronBackend(_learner_cfg(ep, tp, pp, zero), model, GenerationConfig())
            mb._call("load_hf", "policy", sd=policy0)
            mb._call("load_hf", "critic", sd=critic0)
            if ref is None:
                moe_layers = sum(1 for k in before if k.endswith("mlp.gate.weight"))
                b = _replay(model, bench_learner.make_batch(model, batch, seq, torch.device("cpu")), moe_layers)
                ref = _run(tb, b, cfg)
            got = _run(mb, b, cfg)
            rows.append({"layout": name, **cell(ref, got, before), "seconds": round(time.monotonic() - t0, 1)})
        except Exception as e:  # noqa: BLE001  (one layout's failure is a row of the table, not the end of the bench)
            rows.append({"layout": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"})
        finally:
            if mb is not None:
                mb.close()
        print(json.dumps({"family": family, **rows[-1]}), file=sys.stderr, flush=True)
    return rows


def table(res: dict) -> str:
    """The Markdown table of a report."""
    out = ["| family | layout | max abs log-prob diff (replay / own routing) | routing diff | max abs grad diff "
           "(relative to max abs grad) | max abs param diff after AdamW (max relative over tensors) |",
           "|---|---|---|---|---|---|"]
    for fam, rows in res["families"].items():
        for r in rows:
            if "error" in r:
                out.append(f"| {fam} | {LABELS[r['layout']]} | {r['error']} | | | |")
                continue
            out.append(f"| {fam} | {LABELS[r['layout']]} | {r['logprob_replay']:.1e} / {r['logprob_own']:.1e} | "
                       f"{r['routing_diff']:g} | {r['grad']:.1e} ({r['grad_rel']:.1e}) | "
                       f"{r['param']:.1e} ({r['param_rel']:.1e}) |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="t1async bench megatron-parity", description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--table", action="store_true", help="also print the Markdown table (stderr)")
    a = ap.parse_args(argv)
    families, layouts = a.families.split(","), a.layouts.split(",")
    bad = [f for f in families if f not in FAMILIES] + [x for x in layouts if x not in LAYOUTS]
    if bad:
        ap.error(f"unknown family or layout {bad[0]!r}; families: {', '.join(FAMILIES)}; layouts: {', '.join(LAYOUTS)}")
    torch.set_num_threads(1)
    import ray  # (ray: the follower ranks are Ray actors)

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    t0 = time.monotonic()
    res = {"bench": "megatron-parity", "batch": a.batch, "seq": a.seq, "families": {}}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for fam in families:
                res["families"][fam] = family_rows(fam, layouts, a.batch, a.seq, Path(tmp))
    finally:
        ray.shutdown()
    res["wall_s"] = round(time.monotonic() - t0, 1)
    if a.table:
        print(table(res), file=sys.stderr)
    print(json.dumps(res))
    rows = [r for v in res["families"].values() for r in v]
    return 0 if all("error" not in r and r["logprob_replay"] < 1e-5 and r["routing_diff"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
