"""File helpers shared by the actor's spool, the learner's receive log and the rollout workspaces:
writing whole records, folders owned by a live process (``flock``) that a successor can take
over once their owner died, and the disk as a fault (:class:`DiskGuard`: a full or failing disk
pauses the service instead of crashing or hanging it).
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

OWNER_LOCK = "lock"
"""File in an owned folder that its owner holds ``flock``-ed for its life (released by the kernel
when the process dies, however it dies)."""

_IOV_MAX = 1024  # most buffers one pwritev takes (Linux UIO_MAXIOV)

DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EIO)
"""errno values that are a fault of the disk, not of the caller: full, over quota, failing."""
_DISK_MESSAGES = ("No space left on device", "Disk quota exceeded", "Input/output error", "os error 28")
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_FULL_MESSAGES = ("No space left on device", "Disk quota exceeded", "os error 28")
NEARLY_FULL_BYTES = 16 << 20
"""A write that failed with less than this free (or below the floor) failed on a full disk, whatever
its library said: torch's writer reports ENOSPC as ``RuntimeError: basic_ios::clear: iostream error``
or ``... unexpected pos N vs M`` (issue 42, a final checkpoint on a 280 MB tmpfs without a floor)."""
FLOOR_FRACTION = 0.05
"""The free-space floor of :class:`DiskGuard` is at most this fraction of the filesystem's size
(a 64 MiB filesystem is not paused for good by a 1 GiB floor)."""
RESERVE_MARGIN = 1.1
""":meth:`DiskGuard.reserve` keeps this many times the last checkpoint's size free for the next one."""


def pwrite_all(fd: int, parts: Sequence[Any], offset: int) -> int:
    """Write the buffers ``parts`` back to back at byte ``offset`` of ``fd``; returns bytes written.

    ``os.pwritev`` may write less than asked (a signal, a huge request): this goes on from where it
    stopped until every byte is written, so the file never holds a silently short record.

    Raises:
        OSError: the write failed (a full disk: ENOSPC).
    """
    views = [v for v in (memoryview(p).cast("B") for p in parts) if len(v)]
    total, done = sum(len(v) for v in views), 0
    while done < total:
        skip, rest = done, []
        for v in views:
            if skip >= len(v):
                skip -= len(v)
            else:
                rest.append(v[skip:])
                skip = 0
        done += os.pwritev(fd, rest[:_IOV_MAX], offset + done)
    return total


def append_whole(path: str | os.PathLike[str], data: bytes) -> None:
    """Append ``data`` to the file ``path`` (created) as a whole or not at all: a write the disk
    refuses part-way is cut back off, so a reader never meets half a record (a torn JSON line).

    Raises:
        OSError: the write failed (ENOSPC on a full disk); the file is as it was.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        end = os.fstat(fd).st_size
        try:
            pwrite_all(fd, [data], end)
        except OSError:
            os.ftruncate(fd, end)
            raise
    finally:
        os.close(fd)


def replace_file(path: str | os.PathLike[str], data: str | bytes, *, fsync: bool = False) -> None:
    """Write ``data`` as the whole new content of ``path``: into a temporary file beside it, renamed
    over it (``os.replace``), so a reader sees the old file or the new one, never half of either,
    and a reader that tails the file sees a new inode. ``fsync``: flush it to the disk before
    the rename. On a failure (a full disk: ENOSPC) the old file is as it was and the temporary
    one is removed.

    Raises:
        OSError: the write or the rename failed.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def fsync_dir(path: Path) -> None:
    """fsync a directory, so that the renames and creations inside it survive a power loss."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def claim_folder(root: Path, prefix: str) -> tuple[Path, int]:
    """A new folder ``root/<prefix>XXXXXXXX`` owned by this process; returns (folder, the lock's fd).

    The folder is created hidden, locked, then renamed, so :func:`dead_owner_folders` never takes
    a live owner's new folder for a dead one's. Close the fd (or exit) to give it up.
    """
    hidden = Path(tempfile.mkdtemp(prefix=f".{prefix}", dir=root))
    fd = os.open(hidden / OWNER_LOCK, os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    folder = hidden.with_name(hidden.name[1:])
    os.rename(hidden, folder)
    return folder, fd


def dead_owner_folders(root: Path, pattern: str = "*") -> Iterator[Path]:
    """Folders under ``root`` matching ``pattern`` whose owner died (their lock is free), in name
    order; each is yielded while this process holds its lock, so two successors never take the same
    one. Folders without a lock file (not owned folders) and live owners' folders are skipped."""
    for folder in sorted(root.glob(pattern)):
        if folder.name.startswith(".") or not folder.is_dir():
            continue
        try:
            fd = os.open(folder / OWNER_LOCK, os.O_RDWR)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # its owner is alive
            yield folder
        finally:
            os.close(fd)


def is_disk_error(exc: BaseException | None) -> bool:
    """Whether ``exc``, or an exception it was raised from or while handling, is a disk fault: an
    ``OSError`` with an errno of :data:`DISK_ERRNOS`, or a library's wrapped error whose text says
    so (safetensors' ``os error 28``, a subprocess's "No space left on device")."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in DISK_ERRNOS:
            return True
        if any(m in str(exc) for m in _DISK_MESSAGES):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def is_full_error(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or an exception it was raised from or while handling) says the disk is full
    or over quota (ENOSPC, EDQUOT, or a library's text saying so), as opposed to failing (EIO)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in _FULL_ERRNOS or any(m in str(exc) for m in _FULL_MESSAGES):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def free_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes free to an unprivileged writer on the filesystem of ``path`` (or of its nearest
    existing parent: the path may not exist yet)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


class DiskGuard:
    """Whether the disk of a run directory can take writes: a free-space floor and the faults seen.

    ``check()`` is None while writes may go on; otherwise one line, ``disk full at PATH (N MB
    free)`` (or ``disk I/O error at PATH ...`` for EIO and other failed writes), and writers pause (the learner stops
    ACKing and training; its callers keep what they hold) instead of failing again. It turns None
    again by itself: once free space is back above the floor and, after a fault, at least
    ``retry_s`` seconds later (the write that failed is then tried again; a new failure is a new
    fault). Thread-safe.

    The floor also covers the next checkpoint once one has been measured (:meth:`reserve`): a
    learner whose free space lies between ``floor_mb`` and one checkpoint would otherwise resume,
    fail its checkpoint, pause and resume again every few seconds (issue 42: 15 MB floor, 95 MB
    checkpoints, the service flapped every ~15 s and every checkpoint failed).

    Args:
        path: the folder watched (the run directory).
        floor_mb: pause below this many MiB free, or below :data:`FLOOR_FRACTION` of the
            filesystem's size if that is less; 0: no configured floor (the next checkpoint's room,
            :meth:`reserve`, and faults still pause).
        retry_s: how long a fault pauses at least, seconds.
    """

    def __init__(self, path: str | os.PathLike[str], floor_mb: float = 1024.0, retry_s: float = 5.0):
        self.path, self.floor_mb, self.retry_s = Path(path), float(floor_mb), float(retry_s)
        self._lock = threading.Lock()
        self._fault: tuple[float, str, str] | None = None  # (monotonic time, where, what)
        self.faults = 0
        self.reserved = 0  # bytes the next checkpoint needs (reserve()); 0: not measured yet

    def reserve(self, nbytes: int) -> None:
        """Keep room for a write of about ``nbytes`` (the last checkpoint's measured size): the floor
        becomes at least :data:`RESERVE_MARGIN` times it (the next one holds a longer consumed-id
        ledger), whatever ``floor_mb`` says; 0: no reserve."""
        self.reserved = int(max(0, nbytes) * RESERVE_MARGIN)

    def floor_bytes(self) -> int:
        """The floor in bytes (see the class docstring): the larger of the configured floor and
        :attr:`reserved`."""
        if self.floor_mb <= 0:
            return self.reserved  # (no configured floor: room for the next checkpoint only, and faults)
        p = self.path.absolute()
        while not p.exists() and p != p.parent:
            p = p.parent
        return max(self.reserved, int(min(self.floor_mb * (1 << 20), FLOOR_FRACTION * shutil.disk_usage(p).total)))

    def fault(self, exc: BaseException, where: str | os.PathLike[str], *, writing: bool = False) -> str | None:
        """Record a failed write at ``where`` if ``exc`` is a disk fault (:func:`is_disk_error`,
        or any error while free space is below the floor: a library that does not say why its
        write failed); returns its kind, ``full`` or ``error``, or None when it was none (the caller
        then re-raises).

        ``writing``: ``exc`` came out of writing files under ``where`` (a checkpoint), so every
        ``OSError`` and ``RuntimeError`` is a fault whatever the floor (torch reports a full disk
        as ``RuntimeError: basic_ios::clear: iostream error``); judge it before freeing what the
        failed write took. A fault is ``full`` when the error says so or less than
        :data:`NEARLY_FULL_BYTES` (or the floor) is free, else ``error`` (an I/O error: EIO, a
        read-only or vanished folder, a library's write failure on a disk with room)."""
        free = free_bytes(self.path)
        low = free < max(self.floor_bytes(), NEARLY_FULL_BYTES)
        if not (is_disk_error(exc) or free < self.floor_bytes() or (writing and isinstance(exc, (OSError, RuntimeError)))):
            return None
        what = "full" if is_full_error(exc) or low else "error"
        with self._lock:
            self._fault = (time.monotonic(), str(where), what)
            self.faults += 1
        return what

    def check(self) -> str | None:
        """None while writes may go on, else why not (one line; see the class docstring)."""
        free = free_bytes(self.path)
        with self._lock:
            fault = self._fault
            if fault is not None and time.monotonic() - fault[0] >= self.retry_s and free >= self.floor_bytes():
                self._fault = fault = None
        if fault is not None:
            what = "full" if fault[2] == "full" else "I/O error"
            return f"disk {what} at {fault[1]} ({free / (1 << 20):.0f} MB free)"
        floor = self.floor_bytes()
        if free < floor:
            why = " (room for the next checkpoint)" if floor == self.reserved else ""
            return (f"disk full at {self.path} ({free / (1 << 20):.0f} MB free, below the floor of "
                    f"{floor / (1 << 20):.0f} MB{why})")
        return None

    def wait(self, stop: threading.Event, poll_s: float = 1.0) -> float:
        """Block while :meth:`check` says no, until ``stop`` is set; returns the seconds waited."""
        t0 = time.monotonic()
        while not stop.is_set() and self.check() is not None:
            stop.wait(poll_s)
        return time.monotonic() - t0
