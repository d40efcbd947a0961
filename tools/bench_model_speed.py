"""Tokens/s of our model families against transformers' own classes, side by side in one run.

    python tools/bench_model_speed.py [--families ...] [--seq 256] [--batch 2] [--repeats 3] [--concurrent 8]

Per family, on the same random weights (a folder of the family's config, no tokenizer, vocabulary 4,096 so the
LM head does not hide the trunk), float32, 1 thread, interleaved repeats, medians:

- ``learner``: one forward + backward of the summed log-softmax of the targets over a [batch, seq] batch:
  ours with routing replay on (the learner's step, replaying the routing of a first forward) vs
  transformers' plain forward + backward (it has no replay);
- ``sampler``: greedy decoding of ``--new`` tokens after a ``--prompt`` prompt: our embedded engine
  (t1async/sampling/engine.py, its KV / recurrent cache) vs ``transformers`` ``generate(do_sample=False)``;
- ``sampler_concurrent``: the same for ``--concurrent`` prompts at once (default 8, as the rollout actors keep several
  episodes in flight): our engine's continuous batching over the submitted requests vs ``generate`` on the batch
  (prompts of one length, so it pads nothing).

Prints one JSON object per family with tokens/s of each and the ratio ours / transformers (> 1: faster), and
``decode_rows_padded_to``: the row counts the engine's matmuls pad one decode row to on this machine (probed).
``--profile``: also, per family, where one greedy decode spends its time (``torch.profiler``: the matmul calls,
their count and mean microseconds, and the share of the decode they take) for our engine and for ``generate``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
SIZES = {"vocab_size": 4096, "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 64, "num_experts": 16, "num_experts_per_tok": 4,
         "moe_intermediate_size": 256, "tie_word_embeddings": False}


def _learner_step(model, ids, replay, hf: bool) -> None:
    if hf:
        logits = model(ids).logits
    else:
        logits = model(ids, routed_experts=replay).logits
    lp = logits[:, :-1].float().log_softmax(-1).gather(-1, ids[:, 1:, None]).sum()
    lp.backward()
    model.zero_grad(set_to_none=True)


def measure(family: str, folder: Path, seq: int, batch: int, prompt: int, new: int, repeats: int,
            profile: bool = False, concurrent: int = 8) -> dict:
    import transformers

    from t1async.config import ModelConfig
    from t1async.config.model_folder import resolve_model
    from t1async.models.families import load_model
    from t1async.sampling.engine import Engine, SamplingParams

    cfg = resolve_model(ModelConfig(path=str(folder)))
    ours = load_model(cfg)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 4000, (batch, seq), generator=g)
    with torch.no_grad():
        replay = ours(ids, return_routing=True).routed_experts
    engine = Engine(load_model(cfg).eval(), seed=0, prefix_cache=0)
    ref.eval()
    p_ids = torch.randint(0, 4000, (1, prompt), generator=g)
    params = SamplingParams(max_new_tokens=new, temperature=0.0)
    b_ids = torch.randint(0, 4000, (concurrent, prompt), generator=g)
    times: dict[str, list[float]] = {"learner_ours": [], "learner_hf": [], "sampler_ours": [], "sampler_hf": [],
                                     "batch_ours": [], "batch_hf": []}
    for _ in range(repeats):
        t = time.perf_counter()
        _learner_step(ours, ids, replay, hf=False)
        times["learner_ours"].append(time.perf_counter() - t)
        t = time.perf_counter()
        _learner_step(ref, ids, None, hf=True)
        times["learner_hf"].append(time.perf_counter() - t)
        t = time.perf_counter()
        engine.generate(p_ids[0].tolist(), params)
        times["sampler_ours"].append(time.perf_counter() - t)
        t = time.perf_counter()
        with torch.no_grad():
            ref.generate(p_ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        times["sampler_hf"].append(time.perf_counter() - t)
        if concurrent > 1:
            t = time.perf_counter()
            engine.run_until_done([engine.submit(row.tolist(), params) for row in b_ids])
            times["batch_ours"].append(time.perf_counter() - t)
            t = time.perf_counter()
            with torch.no_grad():
                ref.generate(b_ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
            times["batch_hf"].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items() if v}
    profiles = {}
    if profile:
        profiles["sampler_ours"] = _mm_profile(lambda: engine.generate(p_ids[0].tolist(), params))
        profiles["sampler_transformers"] = _mm_profile(lambda: ref.generate(
            p_ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0))
    from t1async.models.batch_invariance import column_major_parameters, rows_for

    # the rows one decode row is padded to, per matmul weight of the engine (t1async/models/batch_invariance.py)
    pads = sorted({rows_for(torch.zeros(1, w.shape[-1]), w[0] if w.dim() == 3 else w)
                   for w in column_major_parameters(engine.model).values()})
    learner = batch * seq / med["learner_ours"], batch * seq / med["learner_hf"]
    sampler = new / med["sampler_ours"], new / med["sampler_hf"]
    batched = {}
    if concurrent > 1:
        ours_b, hf_b = concurrent * new / med["batch_ours"], concurrent * new / med["batch_hf"]
        batched["sampler_concurrent_tokens_per_s"] = {"ours": round(ours_b, 1), "transformers": round(hf_b, 1),
                                                      "ratio": round(ours_b / hf_b, 2)}
    return {"family": family, "learner_tokens_per_s": {"ours": round(learner[0], 1), "transformers": round(learner[1], 1),
                                                       "ratio": round(learner[0] / learner[1], 2)},
            "sampler_tokens_per_s": {"ours": round(sampler[0], 1), "transformers": round(sampler[1], 1),
                                     "ratio": round(sampler[0] / sampler[1], 2)},
            "decode_rows_padded_to": pads, **batched, **profiles}


def _mm_profile(fn) -> dict:
    """``fn()`` under ``torch.profiler`` (CPU, no grad): its matrix multiplies (``aten::mm``, ``aten::bmm``) as
    calls, mean microseconds per call and their share of all operators' own time."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    ops = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in ops)
    mm = [e for e in ops if e.key in ("aten::mm", "aten::bmm")]
    calls, us = sum(e.count for e in mm), sum(e.self_cpu_time_total for e in mm)
    return {"matmul_calls": calls, "matmul_us_per_call": round(us / max(calls, 1), 1),
            "matmul_share": round(us / total, 2) if total else 0.0}


def write_folder(family: str, out: Path) -> Path:
    """A random-weight folder of ``family`` at :data:`SIZES` without tokenizer files (none is needed here)."""
    from types import SimpleNamespace

    from t1async.config import ModelConfig
    from t1async.config.model_folder import resolve_model
    from t1async.models.families import FAMILIES, build_model, save_model

    out.mkdir(parents=True)
    d = FAMILIES[family].init_config(dict(SIZES), SimpleNamespace(end_of_turn_ids=[0]))
    (out / "config.json").write_text(json.dumps(d))
    cfg = resolve_model(ModelConfig(path=str(out)))
    torch.manual_seed(0)
    save_model(out, cfg, build_model(cfg))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", nargs="*", default=None)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--concurrent", type=int, default=8, help="sequences decoded at once in the concurrent sampler "
                    "row (1: skip it)")
    ap.add_argument("--profile", action="store_true", help="also profile one decode of each (matmul calls and time)")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    torch.set_num_threads(1)
    from t1async.models.families import FAMILIES

    families = args.families or sorted(FAMILIES)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for f in families:
            out = write_folder(f, Path(tmp) / f)
            rows.append(measure(f, out, args.seq, args.batch, args.prompt, args.new, args.repeats, args.profile,
                                args.concurrent))
    print(json.dumps({"seq": args.seq, "batch": args.batch, "prompt": args.prompt, "new": args.new,
                      "concurrent": args.concurrent, "sizes": SIZES,
                      "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
