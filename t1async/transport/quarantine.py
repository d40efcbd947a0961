"""The learner's quarantine: a bounded record of every trajectory message it refused to train.

Layout of ``RUN_DIR/quarantine/``::

    NNNNNN.json     metadata of refusal N: reason (the field at fault, e.g. ``token_ids``), error
                    (the one-line message, at most 2,000 characters), key (trajectory id as sent),
                    source (``receipt``: REJected on arrival; ``replay``: a receive-log record
                    refused on resume; ``step``: a trajectory that made a training step fail),
                    size (bytes of the whole message), sha256 (of the whole message), time (Unix
                    seconds), prefix_bytes (bytes kept in NNNNNN.prefix)
    NNNNNN.prefix   the message's first ``transport.quarantine_prefix_bytes`` bytes (the frame's
                    header and its first arrays: enough to see what was sent, never the whole)
    ids.txt         one trajectory id per line: receive-log records refused after they were
                    stored (sources ``replay`` and ``step``); a resumed learner counts them as
                    consumed, so replaying the receive log never brings them back

The folder is bounded: at most ``transport.quarantine_max_files`` refusals and
``transport.quarantine_max_bytes`` bytes of them are kept; beyond either the oldest are evicted
(and counted: :attr:`Quarantine.evicted`). ``ids.txt`` is not evicted (ids only: it grows with the
records refused after storage, which are rare). A write that fails (a full disk) is logged and
skipped: the refusal is still counted and the message still never trained.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import time
from pathlib import Path

from loguru import logger

MAX_ERROR_CHARS = 2000
SOURCES = ("receipt", "replay", "step")


class Quarantine:
    """Bounded store of refused messages in ``directory`` (layout in the module docstring).

    Args:
        directory: the quarantine folder (created on the first refusal).
        prefix_bytes: bytes of each message kept (>= 0).
        max_bytes: most bytes of metadata and prefixes kept in all (>= 0; 0 keeps none).
        max_files: most refusals kept (>= 0; 0 keeps none).
        fsync: fsync ``ids.txt`` after each id (``transport.log_fsync: always``).

    Raises:
        ValueError: a negative bound.
    """

    def __init__(self, directory: str | Path, *, prefix_bytes: int = 64 << 10, max_bytes: int = 64 << 20,
                 max_files: int = 1000, fsync: bool = True):
        if min(prefix_bytes, max_bytes, max_files) < 0:
            raise ValueError(f"quarantine bounds must be >= 0: prefix_bytes={prefix_bytes}, max_bytes={max_bytes}, "
                             f"max_files={max_files}")
        self.dir = Path(directory)
        self.prefix_bytes, self.max_bytes, self.max_files, self.fsync = prefix_bytes, max_bytes, max_files, fsync
        self.evicted = 0
        """Refusals evicted by this object (the oldest first) to keep the bounds."""
        self._kept: collections.deque[tuple[int, int]] = collections.deque()  # (number, bytes), oldest first
        self.nbytes = 0
        """Bytes of the refusals kept (metadata and prefixes)."""
        self._next = 1
        for meta in sorted(self.dir.glob("*.json")) if self.dir.is_dir() else []:  # an earlier life's refusals
            if not meta.stem.isdigit():
                continue
            n = int(meta.stem)
            size = sum(p.stat().st_size for p in (meta, meta.with_suffix(".prefix")) if p.exists())
            self._kept.append((n, size))
            self.nbytes += size
            self._next = max(self._next, n + 1)

    def put(self, frame: bytes | memoryview, *, reason: str, error: str, key: str = "", source: str = "receipt") -> int:
        """Keep metadata and a capped prefix of one refused message; evict the oldest beyond the bounds.

        Args:
            frame: the whole message as received (only its first ``prefix_bytes`` are written).
            reason: what it is counted under (the field at fault).
            error: the one-line error (cut to 2,000 characters).
            key: the trajectory id it was sent under ("" if unknown).
            source: one of ``receipt``, ``replay``, ``step``.

        Returns:
            Refusals evicted by this call (the older ones it made room for, and this one itself
            when it alone exceeds ``max_bytes`` or ``max_files`` is 0; a failed write evicts none).
        """
        mv = memoryview(frame).cast("B") if not isinstance(frame, memoryview) or frame.format != "B" else frame
        prefix = bytes(mv[:self.prefix_bytes])
        meta = {"reason": reason, "error": error[:MAX_ERROR_CHARS], "key": key[:256], "source": source,
                "size": mv.nbytes, "sha256": hashlib.sha256(mv).hexdigest(), "time": time.time(),
                "prefix_bytes": len(prefix)}
        text = json.dumps(meta) + "\n"
        size = len(text.encode()) + len(prefix)
        if self.max_files == 0 or size > self.max_bytes:
            self.evicted += 1
            return 1
        before = self.evicted
        while self._kept and (len(self._kept) >= self.max_files or self.nbytes + size > self.max_bytes):
            self._evict()
        n, self._next = self._next, self._next + 1
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            (self.dir / f"{n:06d}.prefix").write_bytes(prefix)
            (self.dir / f"{n:06d}.json").write_text(text)
        except OSError as e:
            logger.error("quarantine {}: could not keep refusal {} ({}); it is counted, not kept", self.dir, n, e)
            self._remove(n)
            return self.evicted - before
        self._kept.append((n, size))
        self.nbytes += size
        return self.evicted - before

    def _evict(self) -> None:
        n, size = self._kept.popleft()
        self._remove(n)
        self.nbytes -= size
        self.evicted += 1

    def _remove(self, n: int) -> None:
        for suffix in (".json", ".prefix"):
            try:
                (self.dir / f"{n:06d}{suffix}").unlink(missing_ok=True)
            except OSError as e:
                logger.warning("quarantine {}: could not remove refusal {} ({})", self.dir, n, e)

    def __len__(self) -> int:
        return len(self._kept)

    def add_id(self, key: str) -> None:
        """Record (durably with ``fsync``) that receive-log record ``key`` must never be replayed;
        a failed write is logged (a resume then refuses the record again instead of skipping it)."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            with open(self.dir / "ids.txt", "a") as f:
                f.write(key + "\n")
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
        except OSError as e:
            logger.error("quarantine {}: could not record id {} ({}); a resume will refuse it again", self.dir, key, e)

    def ids(self) -> list[str]:
        """The ids of :meth:`add_id`, oldest first (empty if none)."""
        path = self.dir / "ids.txt"
        if not path.exists():
            return []
        return [line for line in path.read_text().splitlines() if line]
