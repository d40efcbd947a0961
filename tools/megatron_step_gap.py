"""Where one learner step of the megatron backend differs from the torch backend's, per tensor, on the tiny
qwen3_5_moe folder (tests/support/qwen3_5_moe.py): the figures of docs/results/2026-12-07-megatron-qwen3_5_moe.md.

    python tools/megatron_step_gap.py [--out DIR]

Both backends take one learner update (replay on) of tests/unit/learner/test_megatron_qwen3_5_moe.py's batch from the
folder's weights; prints the step's metrics on both, the tensors with the largest relative gap after AdamW's step
and, in each, the element that differs most: how far it moved on each backend."""

from __future__ import annotations

import argparse
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
warnings.filterwarnings("ignore")

from t1async.actors.learner import Learner  # noqa: E402
from t1async.config import LearnerConfig, TransportConfig, WeightSyncConfig  # noqa: E402
from tests.support.learner_fakes import synthetic  # noqa: E402
from tests.support.qwen3_5_moe import qwen35_folder  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="folder for the model and the runs (a temporary one by default)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(args.out or tempfile.mkdtemp())
    cfg = qwen35_folder(out / "q35")
    batch = []
    for i, (seed, reward) in enumerate(((1, 2.0), (2, 0.0))):
        t = synthetic(0, seed, reward=reward)
        g = torch.Generator().manual_seed(i)
        rows = [torch.randperm(cfg.num_experts, generator=g)[:cfg.num_experts_per_tok]
                for _ in range(t.routed_experts.shape[0] * cfg.num_hidden_layers)]
        t.routed_experts = torch.stack(rows).view(-1, cfg.num_hidden_layers, cfg.num_experts_per_tok).numpy().astype(
            np.uint8)
        t.num_experts = cfg.num_experts
        batch.append(t)
    res = {}
    for backend in ("torch", "megatron"):
        lc = LearnerConfig(batch_size=2, lr=1e-3, backend=backend, routing_replay=True, episodes_per_step=0)
        learner = Learner(lc, cfg, TransportConfig(curve=False), WeightSyncConfig(), str(out / backend), seed=0)
        try:
            before = {k: v.detach().clone() for k, v in learner.backend.hf_weights()}
            metrics = learner.loop._train_step(batch)
            res[backend] = metrics, {k: v.detach().clone() for k, v in learner.backend.hf_weights()}
        finally:
            learner.close()
    (mt, wt), (mm, wm) = res["torch"], res["megatron"]
    for k, v in mt.items():
        if isinstance(v, float):
            print(f"{k}: torch {v:.7g} megatron {mm[k]:.7g}")
    gaps = sorted(((float((wt[k] - wm[k]).norm() / wt[k].norm()), k) for k in wt), reverse=True)
    for gap, k in gaps[:3]:
        d = (wt[k] - wm[k]).abs().flatten()
        i = int(d.argmax())
        print(f"{k}: |torch - megatron| / |torch| {gap:.3g}; largest element gap {float(d[i]):.3g}, where torch moved "
              f"{float((wt[k] - before[k]).flatten()[i]):.3g} and megatron {float((wm[k] - before[k]).flatten()[i]):.3g}; "
              f"elements differing by more than 1e-4: {int((d > 1e-4).sum())} of {d.numel()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
