"""The learner's side of lossless delivery: durable receive log, bounded byte queue, consumed-id ledger.

Guarantee (with t1async/transport/transport.py and t1async/transport/spool.py): every trajectory a rollout actor
finished is trained on exactly once by the model state that survives, or dropped and counted as
stale, even if the learner is killed with SIGKILL at any instant and restarted with
``learner.resume=true``:

1. The learner ACKs a trajectory only after :meth:`ReceiveLog.append` returned (and, with
   ``log_fsync="always"``, after the fsync that covers it: one per burst of waiting messages,
   :meth:`ReceiveLog.sync`); until then the actor keeps it in its spool and resends
   it after reconnecting. A key already in the log (or already consumed) is ACKed and not
   stored twice: the log holds each trajectory id at most once.
2. A checkpoint records, atomically with the weights (one directory renamed into place,
   t1async/learner/checkpoints.py), the id
   of every trajectory its model state consumed (trained on, or dropped as stale) and the step.
3. On resume the learner loads its latest checkpoint and re-queues every log record that
   checkpoint had not consumed, before reading the socket. Steps trained after that checkpoint
   are lost with the process; their trajectories are in the log and train again, once, in the
   resumed model. Rows of metrics.jsonl past the checkpoint's step are dropped on resume.

Log format (``RUN_DIR/receive_log/seg_NNNNNN.log``; a new segment per learner life and per
``segment_bytes``): records of ``<4sIHQI`` (magic b"T1RL", segment number, key length, payload
length, crc32 of that header's first 18 bytes and the key), the key (utf-8), the payload (a
trajectory frame) and the 4-byte trailer b"T1OK"; after the last record, 4 zero bytes (written
with each record, overwritten by the next). A record cut short by a crash (no trailer) ends the
segment's readable part and is never ACKed, so its sender still has it. The payload carries no
checksum (crc32 of 13 MB costs 10 ms); replayed frames are validated again by the decoder.

Recycling: a segment whose every trajectory was consumed (and checkpointed) is renamed
``free_N.log`` and a later segment is written over it from byte 0, so appends land in pages the
page cache and the disk already hold. On this machine appending 13 MB to a new file costs about
30 ms (fresh pages), overwriting a recycled one about 2 ms. The zero end mark and the segment
number in every record keep an old segment's tail from being read as records of the new one.
"""

from __future__ import annotations

import collections
import json
import os
import queue
import re
import shutil
import struct
import threading
import zlib
from pathlib import Path
from typing import Any

from loguru import logger

from t1async.fileio import fsync_dir, pwrite_all, replace_file

_REC = struct.Struct("<4sIHQI")
_MAGIC, _TRAILER, _END = b"T1RL", b"T1OK", b"\x00\x00\x00\x00"
FSYNC_POLICIES = ("always", "never")


class ReceiveLog:
    """Append-only, segmented log of received trajectory frames, keyed by trajectory id.

    Args:
        directory: the log folder (created).
        fsync: ``always`` (fsync each record before :meth:`append` returns) or ``never``.
        reset: discard an existing log (a new run in an old directory).
        segment_bytes: start a new segment file beyond this size.
        free_segments: consumed segments kept for reuse (beyond them, consumed segments are deleted).

    Raises:
        ValueError: unknown ``fsync`` policy.
    """

    def __init__(self, directory: str | Path, *, fsync: str = "always", reset: bool = False,
                 segment_bytes: int = 1 << 30, free_segments: int = 2):
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"transport.log_fsync {fsync!r} is not one of {FSYNC_POLICIES}")
        self.dir = Path(directory)
        if reset and self.dir.exists():
            logger.info("receive log {}: discarding the log of an earlier run (learner.resume is off)", self.dir)
            shutil.rmtree(self.dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.fsync, self.segment_bytes, self.free_segments = fsync == "always", segment_bytes, max(0, free_segments)
        self._index: dict[str, tuple[int, int, int]] = {}  # key -> (segment, payload offset, length)
        self._segment_keys: dict[int, list[str]] = {}
        self.torn = 0
        for path in sorted(self.dir.glob("seg_*.log")):
            self._scan(int(path.stem[4:]), path)
        self._seg = max(self._segment_keys, default=0)
        self._free = sorted(self.dir.glob("free_*.log"))
        self._fd: int | None = None
        self._pos = 0
        self._unsynced: list[str] = []  # keys appended with sync=False since the last flush
        self._lock = threading.Lock()
        self._roll()

    @property
    def published_version(self) -> int:
        """Highest weight version this learner ever started to publish (-1: none)."""
        p = self.dir / "published_version"
        return int(p.read_text()) if p.exists() else -1

    def note_published(self, version: int) -> None:
        """Record (durably, before the broadcast) that ``version`` is being published."""
        replace_file(self.dir / "published_version", str(version), fsync=self.fsync)

    def _scan(self, seg: int, path: Path) -> None:
        """Index segment ``seg``'s records up to its end mark; anything else there is a torn record."""
        keys = self._segment_keys.setdefault(seg, [])
        size, pos = path.stat().st_size, 0
        with open(path, "rb") as f:
            while pos < size:
                f.seek(pos)
                raw = f.read(_REC.size)
                if raw[:4] == _END:
                    return  # the end mark: what follows is an older segment's tail, or nothing
                if len(raw) < _REC.size:
                    break
                magic, rec_seg, klen, plen, crc = _REC.unpack(raw)
                key_b = f.read(klen)
                end = pos + _REC.size + klen + plen + len(_TRAILER)
                if (magic != _MAGIC or rec_seg != seg or end > size
                        or zlib.crc32(raw[:_REC.size - 4] + key_b) != crc):
                    break
                f.seek(end - len(_TRAILER))
                if f.read(len(_TRAILER)) != _TRAILER:
                    break
                key = key_b.decode()
                if key not in self._index:
                    self._index[key] = (seg, pos + _REC.size + klen, plen)
                    keys.append(key)
                pos = end
            else:
                return
        self.torn += 1
        logger.warning("receive log {}: ignored a torn record at byte {} (never acknowledged)", path, pos)

    def _path(self, seg: int) -> Path:
        return self.dir / f"seg_{seg:06d}.log"

    def _roll(self) -> None:
        """Close the open segment and open the next, over a free (consumed) file when there is one."""
        if self._fd is not None:
            if self.fsync and self._unsynced:  # records of a group not yet flushed stay in this file
                os.fdatasync(self._fd)
                self._unsynced.clear()
            os.close(self._fd)
        self._seg += 1
        self._segment_keys[self._seg] = []
        path = self._path(self._seg)
        if self._free:
            os.rename(self._free.pop(), path)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        self._pos = 0
        os.pwrite(self._fd, _END, 0)  # an empty segment, even over an old file's records
        if self.fsync:
            os.fdatasync(self._fd)
            fsync_dir(self.dir)

    def __contains__(self, key: str) -> bool:
        return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    def keys(self) -> list[str]:
        """Every key in the log, in the order received."""
        return [k for seg in sorted(self._segment_keys) for k in self._segment_keys[seg]]

    def append(self, key: str, frame: bytes | memoryview, *, sync: bool = True) -> None:
        """Store one frame under ``key``; durable per the fsync policy when this returns.

        ``sync=False`` (group commit): the record is written and indexed but flushed only by the
        next :meth:`sync` (or a segment roll); the caller must not ACK it before that returned.
        Many records then cost one flush (on this machine one fdatasync of a small record costs
        about as much as decoding it).

        Raises:
            KeyError: ``key`` is already in the log (callers check :meth:`__contains__`).
            OSError: the disk refused the write (the caller must not ACK).
        """
        with self._lock:
            if key in self._index:
                raise KeyError(f"trajectory {key} is already in the receive log")
            if self._pos > self.segment_bytes:
                self._roll()
            assert self._fd is not None
            kb, n = key.encode(), memoryview(frame).nbytes
            head = _REC.pack(_MAGIC, self._seg, len(kb), n, 0)[:_REC.size - 4]
            total = pwrite_all(self._fd, [_REC.pack(_MAGIC, self._seg, len(kb), n, zlib.crc32(head + kb)), kb, frame,
                                          _TRAILER + _END], self._pos)
            if self.fsync and sync:
                os.fdatasync(self._fd)
            self._index[key] = (self._seg, self._pos + _REC.size + len(kb), n)
            self._segment_keys[self._seg].append(key)
            self._pos += total - len(_END)
            if self.fsync and not sync:
                self._unsynced.append(key)

    def sync(self) -> None:
        """Flush every record appended with ``sync=False`` (one fdatasync; nothing to do with
        ``fsync="never"``).

        Raises:
            OSError: the flush failed; those records are then forgotten (not in the index, so a
                resend is stored again, never ACKed as a duplicate of a record that may be lost).
        """
        with self._lock:
            if not self._unsynced:
                return
            keys, self._unsynced = self._unsynced, []
            try:
                assert self._fd is not None
                os.fdatasync(self._fd)
            except OSError:
                for k in keys:
                    self._index.pop(k, None)
                self._segment_keys[self._seg] = [k for k in self._segment_keys[self._seg] if k in self._index]
                raise

    def read(self, key: str) -> bytes:
        """The frame stored under ``key``."""
        seg, off, n = self._index[key]
        with open(self._path(seg), "rb") as f:
            f.seek(off)
            return f.read(n)

    def drop_consumed(self, consumed: dict[str, int]) -> int:
        """Free closed segments whose every key is in ``consumed`` (kept for reuse, or deleted);
        returns how many.

        Their keys leave the log's index; de-duplication then relies on ``consumed``.
        """
        gone = 0
        with self._lock:
            for seg in sorted(self._segment_keys):
                keys = self._segment_keys[seg]
                if seg == self._seg or not all(k in consumed for k in keys):
                    continue
                if len(self._free) < self.free_segments:
                    free = self.dir / f"free_{seg:06d}.log"
                    os.rename(self._path(seg), free)
                    self._free.append(free)
                else:
                    self._path(seg).unlink(missing_ok=True)
                for k in keys:
                    self._index.pop(k, None)
                del self._segment_keys[seg]
                gone += 1
        return gone

    def close(self) -> None:
        """Close the open segment."""
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


class ByteQueue:
    """FIFO bounded in items and in bytes (one item larger than ``max_bytes`` fits an empty queue).

    ``put`` raises ``queue.Full`` and ``get`` raises ``queue.Empty`` on timeout, like ``queue.Queue``.
    """

    def __init__(self, max_items: int, max_bytes: int):
        self.max_items, self.max_bytes = max(1, max_items), max_bytes
        self._items: list[tuple[Any, int]] = []
        self.nbytes = 0
        self._cond = threading.Condition()

    def put(self, item: Any, nbytes: int, timeout: float) -> None:
        """Append, waiting up to ``timeout`` seconds for room."""
        with self._cond:
            if not self._cond.wait_for(lambda: not self._items or (
                    len(self._items) < self.max_items and self.nbytes + nbytes <= self.max_bytes), timeout):
                raise queue.Full
            self._items.append((item, nbytes))
            self.nbytes += nbytes
            self._cond.notify_all()

    def get(self, timeout: float) -> Any:
        """Pop the oldest item, waiting up to ``timeout`` seconds."""
        with self._cond:
            if not self._cond.wait_for(lambda: bool(self._items), timeout):
                raise queue.Empty
            item, n = self._items.pop(0)
            self.nbytes -= n
            self._cond.notify_all()
            return item

    def qsize(self) -> int:
        return len(self._items)


_STREAM_ID = re.compile(r"^([0-9a-f]{16})-(\d{1,15})$")  # t1async.trajectory.new_trajectory_id


class ConsumedLedger:
    """Every trajectory id a model state consumed (trained on, or dropped), in bounded memory.

    Ids of the form ``<stream>-<seq>`` (:func:`t1async.trajectory.new_trajectory_id`: one stream
    per rollout-actor life, seq counting up) are kept per stream as a high-water mark (the
    highest seq consumed) plus the holes below it (seqs not yet consumed: still queued, or never
    to come: a rejected trajectory, an actor killed between finishing and spooling one). So the
    ledger grows with actor lives and holes, not with trajectories. At most ``max_holes`` holes
    are kept per stream; beyond that the oldest are forgotten (counted as consumed: a seq more
    than ``max_holes`` behind its actor's newest is not in flight any more). Other ids (older runs,
    tools) are kept one by one in ``others``. The last ``window`` consumptions are also kept
    with their step (``recent``) for inspection and tests.

    Mapping-like: ``id in ledger``, ``ledger[id] = step`` (-1: dropped), ``ledger.update(pairs)``,
    ``ledger[id]`` (step, for ids in ``recent``), ``len(ledger)`` (ids consumed in all).
    """

    def __init__(self, window: int = 1000, max_holes: int = 1000):
        self.window, self.max_holes = window, max_holes
        self.marks: dict[str, list[Any]] = {}  # stream -> [high-water seq, set of holes below it]
        self.others: dict[str, int] = {}
        self.recent: collections.OrderedDict[str, int] = collections.OrderedDict()
        self.count = 0

    def __contains__(self, tid: object) -> bool:
        m = _STREAM_ID.match(tid) if isinstance(tid, str) else None
        if m is None:
            return tid in self.others
        mark = self.marks.get(m.group(1))
        seq = int(m.group(2))
        return mark is not None and seq <= mark[0] and seq not in mark[1]

    def __setitem__(self, tid: str, step: int) -> None:
        if tid in self:
            return
        self.count += 1
        self.recent[tid] = step
        if len(self.recent) > self.window:
            self.recent.popitem(last=False)
        m = _STREAM_ID.match(tid)
        if m is None:
            self.others[tid] = step
            return
        seq = int(m.group(2))
        mark = self.marks.setdefault(m.group(1), [-1, set()])
        if seq > mark[0]:
            mark[1].update(range(max(mark[0] + 1, seq - self.max_holes), seq))
            mark[0] = seq
            if len(mark[1]) > self.max_holes:
                mark[1] = set(sorted(mark[1])[-self.max_holes:])
        else:
            mark[1].discard(seq)

    def __getitem__(self, tid: str) -> int:
        return self.recent[tid] if tid in self.recent else self.others[tid]

    def __len__(self) -> int:
        return self.count

    def update(self, pairs: Any) -> None:
        for tid, step in pairs:
            self[tid] = step

    def holes(self) -> int:
        """Seqs below their stream's high-water mark not consumed (in flight, or never to come)."""
        return sum(len(m[1]) for m in self.marks.values())

    def to_json(self) -> dict[str, Any]:
        return {"format": 2, "count": self.count, "streams": {s: [m[0], sorted(m[1])] for s, m in self.marks.items()},
                "others": self.others, "recent": list(self.recent.items())}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> ConsumedLedger:
        led = cls()
        if doc.get("format") != 2:  # format 1: {id: step}, written before the ledger was bounded
            led.update(doc.items())
            return led
        led.count = int(doc["count"])
        led.marks = {s: [int(hw), set(holes)] for s, (hw, holes) in doc["streams"].items()}
        led.others = dict(doc["others"])
        led.recent = collections.OrderedDict((k, int(v)) for k, v in doc["recent"])
        return led


def write_consumed(path: Path, consumed: ConsumedLedger) -> None:
    """Write the consumed-id ledger (:meth:`ConsumedLedger.to_json`)."""
    path.write_text(json.dumps(consumed.to_json()))


def read_consumed(path: Path) -> ConsumedLedger:
    """Read a ledger written by :func:`write_consumed` (empty if the file is absent; a format-1
    ``{id: step}`` file of an older run is converted)."""
    return ConsumedLedger.from_json(json.loads(path.read_text())) if path.exists() else ConsumedLedger()
