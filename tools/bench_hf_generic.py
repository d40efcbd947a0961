"""Tokens/s of a forward+backward through HFMoeForCausalLM with routing replay vs transformers' plain one.

    python tools/bench_hf_generic.py [--hidden 256] [--layers 4] [--experts 16] [--topk 4] [--T 256] [--B 2]
                                     [--repeats 15] [--threads 1] [--device cpu]

Builds one random glm4_moe (transformers ``Glm4MoeForCausalLM``, float32; ``first_k_dense_replace`` 1,
``n_group`` 2, ``topk_group`` 1, one shared expert), wraps it (t1async/models/hf_generic.py), records the routing
of a batch once, then times, alternating on the same modules and batch:

- ``ours``: ``HFMoeForCausalLM.forward(ids, routed_experts=recorded)`` (replay on), log-softmax, backward;
- ``transformers``: ``Glm4MoeForCausalLM(ids, use_cache=False).logits`` (hooks pass through), log-softmax, backward.

Prints one JSON object: per mode the median seconds and tokens/s (B x T per step) over ``--repeats`` steps after
one warm-up each, and ``ratio`` = ours / transformers tokens/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--T", type=int, default=256)
    ap.add_argument("--B", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)  # 1: steadier on a shared machine
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()

    import torch
    import transformers

    from t1async.models.hf_generic import HFMoeForCausalLM

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    config = transformers.Glm4MoeConfig(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=2 * a.hidden, num_hidden_layers=a.layers,
        num_attention_heads=max(1, a.hidden // 64), num_key_value_heads=max(1, a.hidden // 128),
        moe_intermediate_size=a.hidden // 2, n_routed_experts=a.experts, num_experts_per_tok=a.topk, n_group=2,
        topk_group=1, n_shared_experts=1, first_k_dense_replace=1, max_position_embeddings=max(a.T, 256))
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(a.device).train()
    model = HFMoeForCausalLM.wrap(hf)
    ids = torch.randint(0, a.vocab, (a.B, a.T), device=a.device)
    with torch.no_grad():
        recorded = model(ids, return_routing=True).routed_experts

    def sync():
        if a.device.startswith("cuda"):
            torch.cuda.synchronize()

    def ours():
        model(ids, routed_experts=recorded).logits.log_softmax(-1)[..., 0].sum().backward()

    def theirs():
        hf(ids, use_cache=False).logits.float().log_softmax(-1)[..., 0].sum().backward()

    steps = {"ours": ours, "transformers": theirs}
    times: dict[str, list[float]] = {k: [] for k in steps}
    for k, f in steps.items():  # warm-up
        f()
        hf.zero_grad(set_to_none=True)
    for _ in range(a.repeats):
        for k, f in steps.items():
            sync()
            t = time.perf_counter()
            f()
            sync()
            times[k].append(time.perf_counter() - t)
            hf.zero_grad(set_to_none=True)
    tokens = a.B * a.T
    out = {"model": {"hidden": a.hidden, "layers": a.layers, "moe_layers": model.routed_layers, "experts": a.experts,
                     "topk": a.topk, "vocab": a.vocab, "B": a.B, "T": a.T, "threads": a.threads, "device": a.device}}
    for k, ts in times.items():
        s = statistics.median(ts)
        out[k] = {"median_s": round(s, 4), "tokens_per_s": round(tokens / s, 1)}
    out["ratio"] = round(out["ours"]["tokens_per_s"] / out["transformers"]["tokens_per_s"], 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
