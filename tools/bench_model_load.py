"""Peak memory and seconds to load a sharded Hugging Face checkpoint, streamed vs whole-file, side by side.

    python tools/bench_model_load.py [--gb 2.0] [--shard-mb 500] [--dir DIR]

Writes (once, or reuses DIR) a random-weight qwen3_moe folder of about ``--gb`` GB of float32 weights in
``--shard-mb`` shards with an index (t1async/models/hf_folder.py :func:`save_folder`), then loads it in two
fresh processes each, alternating:

- ``streamed``: :func:`t1async.models.families.load_model` (tensors copied one at a time from the
  memory-mapped shards into the allocated model);
- ``whole``: every shard read with ``safetensors.torch.load_file`` into one state dict, then
  ``load_state_dict`` (what a loader that is not streamed does: two copies at the peak).

Prints one JSON object: size on disk, and per mode the median seconds and peak RSS (``ru_maxrss`` of the
child) over ``--repeats`` loads, and peak RSS / size on disk.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SIZES = {"vocab_size": 32768, "hidden_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 8,
         "num_key_value_heads": 4, "head_dim": 128, "num_experts": 32, "num_experts_per_tok": 4,
         "moe_intermediate_size": 512}


def write(folder: Path, gb: float, shard_mb: int) -> None:
    """A random qwen3_moe folder of about ``gb`` GB (the expert count scaled to reach it)."""
    import torch

    from t1async.config import ModelConfig
    from t1async.models.hf_folder import save_folder
    from t1async.models.model import Qwen3MoeForCausalLM, model_config_to_hf

    per_expert = 3 * SIZES["hidden_size"] * SIZES["moe_intermediate_size"] * 4 * SIZES["num_hidden_layers"]
    sizes = dict(SIZES, num_experts=max(4, int(gb * 1e9 * 0.9 / per_expert)))
    cfg = ModelConfig(**sizes)
    torch.manual_seed(0)
    with torch.no_grad():
        model = Qwen3MoeForCausalLM(cfg)
    d = model_config_to_hf(cfg)
    save_folder(folder, model.state_dict().items(), d, max_shard_bytes=shard_mb * 10**6)


def child(mode: str, folder: str) -> None:
    """Load ``folder`` one way; print seconds and peak RSS (bytes) as JSON."""
    import torch

    from t1async.config import ModelConfig
    from t1async.config.model_folder import resolve_model
    from t1async.models.families import build_model, load_model

    torch.set_num_threads(1)
    cfg = resolve_model(ModelConfig(path=folder))
    t = time.perf_counter()
    if mode == "streamed":
        model = load_model(cfg)
    else:
        from safetensors.torch import load_file

        index = json.loads((Path(folder) / "model.safetensors.index.json").read_text())
        sd = {}
        for shard in sorted(set(index["weight_map"].values())):
            sd.update(load_file(str(Path(folder) / shard)))
        model = build_model(cfg)
        model.load_state_dict(sd, strict=False)
    seconds = time.perf_counter() - t
    n = sum(p.numel() for p in model.parameters())
    print(json.dumps({"seconds": seconds, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                      "parameters": n}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=2.0)
    ap.add_argument("--shard-mb", type=int, default=500)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dir", default="/tmp/t1async-bench-load")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return
    folder = Path(args.dir)
    if not (folder / "config.json").exists():
        write(folder, args.gb, args.shard_mb)
    disk = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    runs: dict[str, list[dict]] = {"streamed": [], "whole": []}
    for _ in range(args.repeats):
        for mode in runs:
            out = subprocess.run([sys.executable, __file__, "--child", mode, str(folder)], check=True,
                                 capture_output=True, text=True, cwd=REPO).stdout
            runs[mode].append(json.loads(out.strip().splitlines()[-1]))
    report = {"folder": str(folder), "shards": len(list(folder.glob("*.safetensors"))), "disk_bytes": disk,
              "parameters": runs["streamed"][0]["parameters"]}
    for mode, rs in runs.items():
        rss = statistics.median(r["peak_rss"] for r in rs)
        report[mode] = {"seconds": round(statistics.median(r["seconds"] for r in rs), 2), "peak_rss_bytes": int(rss),
                        "peak_rss_over_disk": round(rss / disk, 2)}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
