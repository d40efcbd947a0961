"""A rollout actor's on-disk spool: every trajectory it has sent and the learner has not yet acknowledged.

Layout: ``SPOOL_DIR/<owner>/`` per live sender, holding ``lock`` (``flock``-ed for the owner's
life) and one file per trajectory, ``<seq:012d>.<key>.traj`` (seq keeps the send order). A file
is written as ``.tmp`` and renamed, so a crash never leaves a half file under a ``.traj`` name;
it is deleted when the learner acknowledges it. A new spool adopts every owner folder whose lock
it can take (its owner died: an actor killed with SIGKILL, a killed run), so trajectories a dead
actor had finished are resent, not lost.

Durability: files are not fsync-ed (``fsync=False``): they survive the process, not a power
loss of the actor's machine; pass ``fsync=True`` to survive that too.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path

from loguru import logger


@dataclass
class SpoolEntry:
    """One spooled trajectory: its key (trajectory id), file and size in bytes."""

    key: str
    path: Path
    nbytes: int


class Spool:
    """Durable FIFO of unacknowledged frames, bounded in bytes and files.

    Args:
        root: spool folder shared by the senders of one run (created); None: a private
            temporary folder, deleted on :meth:`close` when empty (nothing to adopt later).
        fsync: fsync each file before it counts as spooled.

    Thread-safe: :meth:`put` (caller thread) and :meth:`remove` (I/O thread) may race.
    """

    def __init__(self, root: str | Path | None, *, fsync: bool = False):
        self._private = root is None
        self.root = Path(tempfile.mkdtemp(prefix="t1async-spool-")) if root is None else Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        name = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        hidden = self.root / f".{name}"  # locked before it is visible: no one adopts a live, new folder
        hidden.mkdir()
        self._lock_fd = os.open(hidden / "lock", os.O_CREAT | os.O_RDWR, 0o600)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self.dir = self.root / name
        os.rename(hidden, self.dir)
        self.fsync = fsync
        self._mutex = threading.Lock()
        self._entries: dict[str, SpoolEntry] = {}
        self._seq = 0
        self.nbytes = 0

    def adopt_orphans(self) -> list[SpoolEntry]:
        """Move the files of every dead owner's folder into this spool; returns them in send order."""
        adopted: list[SpoolEntry] = []
        for d in sorted(p for p in self.root.iterdir() if p.is_dir() and p != self.dir and not p.name.startswith(".")):
            try:
                fd = os.open(d / "lock", os.O_RDWR)
            except OSError:
                continue  # not a spool folder, or being created
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    continue  # its owner is alive
                for f in sorted(d.glob("*.traj")):
                    key = f.name.split(".", 1)[1].rsplit(".", 1)[0]
                    entry = self._register(key, f.stat().st_size)
                    os.rename(f, entry.path)
                    adopted.append(entry)
                shutil.rmtree(d, ignore_errors=True)
            finally:
                os.close(fd)
        if adopted:
            logger.info("spool {}: adopted {} unacknowledged trajectories of dead senders", self.dir, len(adopted))
        return adopted

    def _register(self, key: str, nbytes: int) -> SpoolEntry:
        with self._mutex:
            self._seq += 1
            entry = SpoolEntry(key, self.dir / f"{self._seq:012d}.{key}.traj", nbytes)
            old = self._entries.pop(key, None)
            if old is not None:
                self.nbytes -= old.nbytes
            self._entries[key] = entry
            self.nbytes += nbytes
        return entry

    def reserve(self, key: str, nbytes: int) -> SpoolEntry:
        """Count ``key`` (a trajectory id: no '/' or NUL) as spooled before its file exists
        (the sender may send it from memory meanwhile); :meth:`write` stores it."""
        if not key or "/" in key or "\x00" in key:
            raise ValueError(f"spool key {key!r} must be non-empty without '/' or NUL")
        return self._register(key, nbytes)

    def write(self, entry: SpoolEntry, frame: bytes | memoryview) -> None:
        """Store a reserved entry's frame (``.tmp`` then rename); dropped if it was ACKed meanwhile."""
        tmp = entry.path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(frame)
            if self.fsync:
                f.flush()
                os.fsync(f.fileno())
        with self._mutex:
            if self._entries.get(entry.key) is entry:
                os.rename(tmp, entry.path)
                return
        tmp.unlink(missing_ok=True)

    def put(self, key: str, frame: bytes | memoryview) -> SpoolEntry:
        """:meth:`reserve` and :meth:`write` in one call; returns the entry."""
        entry = self.reserve(key, len(frame))
        self.write(entry, frame)
        return entry

    def read(self, entry: SpoolEntry) -> bytes:
        """The frame of a spooled entry."""
        return entry.path.read_bytes()

    def remove(self, key: str) -> bool:
        """Forget ``key`` (acknowledged); False if it was not spooled."""
        with self._mutex:  # under the mutex: write() renames only entries still registered
            entry = self._entries.pop(key, None)
            if entry is None:
                return False
            self.nbytes -= entry.nbytes
            entry.path.unlink(missing_ok=True)
        return True

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def close(self) -> None:
        """Release the lock; what is still spooled stays on disk for a later sender to adopt."""
        os.close(self._lock_fd)
        if not self._entries:
            shutil.rmtree(self.dir, ignore_errors=True)
            if self._private:
                shutil.rmtree(self.root, ignore_errors=True)
        else:
            logger.warning("spool {}: {} trajectories ({} bytes) still unacknowledged; a later sender "
                           "with spool_dir {} resends them", self.dir, len(self._entries), self.nbytes, self.root)
