"""File helpers shared by the actor's spool, the learner's receive log and the rollout workspaces:
writing whole records, and folders owned by a live process (``flock``) that a successor can take
over once their owner died.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

OWNER_LOCK = "lock"
"""File in an owned folder that its owner holds ``flock``-ed for its life (released by the kernel
when the process dies, however it dies)."""

_IOV_MAX = 1024  # most buffers one pwritev takes (Linux UIO_MAXIOV)


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
