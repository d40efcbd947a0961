"""Checkpoints: one directory per step, written in a hidden folder and renamed into place.

``RUN_DIR/checkpoints/step_NNNNNN/`` holds the backend's weights and optimisers, the trainer
state and ``consumed.json`` (t1async/transport/delivery.py ``ConsumedLedger``: every trajectory id
that model state consumed); :func:`latest_checkpoint` finds the newest complete one on resume.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from pathlib import Path

from t1async.fileio import fsync_dir

_STEP_DIR = re.compile(r"^step_(\d{6,})$")


def staging_dir(root: Path, step: int) -> Path:
    """A fresh hidden folder to write checkpoint ``step`` into before :func:`commit`."""
    path = root / f".step_{step:06d}.tmp-{uuid.uuid4().hex[:8]}"
    path.mkdir(parents=True)
    return path


def commit(staged: Path, final: Path, *, fsync: bool = True) -> Path:
    """Move a fully written ``staged`` folder to ``final`` atomically (replacing an older one).

    With ``fsync``, every file is fsync-ed first, so a power loss leaves either the old or the new
    checkpoint, never a mix. Between the two renames of a replacement a crash leaves no ``final``;
    :func:`latest_checkpoint` then takes the previous step (still consistent).
    """
    if fsync:
        for f in staged.rglob("*"):
            if f.is_file():
                with open(f, "rb+") as fh:
                    os.fsync(fh.fileno())
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
        os.rename(final, old)
    os.rename(staged, final)
    if fsync:
        fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(root: Path) -> Path | None:
    """The committed ``step_N`` folder with the largest N (that has ``trainer_state.json``), or None."""
    if not root.is_dir():
        return None
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name))
             and (p / "trainer_state.json").is_file()]
    return max(found)[1] if found else None


def rotate_checkpoints(root: Path, keep_last: int, keep_every: int = 0) -> list[Path]:
    """Delete committed ``step_N`` folders except the newest ``keep_last`` and those whose N is a
    multiple of ``keep_every`` (0: none); returns what was deleted. Staging leftovers of a crash
    (``.step_*.tmp-*``, ``.step_*.old-*``) are deleted too: call it between saves."""
    if not root.is_dir():
        return []
    steps = sorted((int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)))
    doomed = [p for i, (n, p) in enumerate(steps)
              if i < len(steps) - max(1, keep_last) and not (keep_every and n % keep_every == 0)]
    doomed += [p for p in root.glob(".step_*") if p.is_dir()]  # (called between saves: none is being written)
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed
