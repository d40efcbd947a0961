"""The learner's inbox: receive durability between the ZeroMQ socket and the training loop.

    ZeroMQ ROUTER --(receive thread: de-duplicate by trajectory id; decode + validate, then
    check against the run's own facts (t1async/transport/intake.py: vocabulary, experts,
    published versions, reward vs tests); bad frames counted by reason, quarantined (bounded:
    t1async/transport/quarantine.py) and REJected; append to the receive log, one flush per
    burst of waiting messages, then ACK)--> bounded queue (messages and bytes) --> the
    learner's batch collector (:attr:`Inbox.queue`).

The receive thread stops reading the socket while the queue is full, so the actors' send
windows and spools fill and their ``send`` waits (backpressure); it stops the same way while the
run directory's disk is full or failing (``disk``, t1async/fileio.py ``DiskGuard``: below the
free-space floor, or a write failed with ENOSPC/EIO), and reads on by itself once space is back. With ``learner.resume`` the
backlog (the receive log's trajectories the restored checkpoint had not consumed) is queued first,
before the socket: nothing lost, nothing trained twice (the exact guarantee is in
t1async/transport/delivery.py). A backlog record that fails the same checks (a log written before
a check existed, or a corrupt one) is quarantined, counted as consumed (dropped) and recorded in
``quarantine/ids.txt``, so no later resume replays it again.
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
from t1async.transport.intake import RunFacts, check_trajectory
from t1async.transport.quarantine import Quarantine
from t1async.transport.transport import Delivery, TrajectoryReceiver

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
            ``duplicates``, ``replayed`` and ``quarantine_evicted``.
        run_dir: where ``quarantine/`` and (``dump_trajectories``) ``trajectories/`` are written.
        shape: ``(num_experts, num_layers, top_k)`` of the model, which every frame must match.
        version: the learner's current version (no frame may carry a later one).
        training_stopped: set once training ended: deliveries are then stored and ACKed, not queued.
        dump_trajectories: keep the first N received frames in ``trajectories/``.
        group_messages: most deliveries stored with one flush of the receive log.
        facts: the run's vocabulary, experts, routing shape and reward kind, checked for every
            frame at receipt and at replay (:func:`t1async.transport.intake.check_trajectory`);
            None: only the frame's own invariants and ``shape``.
        quarantine: where refused messages are kept (bounded); None: ``RUN_DIR/quarantine`` with
            the default bounds.
        rejected_by: refusals counted by reason (the field at fault; shared with the learner,
            which adds ``step_failed``); None: a new dict.
        disk: the run directory's disk guard: while it says the disk is full the socket is not
            read (no ACK: the actors keep their spools); a failed write is recorded in it. None:
            a guard with the default floor.
    """

    def __init__(self, receiver: TrajectoryReceiver, log: ReceiveLog, queue: ByteQueue, consumed: ConsumedLedger,
                 counters: dict[str, int], *, run_dir: Path, shape: tuple[int, int, int], version: Callable[[], int],
                 training_stopped: threading.Event, dump_trajectories: int = 0, group_messages: int = 64,
                 facts: RunFacts | None = None, quarantine: Quarantine | None = None,
                 rejected_by: dict[str, int] | None = None,
                 disk: DiskGuard | None = None):
        self.receiver, self.log, self.queue = receiver, log, queue
        self.facts = facts
        self.quarantine = quarantine if quarantine is not None else Quarantine(run_dir / "quarantine")
        self.rejected_by = rejected_by if rejected_by is not None else {}
        self._refused: collections.deque[str] = collections.deque()  # stored ids refused (refuse_stored)
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
        counted by reason, logged, quarantined (bounded) and REJected, never trained on;
        a trajectory id already stored or consumed is ACKed again and dropped (de-duplication).
        Stopped by :meth:`close`.
        """
        for key in backlog:
            if self._training_stopped.is_set():  # (no training any more: the rest stays in the log for a resume)
                break
            frame = self.log.read(key)
            try:  # validated at receipt; re-checked (a log of an older learner, a check added since)
                traj = self._decode(frame, max_version=max(self._version(), self.log.published_version))
                if traj.trajectory_id != key:
                    raise TrajectoryError("trajectory_id", f"{traj.trajectory_id!r} differs from its log key {key!r}")
            except TrajectoryError as e:
                self.refuse_stored(key, frame, e, source="replay")
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
            traj = decode(frame, num_experts=self._shape[0], num_layers=self._shape[1],
                          top_k=self._shape[2], max_version=max_version)
            if self.facts is not None:
                check_trajectory(traj, self.facts, max_version=max_version)
            return traj
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
            self._quarantine(d.frame, TrajectoryError("<envelope>", d.error), key=d.key)
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
            self._quarantine(d.frame, e, key=d.key)
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

    def _quarantine(self, frame: bytes | memoryview, err: Exception, *, key: str = "",
                    source: str = "receipt") -> None:
        """Count (``rejected``, and by reason in :attr:`rejected_by`), log and keep a capped prefix
        of a refused frame with its metadata (:class:`t1async.transport.quarantine.Quarantine`;
        what that evicts is counted in ``quarantine_evicted``).

        The admission slot is returned by the rollout actor that gets the REJ (once per trajectory),
        not here: a garbage message or a resent rejected one must not free a slot.
        """
        reason = getattr(err, "field", type(err).__name__)
        self.counters["rejected"] += 1
        self.rejected_by[reason] = self.rejected_by.get(reason, 0) + 1
        logger.warning("rejected trajectory #{} ({}{}): {}", self.counters["rejected"], source,
                       f" {key!r}" if key else "", err)
        evicted = self.quarantine.put(frame, reason=reason, error=str(err), key=key, source=source)
        self.counters["quarantine_evicted"] = self.counters.get("quarantine_evicted", 0) + evicted

    def refuse_stored(self, key: str, frame: bytes | memoryview, err: Exception, *, source: str) -> None:
        """Refuse a trajectory already in the receive log (``source``: ``replay``, a backlog record
        that fails the checks; ``step``, one that made a training step fail): quarantine it, count
        it to be counted as consumed (dropped: the learner takes it with :meth:`take_refused`, in
        its own thread, before it writes the ledger) and record its id in ``quarantine/ids.txt``
        so a resume before the next checkpoint skips it too."""
        self._quarantine(frame, err, key=key, source=source)
        self.quarantine.add_id(key)
        self._refused.append(key)

    def take_refused(self) -> list[str]:
        """Ids refused by :meth:`refuse_stored` since the last call (to mark consumed, -1)."""
        out = []
        while self._refused:
            out.append(self._refused.popleft())
        return out
