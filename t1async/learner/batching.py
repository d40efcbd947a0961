"""Batch collection: how the learner takes ``batch_size`` received trajectories for one step.

Two rules, picked by ``rollout.admission`` (t1async/rollout/admission.py):

- :func:`collect_batch`: arrival order (``learner_version``, ``oldest_episode``).
- :class:`HeldTrajectories`: ``learner_wait``: the oldest first, and the learner waits for a slow
  episode before a publication that would make it too stale to train.

Both take trajectories from ``receive()`` (the learner's: the next received one it keeps after
its staleness and abnormal-end filter, or None after a short wait) and give up when ``stopped``
is set or when fewer than ``batch_size`` came within ``learner.batch_timeout_s`` seconds, not
counting the seconds ``paused_s()`` says the learner was paused for a full disk.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from loguru import logger

from t1async.trajectory import Trajectory

Receive = Callable[[], "Trajectory | None"]


def _starved(got: int, batch_size: int, timeout_s: float) -> None:
    logger.error("learner starved: {} of {} trajectories in {} s; stopping", got, batch_size, timeout_s)


def collect_batch(batch_size: int, timeout_s: float, *, receive: Receive, stopped: threading.Event,
                  paused_s: Callable[[], float]) -> list[Trajectory] | None:
    """``batch_size`` trajectories from ``receive``, in arrival order; None when stopped or
    starved (module docstring)."""
    batch: list[Trajectory] = []
    deadline = time.monotonic() + timeout_s
    paused0 = paused_s()  # (time paused for the disk does not count as starving)
    while len(batch) < batch_size:
        if stopped.is_set():
            return None
        if time.monotonic() > deadline + paused_s() - paused0:
            _starved(len(batch), batch_size, timeout_s)
            return None
        traj = receive()
        if traj is not None:
            batch.append(traj)
    return batch


class HeldTrajectories:
    """``rollout.admission: learner_wait``: trajectories received and kept, not yet trained.

    :meth:`collect` takes the ``batch_size`` oldest (oldest sampled timeline version first, then
    arrival order) once the controller allows the publication that follows the step
    (:meth:`actors.controller.Controller.publish_allowed`).

    Admission there follows the learner's version, so fast episodes run up to ``max_staleness``
    versions ahead while a slow one is still running or verifying; the learner, not the actors,
    waits for the slow one before publishing a version it could not be trained at, and then
    trains it first (oldest first is earliest-deadline-first: each version's admissions fit in
    the ``max_staleness + 1`` batches that may train them). No trajectory becomes stale while the
    learner waits, and the actors keep sampling meanwhile (what can still be dropped: a held
    trajectory that more than a batch of older ones keep out of the last batch that may train
    it, and what a hold past the timeout makes stale). Held trajectories count in the learner's
    ``queue_depth``; they are bounded by the admission window, ``(max_staleness + 1) x
    batch_size x publish_every``. After ``batch_timeout_s`` the learner publishes anyway (logged;
    what then becomes too stale is dropped and counted, never trained). The seconds the last
    :meth:`collect` held a full batch back are :attr:`hold_s` (the step's ``hold_s`` metric).
    """

    def __init__(self) -> None:
        self.items: list[Trajectory] = []
        self.hold_s = 0.0

    def __len__(self) -> int:
        return len(self.items)

    def collect(self, batch_size: int, timeout_s: float, *, publishes: bool, next_version: int,
                allowed: Callable[[list[str]], bool], keep: Callable[[Trajectory], bool],
                order: Callable[[Trajectory], int], receive: Receive, stopped: threading.Event,
                paused_s: Callable[[], float]) -> list[Trajectory] | None:
        """The next batch (class docstring).

        Args:
            batch_size, timeout_s: ``learner.batch_size`` and ``learner.batch_timeout_s`` (seconds).
            publishes: the step that trains this batch ends with a publication (only then is
                ``allowed`` asked).
            next_version: the timeline version that publication would be (named in the log).
            allowed: whether that publication may happen, given the held trajectory ids (the
                controller's ``publish_allowed``).
            keep: the learner's filter, applied again to what is held (a bound changed live).
            order: the sort key (the timeline version of a trajectory's oldest sampled token).
            receive, stopped, paused_s: as in the module docstring.

        Returns:
            The batch, or None when the learner is stopped or starved.
        """
        deadline = time.monotonic() + timeout_s
        paused0 = paused_s()  # (time paused for the disk does not count as starving or holding)
        held_since: float | None = None
        self.hold_s = 0.0
        while True:
            if stopped.is_set():
                return None
            if len(self.items) >= batch_size:
                self.items = [t for t in self.items if keep(t)]  # a bound changed live
                self.items.sort(key=order)  # stable: arrival order within a version
            if len(self.items) >= batch_size:
                batch, rest = self.items[:batch_size], self.items[batch_size:]
                # wait only for episodes not here yet (judged by their admission version): waiting
                # cannot save one already held that the batch has no room for (it is dropped as stale)
                ok = not publishes or allowed([t.trajectory_id for t in self.items])
                if not ok and time.monotonic() > deadline + paused_s() - paused0:
                    logger.warning("learner waited {} s for a slow episode; publishing timeline version {} anyway "
                                   "(what that makes too stale is dropped and counted)", timeout_s, next_version)
                    ok = True
                if ok:
                    self.items = rest
                    if held_since is not None:
                        self.hold_s = time.monotonic() - held_since
                    return batch
                held_since = held_since if held_since is not None else time.monotonic()
            elif time.monotonic() > deadline + paused_s() - paused0:
                _starved(len(self.items), batch_size, timeout_s)
                return None
            traj = receive()
            if traj is not None:
                self.items.append(traj)
