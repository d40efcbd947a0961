"""A checkpoint folder with a manifest, written by the product's own code."""

from __future__ import annotations

import json

from t1async.learner.checkpoints import (
    commit,
    staging_dir,
)


def write_checkpoint(root, step: int, payload: bytes = b"weights" * 100):
    tmp = staging_dir(root, step)
    (tmp / "model.safetensors").write_bytes(payload)
    (tmp / "trainer_state.json").write_text(json.dumps({"step": step}))
    return commit(tmp, root / f"step_{step:06d}", fsync=False)
