"""Checkpoints: one directory per step, written in a hidden folder and renamed into place.

``RUN_DIR/checkpoints/step_NNNNNN/`` holds the backend's weights and optimisers, the trainer
state, ``consumed.json`` (t1async/transport/delivery.py ``ConsumedLedger``: every trajectory id
that model state consumed) and ``manifest.json`` (the size and SHA-256 of every other file,
written by :func:`commit`). :func:`latest_checkpoint` finds the newest complete one;
:func:`resumable_checkpoint`, used on resume, takes the newest that also verifies against its
manifest and moves each newer one that does not aside, as ``step_NNNNNN.corrupt`` (kept for a
look, never loaded, never rotated away). A checkpoint written before manifests existed has none:
it is loaded unverified, as before. :func:`write_checkpoint` writes one (the learner's
``save_checkpoint``); :func:`read_trainer_state` reads its trainer state back on resume.

Each checkpoint written is also noted beside the receive log (``RUN_DIR/receive_log/checkpointed``:
its step), outside ``checkpoints/``, so that a resume whose checkpoints are all gone knows the run
had written some: :func:`resume_from_nothing` then refuses to start again from the initial weights
(issue 42: such a resume used to say one INFO line, cut metrics.jsonl back and lose every step).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from loguru import logger

from t1async.fileio import DiskGuard, free_bytes, fsync_dir, replace_file
from t1async.learner.backend import LearnerBackend
from t1async.learner.timeline import VersionTimeline
from t1async.rollout.task_order import write_task_order
from t1async.transport.delivery import ConsumedLedger, read_consumed, write_consumed

MANIFEST = "manifest.json"
"""``{"format": 1, "files": {relative path: {"bytes": int, "sha256": hex str}}}`` of a checkpoint."""

_STEP_DIR = re.compile(r"^step_(\d{6,})$")
CHECKPOINTED = "checkpointed"
"""File in the receive log's folder: the step of the newest checkpoint this run wrote (text)."""


def staging_dir(root: Path, step: int) -> Path:
    """A fresh hidden folder to write checkpoint ``step`` into before :func:`commit`."""
    path = root / f".step_{step:06d}.tmp-{uuid.uuid4().hex[:8]}"
    path.mkdir(parents=True)
    return path


def commit(staged: Path, final: Path, *, fsync: bool = True) -> Path:
    """Move a fully written ``staged`` folder to ``final`` atomically (replacing an older one).

    With ``fsync``, every file is fsync-ed first, so a power loss leaves either the old or the new
    checkpoint, never a mix. Between the two renames of a replacement a crash leaves no ``final``;
    :func:`latest_checkpoint` then takes the previous step (still consistent). The manifest
    (:func:`write_manifest`) is written first, so what a later resume verifies is what was staged.
    """
    write_manifest(staged)
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


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(folder: Path) -> Path:
    """Write ``folder/manifest.json``: the size (bytes) and SHA-256 (hex) of every file under
    ``folder`` but the manifest itself (about 1 s per GB read). Returns its path."""
    files = {f.relative_to(folder).as_posix(): {"bytes": f.stat().st_size, "sha256": _sha256(f)}
             for f in sorted(folder.rglob("*")) if f.is_file() and f.name != MANIFEST}
    path = folder / MANIFEST
    path.write_text(json.dumps({"format": 1, "files": files}, indent=1))
    return path


def verify_checkpoint(folder: Path, *, digests: bool = True) -> str | None:
    """Why checkpoint ``folder`` cannot be trusted (one line: the first file missing, of the
    wrong size, or whose SHA-256 differs from ``manifest.json``; a manifest that cannot be read),
    or None when it verifies. A checkpoint without a manifest (written before they existed)
    verifies if it has ``trainer_state.json``. ``digests=False`` checks names and sizes only
    (a stat per file, no read: the launch's pre-flight)."""
    if not (folder / MANIFEST).exists():
        return None if (folder / "trainer_state.json").is_file() else "no trainer_state.json"
    try:
        files = json.loads((folder / MANIFEST).read_text())["files"]
        entries = [(name, int(e["bytes"]), str(e["sha256"])) for name, e in files.items()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"{MANIFEST} cannot be read ({type(e).__name__})"
    for name, size, digest in entries:
        f = folder / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != size:
            return f"{name} has {f.stat().st_size} bytes, its manifest says {size}"
        if digests and _sha256(f) != digest:
            return f"{name}'s SHA-256 differs from its manifest"
    return None


def _newest_first(root: Path) -> list[Path]:
    """The ``step_N`` folders under ``root`` (none when it is absent), largest N first."""
    if not root.is_dir():
        return []
    found = sorted(((int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()),
                   reverse=True)
    return [p for _, p in found]


def newest_intact_checkpoint(root: Path) -> Path | None:
    """The newest committed checkpoint under ``root`` that verifies (:func:`verify_checkpoint`), moving
    nothing aside (a reader beside the learner, which renames the bad ones: :func:`resumable_checkpoint`)."""
    return next((p for p in _newest_first(root) if verify_checkpoint(p) is None), None)


def untrusted_checkpoints(root: Path, *, digests: bool = True) -> str | None:
    """Why a resume from ``root`` must not start from the initial weights: checkpoints were written
    there (committed ``step_N`` folders, or folders set aside as ``step_N.corrupt``) and none verifies.
    None when one verifies, or when none was ever written (a run killed before its first checkpoint:
    its receive log is trained again from step 0). One line naming the folders and what is wrong.
    """
    parts = []
    for p in _newest_first(root):  # (stops at the first that verifies: each is read once)
        why = verify_checkpoint(p, digests=digests)
        if why is None:
            return None
        parts.append(f"{p.name}: {why}")
    aside = sorted(p.name for p in root.glob("step_*.corrupt*")) if root.is_dir() else []
    if not parts and not aside:
        return None
    parts = parts[:3]
    if aside:
        parts.append(f"set aside as corrupt: {', '.join(aside[:4])}{' ...' if len(aside) > 4 else ''}")
    return f"no checkpoint in {root} can be trusted ({'; '.join(parts)})"


def resumable_checkpoint(root: Path) -> tuple[Path | None, list[str]]:
    """The newest committed checkpoint under ``root`` that verifies (:func:`verify_checkpoint`), and
    one line for each newer one that did not: that one is renamed ``step_NNNNNN.corrupt``
    (a number suffix when that name is taken) so that no later resume tries it again.

    Returns:
        ``(path or None, lines)``; None when no checkpoint verifies (a resume then replays the
        whole receive log from step 0).
    """
    lines: list[str] = []
    for path in _newest_first(root):
        why = verify_checkpoint(path)
        if why is None:
            return path, lines
        aside = path.with_name(f"{path.name}.corrupt")
        n = 1
        while aside.exists():
            n += 1
            aside = path.with_name(f"{path.name}.corrupt{n}")
        os.rename(path, aside)
        lines.append(f"checkpoint {path.name} failed verification ({why}); moved aside to {aside}")
        logger.error("{}", lines[-1])
    return None, lines


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


def write_checkpoint(root: Path, step: int, *, backend: LearnerBackend, consumed: ConsumedLedger,
                     trainer_state: dict[str, Any], task_order: Callable[[], Any] | None, disk: DiskGuard,
                     fsync: bool, keep_last: int, keep_every: int, note_in: Path | None = None) -> Path:
    """Write ``root/step_NNNNNN/`` atomically and rotate the older ones (:func:`rotate_checkpoints`);
    ``disk`` then keeps room for the next one (:meth:`~t1async.fileio.DiskGuard.reserve` of its
    measured size); then note its step in ``note_in/checkpointed`` (the receive log's folder; None: not noted), read
    by :func:`resume_from_nothing`.

    The folder holds the backend's weights and optimisers (``backend.save``), ``consumed.json``
    (every trajectory id this model state trained on or dropped), ``trainer_state.json``
    (``trainer_state``, JSON-serialisable) and ``task_order.json`` (t1async/rollout/task_order.py:
    ``task_order()``, the controller's task order now, so that a resumed run continues it; None:
    no task order; one that raises is logged and the checkpoint is still written, a resume from it
    then starts the order over). It is staged in a hidden folder (:func:`staging_dir`) and renamed
    into place (:func:`commit`, fsync-ed with ``fsync``); a failed write removes the staged folder
    and raises.

    Raises:
        OSError: ENOSPC when the disk is full, EIO when a write failed on a disk with room (any
            ``OSError`` or ``RuntimeError`` of the write, whatever the free-space floor: torch's own
            error on a full disk says "iostream error" or "unexpected pos", not ENOSPC); the fault is
            recorded in ``disk`` (:meth:`~t1async.fileio.DiskGuard.fault` with ``writing``), judged
            before the staged folder's space comes back, and the one-line message names the folder,
            the error, the bytes written and the free space. Any other error (a bug) as it was raised.
    """
    tmp = staging_dir(root, step)
    try:
        backend.save(tmp)
        write_consumed(tmp / "consumed.json", consumed)
        if task_order is not None:
            try:
                write_task_order(tmp, task_order())
            except Exception as e:  # the controller may be gone at shutdown; never lose the checkpoint
                logger.warning("checkpoint without the task order (a resume from it starts the order over): {}", e)
        (tmp / "trainer_state.json").write_text(json.dumps(trainer_state))
        path = commit(tmp, root / f"step_{step:06d}", fsync=fsync)
    except Exception as e:
        kind = disk.fault(e, root, writing=True)  # (judged before the staged folder's space comes back)
        if kind is None:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        free_at, staged = free_bytes(root), checkpoint_bytes(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        mb = 1 << 20
        why = (f"disk {'full' if kind == 'full' else 'I/O error'} writing {tmp.name} under {root}: "
               f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]} ({staged / mb:.0f} MB written, "
               f"{free_at / mb:.0f} MB free when it failed, {free_bytes(root) / mb:.0f} MB once removed)")
        raise OSError(errno.ENOSPC if kind == "full" else errno.EIO, why) from e
    rotate_checkpoints(root, keep_last, keep_every)
    disk.reserve(checkpoint_bytes(path))  # the free-space floor keeps room for the next one
    if note_in is not None:
        note_checkpointed(note_in, step, fsync=fsync)
    return path


def checkpoint_bytes(folder: Path) -> int:
    """Bytes of every file under ``folder`` (a checkpoint's size on disk, before block rounding)."""
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


def note_checkpointed(log_dir: Path, step: int, *, fsync: bool = True) -> None:
    """Record in ``log_dir/checkpointed`` that a checkpoint of ``step`` was written (replaced atomically).

    Raises:
        OSError: the disk refused the write.
    """
    replace_file(Path(log_dir) / CHECKPOINTED, str(step), fsync=fsync)


def checkpointed_step(log_dir: Path) -> int | None:
    """The step of the newest checkpoint this run noted (:func:`note_checkpointed`); None: none noted
    (no checkpoint written yet, or a run from before the note existed) or unreadable."""
    try:
        return int((Path(log_dir) / CHECKPOINTED).read_text())
    except (OSError, ValueError):
        return None


def resume_from_nothing(run_dir: Path) -> str | None:
    """Why resuming ``run_dir`` from no checkpoint would throw trained steps away, or None.

    It would when ``RUN_DIR/checkpoints`` holds no committed checkpoint (none at all: corrupt ones
    are :func:`untrusted_checkpoints`' case) although the run wrote one before
    (``receive_log/checkpointed``): the receive log drops what a checkpoint holds, so the steps
    up to it can no more be trained again. A run killed before its first checkpoint is resumed
    from its receive log, which still holds every trajectory it received (None here).

    Returns:
        One line: the checkpoint noted, the step ``metrics.jsonl`` reaches, where none was found.
    """
    run_dir = Path(run_dir)
    noted = checkpointed_step(run_dir / "receive_log")
    if noted is None or latest_checkpoint(run_dir / "checkpoints") is not None:
        return None
    if any(run_dir.glob("checkpoints/step_*.corrupt*")):
        return None  # (untrusted_checkpoints names them)
    reached = _metrics_step(run_dir / "metrics.jsonl")
    return (f"the run wrote checkpoint step_{noted:06d} before (receive_log/{CHECKPOINTED})"
            + (f" and metrics.jsonl reaches step {reached}" if reached else "")
            + f", but {run_dir / 'checkpoints'} holds no checkpoint now")


def _metrics_step(path: Path) -> int:
    """The step of the last row of ``metrics.jsonl`` (0: none, or unreadable)."""
    try:
        lines = [x for x in path.read_text().splitlines() if x.strip()]
        return int(json.loads(lines[-1]).get("step", 0)) if lines else 0
    except (OSError, ValueError, AttributeError):
        return 0


@dataclass
class TrainerState:
    """What a checkpoint's ``trainer_state.json`` and ``consumed.json`` restore (:func:`read_trainer_state`)."""

    step: int
    version: int  # weight version of the checkpoint's weights
    timeline_version: int  # t1async/learner/timeline.py
    counters: dict[str, int]  # every int-valued key of trainer_state.json (the learner keeps its counters)
    dropped: dict[str, int]  # trajectories dropped, by reason
    rejected_by: dict[str, int]  # trajectories refused, by reason
    group_rewards: dict[str, list[tuple[int, float]]]  # task -> recent (step, reward): the group advantage's window
    weights_published: bool  # the checkpoint's weights are those published as ``version``
    consumed: ConsumedLedger


def read_trainer_state(path: Path, timeline: VersionTimeline, *, publish_every: int) -> TrainerState:
    """The trainer state of checkpoint ``path`` (written by :func:`write_checkpoint`).

    Checkpoints written before a field existed lack it: ``timeline_version`` is then
    ``timeline.at(version)``; ``group_rewards`` (the window of a group whose peers the checkpoint
    split) empty; ``weights_published`` true when ``step`` is a multiple of ``publish_every``
    (such checkpoints were written right after a publication then).

    Raises:
        OSError, ValueError, KeyError: a file is missing or not a trainer state (a verified checkpoint has both).
    """
    state = json.loads((path / "trainer_state.json").read_text())
    step, version = int(state["step"]), int(state["version"])
    return TrainerState(
        step=step, version=version, timeline_version=int(state.get("timeline_version", timeline.at(version))),
        counters={k: int(v) for k, v in state.items() if isinstance(v, int) and not isinstance(v, bool)},
        dropped={k: int(v) for k, v in state.get("dropped", {}).items()},
        rejected_by={k: int(v) for k, v in state.get("rejected_by", {}).items()},
        group_rewards={task: [(int(s), float(r)) for s, r in rows] for task, rows in state.get("group_rewards", {}).items()},
        weights_published=bool(state.get("weights_published", step % publish_every == 0)),
        consumed=read_consumed(path / "consumed.json"))
