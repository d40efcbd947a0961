"""Embedded sampler throughput: tokens/s at 1, 4 and 16 concurrent episodes, side by side.

Run: ``t1async bench sampler [--config configs/local.yaml] [--seconds 20] [--rounds 2]``. Prints ONE
JSON object.

The real serving path: an :class:`~t1async.actors.sampler.EmbeddedSampler` (continuous-batching
engine behind SGLang's HTTP ``/generate``) in its own process, as under Ray, with the model,
dtype, torch threads, prefix cache and ``max_new_tokens`` of the config (random weights: speed
does not depend on their values). The bench process runs C client threads, each an endless
multi-turn episode: a prompt of 64-192 tokens; per turn one /generate over the whole stream so
far (temperature 1, stop ids = 2 % of the vocabulary, so turns end at different lengths), then
its output plus an 8-40 token observation appended, ``env.max_turns`` turns, then a new episode.
Each round runs every concurrency C in (1, 4, 16) for ``--seconds`` seconds in turn (rounds
interleave the modes, so machine noise hits all alike); a mode's figure is its median over
rounds of generated tokens / wall seconds.

Also reported, to say what limits the ratio: the mean sequences per packed forward seen by the
engine at each C, and (in this process, no HTTP) the time of one packed decode forward at
batch 1, 4 and 16: ``forward_ms`` close to flat in the batch means per-forward overhead
(Python and op dispatch), not arithmetic, dominates; and the load average of the machine.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import statistics
import threading
import time
from typing import Any

import numpy as np
import torch

from t1async.cli import OneLineErrors, at_least_one
from t1async.config import load_config

CONCURRENCY = (1, 4, 16)


def _serve(cfg_path: str, url_q: Any, cmd_q: Any) -> None:
    """Child process: one embedded sampler with random weights at version 0; answers "stats"
    on ``cmd_q`` (its :meth:`stats` into ``url_q``) until "stop"."""
    from t1async.actors.sampler import EmbeddedSampler
    from t1async.models.model import Qwen3MoeForCausalLM

    cfg = load_config(cfg_path)
    s = EmbeddedSampler(cfg.model, cfg.sampler, seed=0, torch_threads=cfg.run.torch_threads)
    torch.manual_seed(0)
    s.load_weights(Qwen3MoeForCausalLM(cfg.model).state_dict(), 0)
    url_q.put(s.url())
    while cmd_q.get() == "stats":
        url_q.put(s.stats())
    s.shutdown()


def _episodes(client: Any, cfg: Any, seed: int, deadline: float, counts: list[int]) -> None:
    """Client thread: run multi-turn episodes until ``deadline``; counts[0] += tokens generated."""
    rng = np.random.default_rng(seed)
    V = cfg.model.vocab_size
    stop_ids = [int(t) for t in rng.choice(np.arange(4, V), size=max(1, V // 50), replace=False)]
    while time.monotonic() < deadline:
        stream = rng.integers(4, V, int(rng.integers(64, 193))).tolist()
        for _ in range(cfg.env.max_turns):
            if time.monotonic() >= deadline:
                return
            r = client.generate(stream, {"max_new_tokens": cfg.generation.max_new_tokens, "temperature": 1.0,
                                         "stop_token_ids": stop_ids},
                                routed_experts_start_len=len(stream) - 1)
            counts[0] += len(r.output_ids)
            stream = stream + r.output_ids + rng.integers(4, V, int(rng.integers(8, 41))).tolist()


def run_mode(url: str, cfg: Any, conc: int, seconds: float, seed: int) -> tuple[float, int]:
    """C client threads for ``seconds``; returns (tokens/s, tokens)."""
    from t1async.sampling.sampler_client import HttpSampler

    client = HttpSampler(url, num_layers=cfg.model.num_hidden_layers, top_k=cfg.model.num_experts_per_tok)
    counts = [[0] for _ in range(conc)]
    t0 = time.monotonic()
    deadline = t0 + seconds
    threads = [threading.Thread(target=_episodes, args=(client, cfg, seed * 1000 + i, deadline, counts[i]))
               for i in range(conc)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0  # includes finishing the turns in flight at the deadline
    tokens = sum(c[0] for c in counts)
    return tokens / wall, tokens


def forward_ms(cfg: Any, reps: int = 30) -> dict[str, float]:
    """Median ms of one packed decode forward (every sequence 1 new token, 128 cached) at
    batch 1, 4, 16, in this process with the sampler's dtype and threads."""
    from t1async.models.model import KVCache, PackedSegments, Qwen3MoeForCausalLM
    from t1async.weights.receiver import DTYPES as _DTYPES

    torch.set_num_threads(cfg.run.torch_threads)
    torch.manual_seed(0)
    m = Qwen3MoeForCausalLM(cfg.model).to(_DTYPES[cfg.sampler.dtype]).eval()
    out = {}
    with torch.inference_mode():
        for b in CONCURRENCY:
            caches = [KVCache(capacity=128 + reps + 2) for _ in range(b)]
            m.forward_packed(torch.randint(0, 100, (128 * b,)), PackedSegments(caches, [128] * b))
            times = []
            for _ in range(reps):
                t = time.perf_counter()
                m.forward_packed(torch.randint(0, 100, (b,)), PackedSegments(caches, [1] * b))
                times.append(time.perf_counter() - t)
            out[str(b)] = round(1000 * statistics.median(times), 3)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = OneLineErrors(prog="t1async bench sampler", description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/local.yaml", help="config whose model/sampler/generation to use")
    ap.add_argument("--seconds", type=float, default=20.0, help="seconds per mode per round (> 0)")
    ap.add_argument("--rounds", type=at_least_one, default=2, help="rounds over the modes (median taken)")
    args = ap.parse_args(argv)
    if not args.seconds > 0:
        ap.error(f"--seconds must be > 0, got {args.seconds}")
    cfg = load_config(args.config)
    load_before = os.getloadavg()
    ctx = mp.get_context("fork")  # before any thread of this process starts (tools/ is no package to spawn from)
    url_q, cmd_q = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_serve, args=(args.config, url_q, cmd_q), daemon=True)
    proc.start()

    def stats() -> dict:
        cmd_q.put("stats")
        return url_q.get(timeout=60)

    try:
        url = url_q.get(timeout=120)
        rates: dict[int, list[float]] = {c: [] for c in CONCURRENCY}
        fwd_n: dict[int, list[int]] = {c: [0, 0] for c in CONCURRENCY}  # forwards, sequences carried
        run_mode(url, cfg, 2, 2.0, seed=99)  # warm up (allocator, HTTP threads)
        for rnd in range(args.rounds):
            for c in CONCURRENCY:
                s0 = stats()
                rate, _ = run_mode(url, cfg, c, args.seconds, seed=rnd)
                s1 = stats()
                rates[c].append(rate)
                fwd_n[c][0] += s1["forwards"] - s0["forwards"]
                fwd_n[c][1] += s1["forward_sequences"] - s0["forward_sequences"]
        cache = stats()
        fwd = forward_ms(cfg)
    finally:
        cmd_q.put("stop")
        proc.join(30)
    med = {c: statistics.median(v) for c, v in rates.items()}
    print(json.dumps({
        "bench": "sampler",
        "config": args.config,
        "model": {"hidden_size": cfg.model.hidden_size, "layers": cfg.model.num_hidden_layers,
                  "experts": cfg.model.num_experts, "top_k": cfg.model.num_experts_per_tok,
                  "vocab": cfg.model.vocab_size, "dtype": cfg.sampler.dtype, "torch_threads": cfg.run.torch_threads},
        "max_new_tokens": cfg.generation.max_new_tokens, "turns_per_episode": cfg.env.max_turns,
        "seconds_per_mode": args.seconds, "rounds": args.rounds,
        "tokens_per_s": {str(c): round(v, 1) for c, v in med.items()},
        "tokens_per_s_rounds": {str(c): [round(x, 1) for x in v] for c, v in rates.items()},
        "ratio_16_vs_1": round(med[16] / med[1], 2),
        "ratio_4_vs_1": round(med[4] / med[1], 2),
        "mean_sequences_per_forward": {str(c): round(n[1] / max(1, n[0]), 2) for c, n in fwd_n.items()},
        "decode_forward_ms": fwd,
        "prefix_cache_hits": cache["prefix_cache_hits"], "requests": cache["requests"],
        "loadavg_1m": {"before": round(load_before[0], 2), "after": round(os.getloadavg()[0], 2)},
        "cpus": os.cpu_count(),
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
