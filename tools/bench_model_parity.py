"""Parity table per model family: our learner against transformers, the embedded engine against the learner.

    python tools/bench_model_parity.py [--families qwen3_moe qwen3_5_moe ...] [--tokens 24] [--turns 3]
                                       [--init-std 0.02 0.5]

For each family and each weight scale (``--init-std``: the folder's ``initializer_range``, the std of every
projection and embedding weight; 0.02 gives a tiny model a near-uniform next-token distribution, larger values
the peaked one of a trained model, ``entropy_mean``): a tiny random model folder with a real tokenizer
(``t1async model init`` on a folder from t1async/models/hf_tokenizers.py), then, float32 on CPU:

- ``logprob_vs_transformers``: max |log-softmax difference| between the learner's policy (the family's class,
  as the torch learner builds it) and ``transformers.AutoModelForCausalLM`` on the same folder, over a
  [2, 96] batch of random ids; ``transformers_fp32_vs_fp64``: the same for transformers' own float32 against
  its float64 (the float32 rounding the reference itself carries, the scale to judge the first by);
- the embedded engine (t1async/sampling/engine.py, prefix cache on) samples a multi-turn stream (each turn's
  prompt is the previous stream plus a few ids, as observations are appended); the learner then scores the
  whole stream with the engine's routed experts replayed (R3):
  ``engine_vs_learner_logprob`` = max |engine log-prob - learner log-prob| over every sampled token,
  ``importance_weight_min`` / ``importance_weight_max`` = the extremes of exp(learner - engine) over them (the
  importance weights of a first learner step on the weights that sampled: 1 up to float32 rounding),
  ``entropy_mean`` = the learner's mean next-token entropy (nats) at the sampled tokens,
  ``routing_replay_diff`` = rows where the experts the learner used differ from the engine's (0 = exact replay),
  ``router_own_diff_frac`` = rows where the learner's own router, given the replayed history, would pick
  another expert set (the routing drift that replay removes);
- ``prefix_cache_hits``: requests that resumed a cached sequence (a hybrid model's recurrent state resumes
  only at its full length).

Prints one JSON list, a row per family and weight scale (each row also to stderr as soon as it is measured).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = {"qwen3_moe": "qwen3", "qwen3_5_moe": "qwen3.5", "glm4_moe": "glm-4.6"}
SIZES = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "tie_word_embeddings": False}


def row(family: str, folder: Path, tokens: int, turns: int, init_std: float) -> dict:
    import transformers

    from t1async.config import ModelConfig
    from t1async.config.model_folder import resolve_model
    from t1async.models.families import load_model
    from t1async.sampling.engine import Engine, SamplingParams

    torch.manual_seed(0)
    cfg = resolve_model(ModelConfig(path=str(folder)))
    ours = load_model(cfg).eval()
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 96), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref32 = ref(ids).logits.float().log_softmax(-1)
        vs_hf = float((ours(ids).logits.log_softmax(-1) - ref32).abs().max())
        ref.set_experts_implementation("eager")  # (grouped_mm has no float64 kernel)
        ref64 = ref.to(torch.float64)(ids).logits.log_softmax(-1)
        hf_own = float((ref32.double() - ref64).abs().max())
    del ref
    engine = Engine(load_model(cfg).eval(), seed=0, prefix_cache=4)
    params = SamplingParams(max_new_tokens=tokens, temperature=1.0)
    stream = torch.randint(0, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    sampled, logps, rows = [], [], []
    for t in range(turns):
        out = engine.generate(stream, params, routed_experts_start_len=sum(r.shape[0] for r in rows))
        rows.append(torch.as_tensor(out.routed_experts))
        sampled += list(range(len(stream), len(stream) + len(out.output_ids)))
        logps += out.output_logprobs
        stream = stream + out.output_ids
        if t < turns - 1:  # an observation: ids the policy did not sample
            stream += torch.randint(0, cfg.vocab_size, (7,), generator=torch.Generator().manual_seed(3 + t)).tolist()
    routing = torch.cat(rows, 0)  # [len(stream) - 1 - observation tail, L, K]
    inp = torch.tensor(stream[:-1])[None]
    replay = routing[: inp.shape[1]][None]
    with torch.no_grad():
        out = ours(inp, routed_experts=replay, return_routing=True)
    lp = out.logits[0].log_softmax(-1)
    learner = torch.stack([lp[p - 1, stream[p]] for p in sampled])
    entropy = torch.stack([-(lp[p - 1].exp() * lp[p - 1]).sum() for p in sampled])
    weights = (learner.double() - torch.tensor(logps, dtype=torch.float64)).exp()
    used, own = out.routed_experts[0], out.router_experts[0]
    return {
        "family": family, "init_std": init_std, "parameters": sum(p.numel() for p in ours.parameters()),
        "vocab": cfg.vocab_size,
        "logprob_vs_transformers": vs_hf,
        "transformers_fp32_vs_fp64": hf_own,
        "sampled_tokens": len(sampled),
        "entropy_mean": float(entropy.mean()),
        "engine_vs_learner_logprob": float((learner - torch.tensor(logps)).abs().max()),
        "importance_weight_min": float(weights.min()),
        "importance_weight_max": float(weights.max()),
        "routing_replay_diff": int((used.sort(-1).values != replay[0].long().sort(-1).values).any(-1).sum()),
        "router_own_diff_frac": float((own.sort(-1).values != replay[0].long().sort(-1).values).any(-1).float().mean()),
        "prefix_cache_hits": engine.cache_hits,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", nargs="*", default=None, help="model types (default: every implemented family)")
    ap.add_argument("--tokens", type=int, default=24, help="tokens sampled per turn")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--init-std", type=float, nargs="*", default=[0.02],
                    help="weight scales (initializer_range) to build each family's folder at")
    args = ap.parse_args()
    import sys

    sys.path.insert(0, str(REPO))
    from t1async.commands.model import init_folder
    from t1async.models import hf_tokenizers
    from t1async.models.families import FAMILIES

    families = args.families or sorted(FAMILIES)
    folders = hf_tokenizers.build_folders(sorted({TOKENIZER[f] for f in families}))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for f in families:
            for std in args.init_std:
                out = init_folder(f, folders[TOKENIZER[f]], Path(tmp) / f"{f}-{std}", {**SIZES, "initializer_range": std})
                rows.append(row(f, out, args.tokens, args.turns, std))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)  # each row as it is measured
    print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
