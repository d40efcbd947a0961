"""``t1async bench weight-sync``: a full weight publish against a raw torch.distributed broadcast of the same bytes.

Prints ONE JSON object. Setup: a Qwen3-MoE policy in this process (the learner, rank 0) and
``--samplers`` embedded samplers, each its own process (HTTP server, engine, staging buffers),
joined by :class:`t1async.weights.distributed.DistributedWeightSync` (SGLang's protocol: pause, one
``/update_weights_from_distributed`` per flattened bucket, continue); beside them as many raw
receiver processes in a second group built by :func:`t1async.weights.group.join_group`, which only
receive uint8 tensors of the same bucket sizes. Rounds alternate publish / raw (the machine is
shared and noisy); each round's ``ratio`` is raw time / publish time measured back to back (bytes/s
of the publish over bytes/s of the raw broadcast), and the median over rounds is reported with
both medians beside it.

The publish runs from the policy as the learner holds it: laid out by
:func:`t1async.weights.buckets.pack_parameters`, so each bucket is a view of the parameters. The same
policy unpacked (separate tensors; each bucket concatenated into a send buffer) is published in
every round too: ``ratio_unpacked`` and ``publish_unpacked_s``, side by side.

Also reported: ``flatten_s`` (median seconds to concatenate every bucket of the unpacked policy
once, the copy packing removes; the embedded sampler receives into reused buffers and makes each
weight a view of them, so it copies nothing inside the pause), ``pause_s`` (median seconds the
samplers were paused per publish: pause request to continue answer) and
``pause_s_per_1b_params`` (that, per 10^9 parameters published).

Tensor mode (``weight_sync.mode=tensor``, :class:`t1async.weights.tensor.TensorWeightSync`: SGLang's
``/update_weights_from_tensor``, each bucket as handles to this process's shared memory, copied by
the sampler during the request) publishes the same policy, packed and unpacked, to the same sampler
processes in every round: ``tensor_publish_s``, ``tensor_pause_s``, ``tensor_publish_unpacked_s``,
``tensor_pause_unpacked_s`` beside ``publish_s``/``pause_s`` of the distributed mode (the four
publishes of a round run in a rotating order).

Usage: ``t1async bench weight-sync [--rounds 5] [--samplers 2] [--hidden 256] [--experts 16] [--bucket-mb 64]``.
"""

from __future__ import annotations

import argparse
import copy
import json
import multiprocessing as mp
import statistics
import time

import torch

from t1async.cli import OneLineErrors, at_least_one, positive_float
from t1async.config import ModelConfig, SamplerConfig
from t1async.transport.ports import free_port
from t1async.weights.buckets import pack_parameters, plan_buckets
from t1async.weights.distributed import DistributedWeightSync
from t1async.weights.group import join_group
from t1async.weights.tensor import TensorWeightSync


def model_cfg(a: argparse.Namespace) -> ModelConfig:
    return ModelConfig(vocab_size=a.vocab, hidden_size=a.hidden, num_hidden_layers=a.layers, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=a.hidden // 4, num_experts=a.experts, num_experts_per_tok=2,
                       moe_intermediate_size=a.hidden * 2)


def _sampler_proc(cfg: ModelConfig, conn) -> None:
    torch.set_num_threads(1)
    from t1async.actors.sampler import EmbeddedSampler

    s = EmbeddedSampler(cfg, SamplerConfig(), seed=0)
    conn.send(s.url())
    conn.recv()  # until told to stop
    s.shutdown()


def _raw_proc(port: int, rank: int, world: int, sizes: list[int], rounds: int) -> None:
    torch.set_num_threads(1)
    g = join_group("gloo", "127.0.0.1", port, rank, world, "bench-raw", 300)
    bufs = [torch.empty(n, dtype=torch.uint8) for n in sizes]
    for _ in range(rounds):
        for b in bufs:
            g.broadcast(b, 0).wait()
    g.close()


def main(argv: list[str] | None = None) -> int:
    ap = OneLineErrors(prog="t1async bench weight-sync", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=at_least_one, default=5, help="publish/raw rounds (default 5)")
    ap.add_argument("--samplers", type=at_least_one, default=2, help="embedded samplers, each a process (default 2)")
    ap.add_argument("--hidden", type=at_least_one, default=256, help="model hidden size (default 256: 34 M parameters)")
    ap.add_argument("--layers", type=at_least_one, default=4, help="decoder layers (default 4)")
    ap.add_argument("--experts", type=at_least_one, default=16, help="experts per MoE layer (default 16)")
    ap.add_argument("--vocab", type=at_least_one, default=16000, help="vocabulary size (default 16000)")
    ap.add_argument("--bucket-mb", type=positive_float, default=64.0, help="MiB per flattened bucket (default 64)")
    a = ap.parse_args(argv)
    from t1async.models.model import Qwen3MoeForCausalLM

    cfg = model_cfg(a)
    torch.manual_seed(0)
    policy = Qwen3MoeForCausalLM(cfg).eval()
    named = [(n, p.detach()) for n, p in policy.named_parameters()]
    params = sum(p.numel() for _, p in named)
    buckets = plan_buckets(named, int(a.bucket_mb * (1 << 20)))
    packed_policy = copy.deepcopy(policy)
    if not pack_parameters(packed_policy):
        raise SystemExit("the policy could not be packed (mixed dtypes or devices)")
    packed = [(n, p.detach()) for n, p in packed_policy.named_parameters()]
    sizes = [b.nbytes for b in buckets]
    nbytes = sum(sizes)

    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    for _ in range(a.samplers):
        mine, theirs = ctx.Pipe()
        p = ctx.Process(target=_sampler_proc, args=(cfg, theirs), daemon=True)
        p.start()
        pipes.append(mine)
        procs.append(p)
    urls = [c.recv() for c in pipes]
    port = free_port("127.0.0.1")
    world = a.samplers + 1
    raws = [ctx.Process(target=_raw_proc, args=(port, r, world, sizes, a.rounds), daemon=True)
            for r in range(1, world)]
    for p in raws:
        p.start()
    raw_group = join_group("gloo", "127.0.0.1", port, 0, world, "bench-raw", 300)
    sync = DistributedWeightSync("gloo", timeout_s=300, bucket_mb=a.bucket_mb)
    sync.connect(urls)
    tsync = TensorWeightSync(timeout_s=300, bucket_mb=a.bucket_mb)
    tsync.connect(urls)
    sync.publish(named, 0)  # warm-up: first allocations on both ends
    tsync.publish(packed, 0)  # (and the packed policy's storage moves into shared memory, once)
    tsync.publish(named, 0)
    flats = [b.flatten() for b in buckets]  # raw sends prepared bytes: only the broadcast is timed

    publish_s, raw_s, pause_s, ratios, flatten_s = [], [], [], [], []
    unpacked_s, ratios_unpacked = [], []
    tensor = {"packed": [], "unpacked": [], "pause_packed": [], "pause_unpacked": []}
    kinds = [("distributed", "packed"), ("distributed", "unpacked"), ("tensor", "packed"), ("tensor", "unpacked")]
    version = 1
    for r in range(a.rounds):
        times = {}
        for mode, which in kinds[r % 4:] + kinds[:r % 4]:  # rotate the order (a shared, noisy machine)
            s = sync if mode == "distributed" else tsync
            t0 = time.perf_counter()
            s.publish(named if which == "unpacked" else packed, version)
            version += 1
            times[(mode, which)] = time.perf_counter() - t0
            if mode == "distributed" and which == "packed":
                pause_s.append(sync.last_pause_s)
            if mode == "tensor":
                tensor[which].append(times[(mode, which)])
                tensor["pause_" + which].append(tsync.last_pause_s)
        tp, tu = times[("distributed", "packed")], times[("distributed", "unpacked")]
        t0 = time.perf_counter()
        for f in flats:
            raw_group.broadcast(f, 0).wait()
        tr = time.perf_counter() - t0
        t0 = time.perf_counter()
        for b in buckets:  # the copy the raw broadcast does not make (attribution, not part of the ratio)
            b.flatten()
        flatten_s.append(time.perf_counter() - t0)
        publish_s.append(tp)
        unpacked_s.append(tu)
        raw_s.append(tr)
        ratios.append(tr / tp)
        ratios_unpacked.append(tr / tu)
    sync.close()
    tsync.close()
    raw_group.close()
    for p in raws:
        p.join(30)
    for c in pipes:
        c.send("stop")
    for p in procs:
        p.join(10)

    med = statistics.median
    out = {
        "bench": "weight-sync", "backend": "gloo", "samplers": a.samplers, "rounds": a.rounds,
        "params": params, "bytes": nbytes, "buckets": len(buckets), "bucket_mb": a.bucket_mb,
        "publish_bytes_per_s": round(nbytes / med(publish_s)), "raw_bytes_per_s": round(nbytes / med(raw_s)),
        "ratio": round(med(ratios), 3), "ratio_of_medians": round(med(raw_s) / med(publish_s), 3),
        "publish_s": round(med(publish_s), 4), "raw_s": round(med(raw_s), 4),
        "ratio_unpacked": round(med(ratios_unpacked), 3), "publish_unpacked_s": round(med(unpacked_s), 4),
        "flatten_s": round(med(flatten_s), 4), "pause_s": round(med(pause_s), 4),
        "pause_s_per_1b_params": round(med(pause_s) / (params / 1e9), 3),
        "rounds_ratio": [round(x, 3) for x in ratios],
        "tensor_publish_s": round(med(tensor["packed"]), 4), "tensor_pause_s": round(med(tensor["pause_packed"]), 4),
        "tensor_publish_unpacked_s": round(med(tensor["unpacked"]), 4),
        "tensor_pause_unpacked_s": round(med(tensor["pause_unpacked"]), 4),
        "tensor_publish_bytes_per_s": round(nbytes / med(tensor["packed"])),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
