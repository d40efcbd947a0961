"""Where the launch process sends each learner step's scalars: TensorBoard events, Weights & Biases.

    metrics.jsonl row --(MetricsTail, t1async/service/service.py: numbers only, dict fields as
    ``name/key``)--> TensorBoardSink (RUN_DIR/tensorboard, run.tensorboard)
                   + WandbSink (RUN_DIR/wandb, metrics.wandb; offline by default)

One point per learner step across every life of a run: a sink skips the rows it already holds
(a resumed launch re-reads metrics.jsonl from its start), and a step trained again after a
resume from an earlier checkpoint replaces the lost life's point (TensorBoard: a ``purge_step``
marker, which TensorBoard reads as "drop this run's points from that step on"; wandb keeps the
first point, it cannot rewrite history). A write the disk refuses is kept in memory and tried
again at the next poll; a sink never blocks the launch process (the tensorboardX
``SummaryWriter`` did: its writer thread died on ENOSPC and every later call waited forever).
"""

from __future__ import annotations

import json
import os
import socket
import struct
import time
import uuid
from pathlib import Path
from typing import Any

from loguru import logger
from tensorboardX.proto.event_pb2 import Event, SessionLog
from tensorboardX.proto.summary_pb2 import Summary
from tensorboardX.record_writer import masked_crc32c  # (TFRecord's masked CRC-32C)

from t1async import require_extra
from t1async.fileio import DiskGuard, append_whole

MAX_PENDING_RECORDS = 100_000  # TensorBoard records kept in memory while the disk refuses them (about 100 steps)


def tfrecord(data: bytes) -> bytes:
    """One TFRecord: length (u64), its masked crc32c, ``data``, the data's masked crc32c."""
    head = struct.pack("<Q", len(data))
    return head + struct.pack("<I", masked_crc32c(head)) + data + struct.pack("<I", masked_crc32c(data))


def read_tfrecords(path: Path) -> list[bytes]:
    """The records of a TFRecord file, up to the first torn or corrupt one (a crash's tail)."""
    data, pos, out = path.read_bytes(), 0, []
    while pos + 12 <= len(data):
        (n,) = struct.unpack("<Q", data[pos:pos + 8])
        end = pos + 12 + n + 4
        if end > len(data) or struct.unpack("<I", data[pos + 8:pos + 12])[0] != masked_crc32c(data[pos:pos + 8]):
            break
        out.append(data[pos + 12:pos + 12 + n])
        pos = end
    return out


def visible_steps(folder: Path) -> tuple[dict[int, float], float]:
    """What TensorBoard shows of the event files in ``folder``: ``({step: wall time}, newest wall
    time written)``, following ``purge_step`` markers (a ``SessionLog.START`` at step s hides the
    earlier points at steps >= s), files in name order (their names start with the time)."""
    steps: dict[int, float] = {}
    newest = 0.0
    for f in sorted(folder.glob("events.out.tfevents.*")):
        for rec in read_tfrecords(f):
            ev = Event.FromString(rec)
            if ev.HasField("session_log") and ev.session_log.status == SessionLog.START:
                steps = {s: t for s, t in steps.items() if s < ev.step}
            elif ev.HasField("summary"):
                steps[ev.step] = ev.wall_time
                newest = max(newest, ev.wall_time)
    return steps, newest


class TensorBoardSink:
    """Scalars as TensorBoard events in ``folder``, appended across the lives of a run.

    Each launch writes a new event file (TensorBoard reads every file of the folder as one run);
    rows whose time is not after the newest point already written are skipped (an earlier life
    wrote them), and a row whose step is not after the last one shown starts with a
    ``purge_step`` marker (the learner resumed from an earlier checkpoint and trains those steps
    again). Records are written synchronously, whole (t1async/fileio.py ``append_whole``); a
    refused write stays pending (at most :data:`MAX_PENDING_RECORDS`, older ones are dropped and
    counted in the log) and is retried at the next :meth:`flush`.

    Args:
        folder: ``RUN_DIR/tensorboard`` (created).
        disk: the run directory's disk guard; a refused write is recorded there (``t1async status``).
    """

    def __init__(self, folder: Path, disk: DiskGuard | None = None):
        self.folder, self.disk = folder, disk
        self.folder.mkdir(parents=True, exist_ok=True)
        shown, self.newest = visible_steps(folder)
        self.last_step = max(shown, default=0)
        self.path = folder / f"events.out.tfevents.{time.time():.6f}.{socket.gethostname()}.{os.getpid()}"
        self._pending: list[bytes] = []
        self.dropped = 0
        self._started = False

    def _event(self, **fields: Any) -> None:
        if not self._started:  # the file's first record, as every TensorBoard writer starts
            self._started = True
            self._pending.append(tfrecord(Event(wall_time=time.time(), file_version="brain.Event:2")
                                          .SerializeToString()))
        self._pending.append(tfrecord(Event(**fields).SerializeToString()))
        if len(self._pending) > MAX_PENDING_RECORDS:
            self.dropped += len(self._pending) - MAX_PENDING_RECORDS
            self._pending = self._pending[-MAX_PENDING_RECORDS:]
            logger.error("tensorboard: the disk refused {} records so far; the oldest are dropped", self.dropped)

    def write(self, step: int, wall_time: float, scalars: dict[str, float]) -> None:
        """Queue one step's scalars (see the class docstring for what is skipped or purged)."""
        if wall_time <= self.newest:
            return
        if step <= self.last_step:
            self._event(step=step, wall_time=wall_time, session_log=SessionLog(status=SessionLog.START))
        self._event(step=step, wall_time=wall_time,
                    summary=Summary(value=[Summary.Value(tag=k, simple_value=v) for k, v in scalars.items()]))
        self.newest, self.last_step = wall_time, step

    def flush(self) -> bool:
        """Append what is pending; False if the disk refused it (kept for the next flush)."""
        if not self._pending:
            return True
        try:
            append_whole(self.path, b"".join(self._pending))
        except OSError as e:
            if self.disk is not None:
                self.disk.fault(e, self.folder)
            logger.error("tensorboard: {} records wait for disk space ({})", len(self._pending), e)
            return False
        self._pending.clear()
        return True

    def close(self) -> None:
        self.flush()


class WandbSink:
    """Scalars to Weights & Biases (``metrics.wandb``), in ``RUN_DIR/wandb``.

    ``wandb`` is imported here only (extra ``wandb``). Offline mode (``metrics.wandb_mode:
    offline``, the default) needs no network or account: the run is written under
    ``RUN_DIR/wandb/`` and ``wandb sync`` uploads it later. Every life of a run logs to the same
    wandb run id (kept in ``RUN_DIR/wandb/t1async.json`` with the newest point logged), so a
    resumed launch appends; steps already logged are skipped (wandb cannot rewrite them). A failing
    wandb is logged once and the sink turns itself off: it never stops the service.

    Args:
        folder: ``RUN_DIR/wandb`` (created).
        project: the wandb project.
        mode: ``offline``, ``online`` or ``disabled`` (wandb's ``mode``).
        config: the run's config, recorded with the wandb run.

    Raises:
        MissingExtra: wandb is not installed (one line naming the extra).
    """

    def __init__(self, folder: Path, project: str, mode: str, config: dict[str, Any] | None = None):
        wandb = require_extra("wandb", "wandb", "metrics.wandb=true")  # (optional: imported here only)
        self.folder = folder
        self.folder.mkdir(parents=True, exist_ok=True)
        state_path = folder / "t1async.json"
        state = json.loads(state_path.read_text()) if state_path.exists() else {}
        self._state_path, self.run_id = state_path, state.get("run_id") or uuid.uuid4().hex[:12]
        self.last_step, self.newest = int(state.get("step", 0)), float(state.get("time", 0.0))
        self._run = wandb.init(project=project, dir=str(folder), mode=mode, id=self.run_id, resume="allow",
                               config=config, settings=wandb.Settings(init_timeout=60, console="off"))
        self._dirty = False

    def write(self, step: int, wall_time: float, scalars: dict[str, float]) -> None:
        """Log one step's scalars unless a point at or after ``step`` was already logged."""
        if self._run is None or step <= self.last_step or wall_time <= self.newest:
            return
        try:
            self._run.log(scalars, step=step)
        except Exception as e:  # a wandb failure must not stop the service
            logger.opt(exception=e).error("wandb: logging failed; the wandb sink is off for the rest of this launch")
            self._run = None
            return
        self.last_step, self.newest, self._dirty = step, wall_time, True

    def flush(self) -> bool:
        """Remember the newest point logged (for the next life); False if the disk refused it."""
        if not self._dirty:
            return True
        try:
            self._state_path.write_text(json.dumps({"run_id": self.run_id, "step": self.last_step,
                                                    "time": self.newest}))
        except OSError as e:
            logger.error("wandb: could not record the last step logged ({})", e)
            return False
        self._dirty = False
        return True

    def close(self) -> None:
        self.flush()
        if self._run is not None:
            try:
                self._run.finish()
            except Exception as e:  # (as in write)
                logger.error("wandb: finish failed: {}", e)
            self._run = None
