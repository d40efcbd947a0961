"""The learner's pause for a full or failing disk (t1async/fileio.py :class:`~t1async.fileio.DiskGuard`).

Below ``learner.disk_floor_mb`` free, or after a write refused with ENOSPC/EIO, the learner
neither crashes nor hangs: :meth:`DiskPause.wait` holds it (no step; the inbox stops ACKing too)
until space is back or it is stopped, and writes that must happen (the record of a publication)
wait for space through :meth:`DiskPause.retry`. The seconds paused (:attr:`DiskPause.paused_s`)
are not counted against ``learner.batch_timeout_s``.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Callable

from loguru import logger

from t1async.fileio import DiskGuard


class DiskPause:
    """Pause and retry around ``disk``.

    Args:
        disk: the run directory's guard.
        stop: set when the learner stops (ends a pause at once).
        on_space: called when space is back after a pause (the learner writes the metrics rows that waited).
    """

    def __init__(self, disk: DiskGuard, stop: threading.Event, on_space: Callable[[], object]):
        self.disk, self.stop, self.on_space = disk, stop, on_space
        self._paused_s = 0.0  # seconds paused in the pauses that ended
        self._since: float | None = None  # monotonic start of the pause under way

    @property
    def paused_s(self) -> float:
        """Seconds paused, in all, the pause under way included (``t1async status`` ``disk_paused_s``)."""
        return self._paused_s + (time.monotonic() - self._since if self._since is not None else 0.0)

    def wait(self) -> None:
        """While the disk is full or failing: pause until space is back or ``stop`` is set; then
        (not stopped) call ``on_space``."""
        why = self.disk.check()
        if why is None:
            return
        logger.error("{}: intake and training paused until space is back (t1async status: degraded)", why)
        self._since = time.monotonic()
        try:
            waited = self.disk.wait(self.stop)
        finally:
            self._since = None
        self._paused_s += waited
        if not self.stop.is_set():
            logger.warning("disk space is back after {:.0f} s: intake and training resume", waited)
            self.on_space()

    def retry(self, write: Callable[[], None], where: Path, what: str) -> bool:
        """``write()`` until it succeeds; after each OSError that is a disk fault at ``where``
        (logged: ``could not record WHAT``) :meth:`wait` and try again. False: stopped while waiting.

        Raises:
            OSError: one that is not a disk fault.
        """
        while True:
            try:
                write()
                return True
            except OSError as e:
                if not self.disk.fault(e, where):
                    raise
                logger.error("could not record {} ({}); waiting for disk space", what, e)
            self.wait()
            if self.stop.is_set():
                return False
