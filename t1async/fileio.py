"""File writing shared by the actor's spool and the learner's receive log."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

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
