"""A rollout actor's on-disk spool: every trajectory it has sent and the learner has not yet acknowledged.

Layout: ``SPOOL_DIR/<owner>/`` per live sender (:func:`t1async.fileio.claim_folder`), holding
``lock`` (``flock``-ed for the owner's life) and one file per trajectory, ``<seq:012d>.<nbytes>.<key>.traj``
(seq keeps the send order;
the frame is the file's first ``nbytes`` bytes). A new spool adopts every owner folder whose lock
it can take (its owner died: an actor killed with SIGKILL, a killed run), so trajectories a dead
actor had finished are resent, not lost.

Slots: a frame is written with ``pwritev`` straight from its parts (the arrays of an
``EncodedTrajectory``: one copy in all), and the sender sends it zero-copy from a read-only
mapping of the file. A file gets its ``.traj`` name only once its frame is complete, so a crash
never leaves a half frame under a ``.traj`` name. When the learner acknowledges a trajectory its
file is renamed ``free-<n>`` and a later frame overwrites it in place: its page-cache pages and
disk blocks already exist. On this machine writing 13 MB into a new file costs 5-30 ms (fresh
pages), into a reused one about 1.5 ms. At most ``free_slots`` free files of ``free_bytes`` in
all are kept (a sender keeps as many as it may have in flight); they are never adopted and are
removed on :meth:`Spool.close`. Slot files are sized in coarse classes (:func:`_capacity`) and
their blocks reserved with ``posix_fallocate``, so a full disk is an ``OSError`` at
:meth:`Spool.put`, never a SIGBUS while reading the mapping.

Durability: files are not fsync-ed (``fsync=False``): they survive the process, not a power
loss of the actor's machine; pass ``fsync=True`` to survive that too.
"""

from __future__ import annotations

import mmap
import os
import shutil
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from loguru import logger

from t1async.fileio import claim_folder, dead_owner_folders, pwrite_all


def _capacity(nbytes: int) -> int:
    """Slot file size for a frame: at least 64 KiB, else rounded up to 1/16-1/8 of its power of two
    (at most 12.5 % unused), so frames of similar size reuse each other's files."""
    step = 1 << max(16, nbytes.bit_length() - 4)
    return max(step, -(-nbytes // step) * step)


@dataclass
class _Slot:
    """A spool file and (while needed) its shared, read-only mapping of ``capacity`` bytes."""

    path: Path
    capacity: int
    mm: mmap.mmap | None = None

    def map(self) -> mmap.mmap:
        if self.mm is None:
            fd = os.open(self.path, os.O_RDONLY)
            try:
                self.mm = mmap.mmap(fd, self.capacity, mmap.MAP_SHARED, mmap.PROT_READ)
            finally:
                os.close(fd)  # the mapping holds its own reference
        return self.mm


@dataclass
class SpoolEntry:
    """One spooled trajectory: its key (trajectory id), frame size in bytes and file."""

    key: str
    nbytes: int
    seq: int
    slot: _Slot = field(repr=False)

    @property
    def path(self) -> Path:
        return self.slot.path



class Spool:
    """Durable FIFO of unacknowledged frames in memory-mapped, recycled files.

    Args:
        root: spool folder shared by the senders of one run (created); None: a private
            temporary folder, deleted on :meth:`close` when empty (nothing to adopt later).
        fsync: fsync each file before it counts as spooled.
        free_slots, free_bytes: at most this many acknowledged files, of at most this many bytes
            in all, are kept for reuse (0: unlink each one).

    Thread-safe: :meth:`put` (caller thread) and :meth:`remove` (I/O thread) may race.
    """

    def __init__(self, root: str | Path | None, *, fsync: bool = False, free_slots: int = 64,
                 free_bytes: int = 256 << 20):
        self._private = root is None
        self.root = Path(tempfile.mkdtemp(prefix="t1async-spool-")) if root is None else Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.dir, self._lock_fd = claim_folder(self.root, f"{os.getpid()}-")
        self.fsync = fsync
        self.free_slots, self.free_bytes = max(0, free_slots), max(0, free_bytes)
        self._mutex = threading.Lock()
        self._entries: dict[str, SpoolEntry] = {}
        self._free: list[_Slot] = []  # acknowledged files, overwritten by later frames
        self._seq = 0
        self._names = 0  # numbers the temporary and free file names
        self.nbytes = 0

    # ---- names ---------------------------------------------------------------------------
    def _entry_path(self, seq: int, nbytes: int, key: str) -> Path:
        return self.dir / f"{seq:012d}.{nbytes}.{key}.traj"

    @staticmethod
    def _parse(name: str) -> tuple[int, str] | None:
        """``(nbytes, key)`` of an entry file name, or None if it is not one."""
        parts = name[:-len(".traj")].split(".", 2) if name.endswith(".traj") else []
        if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit() or not parts[2]:
            return None
        return int(parts[1]), parts[2]

    def _fresh_name(self, prefix: str) -> Path:
        self._names += 1
        return self.dir / f"{prefix}-{self._names}"

    # ---- writing ---------------------------------------------------------------------------
    def adopt_orphans(self) -> list[SpoolEntry]:
        """Move the files of every dead owner's folder into this spool; returns them in send order."""
        adopted: list[SpoolEntry] = []
        for d in dead_owner_folders(self.root):
            for f in sorted(d.glob("*.traj")):
                parsed = self._parse(f.name)
                size = f.stat().st_size
                if parsed is None or parsed[0] > size:
                    logger.error("spool {}: {} is not a spooled trajectory of this version; left in place "
                                 "(resend it with a matching t1async, or delete it)", d, f.name)
                    continue
                nbytes, key = parsed
                with self._mutex:
                    adopted.append(self._register(key, nbytes, _Slot(f, size)))
            if not any(d.glob("*.traj")):
                shutil.rmtree(d, ignore_errors=True)
        if adopted:
            logger.info("spool {}: adopted {} unacknowledged trajectories of dead senders", self.dir, len(adopted))
        return adopted

    def _register(self, key: str, nbytes: int, slot: _Slot) -> SpoolEntry:
        """Name ``slot``'s file as the entry ``key`` and count it (caller holds the mutex); an older
        entry of the same key is dropped."""
        self._seq += 1
        path = self._entry_path(self._seq, nbytes, key)
        os.rename(slot.path, path)
        slot.path = path
        entry = SpoolEntry(key, nbytes, self._seq, slot)
        old = self._entries.pop(key, None)
        if old is not None:
            self.nbytes -= old.nbytes
            self._recycle(old.slot, reuse=False)
        self._entries[key] = entry
        self.nbytes += nbytes
        return entry

    def put(self, key: str, data: bytes | memoryview | Sequence[bytes | memoryview]) -> SpoolEntry:
        """Store a frame under ``key`` (a trajectory id: no '/' or NUL); returns its entry once the
        file holds it (``fsync``-ed first with ``fsync``).

        ``data`` is the frame, or its parts in order (``EncodedTrajectory.parts()``: the arrays
        are written from where they are, one copy in all). A free file is overwritten in place
        (``pwritev``: no page faults, no new pages), else a new one is created.

        Raises:
            ValueError: a key with '/' or NUL, or empty.
            OSError: the disk has no room (nothing is counted then).
        """
        if not key or "/" in key or "\x00" in key:
            raise ValueError(f"spool key {key!r} must be non-empty without '/' or NUL")
        parts = [memoryview(p).cast("B") for p in (data if isinstance(data, (list, tuple)) else [data])]
        nbytes = sum(len(p) for p in parts)
        need = _capacity(nbytes)
        with self._mutex:
            fits = [s for s in self._free if s.capacity >= need]
            slot = (min(fits, key=lambda s: s.capacity) if fits
                    else max(self._free, key=lambda s: s.capacity) if self._free else None)
            if slot is not None:
                self._free.remove(slot)
            else:
                slot = _Slot(self._fresh_name("new"), 0)
        try:
            fd = os.open(slot.path, os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                if slot.capacity < need:  # a new file, or a free one too small: grow it, blocks reserved
                    slot.mm = None
                    os.posix_fallocate(fd, 0, need)
                    slot.capacity = need
                pwrite_all(fd, parts, 0)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
        except OSError:
            slot.mm = None
            slot.path.unlink(missing_ok=True)
            raise
        with self._mutex:
            return self._register(key, nbytes, slot)

    @staticmethod
    def frame(entry: SpoolEntry) -> memoryview:
        """The entry's frame: a read-only view of its file's mapping (no copy; mapped again if released)."""
        return memoryview(entry.slot.map())[:entry.nbytes] if entry.nbytes else memoryview(b"")

    @staticmethod
    def release(entry: SpoolEntry) -> None:
        """Drop the spool's mapping of the entry's file (unmapped once no view of it is left); the
        pages stay in the page cache for the kernel to keep or evict."""
        entry.slot.mm = None

    def remove(self, key: str, *, reuse: bool = True) -> bool:
        """Forget ``key`` (acknowledged); False if it was not spooled.

        ``reuse=False`` when a view of the frame may still be read (a zero-copy send not yet
        finished): the file is unlinked instead of being overwritten later.
        """
        with self._mutex:
            entry = self._entries.pop(key, None)
            if entry is None:
                return False
            self.nbytes -= entry.nbytes
            self._recycle(entry.slot, reuse)
        return True

    def _recycle(self, slot: _Slot, reuse: bool) -> None:
        """Keep ``slot`` as a free file, or unlink it; caller holds the mutex."""
        if (reuse and len(self._free) < self.free_slots
                and sum(s.capacity for s in self._free) + slot.capacity <= self.free_bytes):
            path = self._fresh_name("free")
            try:
                os.rename(slot.path, path)
            except FileNotFoundError:
                return
            slot.path = path
            self._free.append(slot)
        else:
            slot.mm = None  # unmapped once no view of it is left
            Path(slot.path).unlink(missing_ok=True)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def close(self) -> None:
        """Release the lock; what is still spooled stays on disk for a later sender to adopt."""
        with self._mutex:
            for slot in self._free:
                slot.mm = None
                slot.path.unlink(missing_ok=True)
            self._free.clear()
        os.close(self._lock_fd)
        if not self._entries:
            shutil.rmtree(self.dir, ignore_errors=True)
            if self._private:
                shutil.rmtree(self.root, ignore_errors=True)
        else:
            logger.warning("spool {}: {} trajectories ({} bytes) still unacknowledged; a later sender "
                           "with spool_dir {} resends them", self.dir, len(self._entries), self.nbytes, self.root)
