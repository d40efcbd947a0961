"""The step guard: a training step that raises is retried without the trajectories to blame.

Poison that passes the intake check (t1async/transport/intake.py; a bug of ours) would make every
step that takes it raise. :class:`StepGuard` runs the step; when it raises, it runs the step's
forward passes on each trajectory alone (:func:`t1async.learner.update.probe`), blames the ones
that raise alone (all of the batch when none, or every one of several, does), has them refused
(the learner quarantines them: :func:`refuse_in_step`), and retries without them.

A step that raises does so in its first forward passes for a trajectory it cannot take (the
critic's values, or the first epoch's log-probs, both before any optimiser step), so the retry
starts from the same weights; gradients are zeroed first.
"""

from __future__ import annotations

from typing import Any, Callable

from loguru import logger

from t1async.config import LearnerConfig
from t1async.learner.backend import LearnerBackend
from t1async.learner.update import probe
from t1async.trajectory import Trajectory, encode
from t1async.transport.inbox import Inbox

MAX_FAILED_STEPS_IN_A_ROW = 3
"""Batches in a row whose step raised even after quarantining what the probe blamed: then the
fault is not in the data (a bug of ours, a broken device) and the learner raises (the service
restarts it; what it quarantined stays skipped)."""


class StepFailed(Exception):
    """A trajectory made a training step raise (counted under ``step_failed``)."""

    field = "step_failed"


class StepGuard:
    """Runs training steps, probing and retrying a step that raises (module docstring).

    Args:
        backend: the models the probe runs the forward passes of (gradients zeroed before it).
        cfg: the ``learner`` section (what the probe's forward passes include).
        num_experts: ``model.num_experts`` (padding of the routed-expert rows).
        max_failed: :data:`MAX_FAILED_STEPS_IN_A_ROW`.
    """

    def __init__(self, backend: LearnerBackend, cfg: LearnerConfig, *, num_experts: int,
                 max_failed: int = MAX_FAILED_STEPS_IN_A_ROW):
        self.backend, self.cfg, self.num_experts, self.max_failed = backend, cfg, num_experts, max_failed
        self.failed_in_a_row = 0

    def run(self, batch: list[Trajectory], train: Callable[[list[Trajectory]], dict[str, Any]],
            refuse: Callable[[Trajectory, Exception], None], *, step: int) -> dict[str, Any] | None:
        """``train(batch)``, and when it raises: blame, ``refuse(trajectory, error)`` each blamed
        one, remove them from ``batch`` (in place) and retry without them.

        Args:
            step: learner steps done before this one (the log line names step + 1).

        Returns:
            The step's metrics (``batch`` then holds the trajectories it trained), or None when
            every one was refused.

        Raises:
            RuntimeError: ``max_failed`` batches in a row needed a retry whose culprit the probe
                could not single out (the fault is ours, not the data's).
        """
        while batch:
            try:
                metrics = train(batch)
                self.failed_in_a_row = 0
                return metrics
            except Exception as e:
                logger.opt(exception=e).error("step {} failed on {} trajectories; probing them one by one",
                                              step + 1, len(batch))
                self.backend.zero_grad()
                blamed = []
                for t in batch:
                    try:
                        probe(t, self.backend, self.cfg, num_experts=self.num_experts)
                    except Exception as pe:
                        blamed.append((t, pe))
                if not blamed or (len(blamed) == len(batch) > 1):  # not one trajectory's fault
                    self.failed_in_a_row += 1
                    if self.failed_in_a_row >= self.max_failed:
                        raise RuntimeError(f"{self.failed_in_a_row} steps in a row failed and no single "
                                           f"trajectory was to blame (last: {type(e).__name__}: {e}); this is a "
                                           "learner bug, not bad data: see the traceback above") from e
                    blamed = [(t, e) for t in batch]
                for t, err in blamed:
                    refuse(t, err)
                batch[:] = [t for t in batch if all(t is not b for b, _ in blamed)]
        return None


def refuse_in_step(inbox: Inbox, traj: Trajectory, err: Exception) -> None:
    """Quarantine a trajectory that made a step fail (:meth:`Inbox.refuse_stored`, source
    ``step``): counted under ``rejected_by["step_failed"]``, its id in ``quarantine/ids.txt`` (a
    resume skips it), kept with its frame (the receive log's record, else ``traj`` encoded anew)
    as evidence. The caller then takes it back from ``inbox.take_refused()`` as consumed."""
    tid = traj.trajectory_id
    try:
        frame = inbox.log.read(tid) if tid in inbox.log else encode(traj)
    except Exception as e:  # (the frame is evidence only)
        frame = f"<frame unavailable: {e}>".encode()
    inbox.refuse_stored(tid, frame, StepFailed(f"{type(err).__name__}: {err}"), source="step")
