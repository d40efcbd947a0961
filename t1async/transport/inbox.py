"""The learner's inbox: receive durability between the ZeroMQ socket and the training loop.

    ZeroMQ ROUTER --(receive thread: de-duplicate by trajectory id; decode + validate, bad
    frames counted, quarantined and REJected; append to the receive log, one flush per burst
    of waiting messages, then ACK)--> bounded queue (messages and bytes) --> the learner's
    batch collector (:attr:`Inbox.queue`).

The receive thread stops reading the socket while the queue is full, so the actors' send
windows and spools fill and their ``send`` waits (backpressure); it stops the same way while the
run directory's disk is full or failing (``disk``, t1async/fileio.py ``DiskGuard``: below the
free-space floor, or a write failed with ENOSPC/EIO), and reads on by itself once space is back. With ``learner.resume`` the
backlog (the receive log's trajectories the restored checkpoint had not consumed) is queued first,
before the socket: nothing lost, nothing trained twice (the exact guarantee is in
t1async/transport/delivery.py).
"""

from __future__ import annotations

import collections
import queue
import threading
from pathlib import Path
from typing import Any, Callable

from loguru import logger

from t1async.fileio import DiskGuard
from t1async.trajectory import Trajectory, TrajectoryError, decode
from t1async.transport.delivery import ByteQueue, ConsumedLedger, ReceiveLog
from t1async.transport.transport import Delivery, TrajectoryReceiver

MAX_QUARANTINED_FILES = 100
GROUP_COMMIT_BYTES = 256 << 20  # most bytes stored with one receive-log flush (held in memory until ACKed)
MAX_REMEMBERED_REJECTIONS = 100_000  # ids of rejected messages kept to answer a resend without counting it again


class Inbox:
    """Receives trajectories durably for one learner: socket -> receive log -> ACK -> queue.

    Args:
        receiver: the bound trajectory socket (:class:`t1async.transport.transport.ZmqReceiver`).
        log: the receive log (``RUN_DIR/receive_log``), already opened (and scanned on resume).
        queue: the bounded queue the learner's batch collector reads.
        consumed: the ids the model state consumed (trained, or dropped: -1); a delivery of one of
            them is ACKed as a duplicate. Shared with the learner, which adds to it.
        counters: the learner's counters; this updates ``received``, ``rejected``,
            ``duplicates`` and ``replayed``.
        run_dir: where ``quarantine/`` and (``dump_trajectories``) ``trajectories/`` are written.
        shape: ``(num_experts, num_layers, top_k)`` of the model, which every frame must match.
        version: the learner's current version (no frame may carry a later one).
        training_stopped: set once training ended: deliveries are then stored and ACKed, not queued.
        dump_trajectories: keep the first N received frames in ``trajectories/``.
        group_messages: most deliveries stored with one flush of the receive log.
        disk: the run directory's disk guard: while it says the disk is full the socket is not
            read (no ACK: the actors keep their spools); a failed write is recorded in it. None:
            a guard with the default floor.
    """

    def __init__(self, receiver: TrajectoryReceiver, log: ReceiveLog, queue: ByteQueue, consumed: ConsumedLedger,
                 counters: dict[str, int], *, run_dir: Path, shape: tuple[int, int, int], version: Callable[[], int],
                 training_stopped: threading.Event, dump_trajectories: int = 0, group_messages: int = 64,
                 disk: DiskGuard | None = None):
        self.receiver, self.log, self.queue = receiver, log, queue
        self._consumed, self.counters = consumed, counters
        self.run_dir, self._shape, self._version = run_dir, shape, version
        self._training_stopped = training_stopped
        self._dump, self._group_messages = dump_trajectories, group_messages
        self.disk = disk if disk is not None else DiskGuard(run_dir)
        self._rejected_keys: collections.OrderedDict[str, str] = collections.OrderedDict()  # id -> reason, newest last
        self._closed = threading.Event()  # receiving stops (close())
        self._thread: threading.Thread | None = None

    def start(self, backlog: list[str]) -> None:
        """Start the receive thread: ``backlog`` (receive-log keys to replay first), then the socket."""
        self._thread = threading.Thread(target=self._receive_loop, args=(backlog,), name="learner-recv", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the receive thread and close the socket and the receive log."""
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        self.receiver.close()
        self.log.close()

    def _receive_loop(self, backlog: list[str]) -> None:
        """Consumes the receive log's backlog (resume), then ZeroMQ deliveries; produces validated
        trajectories on the bounded queue, each stored in the receive log and ACKed first.

        Deliveries already waiting on the socket are taken together (at most
        ``transport.log_group_messages`` / ``GROUP_COMMIT_BYTES``) and stored with one flush of the
        receive log before any of them is answered (:meth:`_on_burst`). Stops reading while the
        queue is full (backpressure). Once training has ended (the learner's run returned,
        or it was stopped), deliveries are still stored and ACKed, not queued: the receive log keeps
        them for a resumed run, and rollout actors finishing their last episodes at shutdown get
        their ACKs instead of waiting for them. A frame that fails validation is
        counted, logged, written to ``quarantine/`` (first 100) and REJected, never trained on;
        a trajectory id already stored or consumed is ACKed again and dropped (de-duplication).
        Stopped by :meth:`close`.
        """
        for key in backlog:
            if self._training_stopped.is_set():  # (no training any more: the rest stays in the log for a resume)
                break
            frame = self.log.read(key)
            try:
                traj = self._decode(frame, max_version=None)  # validated at receipt; re-checked
            except TrajectoryError as e:
                self._quarantine(frame, e)
                continue
            self.counters["replayed"] += 1
            self.enqueue(traj, len(frame))
        while not self._closed.is_set():  # after training too: stored and ACKed, kept for a resume
            if self.disk.check() is not None:  # a full disk: no ACK, the actors keep their spools
                self._closed.wait(0.5)
                continue
            d = self.receiver.recv(timeout_s=0.5)
            if d is None:
                continue
            burst, nbytes = [d], len(d.frame)  # and whatever else is already waiting: one flush for all
            while len(burst) < self._group_messages and nbytes < GROUP_COMMIT_BYTES:
                more = self.receiver.recv(timeout_s=0)
                if more is None:
                    break
                burst.append(more)
                nbytes += len(more.frame)
            self._on_burst(burst)

    def _decode(self, frame: Any, max_version: int | None) -> Trajectory:
        try:
            return decode(frame, num_experts=self._shape[0], num_layers=self._shape[1],
                          top_k=self._shape[2], max_version=max_version)
        except TrajectoryError:
            raise
        except Exception as e:  # a decoder bug must not kill the receive thread
            logger.opt(exception=e).error("decoder failed unexpectedly")
            raise TrajectoryError("<decoder>", f"{type(e).__name__}: {e}") from None

    def _on_burst(self, burst: list[Delivery]) -> None:
        """Store a burst of deliveries with one flush of the receive log (group commit), then answer.

        Every reply (ACK, duplicate ACK, REJ) is sent only after :meth:`ReceiveLog.sync` returned,
        so no ACK ever precedes the durability of what it acknowledges; a duplicate inside the
        burst is ACKed after its original's flush too. If the flush fails nothing appended in the
        burst is ACKed (the actors keep and resend it) and the log forgets it.
        """
        replies: list[tuple[Delivery, bool, str]] = []
        stored: list[tuple[Delivery, Trajectory]] = []
        for d in burst:
            reply = self._store(d, stored)
            if reply is not None:
                replies.append((d, *reply))
        try:
            self.log.sync()
        except OSError as e:
            self.disk.fault(e, self.log.dir)
            logger.error("receive log flush failed ({}); {} trajectories not acknowledged", e, len(stored))
            replies = [r for r in replies if not r[1] or r[0].key in self.log or r[0].key in self._consumed]
            stored = [(d, t) for d, t in stored if d.key in self.log]
        for d, ok, reason in replies:
            self.receiver.ack(d, ok, reason)
        for d, traj in stored:
            self.counters["received"] += 1
            if self.counters["received"] <= self._dump:
                tdir = self.run_dir / "trajectories"
                try:
                    tdir.mkdir(exist_ok=True)
                    (tdir / f"{traj.trajectory_id}.traj").write_bytes(d.frame)
                except OSError as e:  # an inspection copy: the receive log holds the trajectory
                    self.disk.fault(e, tdir)
                    logger.error("could not dump trajectory {} to {} ({}); it is in the receive log",
                                 traj.trajectory_id, tdir, e)
            self.enqueue(traj, len(d.frame))

    def _store(self, d: Delivery, stored: list[tuple[Delivery, Trajectory]]) -> tuple[bool, str] | None:
        """De-duplicate, validate and append one delivery (not yet flushed); returns the reply
        (ok, reason) to send after the flush, or None (no reply: not stored, the actor resends).
        A stored trajectory is appended to ``stored``."""
        if d.error is not None:
            self._quarantine(d.frame, TrajectoryError("<envelope>", d.error))
            return False, d.error
        if d.key in self.log or d.key in self._consumed:
            self.counters["duplicates"] += 1
            return True, "duplicate"
        if d.key in self._rejected_keys:  # resent after its REJ was lost: answer again, count it once
            self.counters["duplicates"] += 1
            return False, self._rejected_keys[d.key]
        try:
            traj = self._decode(d.frame, max_version=self._version())
            if traj.trajectory_id != d.key:
                raise TrajectoryError("trajectory_id", f"{traj.trajectory_id!r} differs from the envelope key {d.key!r}")
        except TrajectoryError as e:
            self._quarantine(d.frame, e)
            self._rejected_keys[d.key] = str(e)[:1000]
            if len(self._rejected_keys) > MAX_REMEMBERED_REJECTIONS:
                self._rejected_keys.popitem(last=False)
            return False, str(e)
        try:
            self.log.append(d.key, d.frame, sync=False)
        except OSError as e:  # not stored: no ACK, the actor keeps it and resends
            self.disk.fault(e, self.log.dir)
            logger.error("receive log append failed ({}); trajectory {} not acknowledged", e, d.key)
            return None
        stored.append((d, traj))
        return True, ""

    def enqueue(self, traj: Trajectory, nbytes: int) -> None:
        while not self._training_stopped.is_set():  # (training ended: kept in the receive log only)
            try:
                self.queue.put(traj, nbytes, timeout=0.5)
                return
            except queue.Full:
                continue

    def _quarantine(self, frame: bytes | memoryview, err: Exception) -> None:
        """Count, log and (first 100) keep a rejected frame with its error in ``quarantine/``.

        The admission slot is returned by the rollout actor that gets the REJ (once per trajectory),
        not here: a garbage message or a resent rejected one must not free a slot.
        """
        self.counters["rejected"] += 1
        n = self.counters["rejected"]
        logger.warning("rejected trajectory #{}: {}", n, err)
        if n <= MAX_QUARANTINED_FILES:
            qdir = self.run_dir / "quarantine"
            try:
                qdir.mkdir(exist_ok=True)
                (qdir / f"{n:06d}.traj").write_bytes(frame)
                (qdir / f"{n:06d}.txt").write_text(f"{err}\n")
            except OSError as e:  # counted and logged above; the copy is for inspection only
                self.disk.fault(e, qdir)
                logger.error("could not keep rejected trajectory #{} in {}: {}", n, qdir, e)
