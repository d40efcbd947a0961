"""Does a learner checkpoint load in transformers with the learner's logits? Prints one JSON object.

``python tools/checkpoint_parity.py CKPT [--tokens 64] [--seed 0]``: loads ``CKPT`` (a Hugging Face
folder written by either learner backend, ``RUN_DIR/checkpoints/step_N``) twice, with
``transformers.AutoModelForCausalLM.from_pretrained(CKPT, dtype=float32)`` and with t1async's own
:func:`t1async.models.families.load_model`, runs both on one random probe batch of ``--tokens`` ids and
prints ``{"checkpoint", "model_type", "parameters", "tokens", "max_abs_logit_diff"}`` (float32 logits,
shape [1, tokens, vocab]). Target: at most 1e-5 (issue 28, checkpoints out in the source's layout).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from t1async.config import ModelConfig
from t1async.config.model_folder import resolve_model
from t1async.models.families import load_model


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    from transformers import AutoModelForCausalLM  # (transformers: deferred, heavy)

    cfg = resolve_model(ModelConfig(path=str(a.checkpoint)))
    ours = load_model(cfg).eval()
    ref = AutoModelForCausalLM.from_pretrained(str(a.checkpoint), dtype=torch.float32).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, a.tokens), generator=torch.Generator().manual_seed(a.seed))
    with torch.no_grad():
        out = ours(ids)
        logits = out.logits if hasattr(out, "logits") else out[0] if isinstance(out, tuple) else out
        diff = (ref(ids).logits.float() - logits.float()).abs().max().item()
    print(json.dumps({"checkpoint": str(a.checkpoint), "model_type": cfg.model_type,
                      "parameters": sum(p.numel() for p in ours.parameters()), "tokens": a.tokens,
                      "max_abs_logit_diff": diff}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
